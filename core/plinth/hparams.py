"""Reading hparams from GGUF metadata: typed keys, required flags, scalar-or-array keys.

Every architecture builds its frozen hparams object with a :class:`KeyReader`,
so errors read the same everywhere: a missing required key names the key and
the file; a per-layer array of the wrong length names the key and both lengths.

Values are checked as they are read: an ``int`` key must hold an integer (not a
bool, not a float), a ``float`` key a finite number, a ``str`` key a string; and
the keys of :data:`RANGES` (block count, head counts, epsilons, rope bases...)
must lie in their declared range, whichever architecture reads them. A bad value
reads ``FILE: key 'K' = V: why``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence, TypeVar

import attrs

from .errors import UserError

T = TypeVar("T")


class HParamsError(UserError, KeyError):
    """A GGUF key is missing or malformed."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class PerLayer(tuple):  # type: ignore[type-arg]
    """A per-layer value (one entry per layer) whose index errors name the key."""

    key: str

    def __new__(cls, values: Sequence[Any], key: str) -> "PerLayer":
        obj = super().__new__(cls, values)
        obj.key = key
        return obj

    def __getitem__(self, il: Any) -> Any:  # type: ignore[override]
        if isinstance(il, int) and not -len(self) <= il < len(self):
            raise IndexError(f"layer {il} out of range for '{self.key}' (n_layer = {len(self)})")
        return super().__getitem__(il)

    @property
    def uniform(self) -> bool:
        """All layers share one value."""
        return len(set(self)) <= 1


#: Most layers a file may declare (the largest released models have a few hundred).
MAX_LAYERS = 1 << 16


@attrs.frozen
class Range:
    """A declared range for a numeric key: ``lo <= v`` (``lo < v`` when ``lo_open``), ``v <= hi``."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False

    def problem(self, value: Any) -> str | None:
        lo = self.lo
        if lo is not None:
            if self.lo_open and not value > lo:
                return f"must be > {lo:g}"
            if not self.lo_open and not value >= lo:
                return f"must be >= {lo:g}"
        if self.hi is not None and not value <= self.hi:
            return f"must be <= {self.hi:g}"
        return None


_COUNT = Range(lo=1)
_LAYER_COUNT = Range(lo=0)  # hybrid models give recurrent layers (or all layers) 0 heads / no FFN
_POSITIVE = Range(lo=0.0, lo_open=True)

#: Declared ranges, by key name after the architecture prefix; every KeyReader checks them.
RANGES: dict[str, Range] = {
    "block_count": Range(lo=1, hi=MAX_LAYERS),
    "embedding_length": _COUNT,
    "context_length": _COUNT,
    "vocab_size": _COUNT,
    "attention.head_count": _LAYER_COUNT,
    "attention.head_count_kv": _LAYER_COUNT,
    "feed_forward_length": _LAYER_COUNT,
    "attention.key_length": _COUNT,
    "attention.value_length": _COUNT,
    "rope.dimension_count": Range(lo=0),
    "attention.layer_norm_rms_epsilon": _POSITIVE,
    "attention.layer_norm_epsilon": _POSITIVE,
    "rope.freq_base": _POSITIVE,
    "rope.freq_base_swa": _POSITIVE,
    "rope.scaling.factor": _POSITIVE,
    "rope.scaling.original_context_length": Range(lo=0),
    "attention.sliding_window": Range(lo=0),
    "expert_count": Range(lo=0),
    "expert_used_count": Range(lo=0),
    "ssm.conv_kernel": _COUNT,
    "ssm.inner_size": _COUNT,
    "ssm.state_size": _COUNT,
    "ssm.time_step_rank": _COUNT,
    "ssm.group_count": _COUNT,
    "final_logit_softcapping": Range(lo=0.0),
    "attn_logit_softcapping": Range(lo=0.0),
}


#: Stricter ranges for an architecture whose every layer is an attention + FFN block
#: (``KeyReader(md, source, arch, ranges=DENSE_RANGES)``): a 0 there would divide by zero.
DENSE_RANGES: dict[str, Range] = {
    "attention.head_count": _COUNT,
    "attention.head_count_kv": _COUNT,
    "feed_forward_length": _COUNT,
}


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _to_python(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)
    return tolist() if tolist is not None else value


class KeyReader:
    """Typed access to one file's metadata under the architecture prefix.

    ``reader.get("block_count")`` reads ``"{arch}.block_count"``; a key starting with
    a known global prefix (``general.``, ``tokenizer.``) or given with ``full=True`` is
    read as is.
    """

    def __init__(self, metadata: Mapping[str, Any], source: str, arch: str,
                 ranges: Mapping[str, Range] | None = None) -> None:
        self.metadata = metadata
        self.source = source
        self.arch = arch
        self.ranges = dict(RANGES) if ranges is None else {**RANGES, **ranges}

    def _bad(self, key: str, value: Any, why: str) -> HParamsError:
        return HParamsError(f"{self.source}: key '{key}' = {_show(value)}: {why}")

    def _cast(self, key: str, name: str, value: Any, cast: Callable[[Any], T]) -> T:
        """``cast(value)`` with the type rules and the declared range of ``name``."""
        if cast is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise self._bad(key, value, "expected an integer")
        elif cast is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise self._bad(key, value, "expected a number")
            if not math.isfinite(value):
                raise self._bad(key, value, "expected a finite number")
        elif cast is str and not isinstance(value, str):
            raise self._bad(key, value, "expected a string")
        try:
            out = cast(value)
        except (TypeError, ValueError) as exc:
            raise self._bad(key, value, f"not a {getattr(cast, '__name__', 'valid value')}") from exc
        bounds = self.ranges.get(name[len(self.arch) + 1:] if name.startswith(self.arch + ".") else name)
        if bounds is not None and isinstance(out, (int, float)) and not isinstance(out, bool):
            why = bounds.problem(out)
            if why:
                raise self._bad(key, value, why)
        return out

    def key(self, name: str) -> str:
        if name.startswith(("general.", "tokenizer.")) or name.startswith(self.arch + "."):
            return name
        return f"{self.arch}.{name}"

    def _missing(self, key: str) -> HParamsError:
        return HParamsError(f"{self.source}: missing required key '{key}' (architecture '{self.arch}')")

    def has(self, name: str) -> bool:
        return self.key(name) in self.metadata

    def get(self, name: str, cast: Callable[[Any], T] = int, *, required: bool = True,  # type: ignore[assignment]
            default: Any = None) -> T:
        """The scalar value of ``name``; ``default`` when absent and not required."""
        key = self.key(name)
        if key not in self.metadata:
            if required:
                raise self._missing(key)
            return default  # type: ignore[no-any-return]
        value = _to_python(self.metadata[key])
        if isinstance(value, list):
            raise HParamsError(f"{self.source}: key '{key}' is an array of {len(value)} values, expected a scalar")
        return self._cast(key, name, value, cast)

    def get_key_or_arr(self, name: str, n_layer: int, cast: Callable[[Any], T] = int, *,  # type: ignore[assignment]
                       required: bool = True, default: Any = None) -> PerLayer:
        """A per-layer value: a scalar broadcasts to every layer, an array must have ``n_layer`` entries."""
        key = self.key(name)
        if key not in self.metadata:
            if required:
                raise self._missing(key)
            return PerLayer([default] * n_layer, key)
        value = _to_python(self.metadata[key])
        if isinstance(value, list):
            if len(value) != n_layer:
                raise HParamsError(
                    f"{self.source}: key '{key}' has {len(value)} entries, expected n_layer = {n_layer}"
                )
            return PerLayer([self._cast(f"{key}[{il}]", name, v, cast)
                             for il, v in enumerate(value)], key)
        return PerLayer([self._cast(key, name, value, cast)] * n_layer, key)

    def n_vocab(self) -> int:
        """``vocab_size``, else the length of the file's token list, else -1 (a file without a vocabulary)."""
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        return self.get("vocab_size", required=False, default=len(tokens) if tokens is not None else -1)

    def expert_counts(self) -> tuple[int, int]:
        """(``expert_count``, ``expert_used_count``): (0, 0) for a dense model; with experts, the used count
        must be 1..expert_count."""
        n_expert = self.get("expert_count", required=False, default=0)
        n_used = self.get("expert_used_count", required=False, default=0)
        if n_expert and not 0 < n_used <= n_expert:
            raise HParamsError(f"{self.source}: key '{self.key('expert_used_count')}' = {n_used}: must be 1.."
                               f"{n_expert} (expert_count)")
        return n_expert, n_used if n_expert else 0

    def rotary_dims(self, name: str, head_dim: int) -> int:
        """The rotated dimensions of a head (``rope.dimension_count`` or a per-layer-type variant), ``head_dim``
        when absent: an even count within 2..head_dim."""
        n_rot = self.get(name, required=False, default=head_dim)
        if n_rot % 2 or not 0 < n_rot <= head_dim:
            raise HParamsError(f"{self.source}: key '{self.key(name)}' = {n_rot}: must be even and within the head "
                               f"size (2..{head_dim})")
        return n_rot

    def get_array(self, name: str, cast: Callable[[Any], T] = int, *, required: bool = True,  # type: ignore[assignment]
                  default: Any = None) -> tuple[T, ...] | None:
        """An array-valued key as a tuple (a scalar becomes a one-element tuple)."""
        key = self.key(name)
        if key not in self.metadata:
            if required:
                raise self._missing(key)
            return default  # type: ignore[no-any-return]
        value = _to_python(self.metadata[key])
        values = value if isinstance(value, list) else [value]
        return tuple(self._cast(f"{key}[{i}]", name, v, cast) for i, v in enumerate(values))

"""Reading hparams from GGUF metadata: typed keys, required flags, scalar-or-array keys.

Every architecture builds its frozen hparams object with a :class:`KeyReader`,
so errors read the same everywhere: a missing required key names the key and
the file; a per-layer array of the wrong length names the key and both lengths.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, TypeVar

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


def _to_python(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)
    return tolist() if tolist is not None else value


class KeyReader:
    """Typed access to one file's metadata under the architecture prefix.

    ``reader.get("block_count")`` reads ``"{arch}.block_count"``; a key starting with
    a known global prefix (``general.``, ``tokenizer.``) or given with ``full=True`` is
    read as is.
    """

    def __init__(self, metadata: Mapping[str, Any], source: str, arch: str) -> None:
        self.metadata = metadata
        self.source = source
        self.arch = arch

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
        try:
            return cast(value)
        except (TypeError, ValueError) as exc:
            raise HParamsError(f"{self.source}: key '{key}' has value {value!r}, not a {cast.__name__}") from exc

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
            return PerLayer([cast(v) for v in value], key)
        return PerLayer([cast(value)] * n_layer, key)

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
        return tuple(cast(v) for v in values)

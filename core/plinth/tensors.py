"""Declared tensors: what an architecture reads, checked against the file before compute."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import attrs

from .errors import UserError


#: Problems named in a TensorCheckError's one line (the count says how many there are).
MAX_LISTED = 8


class TensorCheckError(UserError):
    """The file's tensors do not match the architecture's declaration (every problem listed)."""


@attrs.frozen
class TensorSpec:
    """One tensor an architecture reads.

    name: the GGUF tensor name (``"blk.3.attn_q.weight"``).
    shape: numpy-order shape ``[rows, cols]`` (GGML's ne reversed), from hparams.
    dtypes: allowed GGML type names (``("F32",)``), or None for any supported type.
    required: a missing required tensor is an error; an optional one is simply absent.
    scale: a per-tensor ``<name>.scale`` companion may be present (multiplied in on load).
    """

    name: str
    shape: tuple[int, ...]
    required: bool = True
    dtypes: tuple[str, ...] | None = None
    scale: bool = False


def scale_name(name: str) -> str:
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    return f"{base}.scale"


def check_tensors(specs: Sequence[TensorSpec], present: Mapping[str, tuple[tuple[int, ...], str]],
                  source: str) -> list[TensorSpec]:
    """Check ``present`` (name -> (numpy shape, GGML type name)) against ``specs``.

    Returns the specs whose tensors are present. Raises :class:`TensorCheckError`
    (one line) listing the first missing required tensor, every shape mismatch and every
    disallowed type at once.
    """
    problems: list[str] = []
    found: list[TensorSpec] = []
    for spec in specs:
        info = present.get(spec.name)
        if info is None:
            if spec.required:
                problems.append(f"missing tensor '{spec.name}' (expected shape {list(spec.shape)})")
            continue
        shape, dtype = info
        if tuple(shape) != tuple(spec.shape):
            problems.append(f"tensor '{spec.name}' has shape {list(shape)}, expected {list(spec.shape)}")
        if spec.dtypes is not None and dtype not in spec.dtypes:
            problems.append(f"tensor '{spec.name}' has type {dtype}, allowed: {', '.join(spec.dtypes)}")
        found.append(spec)
    if problems:
        shown = problems[:MAX_LISTED]
        more = f"; and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        raise TensorCheckError(f"{source}: {len(problems)} tensor problem(s) for this architecture: "
                               f"{'; '.join(shown)}{more}")
    return found


def unused_tensors(specs: Iterable[TensorSpec], names: Iterable[str]) -> list[str]:
    """Tensor names in the file that no spec (or scale companion) declares."""
    declared = set()
    for spec in specs:
        declared.add(spec.name)
        if spec.scale:
            declared.add(scale_name(spec.name))
    return sorted(n for n in names if n not in declared)


class UnusedError(UserError):
    """A file holds tensors or architecture keys that its architecture does not read: computing without
    them would answer wrongly without a word, so the load is refused (``allow_unused=True`` overrides)."""


class KeyUse(Mapping[str, Any]):
    """A read-only view of a file's metadata that records which keys an architecture's hparams step asks
    for (``m[key]``, ``m.get(key)``, ``key in m``). Walking the whole mapping (``for``, ``items()``)
    counts as reading every key, so a plugin that reads its keys in bulk is never refused by mistake."""

    def __init__(self, metadata: Mapping[str, Any]) -> None:
        self._metadata = metadata
        self.read: set[str] = set()
        self.walked = False

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return self._metadata[key]

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return key in self._metadata

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return self._metadata.get(key, default)

    def __iter__(self) -> Any:
        self.walked = True
        return iter(self._metadata)

    def __len__(self) -> int:
        return len(self._metadata)

    def unread(self, prefix: str) -> list[str]:
        """The keys under ``prefix`` (``"llama."``) that were never asked for."""
        if self.walked:
            return []
        return sorted(k for k in self._metadata if k.startswith(prefix) and k not in self.read)


def check_unused(tensors: Sequence[str], keys: Sequence[str], source: str, arch: str, plugin: str) -> None:
    """Refuse a file with tensors or ``{arch}.*`` keys that no part of its architecture reads (one line
    naming them). A llama.cpp file may carry a feature plinth lacks (a rope table, a bias, an expert
    layout); loading it without that feature would give fluent, wrong text."""
    what = []
    for names, noun in ((tensors, "tensor(s)"), (keys, "key(s)")):
        if names:
            more = f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
            what.append(f"{len(names)} {noun} ({', '.join(names[:MAX_LISTED])}{more})")
    if not what:
        return
    raise UnusedError(f"{source}: the {arch} architecture (plugin {plugin}) does not read {' and '.join(what)} "
                      f"of this file, so it would compute without them and answer wrongly; load with "
                      f"--allow-unused (PLINTH_ALLOW_UNUSED=1, load_model(..., allow_unused=True)) to run anyway")

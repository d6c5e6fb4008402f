"""Split GGUF models: one model in several files, as llama.cpp's ``gguf-split`` writes them.

Each part is a complete GGUF file holding some of the tensors. Every part carries the keys
``split.no`` (0-based), ``split.count`` and ``split.tensors.count`` (the tensors of all parts);
the first part also carries the model's metadata. The parts are named
``PREFIX-00001-of-00003.gguf``, ``PREFIX-00002-of-00003.gguf``, ... (``split.no + 1`` and
``split.count``, five digits each), and a user opens the first.

:func:`open_gguf` opens a plain file as a :class:`~plinth.gguf.reader.GGUFFile` and a split model
as a :class:`SplitGGUF`, which offers the same ``metadata``, ``tensors`` and ``raw()`` over all its
parts (tensor data stays memory-mapped in each part's file).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from .reader import GGUFError, GGUFFile, TensorInfo

SPLIT_NO = "split.no"
SPLIT_COUNT = "split.count"
SPLIT_TENSORS = "split.tensors.count"
#: a part's file name: the prefix, the 1-based part number and the part count, five digits each
PART_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
#: most parts a split model may have (llama.cpp's gguf-split writes at most 99999)
MAX_PARTS = 99999


def part_path(first: Path, no: int, count: int) -> Path:
    """The path of part ``no`` (0-based) of ``count``, beside ``first`` and named as llama.cpp names it."""
    m = PART_NAME.match(first.name)
    prefix = m.group("prefix") if m else first.name[: -len(".gguf")] if first.name.endswith(".gguf") else first.name
    return first.with_name(f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf")


def _split_key(gf: GGUFFile, key: str, lo: int, hi: int) -> int:
    value = gf.metadata.get(key)
    if type(value) is not int or not lo <= value <= hi:  # noqa: E721 - bool and arrays are refused too
        raise GGUFError(f"{gf.path}: key '{key}' = {value!r}: expected a whole number in {lo}..{hi}")
    return value


class SplitGGUF:
    """The parts of a split model read as one file: ``metadata`` (the first part's), ``tensors``
    (every part's, each name once), ``raw(name)`` from the part that holds it, ``parts`` (the files)."""

    def __init__(self, first: GGUFFile) -> None:
        self.path = first.path
        self.parts: list[GGUFFile] = [first]
        try:
            self._open(first)
        except BaseException:
            self.close()
            raise

    def _open(self, first: GGUFFile) -> None:
        count = _split_key(first, SPLIT_COUNT, 1, MAX_PARTS)
        total = _split_key(first, SPLIT_TENSORS, 0, 1 << 40)
        self.metadata: dict[str, Any] = first.metadata
        self.version = first.version
        self.tensors: dict[str, TensorInfo] = {}
        self._owner: dict[str, GGUFFile] = {}
        for no in range(count):
            if no == 0:
                part = first
            else:
                path = part_path(first.path, no, count)
                if not path.is_file():
                    raise GGUFError(f"{first.path}: part {no + 1} of this {count}-part split model, {path.name}, "
                                    f"is missing (every part must lie beside the first)")
                part = GGUFFile(path)
                self.parts.append(part)
                if _split_key(part, SPLIT_COUNT, 1, MAX_PARTS) != count:
                    raise GGUFError(f"{part.path}: key '{SPLIT_COUNT}' = {part.metadata[SPLIT_COUNT]}, but the "
                                    f"first part {first.path.name} says {count}: the parts are of different splits")
            if _split_key(part, SPLIT_NO, 0, count - 1) != no:
                raise GGUFError(f"{part.path}: key '{SPLIT_NO}' = {part.metadata[SPLIT_NO]}, expected {no} "
                                f"(part {no + 1} of {count} by its place)")
            for name, info in part.tensors.items():
                if name in self.tensors:
                    raise GGUFError(f"{part.path}: tensor '{name}' is also in {self._owner[name].path.name}: "
                                    "a split model holds each tensor once")
                self.tensors[name] = info
                self._owner[name] = part
        if len(self.tensors) != total:
            raise GGUFError(f"{first.path}: key '{SPLIT_TENSORS}' = {total}, but the {count} parts hold "
                            f"{len(self.tensors)} tensors")

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    def part_of(self, name: str) -> GGUFFile:
        """The part holding tensor ``name``."""
        try:
            return self._owner[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named '{name}' in any of its {len(self.parts)} parts") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, name: str) -> Any:
        return self.part_of(name).raw(name)

    def close(self) -> None:
        for p in self.parts:
            p.close()

    def __enter__(self) -> "SplitGGUF":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile | SplitGGUF:
    """A GGUF model file: a :class:`GGUFFile`, or a :class:`SplitGGUF` when it is the first part of a
    split model (``split.count`` > 1). Opening a later part is refused, naming the first."""
    gf = GGUFFile(path)
    if SPLIT_COUNT not in gf.metadata:
        return gf
    try:
        count = _split_key(gf, SPLIT_COUNT, 1, MAX_PARTS)
        no = _split_key(gf, SPLIT_NO, 0, count - 1) if SPLIT_NO in gf.metadata else 0
        if no != 0:
            raise GGUFError(f"{gf.path}: this is part {no + 1} of a {count}-part split model; open the first "
                            f"part, {part_path(gf.path, 0, count).name}")
    except BaseException:
        gf.close()
        raise
    return SplitGGUF(gf)

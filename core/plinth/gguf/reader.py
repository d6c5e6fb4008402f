"""A direct GGUF reader: header and metadata parsed once, tensor data memory-mapped.

Nothing is copied: :meth:`GGUFFile.raw` returns numpy views of the mapped file.
Every malformed input raises :class:`GGUFError` naming the file and the byte
offset where reading failed.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ..errors import UserError
from .constants import BLOCK_SIZES, DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLType, ValueType

_SCALAR = {
    ValueType.UINT8: ("<B", 1), ValueType.INT8: ("<b", 1), ValueType.UINT16: ("<H", 2),
    ValueType.INT16: ("<h", 2), ValueType.UINT32: ("<I", 4), ValueType.INT32: ("<i", 4),
    ValueType.FLOAT32: ("<f", 4), ValueType.BOOL: ("<?", 1), ValueType.UINT64: ("<Q", 8),
    ValueType.INT64: ("<q", 8), ValueType.FLOAT64: ("<d", 8),
}
_NP = {
    ValueType.UINT8: "<u1", ValueType.INT8: "<i1", ValueType.UINT16: "<u2", ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4", ValueType.INT32: "<i4", ValueType.FLOAT32: "<f4", ValueType.BOOL: "?",
    ValueType.UINT64: "<u8", ValueType.INT64: "<i8", ValueType.FLOAT64: "<f8",
}
_PLAIN_DTYPES = {GGMLType.F32: "<f4", GGMLType.F16: "<f2", GGMLType.BF16: "<u2", GGMLType.F64: "<f8",
                 GGMLType.I8: "<i1", GGMLType.I16: "<i2", GGMLType.I32: "<i4", GGMLType.I64: "<i8"}


class GGUFError(UserError, ValueError):
    """A file that is not valid GGUF (message names the file and the offset)."""


#: Deepest nesting of arrays inside arrays a file may use (llama.cpp writes none).
MAX_ARRAY_DEPTH = 4
#: Most metadata keys a file may have (models have tens; each costs a Python object and time).
MAX_KEYS = 1 << 16
#: Most arrays one array may hold (GGUF models use none; each costs a Python object).
MAX_NESTED_ITEMS = 1 << 16
# The fewest bytes one entry can take, so a count is refused before anything is allocated:
# a key-value pair (key length, value type, a 1-byte value), a tensor-info entry (name length,
# n_dims, type, offset), an array item that is itself an array (item type, count).
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
_MIN_ARRAY_BYTES = 4 + 8


@attrs.frozen
class TensorInfo:
    """One tensor's header entry.

    ne: GGML dims (ne0, the contiguous one, first); shape: numpy order (ne reversed).
    offset: absolute byte offset of the data in the file; n_bytes: its size.
    """

    name: str
    ne: tuple[int, ...]
    ggml_type: int
    offset: int
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def type_name(self) -> str:
        try:
            return GGMLType(self.ggml_type).name
        except ValueError:
            return f"type{self.ggml_type}"

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


def _show(value: Any) -> str:
    """A metadata value for an error message, cut short."""
    if isinstance(value, (list, np.ndarray)):
        return f"an array of {len(value)} values"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class GGUFFile:
    """An open GGUF file: ``metadata`` (key -> Python value), ``tensors`` (name -> TensorInfo)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            if not stat.S_ISREG(os.stat(self.path).st_mode):  # a FIFO would block open()
                raise GGUFError(f"{self.path}: not a regular file (a directory, FIFO or device), not a GGUF model")
            self._fh = open(self.path, "rb")
        except OSError as exc:
            raise GGUFError(f"{self.path}: cannot open: {exc.strerror}") from exc
        size = os.fstat(self._fh.fileno()).st_size
        if size == 0:
            self._fh.close()
            raise GGUFError(f"{self.path}: empty file at offset 0, not a GGUF model")
        self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._mm)
        self.size = size
        self._pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse()
        except GGUFError:
            self.close()
            raise
        except (struct.error, UnicodeDecodeError, ValueError, OverflowError, IndexError) as exc:
            at = self._pos
            self.close()
            raise GGUFError(f"{self.path}: corrupt GGUF header at offset {at}: {exc}") from None

    # ------------------------------------------------------------------ parsing

    def _fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what} at offset {self._pos}")

    def _need(self, n: int) -> None:
        if n < 0 or self._pos + n > self.size:
            raise self._fail(f"truncated file (needs {n} more bytes, file has {self.size})")

    def _scalar(self, fmt: str, n: int) -> Any:
        self._need(n)
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += n
        return value

    def _string(self) -> str:
        n = self._scalar("<Q", 8)
        if n > self.size - self._pos:
            raise self._fail(f"string length {n} runs past the end of the file")
        start = self._pos
        self._pos += n
        return str(self._buf[start:self._pos], "utf-8", errors="replace")

    def _value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == ValueType.STRING:
            return self._string()
        if vtype == ValueType.ARRAY:
            itype = self._scalar("<I", 4)
            count = self._scalar("<Q", 8)
            if itype == ValueType.STRING:
                return self._string_array(count)
            if itype == ValueType.ARRAY:
                if depth + 1 >= MAX_ARRAY_DEPTH:
                    raise self._fail(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
                if count > (self.size - self._pos) // _MIN_ARRAY_BYTES:
                    raise self._fail(f"array of {count} arrays cannot fit in the file")
                if count > MAX_NESTED_ITEMS:
                    raise self._fail(f"array of {count} arrays: more than {MAX_NESTED_ITEMS} nested arrays "
                                     "are not supported")
                return [self._value(ValueType.ARRAY, depth + 1) for _ in range(count)]
            dtype = _NP.get(itype)
            if dtype is None:
                raise self._fail(f"unknown array item type {itype}")
            nbytes = count * np.dtype(dtype).itemsize
            self._need(nbytes)
            if count == 0:
                return np.empty(0, dtype=dtype)
            arr = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos).copy()
            self._pos += nbytes
            return arr
        spec = _SCALAR.get(vtype)  # type: ignore[call-overload]
        if spec is None:
            raise self._fail(f"unknown value type {vtype}")
        return self._scalar(*spec)

    def _string_array(self, count: int) -> list[str]:
        if count > (self.size - self._pos) // 8:
            raise self._fail(f"string array of {count} entries cannot fit in the file")
        buf, size, unpack = self._buf, self.size, struct.unpack_from
        pos = self._pos
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                self._pos = pos
                raise self._fail("truncated string array")
            (n,) = unpack("<Q", buf, pos)
            pos += 8
            end = pos + n
            if end > size:
                self._pos = pos
                raise self._fail(f"string length {n} runs past the end of the file")
            append(str(buf[pos:end], "utf-8", errors="replace"))
            pos = end
        self._pos = pos
        return out

    def _parse(self) -> None:
        self._need(4)
        magic = bytes(self._buf[0:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r} at offset 0, expected b'GGUF')")
        self._pos = 4
        version = self._scalar("<I", 4)
        if version not in (2, 3):
            if version > 0xFFFF:
                raise self._fail(f"GGUF version {version:#x} looks big-endian; only little-endian files are supported")
            raise self._fail(f"unsupported GGUF version {version} (2 and 3 are supported)")
        self.version = version
        n_tensors = self._scalar("<Q", 8)
        n_kv = self._scalar("<Q", 8)
        room = self.size - self._pos
        if n_kv > MAX_KEYS:
            raise self._fail(f"{n_kv} metadata keys: more than {MAX_KEYS} are not supported")
        if n_kv > room // _MIN_KV_BYTES or n_tensors > (room - n_kv * _MIN_KV_BYTES) // _MIN_TENSOR_INFO_BYTES:
            raise self._fail(f"implausible counts ({n_tensors} tensors, {n_kv} keys) for a file of "
                             f"{self.size} bytes")
        for _ in range(n_kv):
            key = self._string()
            vtype = self._scalar("<I", 4)
            if key in self.metadata:
                raise self._fail(f"key '{key}' appears twice")
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<I", 4)
            if n_dims > 8:
                raise self._fail(f"tensor '{name}' has {n_dims} dimensions")
            ne = tuple(self._scalar("<Q", 8) for _ in range(n_dims))
            ggml_type = self._scalar("<I", 4)
            offset = self._scalar("<Q", 8)
            infos.append((name, ne, ggml_type, offset))
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int:  # noqa: E721 - bool and arrays are refused too
            raise GGUFError(f"{self.path}: key 'general.alignment' = {_show(alignment)}: expected an unsigned "
                            f"integer (a power of two)")
        if alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 30:
            raise GGUFError(f"{self.path}: key 'general.alignment' = {alignment}: not a power of two")
        self.alignment = alignment
        self.data_offset = (self._pos + alignment - 1) // alignment * alignment
        self._tensor_infos(infos)

    def _tensor_infos(self, infos: list[tuple[str, tuple[int, ...], int, int]]) -> None:
        """Check each tensor's type, size and place; the data regions must tile the data section.

        Each offset is aligned, inside the file, and the tensors, sorted by offset, follow one
        another with only alignment padding between them: so a shifted, overlapping or
        re-typed tensor (whose size no longer matches the bytes it spans) is refused.
        """
        alignment = self.alignment
        for name, ne, ggml_type, offset in infos:
            if name in self.tensors:
                raise GGUFError(f"{self.path}: tensor '{name}' appears twice in the tensor list")
            try:
                block, type_size = BLOCK_SIZES[GGMLType(ggml_type)]
            except (ValueError, KeyError):
                raise GGUFError(f"{self.path}: tensor '{name}' has unknown GGML type {ggml_type} "
                                f"(header entry before offset {self.data_offset})") from None
            n = 1
            for d in ne:
                n *= d
            if ne and ne[0] % block:
                raise GGUFError(f"{self.path}: tensor '{name}' row of {ne[0]} is not a multiple of the "
                                f"{GGMLType(ggml_type).name} block size {block} (header before offset "
                                f"{self.data_offset})")
            n_bytes = n // block * type_size
            start = self.data_offset + offset
            if offset % alignment:
                raise GGUFError(f"{self.path}: tensor '{name}' data offset {offset} is not a multiple of the "
                                f"alignment {alignment}: corrupt tensor info")
            if start + n_bytes > self.size:
                raise GGUFError(f"{self.path}: tensor '{name}' data at offset {start} ({n_bytes} bytes) runs past "
                                f"the end of the file ({self.size} bytes): truncated file or corrupt tensor info")
            self.tensors[name] = TensorInfo(name, ne, ggml_type, start, n_bytes)
        expected = self.data_offset
        for info in sorted(self.tensors.values(), key=lambda t: (t.offset, t.n_bytes)):
            if info.offset != expected:
                what = "overlaps the tensor before it" if info.offset < expected else \
                    f"leaves {info.offset - expected} unexplained bytes before it"
                raise GGUFError(f"{self.path}: tensor '{info.name}' data at offset {info.offset} {what} "
                                f"(expected offset {expected} for {info.type_name} {list(info.shape)}): corrupt "
                                f"tensor info (wrong offset, type or shape)")
            expected = (info.offset + info.n_bytes + alignment - 1) // alignment * alignment
        if self.tensors and self.size > expected:
            raise GGUFError(f"{self.path}: {self.size - expected} bytes after the last tensor's data (ends at "
                            f"{expected}): corrupt tensor info (a tensor's type or shape is smaller than its data)")

    # ------------------------------------------------------------------ access

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """A zero-copy view of a tensor's stored data.

        Plain types come typed in numpy order (BF16 as uint16); block-quantized
        types come as uint8 ``[rows, bytes_per_row]``.
        """
        try:
            info = self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named '{name}'") from None
        gtype = GGMLType(info.ggml_type)
        plain = _PLAIN_DTYPES.get(gtype)
        if plain is not None:
            arr = np.frombuffer(self._mm, dtype=plain, count=info.n_elements, offset=info.offset)
            return arr.reshape(info.shape)
        arr = np.frombuffer(self._mm, dtype=np.uint8, count=info.n_bytes, offset=info.offset)
        rows = info.n_elements // info.ne[0] if info.ne else 1
        return arr.reshape(rows, -1)

    def close(self) -> None:
        # views handed out keep the mapping alive; closing only drops our references
        self._buf = memoryview(b"")
        self._fh.close()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

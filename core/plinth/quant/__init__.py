"""Quantized weights: a 2-D GGUF tensor kept in its block layout, multiplied by compiled kernels.

:class:`QuantWeight` is the "quantized weight object" of the plugin contract: architectures
pass it to :func:`plinth.ops.linear` like a float32 ``[n_out, n_in]`` matrix and
:func:`plinth.ops.linear` dispatches on it.

- Decode and small batches (1..``KERNEL_MAX_ROWS`` rows): a compiled kernel reads every block
  once for all rows (:mod:`plinth.quant.kernels`).
- Prompt batches: tiles of output rows are dequantized on the fly into a small f32 buffer and
  multiplied with BLAS; no f32 copy of the whole weight stays resident.
- Embedding lookups: :meth:`QuantWeight.take` dequantizes only the rows asked for.
- Anything else that asks for the array (``numpy.asarray(w)``) gets the whole tensor
  dequantized on demand: correct, never fast.

Threads: ``PLINTH_THREADS`` (or :func:`set_threads`, the ``--threads`` option) sets the kernel
threads; default the number of cores this process may run on. The kernels and OpenBLAS take
turns (prompt tiles: dequantize with the kernel threads, then one BLAS product), never both at
once.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import numpy as np

log = logging.getLogger("plinth.quant")

#: at most this many activation rows go through the block kernels; more use dequantized tiles + BLAS.
#: A kernel pass costs about m times one row, a tile pass about the same for any m up to ~64, so
#: the two cross at 5-6 rows (a SmolLM2 Q4_1 forward, one thread: 5 rows 153 vs 207 ms, 6 rows
#: 230 vs 202 ms; benchmarks/README.md "Quantized weights")
KERNEL_MAX_ROWS = 5


def _kernel_rows_from_env() -> int:
    """``PLINTH_KERNEL_ROWS=N`` moves the crossover (benchmarks compare settings with it)."""
    text = os.environ.get("PLINTH_KERNEL_ROWS")
    if text is None:
        return KERNEL_MAX_ROWS
    if not text.isdigit():
        from ..errors import UserError

        raise UserError(f"PLINTH_KERNEL_ROWS={text!r}: give a whole number of activation rows (0 = never the kernels)")
    return int(text)


KERNEL_MAX_ROWS = _kernel_rows_from_env()
#: f32 bytes of one dequantized tile in the prompt path
TILE_BYTES = 4 << 20

_state: dict[str, Any] = {"kernels": None, "threads": None, "note": None}


def compiled() -> Any:
    """The compiled kernel module, or None (numba missing or unusable: numpy fallback, noted once)."""
    if _state["kernels"] is None:
        _state["kernels"] = _load_kernels()
    return _state["kernels"] or None


def _load_kernels() -> Any:
    if os.environ.get("PLINTH_KERNELS", "1") == "0":
        _note("PLINTH_KERNELS=0: quantized weights are multiplied through numpy tiles (slow)")
        return False
    try:
        os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")  # no spinning pool next to OpenBLAS
        from . import kernels as k
    except ImportError as exc:
        _note(f"numba is not importable ({exc}); quantized weights use numpy tiles (slow): pip install numba")
        return False
    if not _cache_warm(k):
        print("plinth: compiling the quantized-weight kernels (once per machine, about 10-20 s)...",
              file=sys.stderr, flush=True)
    _state["kernels"] = k
    set_threads(_state["threads"] or default_threads())
    return k


def _note(msg: str) -> None:
    if _state["note"] != msg:
        _state["note"] = msg
        print(f"plinth: {msg}", file=sys.stderr)


def default_threads() -> int:
    env = os.environ.get("PLINTH_THREADS")
    if env:
        return parse_threads(env, "PLINTH_THREADS")
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def parse_threads(value: Any, where: str) -> int:
    from ..errors import UserError

    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise UserError(f"{where}: thread count must be a positive integer, got {value!r}")
    return n


def set_threads(n: int) -> None:
    """Kernel threads (numba) and the BLAS threads used by prompt tiles."""
    n = int(n)
    _state["threads"] = n
    if _state["kernels"]:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


def threads() -> int:
    return int(_state["threads"] or default_threads())


def _cache_warm(k: Any) -> bool:
    """Whether numba's on-disk cache already holds the kernels (else the first call compiles)."""
    from pathlib import Path

    dirs = [Path(k.__file__).parent / "__pycache__"]
    if os.environ.get("NUMBA_CACHE_DIR"):
        dirs.append(Path(os.environ["NUMBA_CACHE_DIR"]))
    return any(any(d.rglob("kernels.matmul_fast-*.nbi")) for d in dirs if d.is_dir())


class QuantWeight:
    """A weight ``[n_out, n_in]`` in its GGUF block layout.

    raw: uint8 ``[n_out, row_bytes]`` (a view of the mapped file, or stacked parts)
    ggml_type: the GGML type code;  shape: ``(n_out, n_in)``.
    """

    ndim = 2
    dtype = np.dtype(np.float32)  # what it computes as

    def __init__(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> None:
        from ..gguf.constants import BLOCK_SIZES, GGMLType

        self.ggml_type = int(ggml_type)
        self.type_name = GGMLType(self.ggml_type).name
        self.shape = (int(shape[0]), int(shape[1]))
        qk, size = BLOCK_SIZES[GGMLType(self.ggml_type)]
        if qk == 1:  # F16 / BF16: 32-value blocks of 2-byte values
            qk, size = 32, 64
        self.qk = qk
        raw = np.asarray(raw).view(np.uint8).reshape(self.shape[0], -1)
        if raw.flags.writeable:  # one array type for the kernels (mapped files are read-only): one compile
            raw = raw.view()
            raw.flags.writeable = False
        self.raw = raw
        if self.raw.shape[1] != self.shape[1] // qk * size:
            raise ValueError(f"QuantWeight: {self.raw.shape[1]} bytes a row do not hold {self.shape[1]} "
                             f"{self.type_name} values")
        self.raw16 = self.raw.view(np.uint16) if self.raw.shape[1] % 2 == 0 else None

    # ------------------------------------------------------------------ array-like

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"QuantWeight({self.type_name}, shape={self.shape})"

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.dequantize()
        return out if dtype is None else out.astype(dtype, copy=False)

    def __getitem__(self, idx: Any) -> Any:
        """Row slices stay quantized (a view); integer indices gather dequantized rows."""
        if isinstance(idx, slice):
            start, stop, step = idx.indices(self.shape[0])
            if step == 1 and (start, stop) == (0, self.shape[0]):
                return self
            if step == 1:
                return QuantWeight(self.raw[start:stop], self.ggml_type, (max(0, stop - start), self.shape[1]))
        if isinstance(idx, (int, np.integer)):
            return self.take(np.asarray([idx]))[0]
        return self.take(np.asarray(idx))

    def dequantize(self) -> np.ndarray:
        """The whole tensor as float32 [n_out, n_in] (a new array)."""
        return self.take(np.arange(self.shape[0]))

    def take(self, rows: Any) -> np.ndarray:
        """float32 [*rows.shape, n_in]: the given rows dequantized (an embedding lookup)."""
        rows = np.asarray(rows)
        flat = rows.reshape(-1).astype(np.intp)
        out = np.empty((flat.size, self.shape[1]), dtype=np.float32)
        k = compiled()
        if k is not None and self.raw16 is not None and flat.size and self.ggml_type in k.FAST_TYPES:
            k.dequantize_fast(self.ggml_type, self.raw, self.raw16, flat, k.F16_TABLE, out)
        elif k is not None and self.raw16 is not None and flat.size:
            k.dequantize_rows(self.ggml_type, self.qk, self.raw, self.raw16, flat, k.F16_TABLE,
                              k.FP4_VALUES, out)
        elif flat.size:
            from ..gguf import quants

            out[:] = quants.dequantize(np.ascontiguousarray(self.raw[flat]).view(self._stored_dtype()),
                                       self.ggml_type, out.shape)
        return out.reshape(*rows.shape, self.shape[1])

    def _stored_dtype(self) -> Any:
        return np.uint16 if self.type_name in ("F16", "BF16") else np.uint8

    # ------------------------------------------------------------------ products

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """y = x @ W.T.  x: float32 [m, n_in] -> [m, n_out]."""
        m = x.shape[0]
        out = np.empty((m, self.shape[0]), dtype=np.float32)
        k = compiled()
        if m == 0:
            return out
        if k is not None and m <= KERNEL_MAX_ROWS and self.raw16 is not None:
            x = np.ascontiguousarray(x, dtype=np.float32)
            if self.ggml_type in k.FAST_TYPES:
                k.matmul_fast(self.ggml_type, self.raw, self.raw16, x, k.F16_TABLE, out)
                return out
            chunk = max(1, min(64, self.shape[0] // (8 * threads())))
            k.matmul_rows(self.ggml_type, self.qk, self.raw, self.raw16, x, k.F16_TABLE, k.FP4_VALUES, out,
                          chunk)
            return out
        tile = max(64, TILE_BYTES // (4 * self.shape[1]))
        for o0 in range(0, self.shape[0], tile):
            o1 = min(self.shape[0], o0 + tile)
            w = self.take(np.arange(o0, o1))
            out[:, o0:o1] = x @ w.T  # (matmul into a strided out= slice leaves BLAS)
        return out


class StackedWeight:
    """Quantized weights stacked on the output axis (fused QKV, gate/up; the parts may differ
    in type, Q4_K q with Q6_K v): each part keeps its own blocks in the mapped file; the
    product is the parts' products side by side."""

    ndim = 2
    dtype = np.dtype(np.float32)

    def __init__(self, parts: list[QuantWeight]) -> None:
        self.parts = list(parts)
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self._starts = np.cumsum([0] + [p.shape[0] for p in parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __repr__(self) -> str:
        return f"StackedWeight({', '.join(p.type_name for p in self.parts)}, shape={self.shape})"

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.concatenate([p.dequantize() for p in self.parts], axis=0)
        return out if dtype is None else out.astype(dtype, copy=False)

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice) and idx.step in (None, 1):
            start, stop, _ = idx.indices(self.shape[0])
            for p, s0 in zip(self.parts, self._starts):
                if s0 <= start and stop <= s0 + p.shape[0]:
                    return p[start - s0:stop - s0]
        return np.asarray(self)[idx]

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """y = x @ W.T.  x: float32 [m, n_in] -> [m, n_out]."""
        return np.concatenate([p.matmul(x) for p in self.parts], axis=1)


#: the weight objects ops.linear multiplies through their own ``matmul``
WEIGHT_TYPES = (QuantWeight, StackedWeight)


def stack(parts: list[Any]) -> Any:
    """Quantized weights ``[n_i, n_in]`` stacked on the output axis as one weight object
    (:class:`StackedWeight`; one part comes back as itself); None when any part is a plain
    array (the caller stacks float32 arrays its own way)."""
    if not parts or not all(isinstance(p, QuantWeight) for p in parts):
        return None
    if any(p.shape[1] != parts[0].shape[1] for p in parts):
        return None
    if len(parts) == 1:
        return parts[0]
    # parts side by side, not one concatenated copy: a copy would double the resident set
    # (the mapped file's pages stay resident next to it once they have been read)
    return StackedWeight(parts)


def warm_up() -> float:
    """Compile (or load from the on-disk cache) every kernel for every kept type; seconds taken."""
    from ..gguf.constants import BLOCK_SIZES, GGMLType

    t0 = time.perf_counter()
    if compiled() is None:
        return 0.0
    for name in KEPT_TYPES:
        qk, size = BLOCK_SIZES[GGMLType[name]]
        n_in = 256
        raw = np.zeros((2, n_in // max(qk, 32) * (64 if qk == 1 else size)), dtype=np.uint8)
        w = QuantWeight(raw, int(GGMLType[name]), (2, n_in))
        w.matmul(np.zeros((1, n_in), dtype=np.float32))
        w.take([0])
    return time.perf_counter() - t0


def block_values(type_name: str) -> int:
    """Values per block of a kept type (F16/BF16 rows are read in 32-value blocks)."""
    from ..gguf.constants import BLOCK_SIZES, GGMLType

    return max(32, BLOCK_SIZES[GGMLType[type_name]][0])


KEPT_TYPES = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")

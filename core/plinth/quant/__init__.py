"""Quantized weights: a 2-D GGUF tensor kept in its block layout, multiplied by compiled kernels.

:class:`QuantWeight` is the "quantized weight object" of the plugin contract: architectures
pass it to :func:`plinth.ops.linear` like a float32 ``[n_out, n_in]`` matrix and
:func:`plinth.ops.linear` dispatches on it.

- Batches of 1..``KERNEL_MAX_ROWS`` (1024) rows (decode, verify, server steps, most prompts): a
  compiled kernel reads every block
  once for all rows. On CPUs with AVX2 the activation rows are quantized per 32 values to int8
  and meet the blocks in integer SIMD dot products (:mod:`plinth.quant.kernels_i8`, as llama.cpp
  does); elsewhere, or with ``PLINTH_INT8=0``, f32 activations multiply the dequantized values
  (:func:`plinth.quant.kernels.matmul_deq`; also MXFP4, NVFP4, F16 and BF16 always). Either way a
  row's result bits do not depend on the other rows of the batch (docs/performance.md).
- Longer batches (long prompts): tiles of output
  rows are dequantized on the fly into a small f32 buffer and multiplied with BLAS; no f32 copy
  of the whole weight stays resident.
- Embedding lookups: :meth:`QuantWeight.take` dequantizes only the rows asked for.
- Anything else that asks for the array (``numpy.asarray(w)``) gets the whole tensor
  dequantized on demand: correct, never fast.

Threads: ``PLINTH_THREADS`` (or :func:`set_threads`, the ``--threads`` option) sets the kernel
threads; default the physical cores this process may run on (:mod:`plinth.runtime`, which loads
the kernels; its names are re-exported here). The kernels and OpenBLAS take
turns, never both spinning at once: kernel products run with OpenBLAS held to one thread;
prompt tiles are dequantized on the calling thread and multiplied by OpenBLAS on the kernel
threads (:mod:`plinth.quant.blas`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from . import blas

log = logging.getLogger("plinth.quant")

#: at most this many activation rows go through the int8 kernels; more use dequantized tiles + BLAS.
#: The int8 kernels read each weight group once for all rows and unpack it once for eight, so a
#: verify batch costs far less than its rows decoded one by one. A whole forward of m prompt rows,
#: 2 threads, kernels / tiles: SmolLM2 Q4_1 m = 512: 932 / 1077 ms, 1024: 2675 / 3124, 2048:
#: 10148 / 8934 (attention, on one BLAS thread beside the kernels, is most of that one); Gemma-3
#: Q4_K_M m = 512: 830 / 1130, 1024: 2173 / 2367. Below the bound a row's result does not depend
#: on the batch it is in (docs/performance.md), so the bound is high.
KERNEL_MAX_ROWS = 1024
#: the same bound for the f32-activation kernel (no AVX2, PLINTH_INT8=0, MXFP4/F16/BF16:
#: :func:`plinth.quant.kernels.matmul_deq`, each weight row dequantized once for all rows and dotted
#: with each in one fixed order). It is the int8 bound: below it a row's bits do not depend on its
#: batch, so a verify batch, a server step or a prompt chunk gives the bits of a lone decode.
F32_KERNEL_MAX_ROWS = KERNEL_MAX_ROWS


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
F32_KERNEL_MAX_ROWS = KERNEL_MAX_ROWS
#: f32 bytes of one dequantized tile in the prompt path
TILE_BYTES = 4 << 20

from ..runtime import (  # noqa: F401  (the kernel runtime: what the products and plinth.ops run on)
    _state,
    blas_threads,
    compiled,
    compiled_i8,
    default_threads,
    parse_threads,
    physical_cores,
    set_threads,
    threads,
)


class QuantWeight:
    """A weight ``[n_out, n_in]`` in its GGUF block layout.

    raw: uint8 ``[n_out, row_bytes]`` (a view of the mapped file, or stacked parts)
    ggml_type: the GGML type code;  shape: ``(n_out, n_in)``.
    scale: the tensor's ``.scale`` companion (float32, one value or one per output row) or None: the
    weight is the blocks' values times it, so products and rows taken are multiplied by it (a product
    row by row: the batch does not change a row's bits).
    """

    ndim = 2
    dtype = np.dtype(np.float32)  # what it computes as

    def __init__(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, int], scale: Any = None) -> None:
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
        if scale is not None:
            scale = np.ascontiguousarray(scale, dtype=np.float32).reshape(-1)
            if scale.size not in (1, self.shape[0]):
                raise ValueError(f"QuantWeight: a scale of {scale.size} values for {self.shape[0]} rows")
        self.scale = scale
        self._i8: Any = None  # the int8 kernel's arguments once known (False: not that path)
        #: int8 products with the largest values of each row recomputed from f32 activations (the LM
        #: head: :class:`plinth.graph.LMHead` sets it; its argmax is the token). See :meth:`matmul`.
        self.precise = False

    # ------------------------------------------------------------------ array-like

    @property
    def scaled(self) -> bool:
        """Whether products are multiplied by :attr:`scale` after the kernel."""
        return self.scale is not None

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
                sc = self.scale if self.scale is None or self.scale.size == 1 else self.scale[start:stop]
                return QuantWeight(self.raw[start:stop], self.ggml_type, (max(0, stop - start), self.shape[1]), sc)
        if isinstance(idx, (int, np.integer)):
            return self.take(np.asarray([idx]))[0]
        return self.take(np.asarray(idx))

    def dequantize(self) -> np.ndarray:
        """The whole tensor as float32 [n_out, n_in] (a new array)."""
        return self.take(np.arange(self.shape[0]), parallel=True)

    def take(self, rows: Any, parallel: bool = False, unscaled: bool = False) -> np.ndarray:
        """float32 [*rows.shape, n_in]: the given rows dequantized (an embedding lookup), on the
        calling thread; ``parallel=True``: over the kernel threads (a whole tensor). ``unscaled``: the
        blocks' values without :attr:`scale`."""
        rows = np.asarray(rows)
        flat = rows.reshape(-1).astype(np.intp)
        out = np.empty((flat.size, self.shape[1]), dtype=np.float32)
        k = compiled()
        if k is not None and self.raw16 is not None and flat.size and self.ggml_type in k.FAST_TYPES:
            (k.dequantize_fast if parallel else k.dequantize_fast_serial)(self.ggml_type, self.raw, self.raw16, flat,
                                                                          k.F16_TABLE, out)
        elif k is not None and self.raw16 is not None and flat.size:
            (k.dequantize_rows if parallel else k.dequantize_rows_serial)(self.ggml_type, self.qk, self.raw,
                                                                          self.raw16, flat, k.F16_TABLE,
                                                                          k.FP4_VALUES, out)
        elif flat.size:
            from ..gguf import quants

            out[:] = quants.dequantize(np.ascontiguousarray(self.raw[flat]).view(self._stored_dtype()),
                                       self.ggml_type, out.shape)
        if self.scale is not None and not unscaled:
            out *= self.scale[:, None] if self.scale.size == 1 else self.scale[flat][:, None]
        return out.reshape(*rows.shape, self.shape[1])

    def _stored_dtype(self) -> Any:
        return np.uint16 if self.type_name in ("F16", "BF16") else np.uint8

    # ------------------------------------------------------------------ products

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """y = x @ W.T.  x: float32 [m, n_in] -> [m, n_out]."""
        y = self._matmul(x)
        if self.scale is not None:
            y *= self.scale
        return y

    def _matmul(self, x: np.ndarray) -> np.ndarray:
        """The product with the blocks' values (before :attr:`scale`)."""
        m = x.shape[0]
        if 0 < m <= KERNEL_MAX_ROWS and _int8_args(self, [self]):
            x = np.ascontiguousarray(x, dtype=np.float32)
            full = _int8_product(self._i8, x, _out_rows(m, self.shape[0]))
            if self.precise:
                self._refine(x, full)
            return full[:, :self.shape[0]]
        out = np.empty((m, self.shape[0]), dtype=np.float32)
        k = compiled()
        if m == 0:
            return out
        if k is not None and m <= F32_KERNEL_MAX_ROWS and self.raw16 is not None:
            # one weight row dequantized once for all m rows, each pair dotted in one fixed order: a row's
            # bits do not depend on the batch (kernels.matmul_deq)
            blas.use(1)
            x = np.ascontiguousarray(x, dtype=np.float32)
            chunk = max(1, min(64, self.shape[0] // (8 * threads())))
            k.matmul_deq(self.ggml_type, self.qk, self.raw, self.raw16, x, k.F16_TABLE, k.FP4_VALUES, out, chunk)
            return out
        blas.use(blas_threads())
        tile = max(64, TILE_BYTES // (4 * self.shape[1]))
        for o0 in range(0, self.shape[0], tile):
            o1 = min(self.shape[0], o0 + tile)
            w = self.take(np.arange(o0, o1), unscaled=True)  # (matmul multiplies by the scale)
            out[:, o0:o1] = x @ w.T  # (matmul into a strided out= slice leaves BLAS)
        return out

    def _refine(self, x: np.ndarray, y: np.ndarray) -> None:
        """Recompute, per row of ``y`` (int8 products), the values within PRECISE_MARGIN of the row's
        maximum as f32 dot products of the dequantized weight rows with the f32 activations (at most
        PRECISE_MAX of them: where more are that close, the margin shrinks until they fit): the
        argmax of an LM head is then the one f32 activations give unless the int8 error passes half
        the margin. A row's result depends on that row only. One compiled call over the kernel threads
        (:func:`plinth.quant.kernels_i8.refine_head`: a pass for the maximum and the near ones, the
        weight rows dequantized as :meth:`take` does, the fixed-order dots)."""
        # (called on the int8 path, so both kernel modules are there, and raw16 too: every int8 type's rows
        # have an even byte count)
        k8, k = compiled_i8(), compiled()
        n = self.shape[0]  # (y's rows may be longer: :func:`_out_rows`)
        k8.refine_head(y, n, PRECISE_MARGIN, PRECISE_MAX, self.ggml_type in k.FAST_TYPES, self.ggml_type, self.qk,
                       self.raw, self.raw16, k.F16_TABLE, k.FP4_VALUES, x)


#: a precise weight's values within this much of their row's maximum are recomputed from f32 activations
#: (the int8 activations' error on the LM heads of SmolLM2-135M and Gemma-3-270M: at most 0.50 and 0.44 over
#: 512 peer-corpus positions, so the true maximum is among them when its error and the int8 maximum's add up
#: to less than the margin)
PRECISE_MARGIN = 1.5
#: ... and at most this many of them a row
PRECISE_MAX = 256


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
        self._i8: Any = None
        #: never a precise head (:meth:`QuantWeight._refine` is one weight's)
        self.precise = False
        #: whether some part's products are multiplied by its scale after the kernel
        self.scaled = any(p.scale is not None for p in self.parts)

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
        m = x.shape[0]
        if 0 < m <= KERNEL_MAX_ROWS and _int8_args(self, self.parts):  # all parts in one int8 product
            y = _int8_product(self._i8, x, np.empty((m, self.shape[0]), dtype=np.float32))
            for p, s0 in zip(self.parts, self._starts):  # (the kernel reads the blocks only)
                if p.scale is not None:
                    y[:, s0:s0 + p.shape[0]] *= p.scale
            return y
        return np.concatenate([p.matmul(x) for p in self.parts], axis=1)


#: floats added to a product's output rows where their length is a multiple of 1024 floats (4 KiB): rows
#: that far apart fall in the same L1 cache set, and the int8 kernels' stores of eight columns to each row of
#: a batch evict each other (an LM head of 49152 or 262144 rows: 11% faster at 8 and 16 rows, 2 threads)
ROW_PAD = 16


def _out_rows(m: int, n: int) -> np.ndarray:
    """An uninitialised float32 array for ``m`` rows of ``n`` products, ``ROW_PAD`` longer where
    needed (the caller returns its first ``n`` columns)."""
    return np.empty((m, n + ROW_PAD if m > 1 and n % 1024 == 0 else n), dtype=np.float32)


def _int8_args(w: Any, parts: list[QuantWeight]) -> Any:
    """Whether ``w`` (a weight or a stack of ``parts``) multiplies through the int8 kernels now;
    its kernel arguments are settled on the first product (False: a part of another type)."""
    if not (_state["kernels"] and _state["i8"]) and compiled_i8() is None:
        return False  # kernels off, PLINTH_INT8=0 or no AVX2 (checked on every product: tests switch it)
    if w._i8 is None:
        w._i8 = _i8_args(parts) or False
    return w._i8


def rows_product(w: Any, x: np.ndarray) -> Any:
    """``w.matmul(x)`` for a decode-sized batch with the least Python on the way (the layers of a dense
    decoder call it a few times a layer, every token): the same int8 kernel call on the same arguments,
    hence the same bits, as :meth:`QuantWeight.matmul` / :meth:`StackedWeight.matmul`. None where that
    shortcut does not apply (the weight's first product not taken yet, the int8 kernels off, a scale, a
    precise head, more rows than KERNEL_MAX_ROWS, x not a C-order float32 host matrix): the caller takes
    :func:`plinth.ops.linear`. x: float32 ``[m, n_in]``."""
    args = w._i8
    if not args or not (_state["kernels"] and _state["i8"]) or w.scaled or w.precise:
        return None
    m = x.shape[0]
    if not (0 < m <= KERNEL_MAX_ROWS and x.dtype == np.float32 and x.flags.c_contiguous and x.ndim == 2):
        return None
    if blas._state["current"] != 1:
        blas.use(1)
    n = w.shape[0]
    if type(w) is QuantWeight:
        out = _out_rows(m, n)
        _state["i8"].linear(*args, x, out)
        return out if out.shape[1] == n else out[:, :n]
    out = np.empty((m, n), dtype=np.float32)
    _state["i8"].linear(*args, x, out)
    return out


def _int8_product(args: tuple[Any, ...], x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = x @ W.T through the int8 kernels (``args`` from :func:`_i8_args`), OpenBLAS at one thread."""
    blas.use(1)
    compiled_i8().linear(*args, np.ascontiguousarray(x, dtype=np.float32), out)
    return out


def _i8_args(parts: list[QuantWeight]) -> tuple[Any, ...] | None:
    """(the types' compiled loops, groups, group starts, row starts) for :func:`plinth.quant.kernels_i8.linear`, or None
    where the int8 kernels are off or some part is of another type (or too many parts). The parts'
    rows are repacked here into groups of eight (:func:`plinth.quant.simd.repack`; in pairs of groups
    for the sixteen-lane loops where the host and the type have them), once, and the
    mapped file pages they came from are handed back (:func:`release_pages`)."""
    k8 = compiled_i8()
    if k8 is None or not 0 < len(parts) <= k8.MAX_PARTS:
        return None
    if any(p.ggml_type not in k8.I8_TYPES or p.shape[1] % 32 for p in parts):
        return None
    from .simd import TYPE_CODES, WIDE_KINDS, WIDE_MAX_BYTES, kernel_address, repack, wide_available

    host_wide = wide_available()
    wide = [host_wide and TYPE_CODES[p.ggml_type] in WIDE_KINDS and p.raw.nbytes <= WIDE_MAX_BYTES for p in parts]
    grps = []
    for p, wd in zip(parts, wide):
        grps.append(repack(p.raw, TYPE_CODES[p.ggml_type], pairs=wd))
        release_pages(p.raw)  # the repacked copy replaces them in memory
    for g in grps:
        g.flags.writeable = False  # (one array type: one compile)
    grps += [grps[0]] * (k8.MAX_PARTS - len(parts))
    fns = np.array([[kernel_address(p.ggml_type), kernel_address(p.ggml_type, 16) if wd else 0]
                    for p, wd in zip(parts, wide)], dtype=np.int64)
    starts = np.cumsum([0] + [p.shape[0] for p in parts]).astype(np.int64)
    gstarts = np.cumsum([0] + [g.shape[0] for g in grps[:len(parts)]]).astype(np.int64)
    return fns, tuple(grps), gstarts, starts


def release_pages(a: np.ndarray) -> int:
    """Hand back to the kernel the pages of a read-only mapped file that ``a`` (a view of it) covers
    whole: they leave the resident set, and a later read maps them again from the page cache (the
    file does not change). ``a`` not a view of a read-only ``mmap``: nothing happens. Bytes released."""
    import mmap

    base = a
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None) if not isinstance(base, memoryview) else base.obj
    if base is None or base.closed or not hasattr(base, "madvise") or not a.size:
        return 0
    try:
        start = a.ctypes.data - np.frombuffer(base, np.uint8, count=1).ctypes.data
    except (ValueError, TypeError):  # pragma: no cover - a closed or empty map
        return 0
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, (start + a.nbytes) // page * page
    if hi <= lo or not a.flags.c_contiguous:
        return 0
    base.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    return hi - lo


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
    """Compile (or load from the on-disk cache) every kernel for every kept type; seconds taken.
    (:func:`plinth.ops.warm_up` does this and the compiled host ops.)"""
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


KEPT_TYPES = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "NVFP4")

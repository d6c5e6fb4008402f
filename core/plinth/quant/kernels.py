"""Compiled kernels that compute from GGUF quantized blocks (numba, f32 activations).

Every kernel reads a weight as stored in the file: ``raw`` is the tensor's bytes as
``uint8`` rows ``[n_out, row_bytes]`` (a memory-mapped view) and ``raw16`` the same
bytes viewed as ``uint16`` (every block size of the supported types is even, and every
f16 field sits at an even offset). ``matmul_fast`` (the eight block types) multiplies each
value as it is unpacked; ``matmul_rows`` (MXFP4, F16, BF16) decodes a 32-value block into a
small per-thread buffer first. Either way a weight row is read from memory once for all m
activation rows (it stays in L1).

Block layouts (ggml): Q4_0 ``d:f16, qs[16]``; Q4_1 ``d, m, qs[16]``; Q5_0 ``d, qh:u32,
qs[16]``; Q5_1 ``d, m, qh, qs[16]``; Q8_0 ``d, qs:i8[32]``; Q4_K ``d, dmin, scales[12],
qs[128]``; Q5_K ``d, dmin, scales[12], qh[32], qs[128]``; Q6_K ``ql[128], qh[64],
scales:i8[16], d``; MXFP4 ``e:e8m0, qs[16]``. 4-bit values: the low nibbles of
``qs`` are elements 0..15 of the 32-block, the high nibbles 16..31. NVFP4 (64 values):
``d:ue4m3[4], qs[32]``, one scale per 16 values, sub-block s's low nibbles its values 0..7,
the high nibbles 8..15.

The compiled code is cached on disk (``cache=True``): the first process on a machine
pays the compile, later ones load it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import carray, njit, prange, types

from .jitcache import address_call, cfunc_address, drop_stale, f32_at, u8_at, u16_at

# ggml type codes (plinth.gguf.constants.GGMLType)
F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 1, 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K, BF16, MXFP4, NVFP4 = 12, 13, 14, 30, 39, 40

#: type code -> (values per block, bytes per block) for the types the kernels decode
KERNEL_TYPES = {F16: (32, 64), BF16: (32, 64), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22),
                Q5_1: (32, 24), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176),
                Q6_K: (256, 210), MXFP4: (32, 17), NVFP4: (64, 36)}

#: f16 bit pattern -> float32 value (256 KiB, stays in cache)
F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
#: E2M1 values doubled (the E8M0 scale is halved to match)
FP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


@njit(cache=True, inline="always")
def _k_scale_min(sc: np.ndarray, base: int, j: int) -> tuple[int, int]:
    """6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block's 12 packed bytes."""
    if j < 4:
        return sc[base + j] & 63, sc[base + j + 4] & 63
    s = (sc[base + j + 4] & 0xF) | ((sc[base + j - 4] >> 6) << 4)
    m = (sc[base + j + 4] >> 4) | ((sc[base + j] >> 6) << 4)
    return s, m


@njit(cache=True, inline="always")
def _decode_block(t: int, row: np.ndarray, row16: np.ndarray, ib: int, f16: np.ndarray,
                  fp4: np.ndarray, buf: np.ndarray, bufu: np.ndarray) -> None:
    """Decode block ``ib`` (32 values; NVFP4 64) of one MXFP4, NVFP4, F16 or BF16 weight row into ``buf``
    (the other types have their own vectorised loops below)."""
    if t == NVFP4:
        o = ib * 36
        for s in range(4):
            e = np.int32(row[o + s])  # unsigned E4M3, halved for the doubled E2M1 table (gguf-py's values)
            ex = (e >> 3) & 0xF
            mn = np.float32(e & 7)
            if e == 0 or e == 0x7F:
                d = np.float32(0.0)
            elif ex == 0:
                d = mn * np.float32(2.0 ** -10)
            else:
                d = (np.float32(1.0) + mn / np.float32(8.0)) * np.float32(np.ldexp(1.0, ex - 8))
            for j in range(8):
                v = row[o + 4 + s * 8 + j]
                buf[s * 16 + j] = fp4[v & 0xF] * d
                buf[s * 16 + 8 + j] = fp4[v >> 4] * d
    elif t == MXFP4:
        o = ib * 17
        e = np.int32(row[o])
        d = np.float32(2.0 ** -128) if e == 0 else np.float32(np.ldexp(1.0, e - 128))
        for j in range(16):
            v = row[o + 1 + j]
            buf[j] = fp4[v & 0xF] * d
            buf[j + 16] = fp4[v >> 4] * d
    elif t == F16:
        o = ib * 32
        for j in range(32):
            buf[j] = f16[row16[o + j]]
    elif t == BF16:
        o = ib * 32
        for j in range(32):
            bufu[j] = np.uint32(row16[o + j]) << 16


def _rows_run(t: int, qk: int, raw_at: int, raw_stride: int, row_bytes: int, x_at: int, m: int, n_in: int,
              f16_at: int, fp4_at: int, out_at: int, n_out: int, o0: int, o1: int) -> None:
    """Output columns o0 .. o1 - 1 of :func:`matmul_rows`, on data addresses: weight row o at ``raw_at + o *
    raw_stride`` (``row_bytes`` bytes), x float32 [m, n_in] and out float32 [m, n_out] C-order, the f16 table
    and the FP4 values."""
    x = carray(f32_at(x_at), (m, n_in))
    out = carray(f32_at(out_at), (m, n_out))
    f16 = carray(f32_at(f16_at), (65536,))
    fp4 = carray(f32_at(fp4_at), (16,))
    buf = np.empty(qk, dtype=np.float32)
    bufu = buf.view(np.uint32)
    acc = np.empty(m, dtype=np.float32)
    for o in range(o0, o1):
        row = carray(u8_at(raw_at + o * raw_stride), (row_bytes,))
        row16 = carray(u16_at(raw_at + o * raw_stride), (row_bytes // 2,))
        for r in range(m):
            acc[r] = 0.0
        for ib in range(n_in // qk):
            _decode_block(t, row, row16, ib, f16, fp4, buf, bufu)
            base = ib * qk
            for r in range(m):
                s = np.float32(0.0)
                for l in range(qk):
                    s += buf[l] * x[r, base + l]
                acc[r] += s
        for r in range(m):
            out[r, o] = acc[r]


#: :func:`_rows_run`'s arguments as a C function's
ROWS_SIG = types.void(*[types.int64] * 14)
_call_rows = address_call(ROWS_SIG, "call_rows")


def rows_address() -> int:
    """The address of :func:`_rows_run` compiled as a C function (on first use, then from numba's on-disk
    cache): :func:`matmul_rows_at`'s parallel region calls it instead of holding its code
    (:func:`plinth.quant.jitcache.address_call` says why)."""
    return cfunc_address("kernels.rows", ROWS_SIG, lambda: _rows_run, fastmath=True)


def matmul_rows(t: int, qk: int, raw: np.ndarray, x: np.ndarray, f16: np.ndarray, fp4: np.ndarray, out: np.ndarray,
                chunk: int) -> None:
    """out[r, o] = sum_i x[r, i] * W[o, i] for an MXFP4, F16 or BF16 W (``qk`` = 32 values a block).

    raw: uint8 [n_out, row_bytes] (rows of contiguous bytes, an even count)
    x: float32 [m, n_in] (C-contiguous);  out: float32 [m, n_out] (C-contiguous)
    Output rows are split over threads in runs of ``chunk``.
    """
    matmul_rows_at(rows_address(), t, qk, raw, x, f16, fp4, out, chunk)


@njit(cache=True, parallel=True)
def matmul_rows_at(fn: int, t: int, qk: int, raw: np.ndarray, x: np.ndarray, f16: np.ndarray, fp4: np.ndarray,
                   out: np.ndarray, chunk: int) -> None:
    """:func:`matmul_rows` with the address of its compiled task (:func:`rows_address`)."""
    n_out = raw.shape[0]
    m, n_in = x.shape
    n_chunks = (n_out + chunk - 1) // chunk
    for ci in prange(n_chunks):
        _call_rows(fn, t, qk, raw.ctypes.data, raw.strides[0], raw.shape[1], x.ctypes.data, m, n_in, f16.ctypes.data,
                   fp4.ctypes.data, out.ctypes.data, n_out, ci * chunk, min(n_out, (ci + 1) * chunk))


@njit(cache=True, inline="always")
def _deq_generic_row(t: int, qk: int, row: np.ndarray, row16: np.ndarray, f16: np.ndarray, fp4: np.ndarray,
                     y: np.ndarray) -> None:
    """y[:] = one MXFP4, F16 or BF16 weight row as float32."""
    buf = np.empty(qk, dtype=np.float32)
    bufu = buf.view(np.uint32)
    for ib in range(y.shape[0] // qk):
        _decode_block(t, row, row16, ib, f16, fp4, buf, bufu)
        for j in range(qk):  # (a loop: an array assignment compiles numba's shape-error message, ~2 s)
            y[ib * qk + j] = buf[j]


@njit(cache=True, parallel=True)
def dequantize_rows(t: int, qk: int, raw: np.ndarray, raw16: np.ndarray, rows: np.ndarray,
                    f16: np.ndarray, fp4: np.ndarray, out: np.ndarray) -> None:
    """out[k] = row ``rows[k]`` of W as float32.  out: float32 [len(rows), n_in]."""
    for k in prange(rows.shape[0]):
        _deq_generic_row(t, qk, raw[rows[k]], raw16[rows[k]], f16, fp4, out[k])


@njit(cache=True)
def dequantize_rows_serial(t: int, qk: int, raw: np.ndarray, raw16: np.ndarray, rows: np.ndarray,
                           f16: np.ndarray, fp4: np.ndarray, out: np.ndarray) -> None:
    """:func:`dequantize_rows` on the calling thread (prompt tiles: BLAS has the cores)."""
    for k in range(rows.shape[0]):
        _deq_generic_row(t, qk, raw[rows[k]], raw16[rows[k]], f16, fp4, out[k])


# ---------------------------------------------------------------------------------------------
# Row dots for the common types: one weight row against one activation row. Each value is
# dequantized in a register and multiplied into ``acc``, 32 float lanes summed only at the end
# of the row, so LLVM vectorises the loops (AVX2: 8 lanes) with no horizontal sum per block.


@njit(cache=True, fastmath=True)
def _dot_q4(row: np.ndarray, row16: np.ndarray, xr: np.ndarray, f16: np.ndarray, acc: np.ndarray,
            has_min: bool) -> float:
    """Q4_0 (value = d * (q - 8)) or Q4_1 (value = d * q + m)."""
    bs = 20 if has_min else 18
    acc[:] = 0.0
    for ib in range(xr.shape[0] // 32):
        o = ib * bs
        d = f16[row16[o >> 1]]
        m = f16[row16[(o >> 1) + 1]] if has_min else np.float32(-8.0) * d
        qb = row[o + bs - 16:o + bs]
        xb = xr[ib * 32:ib * 32 + 32]
        for j in range(16):
            acc[j] += (np.float32(qb[j] & 0xF) * d + m) * xb[j]
            acc[j + 16] += (np.float32(qb[j] >> 4) * d + m) * xb[j + 16]
    return acc.sum()


@njit(cache=True, fastmath=True)
def _dot_q5(row: np.ndarray, row16: np.ndarray, xr: np.ndarray, f16: np.ndarray, acc: np.ndarray,
            has_min: bool) -> float:
    """Q5_0 (value = d * (q - 16)) or Q5_1 (value = d * q + m); q's 5th bit is in qh."""
    bs = 24 if has_min else 22
    acc[:] = 0.0
    for ib in range(xr.shape[0] // 32):
        o = ib * bs
        d = f16[row16[o >> 1]]
        m = f16[row16[(o >> 1) + 1]] if has_min else np.float32(-16.0) * d
        h0 = o + bs - 20
        qh = (np.uint32(row[h0]) | (np.uint32(row[h0 + 1]) << 8)
              | (np.uint32(row[h0 + 2]) << 16) | (np.uint32(row[h0 + 3]) << 24))
        qb = row[o + bs - 16:o + bs]
        xb = xr[ib * 32:ib * 32 + 32]
        for j in range(16):
            lo = np.uint32(qb[j] & 0xF) | (((qh >> np.uint32(j)) & np.uint32(1)) << np.uint32(4))
            hi = np.uint32(qb[j] >> 4) | (((qh >> np.uint32(j + 16)) & np.uint32(1)) << np.uint32(4))
            acc[j] += (np.float32(lo) * d + m) * xb[j]
            acc[j + 16] += (np.float32(hi) * d + m) * xb[j + 16]
    return acc.sum()


@njit(cache=True, fastmath=True)
def _dot_q8_0(row: np.ndarray, row16: np.ndarray, xr: np.ndarray, f16: np.ndarray, acc: np.ndarray) -> float:
    acc[:] = 0.0
    for ib in range(xr.shape[0] // 32):
        o = ib * 34
        d = f16[row16[o >> 1]]
        qb = row[o + 2:o + 34]
        xb = xr[ib * 32:ib * 32 + 32]
        for j in range(32):
            acc[j] += np.float32(np.int8(qb[j])) * d * xb[j]
    return acc.sum()


@njit(cache=True, fastmath=True)
def _dot_k45(row: np.ndarray, row16: np.ndarray, xr: np.ndarray, f16: np.ndarray, acc: np.ndarray,
             five: bool) -> float:
    """Q4_K or Q5_K (five): 8 sub-blocks of 32 with 6-bit scales and mins (value = d*sc*q - dmin*m)."""
    bs = 176 if five else 144
    acc[:] = 0.0
    for ib in range(xr.shape[0] // 256):
        o = ib * bs
        d = f16[row16[o >> 1]]
        dmin = f16[row16[(o >> 1) + 1]]
        qh = row[o + 16:o + 48]
        q0 = o + (48 if five else 16)
        for c in range(4):
            s1, m1 = _k_scale_min(row, o + 4, 2 * c)
            s2, m2 = _k_scale_min(row, o + 4, 2 * c + 1)
            d1 = d * np.float32(s1)
            d2 = d * np.float32(s2)
            n1 = dmin * np.float32(m1)
            n2 = dmin * np.float32(m2)
            qb = row[q0 + 32 * c:q0 + 32 * c + 32]
            xb = xr[ib * 256 + 64 * c:ib * 256 + 64 * c + 64]
            if five:
                sh1 = np.uint32(2 * c)
                sh2 = np.uint32(2 * c + 1)
                for l in range(32):
                    h = np.uint32(qh[l])
                    a = np.uint32(qb[l] & 0xF) | (((h >> sh1) & np.uint32(1)) << np.uint32(4))
                    b = np.uint32(qb[l] >> 4) | (((h >> sh2) & np.uint32(1)) << np.uint32(4))
                    acc[l] += (np.float32(a) * d1 - n1) * xb[l] + (np.float32(b) * d2 - n2) * xb[l + 32]
            else:
                for l in range(32):
                    acc[l] += ((np.float32(qb[l] & 0xF) * d1 - n1) * xb[l]
                               + (np.float32(qb[l] >> 4) * d2 - n2) * xb[l + 32])
    return acc.sum()


@njit(cache=True, fastmath=True)
def _dot_q6_k(row: np.ndarray, row16: np.ndarray, xr: np.ndarray, f16: np.ndarray, acc: np.ndarray) -> float:
    """Q6_K: 16 sub-blocks of 16 with int8 scales; q = 4 low bits (ql) | 2 high bits (qh), minus 32."""
    acc[:] = 0.0
    for ib in range(xr.shape[0] // 256):
        o = ib * 210
        d = f16[row16[(o + 208) >> 1]]
        for half in range(2):
            ql = row[o + 64 * half:o + 64 * half + 64]
            qh = row[o + 128 + 32 * half:o + 128 + 32 * half + 32]
            sc = o + 192 + 8 * half
            xb = xr[ib * 256 + 128 * half:ib * 256 + 128 * half + 128]
            for i in range(2):
                d1 = d * np.float32(np.int8(row[sc + i]))
                d2 = d * np.float32(np.int8(row[sc + i + 2]))
                d3 = d * np.float32(np.int8(row[sc + i + 4]))
                d4 = d * np.float32(np.int8(row[sc + i + 6]))
                for l in range(16 * i, 16 * i + 16):
                    h = np.int32(qh[l])
                    q1 = (np.int32(ql[l] & 0xF) | ((h & 3) << 4)) - 32
                    q2 = (np.int32(ql[l + 32] & 0xF) | (((h >> 2) & 3) << 4)) - 32
                    q3 = (np.int32(ql[l] >> 4) | (((h >> 4) & 3) << 4)) - 32
                    q4 = (np.int32(ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32
                    acc[l] += (d1 * np.float32(q1) * xb[l] + d2 * np.float32(q2) * xb[l + 32]
                               + d3 * np.float32(q3) * xb[l + 64] + d4 * np.float32(q4) * xb[l + 96])
    return acc.sum()


#: the types :func:`matmul_fast` computes (the rest go through :func:`matmul_rows`)
FAST_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)


@njit(cache=True, parallel=True, fastmath=True)
def matmul_fast(t: int, raw: np.ndarray, raw16: np.ndarray, x: np.ndarray, f16: np.ndarray,
                out: np.ndarray) -> None:
    """out[r, o] = x[r] . W[o] for W of a type in FAST_TYPES; output rows split over threads.

    x: float32 [m, n_in];  out: float32 [m, n_out]. The weight row (a few hundred bytes) is
    read from memory once and stays in L1 for the m activation rows.
    """
    n_out = raw.shape[0]
    m = x.shape[0]
    for o in prange(n_out):
        acc = np.empty(32, dtype=np.float32)
        row = raw[o]
        row16 = raw16[o]
        for r in range(m):
            xr = x[r]
            if t == Q4_1:
                v = _dot_q4(row, row16, xr, f16, acc, True)
            elif t == Q4_0:
                v = _dot_q4(row, row16, xr, f16, acc, False)
            elif t == Q5_0:
                v = _dot_q5(row, row16, xr, f16, acc, False)
            elif t == Q5_1:
                v = _dot_q5(row, row16, xr, f16, acc, True)
            elif t == Q8_0:
                v = _dot_q8_0(row, row16, xr, f16, acc)
            elif t == Q4_K:
                v = _dot_k45(row, row16, xr, f16, acc, False)
            elif t == Q5_K:
                v = _dot_k45(row, row16, xr, f16, acc, True)
            else:
                v = _dot_q6_k(row, row16, xr, f16, acc)
            out[r, o] = v


# ---------------------------------------------------------------------------------------------
# Row dequantizers for the same types (prompt tiles, verify batches, embedding rows): the
# loops of the row dots with a store in place of the multiply-add.


@njit(cache=True, fastmath=True)
def _deq_row(t: int, row: np.ndarray, row16: np.ndarray, f16: np.ndarray, y: np.ndarray) -> None:
    """y[:] = weight row (type t in FAST_TYPES) as float32."""
    n = y.shape[0]
    if t == Q4_0 or t == Q4_1:
        bs = 20 if t == Q4_1 else 18
        for ib in range(n // 32):
            o = ib * bs
            d = f16[row16[o >> 1]]
            m = f16[row16[(o >> 1) + 1]] if t == Q4_1 else np.float32(-8.0) * d
            qb = row[o + bs - 16:o + bs]
            yb = y[ib * 32:ib * 32 + 32]
            for j in range(16):
                yb[j] = np.float32(qb[j] & 0xF) * d + m
                yb[j + 16] = np.float32(qb[j] >> 4) * d + m
    elif t == Q5_0 or t == Q5_1:
        bs = 24 if t == Q5_1 else 22
        for ib in range(n // 32):
            o = ib * bs
            d = f16[row16[o >> 1]]
            m = f16[row16[(o >> 1) + 1]] if t == Q5_1 else np.float32(-16.0) * d
            h0 = o + bs - 20
            qh = (np.uint32(row[h0]) | (np.uint32(row[h0 + 1]) << 8)
                  | (np.uint32(row[h0 + 2]) << 16) | (np.uint32(row[h0 + 3]) << 24))
            qb = row[o + bs - 16:o + bs]
            yb = y[ib * 32:ib * 32 + 32]
            for j in range(16):
                lo = np.uint32(qb[j] & 0xF) | (((qh >> np.uint32(j)) & np.uint32(1)) << np.uint32(4))
                hi = np.uint32(qb[j] >> 4) | (((qh >> np.uint32(j + 16)) & np.uint32(1)) << np.uint32(4))
                yb[j] = np.float32(lo) * d + m
                yb[j + 16] = np.float32(hi) * d + m
    elif t == Q8_0:
        for ib in range(n // 32):
            o = ib * 34
            d = f16[row16[o >> 1]]
            qb = row[o + 2:o + 34]
            yb = y[ib * 32:ib * 32 + 32]
            for j in range(32):
                yb[j] = np.float32(np.int8(qb[j])) * d
    elif t == Q4_K or t == Q5_K:
        five = t == Q5_K
        bs = 176 if five else 144
        for ib in range(n // 256):
            o = ib * bs
            d = f16[row16[o >> 1]]
            dmin = f16[row16[(o >> 1) + 1]]
            qh = row[o + 16:o + 48]
            q0 = o + (48 if five else 16)
            for c in range(4):
                s1, m1 = _k_scale_min(row, o + 4, 2 * c)
                s2, m2 = _k_scale_min(row, o + 4, 2 * c + 1)
                d1 = d * np.float32(s1)
                d2 = d * np.float32(s2)
                n1 = dmin * np.float32(m1)
                n2 = dmin * np.float32(m2)
                qb = row[q0 + 32 * c:q0 + 32 * c + 32]
                yb = y[ib * 256 + 64 * c:ib * 256 + 64 * c + 64]
                if five:
                    sh1 = np.uint32(2 * c)
                    sh2 = np.uint32(2 * c + 1)
                    for l in range(32):
                        h = np.uint32(qh[l])
                        a = np.uint32(qb[l] & 0xF) | (((h >> sh1) & np.uint32(1)) << np.uint32(4))
                        b = np.uint32(qb[l] >> 4) | (((h >> sh2) & np.uint32(1)) << np.uint32(4))
                        yb[l] = np.float32(a) * d1 - n1
                        yb[l + 32] = np.float32(b) * d2 - n2
                else:
                    for l in range(32):
                        yb[l] = np.float32(qb[l] & 0xF) * d1 - n1
                        yb[l + 32] = np.float32(qb[l] >> 4) * d2 - n2
    else:  # Q6_K
        for ib in range(n // 256):
            o = ib * 210
            d = f16[row16[(o + 208) >> 1]]
            for half in range(2):
                ql = row[o + 64 * half:o + 64 * half + 64]
                qh = row[o + 128 + 32 * half:o + 128 + 32 * half + 32]
                sc = o + 192 + 8 * half
                yb = y[ib * 256 + 128 * half:ib * 256 + 128 * half + 128]
                for i in range(2):
                    d1 = d * np.float32(np.int8(row[sc + i]))
                    d2 = d * np.float32(np.int8(row[sc + i + 2]))
                    d3 = d * np.float32(np.int8(row[sc + i + 4]))
                    d4 = d * np.float32(np.int8(row[sc + i + 6]))
                    for l in range(16 * i, 16 * i + 16):
                        h = np.int32(qh[l])
                        yb[l] = d1 * np.float32((np.int32(ql[l] & 0xF) | ((h & 3) << 4)) - 32)
                        yb[l + 32] = d2 * np.float32((np.int32(ql[l + 32] & 0xF) | (((h >> 2) & 3) << 4)) - 32)
                        yb[l + 64] = d3 * np.float32((np.int32(ql[l] >> 4) | (((h >> 4) & 3) << 4)) - 32)
                        yb[l + 96] = d4 * np.float32((np.int32(ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32)


@njit(cache=True, parallel=True, fastmath=True)
def dequantize_fast(t: int, raw: np.ndarray, raw16: np.ndarray, rows: np.ndarray, f16: np.ndarray,
                    out: np.ndarray) -> None:
    """out[k] = row ``rows[k]`` of W (type t in FAST_TYPES) as float32.  out: [len(rows), n_in]."""
    for k in prange(rows.shape[0]):
        _deq_row(t, raw[rows[k]], raw16[rows[k]], f16, out[k])


@njit(cache=True, fastmath=True)
def dequantize_fast_serial(t: int, raw: np.ndarray, raw16: np.ndarray, rows: np.ndarray, f16: np.ndarray,
                           out: np.ndarray) -> None:
    """:func:`dequantize_fast` on the calling thread (prompt tiles: BLAS has the cores)."""
    for k in range(rows.shape[0]):
        _deq_row(t, raw[rows[k]], raw16[rows[k]], f16, out[k])


# ---------------------------------------------------------------------------------------------
# Batch-invariant products on f32 activations: every (activation row, weight row) pair runs the same
# float steps whatever else is in the batch (docs/performance.md, "Batch invariance"). The weight row
# is dequantized once (the same bits for every row it meets) into a per-thread buffer, then each
# activation row is dotted with it by :func:`dot_row`.


@njit(cache=True, fastmath=True, nogil=True)
def dot_row(w: np.ndarray, x: np.ndarray) -> np.float32:
    """w . x (float32 [n] each): one compiled loop (vectorised: its partial sums and their final
    reduction are fixed by the code and n alone, never by the data's place in a batch), so the same
    bits for the same inputs wherever and however often it is called."""
    s = np.float32(0.0)
    for j in range(x.shape[0]):
        s += w[j] * x[j]
    return s


@njit(cache=True, parallel=True, nogil=True)
def matmul_deq(t: int, qk: int, raw: np.ndarray, raw16: np.ndarray, x: np.ndarray, f16: np.ndarray,
               fp4: np.ndarray, out: np.ndarray, chunk: int) -> None:
    """out[r, o] = x[r] . W[o] for a quantized W of any kept type (f32 activations), each weight row
    dequantized once for all m rows and each pair dotted by :func:`dot_row`: row r's result does not
    depend on m or on the other rows.  x float32 [m, n_in] C-order;  out float32 [m, n_out]; output rows
    split over threads in runs of ``chunk``."""
    n_out = raw.shape[0]
    m, n_in = x.shape
    n_chunks = (n_out + chunk - 1) // chunk
    fast = False
    for ft in FAST_TYPES:
        if t == ft:
            fast = True
    for ci in prange(n_chunks):
        w = np.empty(n_in, dtype=np.float32)
        for o in range(ci * chunk, min(n_out, (ci + 1) * chunk)):
            if fast:
                _deq_row(t, raw[o], raw16[o], f16, w)
            else:
                _deq_generic_row(t, qk, raw[o], raw16[o], f16, fp4, w)
            for r in range(m):
                out[r, o] = dot_row(w, x[r])


@njit(cache=True, parallel=True, nogil=True)
def matmul_f32(w: np.ndarray, x: np.ndarray, out: np.ndarray, chunk: int) -> None:
    """out[r, o] = x[r] . w[o] for a float32 w [n_out, n_in] (C-order) by :func:`dot_row`: row r's
    result does not depend on the other rows.  x float32 [m, n_in] C-order; out float32 [m, n_out]."""
    n_out = w.shape[0]
    m = x.shape[0]
    n_chunks = (n_out + chunk - 1) // chunk
    for ci in prange(n_chunks):
        for o in range(ci * chunk, min(n_out, (ci + 1) * chunk)):
            for r in range(m):
                out[r, o] = dot_row(w[o], x[r])


@njit(cache=True, parallel=True, nogil=True)
def matmul_f32_t(w_t: np.ndarray, x: np.ndarray, out: np.ndarray, chunk: int) -> None:
    """out[r, o] = sum_i x[r, i] * w_t[i, o] for a float32 w_t [n_in, n_out] (C-order), summed over i in
    order (mul then add): row r's result does not depend on the other rows.  x float32 [m, n_in]."""
    n_in, n_out = w_t.shape
    m = x.shape[0]
    n_chunks = (n_out + chunk - 1) // chunk
    for ci in prange(n_chunks):
        o0 = ci * chunk
        o1 = min(n_out, o0 + chunk)
        for r in range(m):
            for o in range(o0, o1):
                out[r, o] = np.float32(0.0)
            for i in range(n_in):
                xi = x[r, i]
                for o in range(o0, o1):
                    out[r, o] += xi * w_t[i, o]


drop_stale(matmul_rows_at, [Path(__file__).with_name("jitcache.py")])

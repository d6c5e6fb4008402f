"""Int8-activation kernels: the activation rows are quantized per 32 values to int8 (as
llama.cpp's Q8_0 activations) and each weight block meets them in AVX2 integer dot products
(:mod:`plinth.quant.simd`). The eight block types of ``kernels.FAST_TYPES``.

Activations (:func:`quantize_rows`): ``xq`` int8 ``[m, n_in]``, ``xd`` the per-32 scale
``[m, n_in / 32]`` (x ~= xd * xq), ``xs`` the per-32 sums of ``xq``, ``xsd = xd * xs`` and
``xs16`` the per-16 sums (offsets and mins of the weight types come out of these sums, not out
of the products).

Per 32-value block with integer product ``i = sum(q * xq)`` of the unsigned stored quants q:

- Q4_0 ``d * xd * i - 8 * d * xsd``;  Q5_0 ``d * xd * i - 16 * d * xsd``;  Q8_0 ``d * xd * i``
- Q4_1 / Q5_1 ``d * xd * i + m * xsd``   (xsd = xd * xs, once per activation block)
- Q4_K / Q5_K sub-block j: ``xd * (d * sc_j * i - dmin * m_j * xs)``
- Q6_K per 16 values: ``d * sc * xd * (i16 - 32 * xs16)``

So the result equals the f32 product of the dequantized weight with the dequantized
activations up to float rounding (``tests/test_quant_kernels.py`` checks exactly that); the only
approximation is the activation rounding, the one llama.cpp makes.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .kernels import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, _k_scale_min
from .simd import (dot_bits_halves_rows1, dot_bits_halves_rows4, dot_bits_rows1, dot_bits_rows4, half_at, rows_q4_0,
                   rows_q4_1, rows_q5_0, rows_q5_1, rows_q8_0)

#: the types :func:`linear` computes
I8_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)


@njit(cache=True, fastmath=False)
def quantize_rows(x: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray, xsd: np.ndarray,
                  xs16: np.ndarray) -> None:
    """x float32 [m, n] (n a multiple of 32) -> xq int8 [m, n], xd float32 / xs int32 [m, n/32],
    xsd = xd * xs float32 [m, n/32] (the factor of the offset and min terms), xs16 int32 [m, n/16];
    scale = max|x| / 127 per block, values rounded to nearest even."""
    m, n = x.shape
    for r in range(m):
        for b in range(n // 32):
            amax = np.float32(0.0)
            for j in range(32):
                a = abs(x[r, b * 32 + j])
                if a > amax:
                    amax = a
            d = amax / np.float32(127.0)
            inv = np.float32(0.0) if d == 0 else np.float32(1.0) / d
            s0 = 0
            s1 = 0
            for j in range(32):
                q = np.int32(np.rint(x[r, b * 32 + j] * inv))
                xq[r, b * 32 + j] = q
                if j < 16:
                    s0 += q
                else:
                    s1 += q
            xd[r, b] = d
            xs[r, b] = s0 + s1
            xsd[r, b] = d * np.float32(s0 + s1)
            xs16[r, 2 * b] = s0
            xs16[r, 2 * b + 1] = s1


@njit(cache=True, inline="always")
def _k45_term(d: float, dmin: float, s1: int, m1: int, s2: int, m2: int, i1: int, i2: int, xd1: float, xd2: float,
              xs1: int, xs2: int) -> float:
    """Two Q4_K/Q5_K sub-blocks of one row: xd * (d * sc * i - dmin * m * xs), the same arithmetic
    for a row alone or in a group."""
    return (xd1 * (d * np.float32(s1 * i1) - dmin * np.float32(m1 * xs1))
            + xd2 * (d * np.float32(s2 * i2) - dmin * np.float32(m2 * xs2)))


@njit(cache=True, inline="always")
def _q6_term(d: float, sa: int, sb: int, a: int, b: int, xd: float, xsa: int, xsb: int) -> float:
    """A Q6_K 32-value stretch (two 16-value sub-blocks) of one row."""
    return xd * d * np.float32(sa * (a - 32 * xsa) + sb * (b - 32 * xsb))


@njit(cache=True, inline="always")
def _rows_k(t: int, row: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray, xs16: np.ndarray,
            out: np.ndarray, o: int, acc: np.ndarray) -> None:
    """out[:, o] for one Q4_K, Q5_K or Q6_K weight row: each sub-block's quants unpacked once for
    four activation rows (then for the rows left one at a time); per row the same operations in
    the same order either way. ``acc``: float32 [4] scratch."""
    m, n = xq.shape
    r = 0
    while r < m:
        g = 4 if r + 4 <= m else 1
        acc[:] = 0.0
        if t == Q4_K or t == Q5_K:
            five = t == Q5_K
            bs = 176 if five else 144
            hmask = 1 if five else 0
            for ib in range(n // 256):
                o0 = ib * bs
                d = half_at(row, o0)
                dmin = half_at(row, o0 + 2)
                q0 = o0 + (48 if five else 16)
                for c in range(4):
                    s1, m1 = _k_scale_min(row, o0 + 4, 2 * c)
                    s2, m2 = _k_scale_min(row, o0 + 4, 2 * c + 1)
                    j = ib * 8 + 2 * c
                    if g == 4:
                        i1 = dot_bits_rows4(row, q0 + 32 * c, 0, row, o0 + 16, 2 * c, hmask, xq, r, 32 * j)
                        i2 = dot_bits_rows4(row, q0 + 32 * c, 4, row, o0 + 16, 2 * c + 1, hmask, xq, r, 32 * j + 32)
                        for q in range(4):
                            acc[q] += _k45_term(d, dmin, s1, m1, s2, m2, i1[q], i2[q], xd[r + q, j], xd[r + q, j + 1],
                                                xs[r + q, j], xs[r + q, j + 1])
                    else:
                        i1 = dot_bits_rows1(row, q0 + 32 * c, 0, row, o0 + 16, 2 * c, hmask, xq, r, 32 * j)
                        i2 = dot_bits_rows1(row, q0 + 32 * c, 4, row, o0 + 16, 2 * c + 1, hmask, xq, r, 32 * j + 32)
                        acc[0] += _k45_term(d, dmin, s1, m1, s2, m2, i1[0], i2[0], xd[r, j], xd[r, j + 1],
                                            xs[r, j], xs[r, j + 1])
        else:  # Q6_K
            for ib in range(n // 256):
                o0 = ib * 210
                d = half_at(row, o0 + 208)
                for half in range(2):
                    ql = o0 + 64 * half
                    qh = o0 + 128 + 32 * half
                    sc = o0 + 192 + 8 * half
                    for k in range(4):
                        j = ib * 8 + half * 4 + k
                        sa = np.int32(np.int8(row[sc + 2 * k]))
                        sb = np.int32(np.int8(row[sc + 2 * k + 1]))
                        if g == 4:
                            h = dot_bits_halves_rows4(row, ql + 32 * (k & 1), 4 * (k >> 1), row, qh, 2 * k, 3, xq, r,
                                                      32 * j)
                            for q in range(4):
                                acc[q] += _q6_term(d, sa, sb, h[2 * q], h[2 * q + 1], xd[r + q, j],
                                                   xs16[r + q, 2 * j], xs16[r + q, 2 * j + 1])
                        else:
                            h = dot_bits_halves_rows1(row, ql + 32 * (k & 1), 4 * (k >> 1), row, qh, 2 * k, 3, xq, r,
                                                      32 * j)
                            acc[0] += _q6_term(d, sa, sb, h[0], h[1], xd[r, j], xs16[r, 2 * j], xs16[r, 2 * j + 1])
        for q in range(g):
            out[r + q, o] = acc[q]
        r += g


@njit(cache=True, inline="always")
def _rows_32(t: int, row: np.ndarray, xq: np.ndarray, xd: np.ndarray, xsd: np.ndarray, out: np.ndarray,
             o: int) -> None:
    """out[:, o] for one weight row of a 32-value block type."""
    if t == Q4_1:
        rows_q4_1(row, xq, xd, xsd, out, o)
    elif t == Q4_0:
        rows_q4_0(row, xq, xd, xsd, out, o)
    elif t == Q8_0:
        rows_q8_0(row, xq, xd, xsd, out, o)
    elif t == Q5_0:
        rows_q5_0(row, xq, xd, xsd, out, o)
    else:
        rows_q5_1(row, xq, xd, xsd, out, o)


#: parts of one product: a weight, or the parts of a stacked weight (fused QKV, gate/up)
MAX_PARTS = 3


@njit(cache=True, parallel=True)
def _product(ts: np.ndarray, raws: tuple, starts: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray,
             xsd: np.ndarray, xs16: np.ndarray, out: np.ndarray) -> None:
    n_parts = len(ts)
    for o in prange(out.shape[1]):
        p = 0
        while p + 1 < n_parts and o >= starts[p + 1]:
            p += 1
        row = raws[p][o - starts[p]]
        t = ts[p]
        if t == Q4_0 or t == Q4_1 or t == Q5_0 or t == Q5_1 or t == Q8_0:
            _rows_32(t, row, xq, xd, xsd, out, o)
        else:
            _rows_k(t, row, xq, xd, xs, xs16, out, o, np.empty(4, dtype=np.float32))


@njit(cache=True)
def linear(ts: np.ndarray, raws: tuple, starts: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out = x @ W.T for W the parts ``raws`` (a tuple of MAX_PARTS uint8 ``[n_out_p, row_bytes_p]``
    arrays; unused slots repeat a part) stacked on the output axis: part p (type ``ts[p]``, one of
    I8_TYPES) fills output columns ``starts[p]:starts[p+1]``.  x float32 [m, n_in] is quantized
    here, once for all parts; the product is one parallel region over all output rows, each weight
    row read once for the m activation rows.  out: float32 [m, starts[-1]]."""
    m, n = x.shape
    xq = np.empty((m, n), np.int8)
    xd = np.empty((m, n // 32), np.float32)
    xs = np.empty((m, n // 32), np.int32)
    xsd = np.empty((m, n // 32), np.float32)
    xs16 = np.empty((m, n // 16), np.int32)
    quantize_rows(x, xq, xd, xs, xsd, xs16)
    _product(ts, raws, starts, xq, xd, xs, xsd, xs16, out)

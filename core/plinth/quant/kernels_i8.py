"""Int8-activation kernels: the activation rows are quantized per 32 values to int8 (as
llama.cpp's Q8_0 activations) and each weight block meets them in integer dot products
(:mod:`plinth.quant.simd`: AVX512-VNNI where the CPU has it, else AVX2). The eight block types
of ``I8_TYPES``.

Activations (:func:`quantize_rows`): ``xq`` int8 ``[m, n_in]``, and block-major ``[n_in / 32, m]``
(the rows of a group side by side): ``xdt`` the per-32 scale (x ~= xd * xq) and ``xsdt = xd *
sum(xq)`` of the block (the weight types' offsets and mins multiply it, not the products).

Per 32-value unit with integer product ``i = sum(q * xq)`` of the stored quants q (unsigned, or
signed for Q8_0 and Q6_K's q - 32), value = scale * q + offset:

- Q4_0 ``d * xd * i - 8 * d * xsd``;  Q5_0 ``d * xd * i - 16 * d * xsd``;  Q8_0 ``d * xd * i``
- Q4_1 / Q5_1 ``d * xd * i + m * xsd``
- Q4_K / Q5_K sub-block j: ``d * sc_j * xd * i - dmin * m_j * xsd``
- Q6_K, two 16-value sub-blocks: ``d * xd * (sc_a * i_a + sc_b * i_b)``

So the result equals the f32 product of the dequantized weight with the dequantized
activations up to float rounding (``tests/test_quant_kernels.py`` checks exactly that); the only
approximation is the activation rounding, the one llama.cpp makes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import njit, prange

from .jitcache import drop_stale
from .kernels import dequantize_fast_serial, dequantize_rows_serial
from .simd import TYPE_CODES, call_group, quantize_row

#: the GGML type codes :func:`linear` computes
I8_TYPES = tuple(TYPE_CODES)


@njit(cache=True)
def quantize_rows(x: np.ndarray, xq: np.ndarray, xdt: np.ndarray, xsdt: np.ndarray, xit: np.ndarray) -> None:
    """x float32 [m, n] (n a multiple of 32, rows contiguous) -> xq int8 [m, n], xdt float32 [n/32, m]
    the scales, xsdt = xd * sum(xq) float32 [n/32, m], xit int32 [n/16, m] the sums of xq per 16
    values; scale = max|x| / 127 per block, values rounded to nearest even (vector code:
    :func:`plinth.quant.simd.quantize_row`, 3-4x a scalar loop's speed)."""
    for r in range(x.shape[0]):
        quantize_row(x, xq, xdt, xsdt, xit, r)


@njit(cache=True)
def _count_at_least(y: np.ndarray, r: int, n: int, lo: np.float32) -> int:
    """How many of y[r, :n] are >= lo (a loop LLVM vectorises)."""
    c = 0
    for j in range(n):
        c += np.int64(y[r, j] >= lo)
    return c


@njit(cache=True, fastmath=False)
def _thresholds(mx: np.float32, margin: float, los: np.ndarray) -> None:
    """The selection's margins, in float32 as the rule halves them: ``los[i] = mx - margin / 2^i`` as the
    running ``lo = mx - (mx - lo) * 0.5``, i = 0..24."""
    lo = mx - np.float32(margin)
    for i in range(24):
        los[i] = lo
        lo = mx - (mx - lo) * np.float32(0.5)
    los[24] = lo


@njit(cache=True, fastmath=False)
def _near_max_passes(y: np.ndarray, r: int, n: int, los: np.ndarray, cap: int, cols: np.ndarray) -> int:
    """The selection rule of :func:`near_max_row` by whole passes over row r (``los`` its margins,
    :func:`_thresholds`): a pass that counts per margin until one fits, then one that collects, 64 values at a
    time (a chunk without a close value is only compared). Returns how many columns went into ``cols``."""
    lo = los[24]
    for i in range(24):
        if _count_at_least(y, r, n, los[i]) <= cap:
            lo = los[i]
            break
    k = 0
    row = y[r]
    n64 = n - n % 64
    for c0 in range(0, n64, 64):
        hit = np.int32(0)
        for j in range(64):  # (a constant trip count: LLVM vectorises it)
            hit |= np.int32(row[c0 + j] >= lo)
        if hit:
            for j in range(c0, c0 + 64):
                if row[j] >= lo and k < cap:
                    cols[k] = j
                    k += 1
    for j in range(n64, n):
        if row[j] >= lo and k < cap:
            cols[k] = j
            k += 1
    return k


#: columns :func:`near_max_row`'s one pass keeps as candidates (those within twice the margin of the running
#: maximum); a row with more (a ramp, a flat row) takes the rule's whole passes instead
CANDIDATES = 4096


@njit(cache=True, fastmath=False)
def near_max_row(y: np.ndarray, r: int, n: int, margin: float, cap: int, cols: np.ndarray, cand: np.ndarray) -> int:
    """Row r of y's first n columns (float32): the columns within ``margin`` of the row's maximum, in order, into
    ``cols`` (int64 [cap]); where more than ``cap`` are that close the margin is halved (in float32, at most 24
    times) until they fit, and the first ``cap`` of those left are kept (ties at the maximum beyond ``cap``).
    A row holding a NaN selects nothing (its maximum is NaN, as numpy's). Returns the count.

    One pass over the row finds the maximum and keeps, in order, the columns within twice the margin of the
    maximum so far (``cand``, int64 [CANDIDATES]): every column within the final margins is among them, so
    the counts per margin and the collection come from that short list. 64 values at a time: a chunk
    without a value that close is only compared (a loop LLVM vectorises). Where the list overflows, or a
    rounded margin falls below the list's reach, the rule's whole passes (:func:`_near_max_passes`)."""
    row = y[r]
    two = np.float32(2.0 * margin)
    mr = np.float32(-np.inf)
    nc = 0
    over = False
    nan = False
    n64 = n - n % 64
    for c0 in range(0, n64 + 64, 64):
        c1 = min(c0 + 64, n)
        if c0 >= c1:
            break
        if c1 - c0 == 64:
            thr = mr - two
            hit = np.int32(0)
            for j in range(64):  # (a constant trip count: LLVM vectorises it)
                v = row[c0 + j]
                hit |= np.int32(v >= thr) | np.int32(v != v)
            if not hit:
                continue
        for j in range(c0, c1):
            v = row[j]
            if v != v:
                nan = True
            elif v >= mr - two:
                if v > mr:
                    mr = v
                if nc < cand.shape[0]:
                    cand[nc] = j
                    nc += 1
                else:
                    over = True
    if nan or n == 0:
        return 0
    los = np.empty(25, np.float32)
    _thresholds(mr, margin, los)
    reach = mr - two
    for i in range(25):
        if los[i] < reach:  # (NaN margins compare false: they count nothing either way)
            over = True
    if over:
        return _near_max_passes(y, r, n, los, cap, cols)
    lo = los[24]
    for i in range(24):
        c = 0
        for t in range(nc):
            c += np.int64(row[cand[t]] >= los[i])
        if c <= cap:
            lo = los[i]
            break
    k = 0
    for t in range(nc):
        j = cand[t]
        if row[j] >= lo and k < cap:
            cols[k] = j
            k += 1
    return k


@njit(cache=True, fastmath=False)
def _dot16(w: np.ndarray, x: np.ndarray) -> np.float32:
    """w . x in float32 in one fixed order: 16 running sums (value j into sum j % 16), then a fixed tree."""
    acc = np.zeros(16, np.float32)
    n = x.shape[0]
    n16 = n - n % 16
    for j in range(0, n16, 16):
        for lane in range(16):
            acc[lane] += w[j + lane] * x[j + lane]
    for j in range(n16, n):
        acc[j - n16] += w[j] * x[j]
    width = 8
    while width:
        for lane in range(width):
            acc[lane] += acc[lane + width]
        width //= 2
    return acc[0]


@njit(cache=True, nogil=True)
def _refine_row(y: np.ndarray, r: int, n: int, margin: float, cap: int, fast: bool, t: int, qk: int, raw: np.ndarray,
                raw16: np.ndarray, f16: np.ndarray, fp4: np.ndarray, x: np.ndarray) -> None:
    """:func:`refine_head` for row r."""
    cols = np.empty(cap, np.int64)
    k = near_max_row(y, r, n, margin, cap, cols, np.empty(CANDIDATES, np.int64))
    if k == 0:
        return
    w = np.empty((1, x.shape[1]), np.float32)
    at = np.empty(1, np.intp)
    for i in range(k):
        at[0] = cols[i]
        if fast:
            dequantize_fast_serial(t, raw, raw16, at, f16, w)
        else:
            dequantize_rows_serial(t, qk, raw, raw16, at, f16, fp4, w)
        y[r, cols[i]] = _dot16(w[0], x[r])


@njit(cache=True, parallel=True, nogil=True)
def refine_head(y: np.ndarray, n: int, margin: float, cap: int, fast: bool, t: int, qk: int, raw: np.ndarray,
                raw16: np.ndarray, f16: np.ndarray, fp4: np.ndarray, x: np.ndarray) -> None:
    """A precise LM head's refinement (:meth:`plinth.quant.QuantWeight._refine`) in one call: per row r of the int8
    products y (float32 [m, >= n]), the columns :func:`near_max_row` selects are recomputed as ``_dot16`` of the
    weight row dequantized (type t, block size qk, the raw bytes and their uint16 view; ``fast``: the
    :data:`plinth.quant.kernels.FAST_TYPES` loop, else the generic one; ``f16`` / ``fp4`` their tables, as
    :meth:`QuantWeight.take` dequantizes) with the f32 activations x[r]. The rows over the kernel threads: each
    row's result depends on that row only."""
    m = y.shape[0]
    if m == 1:
        _refine_row(y, 0, n, margin, cap, fast, t, qk, raw, raw16, f16, fp4, x)
        return
    for r in prange(m):
        _refine_row(y, r, n, margin, cap, fast, t, qk, raw, raw16, f16, fp4, x)


#: parts of one product: a weight, or the parts of a stacked weight (fused QKV, gate/up)
MAX_PARTS = 3
#: int8 activation bytes a pass over the weight reads: a prompt batch larger than this goes in tiles
#: of rows (a multiple of 8, at least 64), so that the rows each weight row meets stay in the core's
#: L2 cache instead of streaming from L3 once per weight row (+15-25% on a 512-token prompt)
TILE_BYTES = 256 * 1024


@njit(cache=True, parallel=True, nogil=True)
def linear(fns: np.ndarray, grps: tuple, gstarts: np.ndarray, starts: np.ndarray, x: np.ndarray,
           out: np.ndarray) -> None:
    """out = x @ W.T for W the parts stacked on the output axis: part p (``starts[p+1] - starts[p]`` rows
    of a type of I8_TYPES, whose compiled loops are at addresses ``fns[p, 0]`` (eight lanes) and
    ``fns[p, 1]`` (sixteen lanes, two groups a call; 0 where that form is not there):
    :func:`plinth.quant.simd.kernel_address`) fills output columns ``starts[p]:starts[p+1]``.
    ``grps[p]``: its rows in groups of eight (uint8 ``[n_groups, bytes]`` as
    :func:`plinth.quant.simd.repack` writes them, the last group padded with zero rows; in its ``pairs``
    layout where ``fns[p, 1]`` is set); ``gstarts``
    the cumulative group counts (the tuple holds MAX_PARTS arrays; unused slots repeat a part).
    x float32 [m, n_in] is quantized here, once for all parts; the product is one parallel region
    over all the parts' groups per tile of activation rows (TILE_BYTES), each weight row read once
    for them: its tasks a pair of groups each where the sixteen-lane form is there (a part's odd last
    group alone), else one group each.  out: float32 [m, starts[-1]]."""
    m, n = x.shape
    n_parts = len(fns)
    xq = np.empty((m, n), np.int8)
    xdt = np.empty((n // 32, m), np.float32)
    xsdt = np.empty((n // 32, m), np.float32)
    xit = np.empty((n // 16, m), np.int32)
    quantize_rows(x, xq, xdt, xsdt, xit)
    padded = 8 * gstarts[n_parts] != starts[n_parts]
    buf = np.empty((m, 8 * gstarts[n_parts]), np.float32) if padded else out
    tile = max(64, TILE_BYTES // n // 8 * 8)  # (a tile's rows go in the same groups of 8 as without tiles)
    tstarts = np.zeros(n_parts + 1, np.int64)  # the parts' first tasks
    for p in range(n_parts):
        ng = gstarts[p + 1] - gstarts[p]
        tstarts[p + 1] = tstarts[p] + ((ng + 1) // 2 if fns[p, 1] else ng)
    for r in range(0, m, tile):  # (one parallel region a tile)
        r_hi = min(m, r + tile)
        for t in prange(tstarts[n_parts]):
            p = 0
            while p + 1 < n_parts and t >= tstarts[p + 1]:
                p += 1
            grp = grps[p]
            if fns[p, 1]:
                g = 2 * (t - tstarts[p])
                if gstarts[p] + g + 1 < gstarts[p + 1]:
                    call_group(fns[p, 1], grp[g], xq, xdt, xsdt, xit, buf, 8 * (gstarts[p] + g), r, r_hi)
                    continue
            else:
                g = t - tstarts[p]
            call_group(fns[p, 0], grp[g], xq, xdt, xsdt, xit, buf, 8 * (gstarts[p] + g), r, r_hi)
    if padded:  # a part whose rows are not a multiple of 8: its columns without the padding's
        for p in range(n_parts):  # (loops: an array assignment compiles numba's shape-error message, ~2 s)
            for r in range(m):
                for j in range(starts[p + 1] - starts[p]):
                    out[r, starts[p] + j] = buf[r, 8 * gstarts[p] + j]


drop_stale(linear, [Path(__file__).with_name(n) for n in ("simd.py", "kernels.py")])

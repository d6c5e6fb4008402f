"""Compiled host kernels for the ops where numpy's per-call overhead dominates a decode step:
attention for a few query rows, RMSNorm and RoPE (each a handful of numpy calls per layer otherwise).

Attention for a few query rows (decode and verify batches), for the rows of one sequence or of
several (a server step's decode rows, each sequence with its own cache), runs in one parallel
region (:func:`attention_groups`): the vector kernel of :mod:`plinth.ops.attend_simd` where the head
sizes suit it, else a plain loop per (row, head).

Every query row runs exactly the same loops whether it comes alone or with others, so a row's
output does not depend on the batch it is in: a verify batch of k draft tokens produces, row for
row, the activations k single-token decode steps would. The int8-activation kernels make that
matter: they round activations to int8 per 32 values, so a last-bit difference from a BLAS product
of another shape can move a rounding and change a logit by far more than float error (and flip a
near-tie); with this kernel and the row-wise weight kernels, speculative decoding and the server's
batched decode give the tokens a lone decode gives.

Semantics of :func:`plinth.ops.attention` without sinks and with at most an additive bias:
scores ``q . k * scale``, optional ``soft_cap * tanh(s / soft_cap)``, plus ``bias[i, j]`` (0 or
-inf), softmax over keys, weighted sum of values; grouped-query heads (query head h reads kv head
h // (n_head / n_head_kv)); a row that sees no key yields zeros.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from numba import carray, njit, prange, types

from ..quant.jitcache import (address_call, cfunc_address, drop_stale, f32_at, f32_pow2_hi, f32_pow2_lo, i64_at,
                              prefetch_write, u8_at)
from .attend_simd import attend_rows, lanes, scratch_floats

# no 'nnan'/'ninf': the bias and the row maxima hold -inf
_FLAGS = {"nsz", "arcp", "contract", "reassoc", "afn"}
#: float lanes of the vector attention kernel on this host (a compile-time constant of the cached code)
_W = lanes()


#: columns of an attention table: per group its query rows' start and stop, its key count, the addresses of its
#: K, V and bias (:func:`attention_groups`), then the bytes between its kv heads' rows in K and in V and between
#: consecutive keys' rows in K and in V (the cache stores rows head-major: :meth:`plinth.cache.Rows.strides`)
TABLE_COLUMNS = 10


@njit(cache=True)
def full_table(table: np.ndarray, n_head_kv: int, kbytes: int, vbytes: int) -> np.ndarray:
    """``table`` with its stride columns (:data:`TABLE_COLUMNS`); a six-column table (rows stored position-major,
    ``[n, n_head_kv, row]``, ``kbytes`` / ``vbytes`` a kv head's row) gets the strides of that layout."""
    if table.shape[1] >= TABLE_COLUMNS:
        return table
    out = np.empty((table.shape[0], TABLE_COLUMNS), dtype=np.int64)
    for g in range(table.shape[0]):
        for c in range(6):
            out[g, c] = table[g, c]
        out[g, 6], out[g, 7] = kbytes, vbytes
        out[g, 8], out[g, 9] = n_head_kv * kbytes, n_head_kv * vbytes
    return out


@njit(cache=True, fastmath=_FLAGS)
def _attend_one(t: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, n_kv: int, n_head_kv: int, kh: int, krs: int,
                vh: int, vrs: int, bias: np.ndarray, has_bias: bool, sc: float, cap: float, out: np.ndarray) -> None:
    """Query row t // n_head, head t % n_head; k and v flat float32 from the group's first key, kv head hk's
    row of key j at ``hk * kh + j * krs`` (floats)."""
    n_head, hd = q.shape[1], q.shape[2]
    hd_v = out.shape[2]
    i = t // n_head
    h = t - i * n_head
    hk = h // (n_head // n_head_kv)
    qs = np.empty(hd, dtype=np.float32)
    for d in range(hd):
        qs[d] = q[i, h, d] * sc
    s = np.empty(n_kv, dtype=np.float32)
    mx = -np.inf
    for j in range(n_kv):
        a = np.float32(0.0)
        at = hk * kh + j * krs
        for d in range(hd):
            a += qs[d] * k[at + d]
        if cap > 0:
            a = np.float32(np.tanh(a / cap)) * cap
        if has_bias:
            a += bias[i, j]
        s[j] = a
        if a > mx:
            mx = a
    o = np.zeros(hd_v, dtype=np.float32)
    if mx == -np.inf:  # sees no key
        for d in range(hd_v):  # (a loop: an array assignment compiles numba's shape-error message, ~2 s)
            out[i, h, d] = np.float32(0.0)
        return
    den = np.float32(0.0)
    for j in range(n_kv):
        p = np.float32(np.exp(s[j] - mx))
        den += p
        if p != 0:
            at = hk * vh + j * vrs
            for d in range(hd_v):
                o[d] += p * v[at + d]
    inv = np.float32(1.0) / den
    for d in range(hd_v):
        out[i, h, d] = o[d] * inv


#: an attention task's arguments as a C function's: :func:`_vector_task`, :func:`_plain_task`
TASK_SIG = types.void(*[types.int64] * 12, types.float32, types.float32)
_call_task = address_call(TASK_SIG, "call_task")


@njit(cache=True)
def _selected(table: np.ndarray, j: int) -> tuple[int, int]:
    """The group g and the row of q of the j-th row the groups of ``table`` select (in table order)."""
    g = 0
    while j >= table[g, 1] - table[g, 0]:
        j -= table[g, 1] - table[g, 0]
        g += 1
    return g, table[g, 0] + j


@njit(cache=True)
def _chunk(table: np.ndarray, c: int, rows: int) -> tuple[int, int, int]:
    """The group g and the rows r0 .. r1 - 1 of q of the c-th chunk of ``rows`` consecutive rows of a group (each
    group's rows cut into chunks, the last one shorter; the groups in table order)."""
    g = 0
    while True:
        n = table[g, 1] - table[g, 0]
        k = (n + rows - 1) // rows
        if c < k:
            r0 = table[g, 0] + c * rows
            return g, r0, min(r0 + rows, table[g, 1])
        c -= k
        g += 1


@njit(cache=True)
def _chunks(table: np.ndarray, rows: int) -> int:
    """How many chunks of ``rows`` rows the groups of ``table`` make (:func:`_chunk`)."""
    k = 0
    for g in range(table.shape[0]):
        k += (table[g, 1] - table[g, 0] + rows - 1) // rows
    return k


def _vector_task(t: int, q_at: int, out_at: int, table_at: int, n_groups: int, n_head: int, n_head_kv: int, hd: int, hd_v: int, run: int, rows: int, n_scratch: int, sc: float, cap: float) -> None:
    """Task t of :func:`attention_table`'s vector path: a chunk of up to ``rows`` consecutive rows of one group and
    a run of ``run`` query heads that share a kv head, in one call of the kernel (:mod:`plinth.ops.attend_simd`),
    which reads each block of keys and values once for all of them. Each row keeps its own bias row (its mask)
    and its own key count: its trailing masked keys (a verify batch's later rows) left out, as it sees them
    alone (the kernel's sums depend on where a row's key blocks end); the call runs to the last key any row of
    the chunk sees, and gives each row the bits it gives it alone."""
    table = carray(i64_at(table_at), (n_groups, TABLE_COLUMNS))
    per_kv = n_head // n_head_kv
    runs = (per_kv + run - 1) // run
    c = t // (n_head_kv * runs)
    rest = t - c * n_head_kv * runs
    hk = rest // runs
    h0 = hk * per_kv + (rest - hk * runs) * run
    n_q = min(run, (hk + 1) * per_kv - h0)
    g, r0, r1 = _chunk(table, c, rows)
    n_all = table[g, 2]
    n = n_all
    b_at = table[g, 5] + (r0 - table[g, 0]) * n_all * 4 if table[g, 5] != 0 else 0
    keys = np.empty(r1 - r0, np.int64)  # the keys each row sees: its trailing masked ones left out
    keys[:] = n_all
    if b_at != 0:
        for r in range(r1 - r0):
            bias = carray(f32_at(b_at + r * n_all * 4), (n_all,))
            nr = n_all
            while nr > 1 and bias[nr - 1] == -np.inf:
                nr -= 1
            keys[r] = nr
        n = keys.max()
    scratch = np.empty(n_scratch, np.float32)
    attend_rows(q_at + (r0 * n_head + h0) * hd * 4, n_q * (r1 - r0), hd, table[g, 3] + hk * table[g, 6],
                table[g, 4] + hk * table[g, 7], n, table[g, 8] // 4, table[g, 9] // 4, hd, hd_v, sc, b_at,
                scratch.ctypes.data, out_at + (r0 * n_head + h0) * hd_v * 4, hd_v, n_q, n_head * hd, n_head * hd_v,
                n_all, keys.ctypes.data if r1 - r0 > 1 else 0)


def _plain_task(t: int, q_at: int, out_at: int, table_at: int, n_groups: int, n_head: int, n_head_kv: int, hd: int, hd_v: int, run: int, rows: int, n_scratch: int, sc: float, cap: float) -> None:
    """Task t of :func:`attention_table`'s plain path: one selected row and one query head
    (:func:`_attend_one` on its group's arrays; ``run``, ``rows`` and ``n_scratch`` unused)."""
    table = carray(i64_at(table_at), (n_groups, TABLE_COLUMNS))
    j = t // n_head
    g, r = _selected(table, j)
    s0, s1, n_kv = table[g, 0], table[g, 1], table[g, 2]
    q = carray(f32_at(q_at + s0 * n_head * hd * 4), (s1 - s0, n_head, hd))
    kh, vh, krs, vrs = table[g, 6] // 4, table[g, 7] // 4, table[g, 8] // 4, table[g, 9] // 4
    k = carray(f32_at(table[g, 3]), ((n_head_kv - 1) * kh + max(n_kv, 1) * krs,))
    v = carray(f32_at(table[g, 4]), ((n_head_kv - 1) * vh + max(n_kv, 1) * vrs,))
    has_bias = table[g, 5] != 0
    bias = carray(f32_at(table[g, 5] if has_bias else table[g, 3]), (s1 - s0, n_kv if has_bias else 0))
    out = carray(f32_at(out_at + s0 * n_head * hd_v * 4), (s1 - s0, n_head, hd_v))
    _attend_one((r - s0) * n_head + t - j * n_head, q, k, v, n_kv, n_head_kv, kh, krs, vh, vrs, bias, has_bias, sc,
                cap, out)


def task_address(vector: bool) -> int:
    """The address of :func:`_vector_task` or :func:`_plain_task` compiled as a C function (:data:`TASK_SIG`;
    on first use, then from numba's on-disk cache): :func:`attention_table`'s parallel region calls it
    rather than holding its code (:func:`plinth.quant.jitcache.address_call` says why)."""
    return cfunc_address(f"attention.{'vector' if vector else 'plain'}", TASK_SIG,
                         lambda: _vector_task if vector else _plain_task, fastmath=_FLAGS)


@njit(cache=True, nogil=True)
def _ask_for_rows(table: np.ndarray, n_head_kv: int, kbytes: int, vbytes: int) -> None:
    """Prefetch for writing every cache line the rows of ``table`` (ten columns) will land on, ``kbytes`` /
    ``vbytes`` a kv head's K / V row: a server step's rows land in as many cold places as it has sequences x kv
    heads (x K and V), and copying into them one after another waited on each in turn."""
    for g in range(table.shape[0]):
        s0, s1, n0 = table[g, 0], table[g, 1], table[g, 2]
        for r in range(s0, s1):
            j = n0 + r - s0
            for h in range(n_head_kv):
                for at, nb in ((table[g, 3] + h * table[g, 6] + j * table[g, 8], kbytes),
                               (table[g, 4] + h * table[g, 7] + j * table[g, 9], vbytes)):
                    for b in range(0, nb + 63, 64):
                        prefetch_write(at + min(b, nb - 1))


@njit(cache=True, nogil=True)
def scatter_rows(k: np.ndarray, v: np.ndarray, positions: np.ndarray, table: np.ndarray) -> None:
    """Write this forward's K / V rows and positions into their sequences' cache buffers: per row g of
    ``table`` (int64 ``[n, 6]``, or ``[n, 10]`` with the buffers' strides: :meth:`plinth.cache.Rows.reserve_rows`)
    rows ``start:stop`` of k ``[rows, n_head_kv, hd]``, v ``[rows, n_head_kv, hd_v]`` (any strides) and
    positions go to rows ``n_old ..`` of the float32 buffers at the K and V addresses (six columns: C-order)
    and of the int64 buffer at the positions address (columns: start, stop, n_old, K, V, positions
    address, then the strides); the caller made the room (:meth:`plinth.cache.Rows.reserve`)."""
    n_head_kv, hd, hd_v = k.shape[1], k.shape[2], v.shape[2]
    table = full_table(table, n_head_kv, hd * 4, hd_v * 4)
    _ask_for_rows(table, n_head_kv, hd * 4, hd_v * 4)
    for g in range(table.shape[0]):
        s0, s1, n0 = table[g, 0], table[g, 1], table[g, 2]
        n = n0 + s1 - s0
        kh, vh, krs, vrs = table[g, 6] // 4, table[g, 7] // 4, table[g, 8] // 4, table[g, 9] // 4
        kb = carray(f32_at(table[g, 3]), ((n_head_kv - 1) * kh + n * krs,))
        vb = carray(f32_at(table[g, 4]), ((n_head_kv - 1) * vh + n * vrs,))
        pb = carray(i64_at(table[g, 5]), (n,))
        for r in range(s0, s1):
            j = n0 + r - s0
            for h in range(n_head_kv):
                for d in range(hd):
                    kb[h * kh + j * krs + d] = k[r, h, d]
                for d in range(hd_v):
                    vb[h * vh + j * vrs + d] = v[r, h, d]
            pb[j] = positions[r]


@njit(cache=True, nogil=True)
def scatter_stored(k: np.ndarray, v: np.ndarray, positions: np.ndarray, table: np.ndarray) -> None:
    """:func:`scatter_rows` for rows already in a typed cache's stored form: k uint8 ``[rows, n_head_kv,
    kbytes]``, v ``[rows, n_head_kv, vbytes]`` (C order, :func:`plinth.kvtypes.encode`'s bytes) into the
    uint8 buffers ``table`` addresses (ten columns: :meth:`plinth.cache.Rows.reserve_rows`, strides in bytes)."""
    n_head_kv, kbytes, vbytes = k.shape[1], k.shape[2], v.shape[2]
    _ask_for_rows(table, n_head_kv, kbytes, vbytes)
    for g in range(table.shape[0]):
        s0, s1, n0 = table[g, 0], table[g, 1], table[g, 2]
        n = n0 + s1 - s0
        kh, vh, krs, vrs = table[g, 6], table[g, 7], table[g, 8], table[g, 9]
        kb = carray(u8_at(table[g, 3]), ((n_head_kv - 1) * kh + n * krs,))
        vb = carray(u8_at(table[g, 4]), ((n_head_kv - 1) * vh + n * vrs,))
        pb = carray(i64_at(table[g, 5]), (n,))
        for r in range(s0, s1):
            j = n0 + r - s0
            for h in range(n_head_kv):
                for d in range(kbytes):
                    kb[h * kh + j * krs + d] = k[r, h, d]
                for d in range(vbytes):
                    vb[h * vh + j * vrs + d] = v[r, h, d]
            pb[j] = positions[r]


def attention_groups(q: np.ndarray, table: np.ndarray, n_head_kv: int, hd_v: int, scale: float, soft_cap: float,
                     out: np.ndarray, n_threads: int = 1, plain: bool = False) -> None:
    """Attention of a few query rows for one or more sequences in one parallel region. ``table`` int64
    ``[n_groups, 10]``, per group g: its query rows' start and stop in q, its key count n, the data
    addresses of its float32 keys ``[n, n_head_kv, hd]``, values ``[n, n_head_kv, hd_v]`` and bias
    ``[stop - start, n]`` (0: none), and the keys' and values' strides in bytes (between kv heads, then
    between keys: :data:`TABLE_COLUMNS`; a six-column table: C-order keys and values). Rows of no group
    are left alone; q and out C-order. The caller keeps the arrays alive.

    Where the head sizes suit the vector kernel (:mod:`plinth.ops.attend_simd`: no soft-cap, hd a
    multiple of W, hd_v of 4W) a task is a run of the query heads that share a kv head, for a chunk of
    consecutive rows of one group (a verify batch's), which read each block of keys and values once between
    them; the runs are split until there is a task for each of ``n_threads`` threads (so a lone decode row
    of a model with one kv head still uses every thread), and a group's rows are cut into chunks small
    enough to leave two tasks a thread. Otherwise, or with ``plain`` (benchmarks and tests compare
    the two), each (row, head) runs :func:`_attend_one`. Either way a row's output does not depend on
    the other rows of the call, nor on how the heads were split."""
    vector = not plain and vector_suits(q.shape[2], hd_v, soft_cap)
    attention_table(task_address(vector), vector, q, table, n_head_kv, hd_v, scale, soft_cap, out, n_threads)


def vector_suits(hd: int, hd_v: int, soft_cap: float | None) -> bool:
    """Whether the attention kernels take their vector form (:mod:`plinth.ops.attend_simd`, and the typed
    cache's :mod:`plinth.ops.attend_qsimd`) for these head sizes: no soft-cap, hd a multiple of the host's
    float lanes W, hd_v of 4W."""
    return not soft_cap and hd % _W == 0 and hd_v % (4 * _W) == 0


@njit(cache=True, parallel=True, fastmath=_FLAGS, nogil=True)
def attention_table(fn: int, vector: bool, q: np.ndarray, table: np.ndarray, n_head_kv: int, hd_v: int, scale: float,
                    soft_cap: float, out: np.ndarray, n_threads: int) -> None:
    """:func:`attention_groups`' parallel region: its tasks run the compiled function at ``fn``
    (:func:`task_address`; the vector kernel where ``vector``, else the plain loop)."""
    table = full_table(table, n_head_kv, q.shape[2] * 4, hd_v * 4)
    n_groups = table.shape[0]
    n_head, hd = q.shape[1], q.shape[2]
    n_sel = 0
    for g in range(n_groups):
        n_sel += table[g, 1] - table[g, 0]
    run = n_scratch = 0
    rows = 1
    n_tasks = n_sel * n_head
    if vector:
        per_kv = n_head // n_head_kv
        run = per_kv  # query heads a task, split only until every thread has a task (each task reads its kv
        while run > 1 and n_sel * n_head_kv * ((per_kv + run - 1) // run) < n_threads:  # head's keys and values:
            run = (run + 1) // 2  # SmolLM2's decode step at 4096 keys, 2 threads, 16.3-17.5 ms, 21-23 split further)
        runs = n_head_kv * ((per_kv + run - 1) // run)
        n_top = 0  # a group's rows a task: as many as leave two tasks a thread (SmolLM2's k = 8 verify, 2 threads:
        for g in range(n_groups):  # 24 one-row tasks 30.5 us a layer, 6 of four rows ~19; one row each: a server
            n_top = max(n_top, table[g, 1] - table[g, 0])  # step's groups, a decode step)
        rows = max(1, n_top)
        while rows > 1 and _chunks(table, rows) * runs < 2 * n_threads:
            rows = (rows + 1) // 2
        n_tasks = _chunks(table, rows) * runs
        n_max = 0
        for g in range(n_groups):
            n_max = max(n_max, table[g, 2])
        n_scratch = scratch_floats(n_max, run * rows, hd, hd_v, _W)
    sc, cap = np.float32(scale), np.float32(soft_cap)
    for t in prange(n_tasks):  # (the tasks read only the caller's arrays: the addresses stay valid)
        _call_task(fn, t, q.ctypes.data, out.ctypes.data, table.ctypes.data, n_groups, n_head, n_head_kv, hd, hd_v,
                   run, rows, n_scratch, sc, cap)


@njit(cache=True, nogil=True)
def rms_norm_rows(x: np.ndarray, w: np.ndarray, has_w: bool, unit_offset: bool, eps: float, out: np.ndarray) -> None:
    """out[r] = x[r] / sqrt(mean(x[r]**2) + eps) * w (or * (1 + w)) for x float32 [m, n] (C order).

    The sum of squares runs in float64 (a sequential f32 sum over a few thousand values would lose
    more than numpy's pairwise one), in eight interleaved partial sums (eight independent chains of
    adds instead of one: 16 rows of 576 in 3.8 us, not 8.5; float64's error on a few thousand squares
    is far below what the float32 rounding after it keeps), the rest in f32 as
    :func:`plinth.ops.rms_norm` states it;
    each row is computed alone, so a row's result does not depend on its batch."""
    m, n = x.shape
    e = np.float32(eps)
    nn = np.float32(n)
    n8 = n - n % 8
    for r in range(m):
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
        for j in range(0, n8, 8):
            v0, v1, v2, v3 = (np.float64(x[r, j]), np.float64(x[r, j + 1]), np.float64(x[r, j + 2]),
                              np.float64(x[r, j + 3]))
            v4, v5, v6, v7 = (np.float64(x[r, j + 4]), np.float64(x[r, j + 5]), np.float64(x[r, j + 6]),
                              np.float64(x[r, j + 7]))
            s0 += v0 * v0
            s1 += v1 * v1
            s2 += v2 * v2
            s3 += v3 * v3
            s4 += v4 * v4
            s5 += v5 * v5
            s6 += v6 * v6
            s7 += v7 * v7
        for j in range(n8, n):
            v = np.float64(x[r, j])
            s0 += v * v
        ss = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
        inv = np.float32(1.0) / np.float32(np.sqrt(np.float32(ss) / nn + e))
        if has_w:
            for j in range(n):
                out[r, j] = x[r, j] * inv * ((w[j] + np.float32(1.0)) if unit_offset else w[j])
        else:
            for j in range(n):
                out[r, j] = x[r, j] * inv


@njit(cache=True, nogil=True)
def rope_rows(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, offset: int, neox: bool, inverse: bool,
              out: np.ndarray) -> None:
    """:func:`plinth.ops.apply_rope` on the host: x float32 [n, n_head, head_dim] (any strides), cos / sin
    [n, half] float32; the pairs (offset + 2i, offset + 2i + 1) ("normal") or (offset + i, offset + half + i)
    ("neox") turn by the angle, the other dims pass through; out C-order [n, n_head, head_dim]. The
    same float32 steps as the numpy expression (a c - b s, a s + b c, no fused multiply-add), one
    call instead of a dozen array operations and temporaries."""
    n, n_head, hd = x.shape
    half = cos.shape[1]
    sign = np.float32(-1.0) if inverse else np.float32(1.0)  # (times -1: the bits of a negation)
    for t in range(n):
        c = cos[t]
        sn = sin[t]
        for h in range(n_head):
            src = x[t, h]
            dst = out[t, h]
            for d in range(offset):  # the dims that do not turn
                dst[d] = src[d]
            for d in range(offset + 2 * half, hd):
                dst[d] = src[d]
            if neox:  # (one loop per form, the pair's places fixed in it: a loop LLVM vectorises)
                for i in range(half):
                    a = src[offset + i]
                    b = src[offset + half + i]
                    si = sign * sn[i]
                    dst[offset + i] = a * c[i] - b * si
                    dst[offset + half + i] = a * si + b * c[i]
            else:
                for i in range(half):
                    a = src[offset + 2 * i]
                    b = src[offset + 2 * i + 1]
                    si = sign * sn[i]
                    dst[offset + 2 * i] = a * c[i] - b * si
                    dst[offset + 2 * i + 1] = a * si + b * c[i]


# exp in float32 for silu_rows: x = n ln2 + r (Cody-Waite: ln2 in a high part of few bits, so n * _LN2_HI is
# exact for |n| <= 128, and a low part), e^r by its Taylor series to r^7 / 7! (|r| <= ln2 / 2: the first term
# left out is below 0.1 ulp), times 2^n built from its bits in two halves (no overflow of the exponent field)
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.1219444005469057e-4)
_EXP_MAX = np.float32(88.72283)  # above: inf (past the largest float32)
_EXP_MIN = np.float32(-87.33654)  # below: 0 (past the smallest normal float32)
_T2, _T3, _T4 = np.float32(1 / 2), np.float32(1 / 6), np.float32(1 / 24)
_T5, _T6, _T7 = np.float32(1 / 120), np.float32(1 / 720), np.float32(1 / 5040)
_ONE, _HALF, _ZERO, _INF = np.float32(1.0), np.float32(0.5), np.float32(0.0), np.float32(np.inf)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def exp_f32(v: float) -> float:
    """e^v for a float32 ``v``, within 2 ulp of the true value over the normal float32 range (inf above it, 0
    below it, NaN for NaN). Plain float32 steps, no call and no branch: a loop over it vectorises, and its
    result is the same wherever it is compiled (no fused multiply-add, no reassociation)."""
    c = v if v > _EXP_MIN else _EXP_MIN
    c = c if c < _EXP_MAX else _EXP_MAX
    n = np.floor(c * _LOG2E + _HALF)  # (float32, an integer in [-126, 128])
    r = (c - n * _LN2_HI) - n * _LN2_LO
    p = _ONE + r * (_ONE + r * (_T2 + r * (_T3 + r * (_T4 + r * (_T5 + r * (_T6 + r * _T7))))))
    s = p * f32_pow2_lo(n) * f32_pow2_hi(n)
    s = _INF if v > _EXP_MAX else s
    s = _ZERO if v < _EXP_MIN else s
    return v if v != v else s


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def silu_f32(v: float) -> float:
    """v / (1 + exp(-v)) for a float32 ``v`` (:func:`exp_f32`): the one silu of the host paths."""
    return v / (_ONE + exp_f32(-v))


@njit(cache=True, nogil=True, error_model="numpy")
def silu_rows(x: np.ndarray, out: np.ndarray) -> None:
    """out = x / (1 + exp(-x)) for x float32 [m, n] (C order, as out): every host silu of float32 arrays
    (:func:`plinth.ops.silu`; :func:`silu_mul_rows` for a GLU), so a value's result does not depend on the call."""
    for r in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[r, j] = silu_f32(x[r, j])


#: GELU's tanh form as a logistic: 0.5 x (1 + tanh(c u)) = x / (1 + exp(-2 c u)), u = x + 0.044715 x^3
_GELU_K = np.float32(0.044715)
_GELU_2C = np.float32(2.0 * math.sqrt(2.0 / math.pi))


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def gelu_f32(v: float) -> float:
    """GELU (the tanh approximation) of a float32 ``v`` as ``v / (1 + exp(-2 sqrt(2 / pi) (v + 0.044715 v^3)))``
    (:func:`exp_f32`): the same function as ``0.5 v (1 + tanh(...))`` without its cancellation where the tanh
    nears -1, and the one GELU of the host paths (a call to the C library's tanhf would not vectorise)."""
    return v / (_ONE + exp_f32(-(_GELU_2C * (v + _GELU_K * (v * v * v)))))


@njit(cache=True, nogil=True, error_model="numpy")
def gelu_rows(x: np.ndarray, out: np.ndarray) -> None:
    """out = gelu(x) (:func:`gelu_f32`) for x float32 [m, n] (C order, as out): every host tanh-GELU of float32
    arrays (:func:`plinth.ops.gelu`; :func:`gelu_mul_rows` for a GLU)."""
    for r in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[r, j] = gelu_f32(x[r, j])


@njit(cache=True, nogil=True, error_model="numpy")
def gelu_mul_rows(gate_up: np.ndarray, n: int, out: np.ndarray) -> None:
    """out = gelu(gate_up[:, :n]) * gate_up[:, n:2n] (C order): the bits of ``h = ops.gelu(gate); h *= up``."""
    for r in range(gate_up.shape[0]):
        for j in range(n):
            out[r, j] = gelu_f32(gate_up[r, j]) * gate_up[r, n + j]


@njit(cache=True, nogil=True, error_model="numpy")
def silu_mul_rows(gate_up: np.ndarray, n: int, out: np.ndarray) -> None:
    """out = silu(gate_up[:, :n]) * gate_up[:, n:2n] (C order), the silu of :func:`silu_rows` then one
    float32 product: the bits of ``h = ops.silu(gate); h *= up``."""
    for r in range(gate_up.shape[0]):
        for j in range(n):
            out[r, j] = silu_f32(gate_up[r, j]) * gate_up[r, n + j]


drop_stale(attention_table, [Path(__file__).with_name("attend_simd.py"), Path(__file__).parents[1] / "quant" / "jitcache.py"])

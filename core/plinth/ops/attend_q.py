"""Attention over a typed K/V cache (f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1: :mod:`plinth.kvtypes`),
reading the stored blocks directly: no float32 copy of the cache is made.

A task is up to ROWS query rows of one sequence and a run of the query heads that share a kv head
(as in :mod:`plinth.ops.compiled`). For each of its keys the task unpacks that key's row of its kv
head (``hd`` values, gguf-py's dequantization) into a block of the task's own and takes every row's
and query head's dot product with it; the softmax is the plain two-pass one; then each value row with a
non-zero weight is unpacked once for the run and added into each head's sums. A row's trailing
masked keys (a verify batch's later rows) are left out before anything is summed, so a row's
arithmetic is the same whether it runs alone or beside other rows and sequences: the same bits
(``tests/test_attend_q.py``).

Where the head sizes suit it (no soft-cap, head sizes multiples of the vector width: SmolLM2, Gemma-3,
...) a task is one row and a run of query heads instead, and the vector kernel of
:mod:`plinth.ops.attend_qsimd` runs it: a block of keys and of values unpacked at a time into
L1-sized scratch blocks, then the float32 vector kernel's steps (its result is, bit for bit, the
float32 kernel's over the dequantized rows; about the float32 kernel's speed a decode row, ~10x the
plain loops').

Queries and outputs are in the cache's rotated space when the cache turns its rows
(:class:`plinth.kvtypes.Codec`): :func:`attention_rows_q` turns the queries in and the outputs back.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from numba import carray, njit, prange, types

from ..kvtypes import decode_row
from ..quant.jitcache import address_call, cfunc_address, drop_stale, f32_at, i64_at, u8_at
from .attend_qsimd import attend_rows_typed as _attend_rows_v
from .attend_qsimd import scratch_floats
from .attend_simd import lanes
from .compiled import TABLE_COLUMNS, _selected, full_table, vector_suits

_FLAGS = {"nsz", "arcp", "contract", "reassoc", "afn"}
#: float16 bits -> float32 (the kernels' scales and f16 rows)
_F16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True, fastmath=_FLAGS, nogil=True, inline="always")
def _half(src: np.ndarray, at: int, f16: np.ndarray) -> np.float32:
    return f16[np.int64(src[at]) | (np.int64(src[at + 1]) << 8)]


@njit(cache=True, fastmath=_FLAGS, nogil=True, inline="always")
def _unpack(src: np.ndarray, at: int, code: int, n: int, f16: np.ndarray, buf: np.ndarray) -> None:
    """buf[:n] = the row of type ``code`` at ``src[at:]`` as float32 (gguf-py's dequantization: q8_0 and
    f16 in vector loops here, the other types by :func:`plinth.kvtypes.decode_row`)."""
    if code == 3:
        for b in range(n // 32):
            o = at + b * 34
            d = _half(src, o, f16)
            for i in range(32):
                buf[b * 32 + i] = d * np.float32(np.int8(src[o + 2 + i]))
    elif code == 1:
        for i in range(n):
            buf[i] = _half(src, at + 2 * i, f16)
    else:
        decode_row(src[at:], code, buf[:n])


#: keys scored together: each key's row is unpacked into one column of a [hd, KB] block, and the queries'
#: products run along the block (no horizontal sum a key). A key's score is the same chain over its
#: column wherever the block ends (the columns past the last key are left over and never read).
KB = 16


@njit(cache=True, fastmath=_FLAGS, nogil=True, inline="always")
def _add_value(src: np.ndarray, at: int, code: int, p: np.ndarray, jj: int, n_q: int, hd_v: int, f16: np.ndarray,
               vbuf: np.ndarray, o: np.ndarray) -> None:
    """o[qi] += p[qi, jj] * value row (of ``code`` at ``src[at:]``) for the queries whose weight is not 0."""
    live = False
    for qi in range(n_q):
        if p[qi, jj] != 0:
            live = True
    if not live:
        return
    _unpack(src, at, code, hd_v, f16, vbuf)
    for qi in range(n_q):
        pj = p[qi, jj]
        if pj != 0:
            for d in range(hd_v):
                o[qi, d] += pj * vbuf[d]


#: query rows of one sequence a task takes together (each key row it unpacks serves them all)
ROWS = 8


@njit(cache=True, fastmath=_FLAGS, nogil=True)
def _task(t: int, q: np.ndarray, out: np.ndarray, table: np.ndarray, chunks: np.ndarray, n_head_kv: int, kcode: int,
          vcode: int, kbytes: int, vbytes: int, run: int, sc: np.float32, cap: np.float32, f16: np.ndarray) -> None:
    """Task t: chunk ``t // (n_head_kv * runs)`` of ``chunks`` (its group and rows r0..r1 of q), one kv head
    and a run of its query heads. Every row keeps its own key count (its trailing masked keys left out)
    and runs the steps it would run alone; the key and value rows are unpacked once for all of them."""
    n_head, hd = q.shape[1], q.shape[2]
    hd_v = out.shape[2]
    per_kv = n_head // n_head_kv
    runs = (per_kv + run - 1) // run
    c = t // (n_head_kv * runs)
    rest = t - c * n_head_kv * runs
    hk = rest // runs
    h0 = hk * per_kv + (rest - hk * runs) * run
    n_q = min(run, (hk + 1) * per_kv - h0)
    g, r0, r1 = chunks[c, 0], chunks[c, 1], chunks[c, 2]
    nr = r1 - r0
    n_all = table[g, 2]
    has_bias = table[g, 5] != 0
    bias = carray(f32_at(table[g, 5] if has_bias else table[g, 3]), ((table[g, 1] - table[g, 0]) * n_all
                                                                    if has_bias else 0,))
    ns = np.empty(nr, dtype=np.int64)  # per row, its keys
    n = 0
    for ri in range(nr):
        m = n_all
        if has_bias:
            b0 = (r0 + ri - table[g, 0]) * n_all
            while m > 1 and bias[b0 + m - 1] == -np.inf:  # the row's trailing masked keys
                m -= 1
        ns[ri] = m
        n = max(n, m)
    khs, vhs, krs, vrs = table[g, 6], table[g, 7], table[g, 8], table[g, 9]  # head and key strides
    kb = carray(u8_at(table[g, 3]), ((n_head_kv - 1) * khs + n * krs,))
    vb = carray(u8_at(table[g, 4]), ((n_head_kv - 1) * vhs + n * vrs,))
    nrq = nr * n_q
    qv = np.empty((nrq, hd), dtype=np.float32)
    for ri in range(nr):
        for qi in range(n_q):
            for d in range(hd):
                qv[ri * n_q + qi, d] = q[r0 + ri, h0 + qi, d]
    s = np.zeros((nrq, n), dtype=np.float32)
    kbuf = np.empty(hd, dtype=np.float32)
    vbuf = np.empty(hd_v, dtype=np.float32)
    o = np.zeros((nrq, hd_v), dtype=np.float32)
    mx = np.full(nrq, -np.inf, dtype=np.float32)
    kt = np.zeros((hd, KB), dtype=np.float32)
    acc = np.empty(KB, dtype=np.float32)
    for j0 in range(0, n, KB):
        nk = min(KB, n - j0)
        for kk in range(nk):
            at = (j0 + kk) * krs + hk * khs
            if kcode == 3:  # q8_0 straight into the block's column
                for b in range(hd // 32):
                    ob = at + b * 34
                    dq = _half(kb, ob, f16)
                    for i in range(32):
                        kt[b * 32 + i, kk] = dq * np.float32(np.int8(kb[ob + 2 + i]))
            else:
                _unpack(kb, at, kcode, hd, f16, kbuf)
                for d in range(hd):
                    kt[d, kk] = kbuf[d]
        for ri in range(nr):
            if j0 >= ns[ri]:
                continue
            b0 = (r0 + ri - table[g, 0]) * n_all
            for qi in range(n_q):
                x = ri * n_q + qi
                for kk in range(KB):
                    acc[kk] = np.float32(0.0)
                for d in range(hd):
                    qd = qv[x, d]
                    for kk in range(KB):
                        acc[kk] += qd * kt[d, kk]
                for kk in range(min(nk, ns[ri] - j0)):
                    jj = j0 + kk
                    a = acc[kk] * sc
                    if cap > 0:
                        a = np.float32(math.tanh(a / cap)) * cap
                    if has_bias:
                        a += bias[b0 + jj]
                    s[x, jj] = a
                    if a > mx[x]:
                        mx[x] = a
    for x in range(nrq):
        m = ns[x // n_q]
        if mx[x] == -np.inf:  # sees no key: zeros
            for jj in range(m):
                s[x, jj] = np.float32(0.0)
            continue
        den = np.float32(0.0)
        for jj in range(m):
            p = np.float32(math.exp(s[x, jj] - mx[x]))
            s[x, jj] = p
            den += p
        mx[x] = np.float32(1.0) / den
    for jj in range(n):  # (past a row's own keys its weights stay 0: skipped)
        _add_value(vb, jj * vrs + hk * vhs, vcode, s, jj, nrq, hd_v, f16, vbuf, o)
    for x in range(nrq):
        ri = x // n_q
        qi = x - ri * n_q
        inv = mx[x]
        for d in range(hd_v):
            out[r0 + ri, h0 + qi, d] = np.float32(0.0) if inv == -np.inf else o[x, d] * inv


@njit(cache=True, parallel=True, nogil=True)
def attention_table_q(q: np.ndarray, table: np.ndarray, n_head_kv: int, kcode: int, vcode: int, kbytes: int,
                      vbytes: int, scale: float, soft_cap: float, out: np.ndarray, n_threads: int,
                      f16: np.ndarray) -> None:
    """The parallel region of :func:`attention_rows_q`: ``table`` int64 [n_groups, 6] as
    :func:`plinth.ops.attention_rows` takes it (or with its stride columns: :data:`TABLE_COLUMNS`), its K / V
    addresses those of uint8 buffers of ``kbytes`` / ``vbytes`` a (position, kv head) of types ``kcode`` /
    ``vcode``. A group's rows go in chunks of up to ROWS."""
    table = full_table(table, n_head_kv, kbytes, vbytes)
    n_groups = table.shape[0]
    n_head = q.shape[1]
    n_chunks = 0
    for g in range(n_groups):
        n_chunks += (table[g, 1] - table[g, 0] + ROWS - 1) // ROWS
    chunks = np.empty((n_chunks, 3), dtype=np.int64)
    c = 0
    for g in range(n_groups):
        for r0 in range(table[g, 0], table[g, 1], ROWS):
            chunks[c, 0], chunks[c, 1], chunks[c, 2] = g, r0, min(r0 + ROWS, table[g, 1])
            c += 1
    per_kv = n_head // n_head_kv
    run = per_kv
    while run > 1 and n_chunks * n_head_kv * ((per_kv + run - 1) // run) < 2 * n_threads:
        run = (run + 1) // 2
    n_tasks = n_chunks * n_head_kv * ((per_kv + run - 1) // run)
    sc, cap = np.float32(scale), np.float32(soft_cap)
    for t in prange(n_tasks):
        _task(t, q, out, table, chunks, n_head_kv, kcode, vcode, kbytes, vbytes, run, sc, cap, f16)


#: float lanes of the vector kernel on this host (a compile-time constant of the cached code)
_W = lanes()
#: the vector task's arguments as a C function's: :func:`_vector_task`
TASK_SIG = types.void(*[types.int64] * 15, types.float32)
_call_task = address_call(TASK_SIG, "call_typed_task")


def _vector_task(t: int, q_at: int, out_at: int, table_at: int, n_groups: int, n_head: int, n_head_kv: int, hd: int,
                 hd_v: int, run: int, n_scratch: int, kcode: int, vcode: int, kbytes: int, vbytes: int,
                 sc: float) -> None:
    """Task t of :func:`attention_table_qv`: one selected row and a run of ``run`` query heads that share a
    kv head (:mod:`plinth.ops.attend_qsimd`), as :func:`plinth.ops.compiled._vector_task` for float32 rows."""
    table = carray(i64_at(table_at), (n_groups, TABLE_COLUMNS))
    per_kv = n_head // n_head_kv
    runs = (per_kv + run - 1) // run
    j = t // (n_head_kv * runs)
    rest = t - j * n_head_kv * runs
    hk = rest // runs
    h0 = hk * per_kv + (rest - hk * runs) * run
    n_q = min(run, (hk + 1) * per_kv - h0)
    g, r = _selected(table, j)
    n = table[g, 2]
    b_at = table[g, 5] + (r - table[g, 0]) * n * 4 if table[g, 5] != 0 else 0
    if b_at != 0:  # the row's trailing masked keys (a verify batch's later rows) are left out: the row sees
        bias = carray(f32_at(b_at), (n,))  # the key count it sees alone
        while n > 1 and bias[n - 1] == -np.inf:
            n -= 1
    scratch = np.empty(n_scratch, np.float32)
    _attend_rows_v(q_at + (r * n_head + h0) * hd * 4, n_q, hd, table[g, 3] + hk * table[g, 6],
                   table[g, 4] + hk * table[g, 7], n, table[g, 8], table[g, 9], hd, hd_v, sc, b_at, scratch.ctypes.data,
                   out_at + (r * n_head + h0) * hd_v * 4, hd_v, kcode, vcode, kbytes, vbytes)


def task_address() -> int:
    """The address of :func:`_vector_task` compiled as a C function (:data:`TASK_SIG`; once, then from numba's
    on-disk cache: :func:`plinth.quant.jitcache.address_call` says why)."""
    return cfunc_address("attention.typed_vector", TASK_SIG, lambda: _vector_task, fastmath=_FLAGS)


@njit(cache=True, parallel=True, nogil=True)
def attention_table_qv(fn: int, q: np.ndarray, table: np.ndarray, n_head_kv: int, hd_v: int, kcode: int, vcode: int,
                       kbytes: int, vbytes: int, scale: float, out: np.ndarray, n_threads: int) -> None:
    """The parallel region of :func:`attention_rows_q`'s vector path: a task a selected row and a run of
    the query heads of one kv head, the runs split until there is a task for each thread; ``table`` as
    :func:`attention_table_q` takes it."""
    table = full_table(table, n_head_kv, kbytes, vbytes)
    n_groups = table.shape[0]
    n_head, hd = q.shape[1], q.shape[2]
    n_sel = 0
    n_max = 0
    for g in range(n_groups):
        n_sel += table[g, 1] - table[g, 0]
        n_max = max(n_max, table[g, 2])
    per_kv = n_head // n_head_kv
    run = per_kv  # split only until every thread has a task: a task unpacks its kv head's keys and values,
    while run > 1 and n_sel * n_head_kv * ((per_kv + run - 1) // run) < n_threads:  # which costs more than a
        run = (run + 1) // 2  # query head's products (SmolLM2, one decode row at 4096 keys, 2 threads: three
    # tasks of three heads 4.8 ms a token, six of one or two 5.5 ms; q8_0 6.0 vs 7.5; Gemma-3 f16 8.9 vs 11.5)
    n_tasks = n_sel * n_head_kv * ((per_kv + run - 1) // run)
    n_scratch = scratch_floats(n_max, run, hd, hd_v, _W)
    sc = np.float32(scale)
    for t in prange(n_tasks):
        _call_task(fn, t, q.ctypes.data, out.ctypes.data, table.ctypes.data, n_groups, n_head, n_head_kv, hd, hd_v,
                   run, n_scratch, kcode, vcode, kbytes, vbytes, sc)


def attention_rows_q(q: np.ndarray, table: np.ndarray, n_head_kv: int, hd_v: int, kcodec, vcodec, scale: float,
                     soft_cap: float | None = None, plain: bool = False) -> np.ndarray:
    """:func:`plinth.ops.attention_rows` for a typed cache: ``kcodec`` / ``vcodec`` the
    :class:`plinth.kvtypes.Codec` of the K and V buffers (None: float32). The queries ``q`` [n_rows,
    n_head, hd] are in the model's space; they are turned into the keys' space here and the outputs
    turned back from the values'. Returns [n_rows, n_head, hd_v].

    Where the head sizes suit it (:func:`vector_suits`) the vector kernel runs, a task a row; otherwise,
    or with ``plain`` (benchmarks and tests compare the two), the plain loops of :func:`_task`, a task up
    to ROWS rows of a sequence. Either way a row's bits do not depend on the other rows of the call."""
    from ..kvtypes import CACHE_TYPES, rotate
    from .attention import _threads

    f32 = CACHE_TYPES["f32"]
    kt = kcodec.type if kcodec is not None else f32
    vt = vcodec.type if vcodec is not None else f32
    hd = q.shape[2]
    qr = rotate(np.ascontiguousarray(q, dtype=np.float32), kcodec.rot if kcodec is not None else 0)
    qr = np.ascontiguousarray(qr, dtype=np.float32)
    out = np.empty((q.shape[0], q.shape[1], hd_v), dtype=np.float32)
    if not (isinstance(table, np.ndarray) and table.dtype == np.int64 and table.flags.c_contiguous):
        table = np.ascontiguousarray(table, dtype=np.int64)
    if not plain and vector_suits(hd, hd_v, soft_cap):
        attention_table_qv(task_address(), qr, table, n_head_kv, hd_v, kt.code, vt.code, kt.row_bytes(hd),
                           vt.row_bytes(hd_v), float(scale), out, _threads())
    else:
        attention_table_q(qr, table, n_head_kv, kt.code, vt.code, kt.row_bytes(hd), vt.row_bytes(hd_v), float(scale),
                          float(soft_cap or 0.0), out, _threads(), _F16)
    return rotate(out, vcodec.rot) if vcodec is not None and vcodec.rot else out


def attend_rows_typed(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv, shared: bool, step, scale: float,
                      window: int, soft_cap: float | None, key_columns) -> np.ndarray:
    """:func:`plinth.graph.attend`'s few-rows path for a typed :class:`plinth.cache.KV`: this forward's K / V
    rows are turned and packed once for the batch (:meth:`plinth.cache.Rows.encode`), copied into each
    sequence's buffers, and :func:`attention_rows_q` reads every sequence's stored blocks in one call.
    ``key_columns(step, kv, table, window)`` fills the table's key count, address and bias columns (the
    graph's, as for a float32 cache)."""
    groups = step.groups
    if not shared:
        ke, ve = kv.encode(k, v)
        positions = step.batch.positions
        shapes = (k.shape[1:], v.shape[1:])
        for seq, sel in groups:
            kv.append_stored(seq, positions[sel], shapes, ke[sel], ve[sel])
    table = kv.rows_table(groups)
    key_columns(step, kv, table, window)
    kb = kv.buffers(groups[0][0])[0]
    kc, vc = kv.codecs
    hd_v = kv.widths[1]
    if kv.widths[0] != q.shape[2]:
        raise ValueError(f"attention: the cached keys have head size {kv.widths[0]}, the queries {q.shape[2]}")
    return attention_rows_q(q, table, kb.shape[1], hd_v, kc, vc, scale, soft_cap)


drop_stale(attention_table_qv, [Path(__file__).with_name(f) for f in ("attend_qsimd.py", "attend_simd.py",
                                                                     "compiled.py")]
           + [Path(__file__).parents[1] / f for f in ("kvtypes.py", "quant/jitcache.py")])

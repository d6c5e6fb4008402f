"""One compiled call for a pre-norm dense block (llama's), on the host.

A decode step of a small dense model spends as long in the Python between its kernels (the
wrappers of a dozen calls a layer, the views and small arrays they make) as in the kernels' own
work beyond the weight reads. :func:`dense_block` runs a whole layer in one call::

    h  = rms_norm(x) * attn_norm                # plinth.ops.compiled.rms_norm_rows
    qkv = h @ Wqkv.T                            # plinth.quant.kernels_i8.linear
    q, k = rope(q), rope(k)                     # plinth.ops.compiled.rope_rows
    cache <- k, v                               # plinth.ops.compiled.scatter_rows
    a  = attention(q, cache)                    # plinth.ops.compiled.attention_table
    x1 = x + a @ Wo.T
    gu = (rms_norm(x1) * ffn_norm) @ [Wgate | Wup].T
    out = x1 + (silu(gate) * up) @ Wdown.T     # plinth.ops.compiled.silu_mul_rows

and the forms of Qwen3's and Gemma-3's layers: Q and K normed per head before RoPE (``qk_norm``), the
attention's and the FFN's outputs normed before their residual adds (``post_norms``), GELU for SiLU
(``gelu``: :func:`plinth.ops.compiled.gelu_mul_rows`), a sliding window (the keys before a row's window
left out in whole runs, ``lo``, as :func:`plinth.graph._key_columns` does).

It calls the very kernels the layer's Python calls one by one, on the same values in the same
order (no float step is reordered, fused or skipped), so a row's result is bit for bit the one
the general path gives, alone or in any batch; ``tests/test_fused_block.py`` compares the two.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import njit

from ..kvtypes import _encode_rows, _fwht_rows
from ..quant.jitcache import drop_stale
from ..quant.kernels_i8 import linear
from .attend_q import attention_table_qv
from .compiled import (attention_table, gelu_mul_rows, rms_norm_rows, rope_rows, scatter_rows, scatter_stored,
                       silu_mul_rows)


@njit(cache=True, nogil=True)
def dense_block(x: np.ndarray, attn_norm: np.ndarray, ffn_norm: np.ndarray, eps: float,
                qkv_fns: np.ndarray, qkv_grps: tuple, qkv_gstarts: np.ndarray, qkv_starts: np.ndarray,
                ao_fns: np.ndarray, ao_grps: tuple, ao_gstarts: np.ndarray, ao_starts: np.ndarray,
                gu_fns: np.ndarray, gu_grps: tuple, gu_gstarts: np.ndarray, gu_starts: np.ndarray,
                dn_fns: np.ndarray, dn_grps: tuple, dn_gstarts: np.ndarray, dn_starts: np.ndarray,
                n_head: int, n_head_kv: int, hd: int, n_ff: int, cos: np.ndarray, sin: np.ndarray, neox: bool,
                positions: np.ndarray, table: np.ndarray, bias_col: np.ndarray, task: int, vector: bool,
                scale: float, n_threads: int, kcode: int, vcode: int, krot: int, vrot: int, krot_scale: float,
                vrot_scale: float, kbytes: int, vbytes: int, qk_norm: bool, q_norm: np.ndarray, k_norm: np.ndarray,
                post_norms: bool, post_attn: np.ndarray, post_ffn: np.ndarray, gelu: bool, lo: np.ndarray,
                biases: int, qkv_b: np.ndarray, ao_b: np.ndarray, gu_b: np.ndarray, dn_b: np.ndarray) -> np.ndarray:
    """A dense block for the rows x float32 ``[m, n_embd]`` (C order): returns its output ``[m, n_embd]``.

    The four products' arguments are :func:`plinth.quant.kernels_i8.linear`'s (Q | K | V stacked, the
    attention output, gate | up stacked, down); ``n_ff`` the FFN's width; cos / sin ``[m, n_rot / 2]`` the rows' RoPE tables (interleaved
    pairs, or halves where ``neox``); ``positions`` int64 ``[m]``. ``table`` int64 ``[n_groups, 10]`` is
    :meth:`plinth.cache.Rows.reserve_rows`' (room made for every group's rows); after the rows are written
    its key counts are advanced and its column 5 becomes ``bias_col`` (each group's bias address, 0: none),
    as :func:`plinth.graph.attend` does. ``task`` / ``vector``: :func:`plinth.ops.compiled.task_address`'s.

    A typed cache (``kcode`` / ``vcode`` not both 0: :mod:`plinth.kvtypes`' codes, ``kbytes`` / ``vbytes`` a
    stored row's bytes, ``krot`` / ``vrot`` the Hadamard sizes, 0: none, with their ``1 / sqrt(n)`` as
    float32) takes :func:`plinth.ops.attend_q.attend_rows_typed`'s steps instead: K / V rows turned and
    packed (:meth:`plinth.kvtypes.Codec.encode`), the queries turned, the typed vector kernel
    (:func:`plinth.ops.attend_q.attention_table_qv`, ``task`` its task's address), the outputs turned back.

    ``qk_norm``: Q and K heads RMS-normed without weight, then times ``q_norm`` / ``k_norm`` [hd] (Qwen3's
    ``qk_norm``); ``post_norms``: the attention output and the FFN output RMS-normed by ``post_attn`` /
    ``post_ffn`` before their residual adds (Gemma-3); ``gelu``: GELU for SiLU; ``lo`` int64 [n_groups]: keys
    each group's rows skip (a sliding window's, :func:`plinth.graph._window_columns`; zeros for none).
    ``biases``: bit p set where product p (Q|K|V, output, gate|up, down) has a bias (``qkv_b`` ... ``dn_b``),
    added to its product as ``y += bias`` adds it (Qwen2's Q / K / V biases)."""
    m = x.shape[0]
    h = np.empty_like(x)
    rms_norm_rows(x, attn_norm, True, False, eps, h)
    n_qk = n_head + n_head_kv
    qkv = np.empty((m, n_qk + n_head_kv, hd), np.float32)
    linear(qkv_fns, qkv_grps, qkv_gstarts, qkv_starts, h, qkv.reshape(m, (n_qk + n_head_kv) * hd))
    if biases & 1:
        _add_bias(qkv.reshape(m, (n_qk + n_head_kv) * hd), qkv_b)
    qk = np.empty((m, n_qk, hd), np.float32)
    if qk_norm:  # (ops.head_rms_norm without weight, then the weights: Qwen3Graph.qk_norm's steps)
        normed = np.empty((m * n_qk, hd), np.float32)
        rms_norm_rows(np.ascontiguousarray(qkv[:, :n_qk]).reshape(m * n_qk, hd), q_norm, False, False, eps, normed)
        nqk = normed.reshape(m, n_qk, hd)
        for r in range(m):
            for hh in range(n_qk):
                w = q_norm if hh < n_head else k_norm
                for j in range(hd):
                    nqk[r, hh, j] *= w[j]
        rope_rows(nqk, cos, sin, 0, neox, False, qk)
    else:
        rope_rows(qkv[:, :n_qk], cos, sin, 0, neox, False, qk)
    att = np.empty((m, n_head, hd), np.float32)
    if kcode == 0 and vcode == 0:
        scatter_rows(qk[:, n_head:], qkv[:, n_qk:], positions, table)
        _advance(table, bias_col, lo)
        q = np.ascontiguousarray(qk[:, :n_head])
        attention_table(task, vector, q, table, n_head_kv, hd, scale, 0.0, att, n_threads)
    else:
        kr = _turned(np.ascontiguousarray(qk[:, n_head:]).reshape(m * n_head_kv, hd), krot, krot_scale)
        vr = _turned(np.ascontiguousarray(qkv[:, n_qk:]).reshape(m * n_head_kv, hd), vrot, vrot_scale)
        ke = np.empty((m * n_head_kv, kbytes), np.uint8)
        ve = np.empty((m * n_head_kv, vbytes), np.uint8)
        _stored(kr, kcode, ke)
        _stored(vr, vcode, ve)
        scatter_stored(ke.reshape(m, n_head_kv, kbytes), ve.reshape(m, n_head_kv, vbytes), positions, table)
        _advance(table, bias_col, lo)
        q = _turned(np.ascontiguousarray(qk[:, :n_head]).reshape(m * n_head, hd), krot, krot_scale)
        attention_table_qv(task, q.reshape(m, n_head, hd), table, n_head_kv, hd, kcode, vcode, kbytes, vbytes, scale,
                           att, n_threads)
        if vrot:
            att = _turned(att.reshape(m * n_head, hd), vrot, vrot_scale).reshape(m, n_head, hd)
    x1 = np.empty_like(x)
    a = np.empty_like(x) if post_norms else x1  # (the output product, normed into x1 where the layer has post-norms)
    linear(ao_fns, ao_grps, ao_gstarts, ao_starts, att.reshape(m, n_head * hd), a)
    if biases & 2:
        _add_bias(a, ao_b)
    if post_norms:
        rms_norm_rows(a, post_attn, True, False, eps, x1)
    for r in range(m):
        for j in range(x.shape[1]):
            x1[r, j] += x[r, j]
    rms_norm_rows(x1, ffn_norm, True, False, eps, h)
    gu = np.empty((m, 2 * n_ff), np.float32)
    linear(gu_fns, gu_grps, gu_gstarts, gu_starts, h, gu)
    if biases & 4:
        _add_bias(gu, gu_b)
    act = np.empty((m, n_ff), np.float32)
    if gelu:
        gelu_mul_rows(gu, n_ff, act)
    else:
        silu_mul_rows(gu, n_ff, act)
    out = np.empty_like(x)
    d = np.empty_like(x) if post_norms else out
    linear(dn_fns, dn_grps, dn_gstarts, dn_starts, act, d)
    if biases & 8:
        _add_bias(d, dn_b)
    if post_norms:
        rms_norm_rows(d, post_ffn, True, False, eps, out)
    for r in range(m):
        for j in range(x.shape[1]):
            out[r, j] += x1[r, j]
    return out


@njit(cache=True, nogil=True)
def _add_bias(y: np.ndarray, b: np.ndarray) -> None:
    """y[r] += b for the rows of y [m, n] (C order): ``y += bias``'s float32 adds."""
    for r in range(y.shape[0]):
        for j in range(y.shape[1]):
            y[r, j] += b[j]


@njit(cache=True, nogil=True)
def _advance(table: np.ndarray, bias_col: np.ndarray, lo: np.ndarray) -> None:
    """The table's key counts past this call's rows, less the ``lo`` keys a group skips (its K / V addresses
    moved past them by the row strides of columns 8 and 9), and its bias column (:func:`dense_block`)."""
    for g in range(table.shape[0]):
        table[g, 2] += table[g, 1] - table[g, 0] - lo[g]
        table[g, 3] += lo[g] * table[g, 8]
        table[g, 4] += lo[g] * table[g, 9]
        table[g, 5] = bias_col[g]


@njit(cache=True, nogil=True)
def _turned(x: np.ndarray, n: int, scale: float) -> np.ndarray:
    """:func:`plinth.kvtypes.rotate` of the C-order rows ``x`` [r, w] (n = 0: ``x`` itself)."""
    if n == 0:
        return x
    out = np.empty_like(x)
    _fwht_rows(x, n, np.float32(scale), out)
    return out


@njit(cache=True, nogil=True)
def _stored(x: np.ndarray, code: int, out: np.ndarray) -> None:
    """:meth:`plinth.kvtypes.Codec.encode`'s packing of the rows ``x`` (already turned) into ``out``."""
    if code == 0:
        out[...] = x.view(np.uint8)
    else:
        _encode_rows(x, code, out, True)


drop_stale(dense_block, [Path(__file__).parents[1] / "quant" / n for n in ("kernels_i8.py", "simd.py", "jitcache.py")]
           + [Path(__file__).with_name(n) for n in ("compiled.py", "attend_simd.py", "attend_q.py", "attend_qsimd.py")]
           + [Path(__file__).parents[1] / "kvtypes.py"])


def warm_up() -> None:
    """Compile (or load from the on-disk cache) :func:`dense_block` for the argument types a model's layers
    pass it (read-only norm weights and weight groups), on a one-row block of 64-wide zero weights."""
    from .. import quant
    from ..quant import QuantWeight
    from . import compiled
    from .attention import _threads

    e = hd = ff = 64
    q8_0 = 8

    def weight(n_out: int, n_in: int) -> QuantWeight:
        return QuantWeight(np.zeros((n_out, n_in // 32 * 34), np.uint8), q8_0, (n_out, n_in))

    def args(parts: list) -> tuple:
        w = parts[0] if len(parts) == 1 else quant.stack(parts)
        got = quant._int8_args(w, parts)
        if not got:
            raise RuntimeError("the int8 kernels are off")
        return got

    norm = np.ones(e, np.float32)
    norm.flags.writeable = False  # (as a mapped file's)
    k = np.zeros((1, 4, hd), np.float32)  # (one kv head, room for four rows, head-major as plinth.cache's)
    v = np.zeros_like(k)
    positions = np.zeros(4, np.int64)
    table = np.array([[0, 1, 0, k.ctypes.data, v.ctypes.data, positions.ctypes.data, k.strides[0], v.strides[0],
                       k.strides[1], v.strides[1]]], dtype=np.int64)
    vector = compiled.vector_suits(hd, hd, None)
    cos = np.ones((1, hd // 2), np.float32)
    dense_block(np.zeros((1, e), np.float32), norm, norm, 1e-6, *args([weight(hd, e)] * 3), *args([weight(e, hd)]),
                *args([weight(ff, e)] * 2), *args([weight(e, ff)]), 1, 1, hd, ff, cos, cos, False,
                np.zeros(1, np.int64), table, np.zeros(1, np.int64), compiled.task_address(vector), vector,
                1.0 / hd ** 0.5, _threads(), 0, 0, 0, 0, 1.0, 1.0, hd * 4, hd * 4, False, norm, norm, False, norm, norm,
                False, np.zeros(1, np.int64), 0, norm, norm, norm, norm)

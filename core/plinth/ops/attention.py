"""Scaled dot-product attention with causal / sliding-window / extra masks, soft-capping,
attention sinks and grouped-query heads."""

from __future__ import annotations

from typing import Any

import numpy

from .. import runtime
from ._xp import F32, array_module, as_f32, compiled_ops

#: up to this many query rows of a sequence, attention on the host runs the compiled row kernel
#: (:mod:`plinth.ops.compiled`: decode rows, verify batches, server steps and prompt chunks, each row
#: computed as if alone, so its bits do not depend on the batch); more (long prompts) go through BLAS.
#: The same bound as the products' (``plinth.quant.KERNEL_MAX_ROWS``).
KERNEL_MAX_Q = 1024


def attention_mask(
    q_pos: Any,
    k_pos: Any,
    causal: bool = True,
    sliding_window: int | None = None,
    mask: Any = None,
    xp: Any = None,
) -> Any:
    """Boolean visibility matrix (True = the query may attend to the key).

    q_pos: [n_q];  k_pos: [n_kv_tok];  mask: [n_q, n_kv_tok] bool or None (ANDed in).
    causal: keep keys with k_pos <= q_pos.
    sliding_window: keep keys with q_pos - k_pos < sliding_window (a window of W keeps the
        current token and the W - 1 before it, as llama.cpp's standard SWA).
    xp: the array module of the result (default: the one of the inputs). Positions on the
        host are compared there and the matrix is copied to ``xp`` once.
    Returns [n_q, n_kv_tok] bool, or None when nothing is masked.
    """
    pm = array_module(q_pos, k_pos)
    xp = xp or array_module(q_pos, k_pos, mask)
    vis = None
    if causal or sliding_window is not None:
        d = pm.asarray(q_pos)[:, None] - pm.asarray(k_pos)[None, :]
        if causal:
            vis = d >= 0
        if sliding_window is not None:
            w = d < sliding_window
            vis = w if vis is None else (vis & w)
        vis = xp.asarray(vis)
    if mask is not None:
        m = xp.asarray(mask, dtype=bool)
        vis = m if vis is None else (vis & m)
    return vis


def attention_bias(
    q_pos: Any,
    k_pos: Any,
    causal: bool = True,
    sliding_window: int | None = None,
    mask: Any = None,
    xp: Any = None,
) -> Any:
    """The additive score bias of :func:`attention_mask`: 0 where visible, -inf where hidden.

    Returns [n_q, n_kv_tok] float32 of module ``xp`` (default: the inputs' module), or None
    when every query sees every key. Build it once per forward and pass it as
    ``attention(..., bias=...)`` to every layer. With host positions (a :class:`Batch`'s)
    and no extra mask, the matrix is built on the host and copied to the device once;
    nothing is read back from the device.
    """
    pm = array_module(q_pos, k_pos)
    xp = xp or array_module(q_pos, k_pos, mask)
    if mask is None and pm.__name__ == "numpy":
        vis = attention_mask(q_pos, k_pos, causal, sliding_window, xp=pm)
        if vis is None or vis.all():  # a host check: no device round trip
            return None
        return xp.asarray(numpy.where(vis, F32(0.0), F32(-numpy.inf)))
    vis = attention_mask(q_pos, k_pos, causal, sliding_window, mask, xp=xp)
    if vis is None:
        return None
    return xp.where(vis, F32(0.0), F32(-xp.inf))


def _threads() -> int:
    """The kernel threads (``--threads`` / PLINTH_THREADS; only the split of the work depends on it)."""
    return runtime.threads()


def host_bias(bias: Any, n_rows: int, n_kv: int) -> Any:
    """``bias`` as the C-order float32 ``[n_rows, n_kv]`` host array the compiled kernel reads through
    its address (itself when it already is one)."""
    if bias.shape == (n_rows, n_kv) and bias.dtype == F32 and bias.flags.c_contiguous:
        return bias
    return numpy.ascontiguousarray(numpy.broadcast_to(as_f32(bias, numpy), (n_rows, n_kv)))


def attention_rows(q: Any, table: Any, n_head_kv: int, hd_v: int, scale: float,
                   soft_cap: float | None = None) -> Any:
    """:func:`attention_groups` on the host for rows whose keys and values are in float32 C-order
    host buffers already (``plinth.cache.Rows``' own, which :func:`plinth.graph.attend` passes for a
    server step's or a verify batch's rows): ``table`` int64 ``[n_groups, 6 or 10]``, per group its rows'
    start and stop in q (at most KERNEL_MAX_Q of them), its key count n_kv, the data addresses of its
    K ``[>= n_kv, n_head_kv, hd]`` and V ``[>= n_kv, n_head_kv, hd_v]`` buffers and of its bias
    ``[stop - start, n_kv]`` (0: none). The caller keeps those alive and guarantees their shapes: no
    per-group check, one compiled call. Returns [n_rows, n_head, hd_v] for the rows the groups cover
    (the same bits :func:`attention_groups` gives)."""
    if q.shape[1] % n_head_kv:
        raise ValueError(f"attention: n_head {q.shape[1]} is not a multiple of n_head_kv {n_head_kv}")
    if not (q.dtype == F32 and q.flags.c_contiguous):
        q = numpy.ascontiguousarray(q, dtype=F32)
    out = numpy.empty((q.shape[0], q.shape[1], hd_v), dtype=F32)
    if not (isinstance(table, numpy.ndarray) and table.dtype == numpy.int64 and table.flags.c_contiguous):
        table = numpy.ascontiguousarray(table, dtype=numpy.int64)
    compiled_ops().attention_groups(q, table, n_head_kv, hd_v, float(scale), float(soft_cap or 0.0), out, _threads())
    return out


def attention_groups(q: Any, groups: list[tuple[int, int, Any, Any, Any]], scale: float,
                     soft_cap: float | None = None) -> Any:
    """:func:`attention` with ``causal=False`` and an additive bias, for the query rows of several
    sequences: ``groups`` holds per sequence ``(start, stop, k, v, bias)`` (its rows ``q[start:stop]``,
    its cached K and V, its bias ``[stop - start, n_kv]`` or None), optionally with a sixth item, the
    data addresses of float32 C-order host arrays that k and v are leading views of (a
    :class:`plinth.cache.Rows` buffer's ``addresses``: they save reading them from the arrays). On
    the host the groups of at most KERNEL_MAX_Q rows (a server step's decode and verify rows) go
    through one compiled call (one per layer instead of one per sequence) with the same per-row
    arithmetic as one call per sequence; the others (prompt chunks), and every group on a device,
    take one :func:`attention` each. (One sequence's few rows in :func:`attention` take the same
    kernel, so a row's result does not depend on which of the two calls computed it.)
    Returns [n_rows, n_head, hd_v] for the rows the groups cover."""
    xp = array_module(q)
    n_head = q.shape[1]
    hd_v = groups[0][3].shape[2]
    out = None
    small = [grp for grp in groups if 0 < grp[1] - grp[0] <= KERNEL_MAX_Q and len(grp[2])] \
        if xp is numpy and compiled_ops() is not None else []
    if small:
        k0, v0 = small[0][2], small[0][3]
        n_head_kv = k0.shape[1]
        k_tail, v_tail = k0.shape[1:], v0.shape[1:]
        if k_tail[1] != q.shape[2]:
            raise ValueError(f"attention: rows {small[0][0]}:{small[0][1]} have k {k0.shape} against q {q.shape}: "
                             "the head sizes differ")
        keep = []  # the contiguous float32 arrays whose addresses the kernel reads
        table = []  # per group: start, stop, n_kv, K, V and bias addresses (0: no bias), K / V strides
        for grp in small:
            s, e, k, v, bias = grp[:5]
            at = grp[5] if len(grp) > 5 else None
            # (the kernel reads these arrays through their addresses: their shapes must be what it assumes)
            if k.shape[1:] != k_tail or v.shape[1:] != v_tail or v.shape[0] != k.shape[0]:
                raise ValueError(f"attention: rows {s}:{e} have k {k.shape}, v {v.shape} beside {k0.shape}, "
                                 f"{v0.shape}")
            if at is None:  # (the kernel takes any strides with the head's values contiguous: a cache's views)
                if not (k.dtype == F32 and k.strides[2] == 4 and min(k.strides) > 0):
                    k = numpy.ascontiguousarray(k, dtype=F32)
                if not (v.dtype == F32 and v.strides[2] == 4 and min(v.strides) > 0):
                    v = numpy.ascontiguousarray(v, dtype=F32)
                keep += [k, v]
                at = (k.ctypes.data, v.ctypes.data)
            b_at = 0
            if bias is not None:
                b = host_bias(bias, e - s, k.shape[0])
                keep.append(b)
                b_at = b.ctypes.data
            table.append((s, e, k.shape[0], at[0], at[1], b_at, k.strides[1], v.strides[1], k.strides[0], v.strides[0]))
        out = attention_rows(q, table, n_head_kv, hd_v, scale, soft_cap)
        del keep
        done = {id(grp) for grp in small}
        groups = [grp for grp in groups if id(grp) not in done]
    if out is None:
        out = xp.empty((q.shape[0], n_head, hd_v), dtype=xp.float32)
    for grp in groups:
        s, e, k, v, bias = grp[:5]
        out[s:e] = attention(q[s:e], k, v, scale=scale, causal=False, bias=bias, soft_cap=soft_cap)
    return out


def attention(
    q: Any,
    k: Any,
    v: Any,
    q_pos: Any = None,
    k_pos: Any = None,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: Any = None,
    mask: Any = None,
    bias: Any = None,
) -> Any:
    """Multi-head attention softmax(q k^T * scale) v over cached keys.

    q: [n_q, n_head, head_dim]
    k: [n_kv_tok, n_head_kv, head_dim]
    v: [n_kv_tok, n_head_kv, head_dim_v]
    q_pos: [n_q], k_pos: [n_kv_tok] — absolute positions (needed for causal / sliding_window).
    scale: score multiplier (default 1/sqrt(head_dim)).
    causal: keys after the query position are hidden.
    sliding_window: keys with q_pos - k_pos >= sliding_window are hidden (llama.cpp semantic).
    soft_cap: scores become soft_cap * tanh(scores / soft_cap) (after scaling, before masking).
    sinks: [n_head] or None — one extra logit per head that joins the softmax denominator
        but carries no value (gpt-oss / DeepSeek V4 attention sinks).
    mask: [n_q, n_kv_tok] bool or None — extra visibility (e.g. same-sequence), ANDed in.
    bias: [n_q, n_kv_tok] float32 or None — additive score bias (0 / -inf), added after
        soft-capping; e.g. :func:`attention_bias` built once per forward and shared by the
        layers (then pass causal=False unless the masks should combine).
    n_head must be a multiple of n_head_kv; query head h reads kv head h // (n_head / n_head_kv).
    A query that sees no key (and has no sink) yields zeros.
    Returns [n_q, n_head, head_dim_v] float32.
    """
    xp = array_module(q, k, v)
    q = as_f32(q, xp)
    k = as_f32(k, xp)
    v = as_f32(v, xp)
    n_q, n_head, hd = q.shape
    n_kv, n_head_kv, hd_k = k.shape
    hd_v = v.shape[-1]
    if hd_k != hd or v.shape[:2] != (n_kv, n_head_kv):
        raise ValueError(f"attention: shapes q {q.shape}, k {k.shape}, v {v.shape} do not agree")
    if n_head % n_head_kv:
        raise ValueError(f"attention: n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
    g = n_head // n_head_kv
    if scale is None:
        scale = 1.0 / float(hd) ** 0.5
    if xp is numpy and 0 < n_q <= KERNEL_MAX_Q and n_kv and sinks is None and compiled_ops() is not None:
        # the same compiled kernel, the masks folded into one additive bias: a row's bits do not depend on the batch
        if causal or sliding_window is not None or mask is not None:
            if (causal or sliding_window is not None) and (q_pos is None or k_pos is None):
                raise ValueError("attention: causal / sliding_window masking needs q_pos and k_pos")
            own = attention_bias(q_pos, k_pos, causal, sliding_window, mask, xp=numpy)
            if own is not None and bias is not None:
                own = own + as_f32(bias, numpy)
            bias = own if own is not None else bias
        return attention_groups(q, [(0, n_q, k, v, bias)], float(scale), soft_cap)

    # [n_head_kv, g * n_q, hd] with rows ordered (group member, query)
    qg = (q * F32(scale)).reshape(n_q, n_head_kv, g, hd).transpose(1, 2, 0, 3).reshape(n_head_kv, g * n_q, hd)
    kt = k.transpose(1, 2, 0)  # [n_head_kv, hd, n_kv]
    scores = xp.matmul(qg, kt).reshape(n_head_kv, g, n_q, n_kv)
    if soft_cap is not None:
        scores = xp.tanh(scores * F32(1.0 / soft_cap)) * F32(soft_cap)

    if causal or sliding_window is not None:
        if q_pos is None or k_pos is None:
            raise ValueError("attention: causal / sliding_window masking needs q_pos and k_pos")
    # additive 0 / -inf bias, built once at [n_q, n_kv] and broadcast over heads in place
    own = attention_bias(q_pos, k_pos, causal, sliding_window, mask, xp=xp) if (
        causal or sliding_window is not None or mask is not None) else None
    if own is not None:
        scores += own
    if bias is not None:
        scores += as_f32(bias, xp)

    m = scores.max(axis=-1, keepdims=True) if n_kv else xp.full((n_head_kv, g, n_q, 1), -xp.inf, dtype=F32)
    if sinks is not None:
        sk = as_f32(sinks, xp).reshape(n_head_kv, g, 1, 1)
        m = xp.maximum(m, sk)
    masked = own is not None or bias is not None or not n_kv
    if masked:  # a query that sees no key has max -inf
        m = xp.where(xp.isfinite(m), m, F32(0.0))
    scores -= m
    p = xp.exp(scores, out=scores)
    denom = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + xp.exp(sk - m)
    if masked:
        denom = xp.where(denom > 0, denom, F32(1.0))
    p *= xp.reciprocal(denom, out=denom)

    vt = v.transpose(1, 0, 2)  # [n_head_kv, n_kv, hd_v]
    out = xp.matmul(p.reshape(n_head_kv, g * n_q, n_kv), vt)  # [n_head_kv, g*n_q, hd_v]
    return out.reshape(n_head_kv, g, n_q, hd_v).transpose(2, 0, 1, 3).reshape(n_q, n_head, hd_v)

"""Mamba-2 building blocks: causal depthwise conv with state, the selective state-space scan
(chunked SSD form for prefill, one-step recurrence for decode), gated grouped RMSNorm.

Sizes used throughout: ``H`` SSM heads of ``P`` channels each (``d_inner = H * P``), ``G``
groups of ``N``-wide B/C vectors (head h reads group ``h // (H / G)``), conv kernel ``K``,
conv channels ``C = d_inner + 2 G N``.

The recurrence, per head h and position t (``dt_t`` already through softplus, ``A_h < 0``)::

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T          S: [P, N]
    y_t = S_t C_t (+ D_h x_t)

:func:`ssm_scan` computes the same thing a chunk at a time (the SSD "masked attention" form of
Mamba-2, arXiv 2405.21060): within a chunk y is a lower-triangular decayed ``(C B^T)`` product
with the inputs, plus the carried-in state read through C; the state leaves the chunk decayed
once. :func:`ssm_step` is the one-token recurrence. Both compute in float32 with the in-chunk
cumulative decay in float64, so they agree to rounding.
"""

from __future__ import annotations

from typing import Any

import attrs

from ._xp import F32, array_module, as_f32
from .activations import silu


@attrs.frozen
class ConvOut:
    """Result of :func:`causal_conv1d`.

    y: [T, C] float32 — conv output (before any activation).
    state: [K-1, C] float32 — the last K-1 inputs, the state after these T rows.
    """

    y: Any
    state: Any


@attrs.frozen
class ScanOut:
    """Result of :func:`ssm_scan` / :func:`ssm_step`.

    y: [T, H, P] float32 — SSM output (including the ``D`` skip when D was given).
    state: [H, P, N] float32 — the state after the last row.
    """

    y: Any
    state: Any


def causal_conv1d(x: Any, weight: Any, bias: Any = None, state: Any = None) -> ConvOut:
    """Causal depthwise conv over time, continuing from ``state``.

    x: [T, C] — new inputs (T >= 1).
    weight: [C, K] — per-channel taps; tap K-1 multiplies the current row.
    bias: [C] or None.
    state: [K-1, C] — the K-1 inputs before x (None = zeros, a fresh sequence).
    Returns ConvOut(y [T, C], state [K-1, C]); the new state is a new array.
    """
    xp = array_module(x, weight)
    x = as_f32(x, xp)
    t, c = x.shape
    k = weight.shape[1]
    if state is None:
        state = xp.zeros((k - 1, c), dtype=F32)
    window = xp.concatenate([as_f32(state, xp), x], axis=0)  # [K-1+T, C]
    w = as_f32(weight, xp)
    y = window[0:t] * w[:, 0]
    for j in range(1, k):
        y += window[j:j + t] * w[:, j]
    if bias is not None:
        y += as_f32(bias, xp)
    return ConvOut(y=y, state=window[t:].copy() if k > 1 else window[:0].copy())


def _heads_of_groups(v: Any, n_head: int) -> Any:
    """[T, G, N] -> [T, H, N]: every head sees its group's vector."""
    xp = array_module(v)
    g = v.shape[1]
    if n_head % g:
        raise ValueError(f"ssm: {n_head} heads cannot be split into {g} groups")
    return xp.repeat(v, n_head // g, axis=1)


def ssm_step(x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any = None, state: Any = None) -> ScanOut:
    """One-token selective-state update.

    x: [1, H, P] or [H, P];  dt: [1, H] or [H] (after softplus, > 0);  A: [H] (negative);
    B, C: [1, G, N] or [G, N];  D: [H] or None;  state: [H, P, N] or None (zeros).
    Returns ScanOut(y [1, H, P], state [H, P, N] — a new array).
    """
    xp = array_module(x, B)
    x = as_f32(x, xp)
    if x.ndim == 3:
        x = x[0]
    h, p = x.shape
    dt = as_f32(dt, xp).reshape(h)
    B = _heads_of_groups(as_f32(B, xp).reshape(1, -1, B.shape[-1]), h)[0]  # [H, N]
    C = _heads_of_groups(as_f32(C, xp).reshape(1, -1, C.shape[-1]), h)[0]
    n = B.shape[-1]
    if state is None:
        state = xp.zeros((h, p, n), dtype=F32)
    decay = xp.exp(dt * as_f32(A, xp))  # [H]
    new = state * decay[:, None, None] + (x * dt[:, None])[:, :, None] * B[:, None, :]
    y = xp.matmul(new, C[:, :, None])[:, :, 0]  # [H, P]
    if D is not None:
        y = y + as_f32(D, xp)[:, None] * x
    return ScanOut(y=y[None], state=new.astype(F32, copy=False))


#: up to this many rows :func:`ssm_scan` runs :func:`ssm_step` row by row, so a verify batch (or a server
#: step's rows) on a recurrent target gives the bits of one-token decoding; longer scans (prompts) take
#: the chunked SSD form, whose rounding depends on the chunking
STEP_SCAN_MAX_ROWS = 256


def ssm_scan(x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any = None, state: Any = None,
             chunk: int = 64) -> ScanOut:
    """Selective scan over T tokens, ``chunk`` rows at a time (exact, not an approximation); up to
    ``STEP_SCAN_MAX_ROWS`` rows, one :func:`ssm_step` a row (the same bits as decoding them one by one).

    x: [T, H, P];  dt: [T, H] (after softplus);  A: [H] (negative);  B, C: [T, G, N];
    D: [H] or None;  state: [H, P, N] or None (zeros);  chunk: rows per SSD chunk.
    Returns ScanOut(y [T, H, P], state [H, P, N]).
    """
    xp = array_module(x, B)
    x = as_f32(x, xp)
    t, h, p = x.shape
    if t <= STEP_SCAN_MAX_ROWS:  # decode-sized: the rows of one-token steps, bit for bit
        ys = []
        for i in range(t):
            one = ssm_step(x[i:i + 1], dt[i:i + 1], A, B[i:i + 1], C[i:i + 1], D, state=state)
            ys.append(one.y)
            state = one.state
        return ScanOut(y=xp.concatenate(ys, axis=0), state=state)
    dt = as_f32(dt, xp)
    A = as_f32(A, xp)
    Bh = _heads_of_groups(as_f32(B, xp), h)  # [T, H, N]
    Ch = _heads_of_groups(as_f32(C, xp), h)
    n = Bh.shape[-1]
    S = xp.zeros((h, p, n), dtype=F32) if state is None else as_f32(state, xp)
    y = xp.empty((t, h, p), dtype=F32)
    for c0 in range(0, t, max(1, int(chunk))):
        c1 = min(t, c0 + max(1, int(chunk)))
        y[c0:c1], S = _chunk(x[c0:c1], dt[c0:c1], A, Bh[c0:c1], Ch[c0:c1], S, xp)
    if D is not None:
        y += as_f32(D, xp)[None, :, None] * x
    return ScanOut(y=y, state=S)


def _chunk(x: Any, dt: Any, A: Any, B: Any, C: Any, S: Any, xp: Any) -> tuple[Any, Any]:
    """One SSD chunk. x [L,H,P], dt [L,H], B/C [L,H,N], S [H,P,N] -> (y [L,H,P], S_out [H,P,N])."""
    n_rows = x.shape[0]
    cum = xp.cumsum((dt * A).astype(xp.float64), axis=0)  # [L, H]: sum of log-decays up to each row
    xdt = x * dt[:, :, None]  # [L, H, P]
    # decay from row s to row l (s <= l): exp(cum[l] - cum[s]); zero above the diagonal
    seg = (cum.T[:, :, None] - cum.T[:, None, :])  # [H, L, S]
    causal = xp.tril(xp.ones((n_rows, n_rows), dtype=bool))
    decay = xp.where(causal[None], xp.exp(xp.where(causal[None], seg, 0.0)), 0.0).astype(F32)
    Bt = B.transpose(1, 0, 2)  # [H, L, N]
    Ct = C.transpose(1, 0, 2)
    scores = xp.matmul(Ct, Bt.transpose(0, 2, 1)) * decay  # [H, L, S]
    y = xp.matmul(scores, xdt.transpose(1, 0, 2))  # [H, L, P]
    # carried-in state, read at every row through C and decayed to that row
    carry = xp.matmul(Ct, S.transpose(0, 2, 1))  # [H, L, P]
    y += carry * xp.exp(cum.T).astype(F32)[:, :, None]
    # state out: old state decayed over the chunk + every row's contribution decayed to the end
    to_end = xp.exp(cum[-1][None, :] - cum).astype(F32)  # [L, H]
    contrib = xp.matmul((xdt * to_end[:, :, None]).transpose(1, 2, 0), Bt)  # [H, P, N]
    S_out = S * xp.exp(cum[-1]).astype(F32)[:, None, None] + contrib
    return y.transpose(1, 0, 2), S_out.astype(F32, copy=False)


def gated_group_rms_norm(y: Any, z: Any, weight: Any, n_group: int, eps: float) -> Any:
    """Mamba-2's output norm: RMS-normalise ``y * silu(z)`` in ``n_group`` equal groups, times ``weight``.

    y, z: [T, d_inner];  weight: [d_inner] or [G, d_inner / G];  n_group: G.
    Returns [T, d_inner] float32.
    """
    xp = array_module(y, z)
    v = as_f32(y, xp) * silu(as_f32(z, xp))
    t, d = v.shape
    if d % n_group:
        raise ValueError(f"gated_group_rms_norm: {d} channels cannot be split into {n_group} groups")
    g = v.reshape(t, n_group, d // n_group)
    ms = xp.mean(g * g, axis=-1, keepdims=True)
    g = g * (F32(1.0) / xp.sqrt(ms + F32(eps)))
    return g.reshape(t, d) * as_f32(weight, xp).reshape(d)


__all__ = ["ConvOut", "ScanOut", "causal_conv1d", "gated_group_rms_norm", "ssm_scan", "ssm_step"]

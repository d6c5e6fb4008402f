"""Mamba-2 ops (plinth.ops.ssm): chunked scan == step recurrence == a plain float64 loop."""

from __future__ import annotations

import numpy as np
import pytest

from plinth.ops.ssm import causal_conv1d, gated_group_rms_norm, ssm_scan, ssm_step


def _inputs(t=37, h=6, p=4, g=3, n=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, h, p)).astype(np.float32)
    dt = np.log1p(np.exp(rng.standard_normal((t, h)))).astype(np.float32)  # softplus
    A = -rng.uniform(0.5, 8.0, h).astype(np.float32)
    B = rng.standard_normal((t, g, n)).astype(np.float32)
    C = rng.standard_normal((t, g, n)).astype(np.float32)
    D = rng.standard_normal(h).astype(np.float32)
    S0 = rng.standard_normal((h, p, n)).astype(np.float32)
    return x, dt, A, B, C, D, S0


def _loop(x, dt, A, B, C, D, S0):
    """Textbook recurrence in float64, one position at a time."""
    t, h, p = x.shape
    rep = h // B.shape[1]
    S = S0.astype(np.float64).copy()
    ys = np.zeros((t, h, p))
    for i in range(t):
        for hh in range(h):
            g = hh // rep
            S[hh] = np.exp(dt[i, hh] * A[hh]) * S[hh] + dt[i, hh] * np.outer(x[i, hh], B[i, g])
            ys[i, hh] = S[hh] @ C[i, g] + D[hh] * x[i, hh]
    return ys, S


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_scan_matches_loop(chunk):
    x, dt, A, B, C, D, S0 = _inputs()
    ref_y, ref_S = _loop(x, dt, A, B, C, D, S0)
    out = ssm_scan(x, dt, A, B, C, D, state=S0, chunk=chunk)
    np.testing.assert_allclose(out.y, ref_y, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(out.state, ref_S, atol=2e-5, rtol=1e-5)


def test_step_recurrence_matches_scan_and_keeps_input_state():
    x, dt, A, B, C, D, S0 = _inputs(t=9)
    full = ssm_scan(x, dt, A, B, C, D, state=S0, chunk=4)
    S = S0.copy()
    ys = []
    for i in range(9):
        o = ssm_step(x[i:i + 1], dt[i:i + 1], A, B[i:i + 1], C[i:i + 1], D, state=S)
        assert o.state is not S
        S = o.state
        ys.append(o.y)
    np.testing.assert_allclose(np.concatenate(ys), full.y, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(S, full.state, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(S0, _inputs(t=9)[6])  # the caller's state was not mutated


def test_scan_without_state_starts_from_zero():
    x, dt, A, B, C, D, _ = _inputs(t=8)
    ref_y, _ = _loop(x, dt, A, B, C, D, np.zeros((6, 4, 5), np.float32))
    np.testing.assert_allclose(ssm_scan(x, dt, A, B, C, D).y, ref_y, atol=2e-5, rtol=1e-5)


def test_causal_conv1d_streams_like_one_pass():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((11, 7)).astype(np.float32)
    w = rng.standard_normal((7, 4)).astype(np.float32)
    b = rng.standard_normal(7).astype(np.float32)
    padded = np.concatenate([np.zeros((3, 7), np.float32), x])
    ref = np.stack([(padded[i:i + 4].T * w).sum(1) + b for i in range(11)])
    one = causal_conv1d(x, w, b)
    np.testing.assert_allclose(one.y, ref, atol=1e-5)
    np.testing.assert_array_equal(one.state, x[-3:])
    state, parts = None, []
    for lo, hi in [(0, 2), (2, 3), (3, 9), (9, 11)]:
        o = causal_conv1d(x[lo:hi], w, b, state)
        parts.append(o.y)
        state = o.state
    np.testing.assert_allclose(np.concatenate(parts), ref, atol=1e-5)


def test_gated_group_rms_norm_normalises_each_group():
    rng = np.random.default_rng(2)
    y = rng.standard_normal((3, 12)).astype(np.float32)
    z = rng.standard_normal((3, 12)).astype(np.float32)
    w = rng.standard_normal(12).astype(np.float32)
    out = gated_group_rms_norm(y, z, w.reshape(3, 4), n_group=3, eps=1e-5)
    v = y * (z / (1 + np.exp(-z)))
    g = v.reshape(3, 3, 4)
    ref = (g / np.sqrt((g ** 2).mean(-1, keepdims=True) + 1e-5)).reshape(3, 12) * w
    np.testing.assert_allclose(out, ref, atol=1e-5)
    with pytest.raises(ValueError, match="cannot be split into 5 groups"):
        gated_group_rms_norm(y, z, w, n_group=5, eps=1e-5)


@pytest.mark.ref
def test_chunked_scan_matches_transformers_torch_scan():
    torch = pytest.importorskip("torch")
    nh = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    x, dt_raw, A, B, C, D, S0 = _inputs(t=21)
    dt_bias = np.linspace(-0.5, 0.5, 6).astype(np.float32)
    out_hf, state_hf = nh.mamba2_chunk_scan(
        torch.from_numpy(x)[None], torch.from_numpy(dt_raw)[None], torch.from_numpy(A), torch.from_numpy(B)[None],
        torch.from_numpy(C)[None], chunk_size=8, D=torch.from_numpy(D), dt_bias=torch.from_numpy(dt_bias),
        initial_states=torch.from_numpy(S0)[None], dt_softplus=True, return_final_states=True)
    dt = np.log1p(np.exp(dt_raw + dt_bias)).astype(np.float32)
    ours = ssm_scan(x, dt, A, B, C, D, state=S0, chunk=5)
    np.testing.assert_allclose(ours.y, out_hf[0].numpy(), atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(ours.state, state_hf[0].numpy(), atol=1e-4, rtol=1e-5)

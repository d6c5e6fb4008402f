"""plinth.ops against naive references written here with explicit loops and formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest

from plinth import ops

RNG = np.random.default_rng(1234)


def randn(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


# ---------------------------------------------------------------- activations / norms


def test_activations_match_scalar_formulas():
    x = randn(257, scale=4.0)
    x[:3] = [-100.0, 0.0, 100.0]
    ref_sig = np.array([1 / (1 + math.exp(-v)) if v > -50 else 0.0 for v in x.astype(float)])
    np.testing.assert_allclose(ops.sigmoid(x), ref_sig, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ops.silu(x), x * ref_sig, rtol=1e-5, atol=1e-6)
    ref_erf = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(float)])
    np.testing.assert_allclose(ops.gelu(x, "erf"), ref_erf, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ops.gelu_erf(x), ref_erf, rtol=1e-5, atol=1e-6)
    ref_tanh = np.array(
        [0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3))) for v in x.astype(float)]
    )
    np.testing.assert_allclose(ops.gelu(x), ref_tanh, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ops.relu2(x), np.array([max(v, 0.0) ** 2 for v in x.astype(float)]), rtol=1e-6)
    ref_sp = np.array([math.log1p(math.exp(v)) if v < 30 else v for v in x.astype(float)])
    np.testing.assert_allclose(ops.softplus(x), ref_sp, rtol=1e-6, atol=1e-6)
    for f in (ops.sigmoid, ops.silu, ops.gelu, ops.relu2, ops.softplus):
        assert f(x).dtype == np.float32


def test_erf_is_float32_accurate_everywhere():
    """ops.erf (elementwise array operations only) within 0.55 float32 ulps of math.erf on a dense grid
    (the region boundary at |x| = 1 and the flat tails included), and exact GELU built on it."""
    x = np.concatenate([np.linspace(-7, 7, 400_001, dtype=np.float32),
                        np.float32([0.0, -0.0, 1e-30, -1e-20, 1.0, -1.0, 4.5, -4.5, 30.0, -30.0])])
    ref = np.array([math.erf(v) for v in x.astype(float)])
    got = ops.erf(x)
    assert got.dtype == np.float32
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(float)
    assert np.max(np.abs(got - ref) / np.maximum(ulp, 1e-45)) <= 0.55
    assert np.all(np.abs(got) <= 1.0) and np.isnan(ops.erf(np.float32([np.nan]))).all()
    np.testing.assert_array_equal(ops.erf(np.float32([np.inf, -np.inf])), [1.0, -1.0])
    gelu_ref = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(float)])
    assert np.all(np.abs(ops.gelu(x, "none") - gelu_ref) <= 1.2e-7 * np.maximum(np.abs(x), 1.0))
    np.testing.assert_array_equal(ops.gelu(x, "none"), ops.gelu_erf(x))


def test_exact_gelu_runs_on_the_strict_backend():
    """Exact GELU on the strict device stand-in (no implicit host conversion) gives the host's bits."""
    from plinth.testing.strict import module as sxp, to_host

    x = randn(3, 64, scale=3.0)
    np.testing.assert_array_equal(to_host(ops.gelu(sxp.asarray(x), approximate="none")), ops.gelu(x, "none"))
    np.testing.assert_array_equal(to_host(ops.erf(sxp.asarray(x))), ops.erf(x))


def test_softmax_and_log_softmax():
    x = randn(5, 7, scale=10.0)
    for axis in (0, 1, -1):
        e = np.exp(x.astype(np.float64) - x.max(axis=axis, keepdims=True))
        ref = e / e.sum(axis=axis, keepdims=True)
        np.testing.assert_allclose(ops.softmax(x, axis), ref, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(ops.log_softmax(x, axis), np.log(ref), rtol=1e-5, atol=1e-5)
    big = np.array([1000.0, 1000.0, -np.inf], np.float32)
    np.testing.assert_allclose(ops.softmax(big), [0.5, 0.5, 0.0])
    assert np.all(ops.softmax(np.full(4, -np.inf, np.float32)) == 0)


def test_rms_norm_and_layer_norm():
    x = randn(6, 16)
    w = randn(16)
    b = randn(16)
    for t in range(6):
        row = x[t].astype(np.float64)
        rms = math.sqrt(sum(v * v for v in row) / 16 + 1e-6)
        np.testing.assert_allclose(ops.rms_norm(x, w, 1e-6)[t], row / rms * w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ops.rms_norm(x, w, 1e-6, add_unit_offset=True)[t], row / rms * (1 + w), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ops.rms_norm(x, None, 1e-6)[t], row / rms, rtol=1e-5, atol=1e-6)
        mu = sum(row) / 16
        var = sum((v - mu) ** 2 for v in row) / 16
        np.testing.assert_allclose(
            ops.layer_norm(x, w, b, 1e-5)[t], (row - mu) / math.sqrt(var + 1e-5) * w + b, rtol=1e-5, atol=1e-5
        )


def test_rms_norm_compiled_rows_match_numpy_and_do_not_depend_on_the_batch():
    import importlib

    if importlib.import_module("plinth.ops._xp").compiled_ops() is None:
        pytest.skip("numba kernels off here")
    x, w = randn(300, 48, scale=3.0), randn(48)
    for weight, unit in ((w, False), (w, True), (None, False)):
        y = ops.rms_norm(x, weight, 1e-5, add_unit_offset=unit)
        ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5)
        if weight is not None:
            ref = ref * ((w + 1.0) if unit else w)
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
        assert all(np.array_equal(ops.rms_norm(x[r:r + 1], weight, 1e-5, add_unit_offset=unit)[0], y[r])
                   for r in range(0, 300, 37))  # a prompt-sized batch row for row as decode rows
    assert ops.rms_norm(randn(2, 3, 16), w[:16]).shape == (2, 3, 16)


def test_rms_norm_compiled_sum_of_squares_is_the_exact_sum_rounded():
    """The compiled norm's float64 partial sums, rounded to float32, give the float32 of the exact sum
    of squares (math.fsum): its outputs equal that reference bit for bit, row lengths with and
    without a tail past a multiple of eight, magnitudes over four orders."""
    import importlib
    import math

    if importlib.import_module("plinth.ops._xp").compiled_ops() is None:
        pytest.skip("numba kernels off here")
    rng = np.random.default_rng(5)
    for n in (7, 64, 576, 1030):
        x = (rng.standard_normal((200, n)) * rng.uniform(0.01, 100, (200, 1))).astype(np.float32)
        w = randn(n)
        y = ops.rms_norm(x, w, 1e-6)
        for r in range(200):
            ss = np.float32(math.fsum(float(v) * float(v) for v in x[r]))
            inv = np.float32(1.0) / np.float32(np.sqrt(ss / np.float32(n) + np.float32(1e-6)))
            assert np.array_equal(y[r], x[r] * inv * w), (n, r)


def test_per_head_norms_normalise_each_head():
    x = randn(3, 4, 8)
    w = randn(8)
    y = ops.head_rms_norm(x, w, 1e-6)
    yl = ops.head_layer_norm(x, w, None, 1e-5)
    for t in range(3):
        for h in range(4):
            np.testing.assert_allclose(y[t, h], ops.rms_norm(x[t, h][None], w, 1e-6)[0], rtol=1e-6)
            np.testing.assert_allclose(yl[t, h], ops.layer_norm(x[t, h][None], w, None, 1e-5)[0], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- RoPE


def naive_rope(x, positions, theta, mode, offset=0, mscale=1.0):
    """Rotate pairs by explicit angles pos * theta[i], one scalar at a time."""
    out = x.astype(np.float64).copy()
    n_tok, n_head, _ = x.shape
    half = len(theta)
    for t in range(n_tok):
        for h in range(n_head):
            for i in range(half):
                if mode == "normal":
                    ia, ib = offset + 2 * i, offset + 2 * i + 1
                else:
                    ia, ib = offset + i, offset + i + half
                ang = positions[t] * theta[i]
                a, b = float(x[t, h, ia]), float(x[t, h, ib])
                out[t, h, ia] = (a * math.cos(ang) - b * math.sin(ang)) * mscale
                out[t, h, ib] = (a * math.sin(ang) + b * math.cos(ang)) * mscale
    return out


def plain_theta(n_rot, base):
    return [base ** (-2.0 * i / n_rot) for i in range(n_rot // 2)]


@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_rope_full(mode):
    x = randn(5, 3, 16)
    pos = np.array([0, 1, 7, 100, 4095])
    f = ops.rope_freqs(16, 10000.0)
    np.testing.assert_allclose(f.inv_freq, plain_theta(16, 10000.0), rtol=1e-6)
    y = ops.apply_rope(x, pos, f, mode)
    np.testing.assert_allclose(y, naive_rope(x, pos, plain_theta(16, 10000.0), mode), rtol=1e-4, atol=1e-4)


def test_rope_normal_and_neox_differ():
    x = randn(2, 1, 8)
    f = ops.rope_freqs(8, 10000.0)
    assert not np.allclose(ops.apply_rope(x, [3, 5], f, "normal"), ops.apply_rope(x, [3, 5], f, "neox"))


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("offset", [0, 4, 8])
def test_rope_partial_with_offset(mode, offset):
    x = randn(4, 2, 16)
    pos = np.array([2, 3, 11, 50])
    f = ops.rope_freqs(8, 500.0)
    y = ops.apply_rope(x, pos, f, mode, offset=offset)
    np.testing.assert_allclose(y, naive_rope(x, pos, plain_theta(8, 500.0), mode, offset), rtol=1e-4, atol=1e-4)
    # dims outside the slice pass through untouched
    keep = [d for d in range(16) if not offset <= d < offset + 8]
    np.testing.assert_array_equal(y[..., keep], x[..., keep])


def test_rope_inverse_undoes_rope_and_cache_matches():
    x = randn(6, 2, 12)
    pos = np.array([0, 5, 9, 31, 2, 700])
    f = ops.rope_freqs(12, 10000.0)
    y = ops.apply_rope(x, pos, f, "neox")
    np.testing.assert_allclose(ops.apply_rope(y, pos, f, "neox", inverse=True), x, rtol=1e-4, atol=1e-5)
    cache = ops.RopeCache(f, capacity=8)
    y2 = ops.apply_rope(x, cos_sin=cache(pos), mode="neox")
    np.testing.assert_allclose(y2, y, rtol=1e-6, atol=1e-6)


def test_rope_linear_scaling_and_freq_factors():
    x = randn(3, 2, 8)
    pos = np.array([1, 10, 100])
    f = ops.rope_freqs(8, 10000.0, scaling="linear", factor=4.0)
    np.testing.assert_allclose(
        ops.apply_rope(x, pos, f), naive_rope(x, pos / 4.0, plain_theta(8, 10000.0), "normal"), rtol=1e-4, atol=1e-4
    )
    ff = np.array([1.0, 2.0, 8.0, 8.0], np.float32)
    f2 = ops.rope_freqs(8, 10000.0, freq_factors=ff)
    theta = [t / d for t, d in zip(plain_theta(8, 10000.0), ff)]
    np.testing.assert_allclose(ops.apply_rope(x, pos, f2), naive_rope(x, pos, theta, "normal"), rtol=1e-4, atol=1e-4)


def yarn_reference(n_dims, base, factor, n_ctx_orig, beta_fast, beta_slow, ext_factor, attn_factor):
    """YaRN per llama.cpp's ggml_rope_yarn: blend interpolated and extrapolated angles by a
    linear ramp between the corrected dims, and scale cos/sin by attn_factor*(1+0.1 ln s)."""

    def corr_dim(n_rot):
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(n_dims - 1.0, math.ceil(corr_dim(beta_slow)))
    freq_scale = 1.0 / factor
    thetas = []
    for i0 in range(0, n_dims, 2):
        extrap = base ** (-i0 / n_dims)
        interp = freq_scale * extrap
        y = (i0 / 2 - low) / max(0.001, high - low)
        ramp = 1.0 - min(1.0, max(0.0, y))
        mix = ramp * ext_factor
        thetas.append(interp * (1 - mix) + extrap * mix)
    mscale = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale)) if ext_factor != 0 else attn_factor
    return thetas, mscale


@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_rope_yarn(mode):
    n_dims, base, factor, n_orig = 64, 10000.0, 8.0, 4096
    f = ops.rope_freqs(n_dims, base, "yarn", factor, n_orig, beta_fast=32.0, beta_slow=1.0, attn_factor=1.0)
    thetas, mscale = yarn_reference(n_dims, base, factor, n_orig, 32.0, 1.0, 1.0, 1.0)
    np.testing.assert_allclose(f.inv_freq, thetas, rtol=1e-6)
    assert f.mscale == pytest.approx(mscale)
    assert f.mscale == pytest.approx(1 + 0.1 * math.log(8.0))
    # high-frequency dims extrapolate (unchanged), low-frequency ones interpolate (/ factor)
    assert f.inv_freq[0] == pytest.approx(1.0)
    assert f.inv_freq[-1] == pytest.approx(base ** (-(n_dims - 2) / n_dims) / factor, rel=1e-6)
    x = randn(3, 2, n_dims)
    pos = np.array([0, 17, 30000])
    y = ops.apply_rope(x, pos, f, mode)
    # angles at position 30000 amplify the float32 rounding of the table itself: rotate by
    # the float32-rounded reference frequencies (already checked above to 1e-6)
    thetas32 = np.float32(thetas).astype(np.float64)
    np.testing.assert_allclose(y, naive_rope(x, pos, thetas32, mode, mscale=mscale), rtol=2e-4, atol=2e-4)
    # ext_factor 0: pure interpolation, no mscale bump
    f0 = ops.rope_freqs(n_dims, base, "yarn", factor, n_orig, ext_factor=0.0)
    t0, m0 = yarn_reference(n_dims, base, factor, n_orig, 32.0, 1.0, 0.0, 1.0)
    np.testing.assert_allclose(f0.inv_freq, t0, rtol=1e-6)
    assert f0.mscale == pytest.approx(m0) == 1.0


# ---------------------------------------------------------------- attention


def naive_attention(q, k, v, q_pos, k_pos, scale, causal=True, window=None, soft_cap=None, sinks=None, mask=None):
    n_q, n_head, _ = q.shape
    n_kv, n_head_kv, hd_v = v.shape
    g = n_head // n_head_kv
    out = np.zeros((n_q, n_head, hd_v))
    for h in range(n_head):
        kh = h // g
        for i in range(n_q):
            logits, vals = [], []
            for j in range(n_kv):
                if causal and k_pos[j] > q_pos[i]:
                    continue
                if window is not None and q_pos[i] - k_pos[j] >= window:
                    continue
                if mask is not None and not mask[i, j]:
                    continue
                s = float(np.dot(q[i, h].astype(np.float64), k[j, kh])) * scale
                if soft_cap is not None:
                    s = soft_cap * math.tanh(s / soft_cap)
                logits.append(s)
                vals.append(v[j, kh].astype(np.float64))
            extra = [float(sinks[h])] if sinks is not None else []
            if not logits:
                continue
            m = max(logits + extra)
            ws = [math.exp(s - m) for s in logits]
            den = sum(ws) + sum(math.exp(s - m) for s in extra)
            out[i, h] = sum(w * val for w, val in zip(ws, vals)) / den
    return out


def make_qkv(n_q, n_kv, n_head, n_head_kv, hd, hd_v=None):
    return randn(n_q, n_head, hd), randn(n_kv, n_head_kv, hd), randn(n_kv, n_head_kv, hd_v or hd)


@pytest.mark.parametrize("n_head,n_head_kv", [(4, 4), (6, 2), (4, 1)])
def test_attention_causal_prefill(n_head, n_head_kv):
    q, k, v = make_qkv(7, 7, n_head, n_head_kv, 8, 5)
    pos = np.arange(7)
    y = ops.attention(q, k, v, pos, pos, scale=0.3)
    assert y.shape == (7, n_head, 5) and y.dtype == np.float32
    np.testing.assert_allclose(y, naive_attention(q, k, v, pos, pos, 0.3), rtol=1e-4, atol=1e-5)


def test_attention_decode_with_cache_and_default_scale():
    q, k, v = make_qkv(1, 12, 9, 3, 16)
    kp = np.arange(12)
    qp = np.array([11])
    y = ops.attention(q, k, v, qp, kp)
    np.testing.assert_allclose(y, naive_attention(q, k, v, qp, kp, 1 / 4.0), rtol=1e-4, atol=1e-5)


def test_attention_sliding_window():
    q, k, v = make_qkv(10, 10, 4, 2, 8)
    pos = np.arange(10)
    y = ops.attention(q, k, v, pos, pos, scale=0.5, sliding_window=3)
    np.testing.assert_allclose(y, naive_attention(q, k, v, pos, pos, 0.5, window=3), rtol=1e-4, atol=1e-5)
    # window 1 keeps only the token itself
    y1 = ops.attention(q, k, v, pos, pos, scale=0.5, sliding_window=1)
    np.testing.assert_allclose(y1, np.repeat(v, 2, axis=1), rtol=1e-6)


def test_attention_soft_cap_and_sinks():
    q, k, v = make_qkv(5, 8, 4, 2, 8)
    q *= 4
    kp = np.arange(8)
    qp = np.array([3, 4, 5, 6, 7])
    sinks = randn(4)
    y = ops.attention(q, k, v, qp, kp, scale=0.35, soft_cap=5.0, sinks=sinks)
    ref = naive_attention(q, k, v, qp, kp, 0.35, soft_cap=5.0, sinks=sinks)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
    y_nosink = ops.attention(q, k, v, qp, kp, scale=0.35, soft_cap=5.0)
    assert np.all(np.linalg.norm(y, axis=-1) < np.linalg.norm(y_nosink, axis=-1) + 1e-6)


def test_attention_gqa_equals_mha_with_repeated_kv():
    q, k, v = make_qkv(6, 9, 8, 2, 8)
    qp = np.arange(3, 9)
    kp = np.arange(9)
    sinks = randn(8)
    y = ops.attention(q, k, v, qp, kp, sinks=sinks, sliding_window=4)
    y_mha = ops.attention(q, np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1), qp, kp, sinks=sinks, sliding_window=4)
    np.testing.assert_allclose(y, y_mha, rtol=1e-5, atol=1e-6)


def test_attention_extra_mask_and_empty_rows():
    q, k, v = make_qkv(4, 6, 2, 1, 8)
    kp = np.arange(6)
    qp = np.array([2, 3, 4, 5])
    mask = RNG.random((4, 6)) > 0.4
    mask[1] = False  # query 1 sees nothing
    y = ops.attention(q, k, v, qp, kp, mask=mask)
    assert np.all(np.isfinite(y))
    np.testing.assert_array_equal(y[1], 0.0)
    np.testing.assert_allclose(y, naive_attention(q, k, v, qp, kp, 1 / math.sqrt(8), mask=mask), rtol=1e-4, atol=1e-5)
    # a query placed before every key is empty too (causal), also with a window
    y2 = ops.attention(q, k + 0, v, np.array([-1, 0, 1, 2]), kp + 2, sliding_window=2)
    assert np.all(np.isfinite(y2)) and np.all(y2[:2] == 0)


def test_attention_non_causal_and_two_sequences():
    q, k, v = make_qkv(6, 6, 2, 2, 4)
    seq = np.array([0, 0, 0, 1, 1, 1])
    pos = np.array([0, 1, 2, 0, 1, 2])
    same = seq[:, None] == seq[None, :]
    y = ops.attention(q, k, v, pos, pos, mask=same)
    y0 = ops.attention(q[:3], k[:3], v[:3], pos[:3], pos[:3])
    y1 = ops.attention(q[3:], k[3:], v[3:], pos[3:], pos[3:])
    np.testing.assert_allclose(y, np.concatenate([y0, y1]), rtol=1e-5, atol=1e-6)
    yn = ops.attention(q, k, v, causal=False)
    np.testing.assert_allclose(yn, naive_attention(q, k, v, pos, pos, 0.5, causal=False), rtol=1e-4, atol=1e-5)


def test_attention_row_kernel_with_bias_and_soft_cap_is_batch_invariant():
    """The compiled path (few query rows, an additive bias as the graphs pass it): the naive result,
    and each row's output bit for bit the same when computed alone."""
    import importlib

    attn_mod = importlib.import_module("plinth.ops.attention")  # (plinth.ops.attention is the function)

    if importlib.import_module("plinth.ops._xp").compiled_ops() is None:
        pytest.skip("numba kernels off here")
    for n_q, n_head, n_head_kv, hd, cap in ((1, 6, 2, 16, None), (7, 4, 4, 8, 5.0), (16, 8, 2, 32, None)):
        q, k, v = make_qkv(n_q, 40, n_head, n_head_kv, hd)
        kp = np.arange(40)
        qp = np.arange(40 - n_q, 40)
        vis = (kp[None, :] <= qp[:, None]) & (RNG.random((n_q, 40)) > 0.2)
        vis[0] = False  # a row that sees nothing: zeros
        bias = np.where(vis, 0.0, -np.inf).astype(np.float32)
        assert n_q <= attn_mod.KERNEL_MAX_Q
        y = ops.attention(q, k, v, scale=0.3, causal=False, bias=bias, soft_cap=cap)
        np.testing.assert_allclose(y, naive_attention(q, k, v, qp, kp, 0.3, causal=False, soft_cap=cap, mask=vis),
                                   rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(y[0], 0.0)
        for i in range(n_q):
            alone = ops.attention(q[i:i + 1], k, v, scale=0.3, causal=False, bias=bias[i:i + 1], soft_cap=cap)
            assert np.array_equal(alone[0], y[i]), f"row {i} of {n_q}"
        assert np.array_equal(ops.attention(q, k, v, scale=0.3, causal=False, soft_cap=cap)[3 % n_q],
                              ops.attention(q[3 % n_q:3 % n_q + 1], k, v, scale=0.3, causal=False, soft_cap=cap)[0])



@pytest.mark.parametrize("mode,offset,inverse", [("normal", 0, False), ("neox", 0, False), ("neox", 8, True),
                                                  ("normal", 4, True)])
def test_rope_compiled_rows_are_the_numpy_expression(mode, offset, inverse):
    """The host kernel gives the numpy expression's bits (a c - b s, a s + b c in float32), on a
    strided view as the graphs pass it, for any batch (a row alone gives its row)."""
    n, n_head, hd, half = 7, 3, 32, 12
    base = randn(n, n_head + 2, hd)
    x = base[:, 1:1 + n_head]  # not contiguous
    ang = RNG.standard_normal((n, half))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    y = ops.apply_rope(x, mode=mode, offset=offset, cos_sin=(cos, sin), inverse=inverse)
    seg = x[..., offset:offset + 2 * half]
    a, b = (seg[..., 0::2], seg[..., 1::2]) if mode == "normal" else (seg[..., :half], seg[..., half:])
    c, s = cos[:, None, :], (-sin if inverse else sin)[:, None, :]
    want = x.copy()
    tgt = want[..., offset:offset + 2 * half]
    ra, rb = a * c - b * s, a * s + b * c
    if mode == "normal":
        tgt[..., 0::2], tgt[..., 1::2] = ra, rb
    else:
        tgt[..., :half], tgt[..., half:] = ra, rb
    assert np.array_equal(y, want)
    assert np.array_equal(ops.apply_rope(x[3:4], mode=mode, offset=offset, cos_sin=(cos[3:4], sin[3:4]),
                                         inverse=inverse)[0], y[3])

def test_attention_groups_equal_one_call_per_sequence():
    """Several sequences' rows in one call (a server step): each group bit for bit its own
    attention call, with caches of different lengths, biases on some groups, a prompt-sized group
    (more than KERNEL_MAX_Q rows, attended apart) and soft-capping."""
    import importlib

    attn_mod = importlib.import_module("plinth.ops.attention")
    n_head, n_head_kv, hd = 6, 2, 16
    sizes = [1, 3, 1, attn_mod.KERNEL_MAX_Q + 4, 2]
    lens = [5, 40, 17, 60, 9]
    q = randn(sum(sizes), n_head, hd)
    groups, s = [], 0
    for n, n_kv in zip(sizes, lens):
        k, v = randn(n_kv, n_head_kv, hd), randn(n_kv, n_head_kv, hd)
        bias = None
        if n > 1:
            kp, qp = np.arange(n_kv), np.arange(n_kv - n, n_kv)
            bias = np.where(kp[None, :] <= qp[:, None], 0.0, -np.inf).astype(np.float32)
        groups.append((s, s + n, k, v, bias))
        s += n
    for cap in (None, 4.0):
        y = ops.attention_groups(q, groups, scale=0.3, soft_cap=cap)
        for s, e, k, v, bias in groups:
            alone = ops.attention(q[s:e], k, v, scale=0.3, causal=False, bias=bias, soft_cap=cap)
            assert np.array_equal(y[s:e], alone), (s, e, cap)
            np.testing.assert_allclose(alone, naive_attention(q[s:e], k, v, np.arange(e - s), np.arange(len(k)), 0.3,
                                                              causal=False, soft_cap=cap,
                                                              mask=None if bias is None else bias == 0),
                                       rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="rows 1:4"):
        bad = list(groups)
        bad[1] = (1, 4, randn(40, 3, hd), randn(40, 3, hd), None)
        ops.attention_groups(q, bad, scale=0.3)
    with pytest.raises(ValueError, match="rows 0:1"):  # keys of another head size than the queries
        bad = list(groups)
        bad[0] = (0, 1, randn(5, n_head_kv, hd + 8), randn(5, n_head_kv, hd), None)
        ops.attention_groups(q, bad[:1], scale=0.3)


# ---------------------------------------------------------------- FFN / linear


def test_linear_gguf_layout():
    x = randn(3, 5, 7)
    w = randn(11, 7)
    b = randn(11)
    y = ops.linear(x, w, b)
    ref = np.einsum("tsi,oi->tso", x.astype(np.float64), w) + b
    assert y.shape == (3, 5, 11)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ops.linear(x[:, 1], w), x[:, 1] @ w.T, rtol=1e-5, atol=1e-5)


def test_glu_ffns_and_relu2_mlp():
    x = randn(4, 8)
    wg, wu, wd = randn(16, 8), randn(16, 8), randn(8, 16)
    x64 = x.astype(np.float64)
    g = x64 @ wg.T.astype(np.float64)
    u = x64 @ wu.T.astype(np.float64)
    silu = g / (1 + np.exp(-g))
    np.testing.assert_allclose(ops.swiglu(x, wg, wu, wd), (silu * u) @ wd.T, rtol=1e-4, atol=1e-4)
    gel = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
    np.testing.assert_allclose(ops.geglu(x, wg, wu, wd), (gel * u) @ wd.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ops.relu2_mlp(x, wu, wd), (np.maximum(u, 0) ** 2) @ wd.T, rtol=1e-4, atol=1e-3)


# ---------------------------------------------------------------- MoE


def naive_route(logits, k, score_func, norm, bias=None, n_group=1, topk_group=None, scaling=1.0):
    ids_all, w_all = [], []
    n_exp = logits.shape[1]
    for row in logits.astype(np.float64):
        if score_func == "softmax":
            e = np.exp(row - row.max())
            p = e / e.sum()
        elif score_func == "sigmoid":
            p = 1 / (1 + np.exp(-row))
        else:
            p = row.copy()
        sel = p + (bias if bias is not None else 0)
        allowed = set(range(n_exp))
        if n_group > 1 and topk_group:
            gs = n_exp // n_group
            scores = [sum(sorted(sel[g * gs : (g + 1) * gs])[-2:]) for g in range(n_group)]
            groups = sorted(range(n_group), key=lambda g: -scores[g])[:topk_group]
            allowed = {e for g in groups for e in range(g * gs, (g + 1) * gs)}
        cands = sorted(allowed, key=lambda e: (-sel[e], e))[:k]
        w = np.array([p[e] for e in cands])
        if score_func == "softmax_topk":
            w = np.exp(w - w.max())
            w /= w.sum()
        if norm:
            w = w / w.sum()
        ids_all.append(cands)
        w_all.append(w * scaling)
    return np.array(ids_all), np.array(w_all)


@pytest.mark.parametrize(
    "kw",
    [
        dict(score_func="softmax", norm_topk=False),
        dict(score_func="softmax", norm_topk=True),
        dict(score_func="softmax_topk", norm_topk=False),
        dict(score_func="sigmoid", norm_topk=True, bias=True, routed_scaling=2.5),
        dict(score_func="sigmoid", norm_topk=True, bias=True, n_group=4, topk_group=2, routed_scaling=1.5),
    ],
)
def test_moe_route_matches_loop(kw):
    kw = dict(kw)
    logits = randn(9, 16, scale=2.0)
    bias = randn(16) if kw.pop("bias", False) else None
    r = ops.moe_route(logits, 4, score_bias=bias, **kw)
    ids, w = naive_route(
        logits, 4, kw["score_func"], kw["norm_topk"], bias, kw.get("n_group", 1), kw.get("topk_group"), kw.get("routed_scaling", 1.0)
    )
    np.testing.assert_array_equal(r.ids, ids)
    np.testing.assert_allclose(r.weights, w, rtol=1e-5, atol=1e-6)
    assert r.weights.dtype == np.float32


def test_moe_bias_changes_selection_not_weights():
    logits = np.zeros((1, 4), np.float32)
    logits[0] = [0.0, 1.0, 2.0, 3.0]
    bias = np.array([10.0, 0.0, 0.0, 0.0], np.float32)
    r = ops.moe_route(logits, 1, "sigmoid", score_bias=bias)
    assert r.ids[0, 0] == 0
    assert r.weights[0, 0] == pytest.approx(0.5)


@pytest.mark.parametrize("gated", [True, False])
def test_moe_ffn_matches_loop(gated):
    n_tok, n_embd, n_ff, n_exp, k = 7, 8, 12, 5, 2
    x = randn(n_tok, n_embd)
    gate = randn(n_exp, n_ff, n_embd) if gated else None
    up = randn(n_exp, n_ff, n_embd)
    down = randn(n_exp, n_embd, n_ff)
    r = ops.moe_route(randn(n_tok, n_exp), k, "softmax", norm_topk=True)
    act = "silu" if gated else "relu2"
    y = ops.moe_ffn(x, r, gate, up, down, act)
    ref = np.zeros((n_tok, n_embd))
    for t in range(n_tok):
        for j in range(k):
            e = r.ids[t, j]
            if gated:
                h = ops.silu(gate[e] @ x[t]) * (up[e] @ x[t])
            else:
                h = np.maximum(up[e] @ x[t], 0) ** 2
            ref[t] += r.weights[t, j] * (down[e] @ h)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- misc


def test_pad_left_right():
    x = randn(2, 3)
    y = ops.pad(x, 1, 2, 1, value=-1.0)
    assert y.shape == (2, 6)
    np.testing.assert_array_equal(y[:, :2], -1.0)
    np.testing.assert_array_equal(y[:, 2:5], x)
    np.testing.assert_array_equal(y[:, 5], -1.0)
    assert ops.pad(x, 0, 0, 3).shape == (5, 3)


def test_top_k_sorted_descending():
    x = randn(4, 10)
    for k in (1, 3, 10):
        r = ops.top_k(x, k)
        for row in range(4):
            ref = sorted(range(10), key=lambda i: -x[row, i])[:k]
            np.testing.assert_array_equal(r.indices[row], ref)
            np.testing.assert_array_equal(r.values[row], x[row, ref])
    r0 = ops.top_k(x, 2, axis=0)
    assert r0.indices.shape == (2, 10)
    np.testing.assert_array_equal(r0.values[0], x.max(axis=0))
    ties = np.array([1.0, 3.0, 3.0, 0.0, 3.0], np.float32)
    np.testing.assert_array_equal(ops.top_k(ties, 2).indices, [1, 2])


def test_gather_rows_and_array_module():
    t = randn(10, 4)
    ids = np.array([[3, 1], [9, 9]])
    np.testing.assert_array_equal(ops.gather_rows(t, ids), t[ids])
    assert ops.array_module(t) is np


# ---------------------------------------------------------------- torch cross-checks (opt-in)


@pytest.mark.ref
def test_ref_activations_and_norms_against_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = randn(6, 32, scale=3.0)
    w, b = randn(32), randn(32)
    tx = torch.from_numpy(x)
    np.testing.assert_allclose(ops.silu(x), F.silu(tx).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ops.gelu(x), F.gelu(tx, approximate="tanh").numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ops.gelu(x, "erf"), F.gelu(tx).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ops.softplus(x), F.softplus(tx).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ops.log_softmax(x), F.log_softmax(tx, -1).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        ops.rms_norm(x, w, 1e-6), F.rms_norm(tx, (32,), torch.from_numpy(w), 1e-6).numpy(), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        ops.layer_norm(x, w, b, 1e-5),
        F.layer_norm(tx, (32,), torch.from_numpy(w), torch.from_numpy(b), 1e-5).numpy(),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.ref
def test_ref_attention_against_torch_sdpa():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    n, n_head, n_head_kv, hd = 11, 9, 3, 16
    q, k, v = make_qkv(n, n, n_head, n_head_kv, hd)
    pos = np.arange(n)
    for window in (None, 4):
        vis = ops.attention_mask(pos, pos, True, window)
        tq, tk, tv = (torch.from_numpy(a).transpose(0, 1) for a in (q, k, v))
        ref = F.scaled_dot_product_attention(
            tq[None], tk[None], tv[None], attn_mask=torch.from_numpy(vis), scale=0.2, enable_gqa=True
        )[0].transpose(0, 1)
        y = ops.attention(q, k, v, pos, pos, scale=0.2, sliding_window=window)
        np.testing.assert_allclose(y, ref.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.ref
def test_ref_neox_rope_against_torch_rotate_half():
    torch = pytest.importorskip("torch")
    x = randn(5, 2, 32)
    pos = np.arange(5) * 13
    f = ops.rope_freqs(32, 10000.0)
    # the HF formulation: x * cos + rotate_half(x) * sin with [cos, cos] tables
    tx = torch.from_numpy(x).double()
    ang = torch.from_numpy(pos).double()[:, None] * torch.from_numpy(f.inv_freq).double()[None]
    emb = torch.cat([ang, ang], -1)[:, None, :]
    x1, x2 = tx[..., :16], tx[..., 16:]
    ref = tx * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()
    np.testing.assert_allclose(ops.apply_rope(x, pos, f, "neox"), ref.numpy(), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- cupy parity (opt-in)


@pytest.mark.gpu
def test_gpu_ops_match_numpy():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no CUDA device")
    except Exception as exc:  # no driver
        pytest.skip(f"no usable CUDA device: {exc}")
    q, k, v = make_qkv(5, 9, 6, 2, 8)
    qp, kp = np.arange(4, 9), np.arange(9)
    sinks = randn(6)
    ref = ops.attention(q, k, v, qp, kp, sliding_window=3, soft_cap=4.0, sinks=sinks)
    got = ops.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(qp), cp.asarray(kp),
                        sliding_window=3, soft_cap=4.0, sinks=cp.asarray(sinks))
    assert ops.array_module(got) is cp
    np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=1e-4, atol=1e-5)
    f = ops.rope_freqs(8, 10000.0, xp=cp)
    np.testing.assert_allclose(
        cp.asnumpy(ops.apply_rope(cp.asarray(q), cp.asarray(qp), f, "neox", offset=0)),
        ops.apply_rope(q, qp, ops.rope_freqs(8, 10000.0), "neox"), rtol=1e-4, atol=1e-5,
    )
    x = randn(7, 8)
    wg, wu, wd = randn(5, 16, 8), randn(5, 16, 8), randn(5, 8, 16)
    logits = randn(7, 5)
    r = ops.moe_route(logits, 2, "sigmoid", norm_topk=True)
    rg = ops.moe_route(cp.asarray(logits), 2, "sigmoid", norm_topk=True)
    np.testing.assert_array_equal(cp.asnumpy(rg.ids), r.ids)
    y = ops.moe_ffn(x, r, wg, wu, wd)
    yg = ops.moe_ffn(cp.asarray(x), rg, cp.asarray(wg), cp.asarray(wu), cp.asarray(wd))
    np.testing.assert_allclose(cp.asnumpy(yg), y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cp.asnumpy(ops.rms_norm(cp.asarray(x), cp.asarray(x[0]))), ops.rms_norm(x, x[0]), rtol=1e-5)

"""The vector attention kernel of decode and verify rows (plinth.ops.attend_simd through
plinth.ops.compiled.attention_groups): against a float64 reference, and bit for bit independent of
the batch, of masked keys past a row's own, and of how the heads are split over threads."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

from plinth import ops

RNG = np.random.default_rng(77)


def _compiled():
    mod = importlib.import_module("plinth.ops._xp").compiled_ops()
    if mod is None:
        pytest.skip("numba kernels off here")
    return mod


def _lanes():
    return importlib.import_module("plinth.ops.attend_simd").lanes()


def reference(q, k, v, scale, vis):
    """float64 softmax attention; vis [n_q, n_kv] bool; a row that sees nothing gives zeros."""
    n_q, n_head, _ = q.shape
    n_kv, n_head_kv, hd_v = v.shape
    g = n_head // n_head_kv
    out = np.zeros((n_q, n_head, hd_v))
    for i in range(n_q):
        keep = np.flatnonzero(vis[i])
        if not len(keep):
            continue
        for h in range(n_head):
            s = k[keep, h // g].astype(np.float64) @ q[i, h].astype(np.float64) * scale
            w = np.exp(s - s.max())
            out[i, h] = w @ v[keep, h // g].astype(np.float64) / w.sum()
    return out


def _case(n_q, n_head, n_head_kv, hd, hd_v, n_kv, spread=1.0):
    q = (RNG.standard_normal((n_q, n_head, hd)) * spread).astype(np.float32)
    k = RNG.standard_normal((n_kv, n_head_kv, hd)).astype(np.float32)
    v = RNG.standard_normal((n_kv, n_head_kv, hd_v)).astype(np.float32)
    qp = np.arange(n_kv - n_q, n_kv)
    vis = np.arange(n_kv)[None, :] <= qp[:, None]
    return q, k, v, vis


# hd a multiple of W, hd_v of 4 W (16 lanes with AVX-512, 8 with AVX2): the vector kernel runs
SHAPES = [(1, 9, 3, 64, 64, 129), (8, 9, 3, 64, 64, 37), (4, 4, 1, 256, 256, 300), (3, 8, 2, 192, 128, 17),
          (16, 6, 6, 64, 128, 21), (1, 2, 1, 64, 64, 1)]


@pytest.mark.parametrize("shape", SHAPES)
def test_vector_kernel_matches_float64_reference(shape):
    """Causal rows plus a random mask, keys a ragged multiple of the lanes, one row that sees no key
    (zeros), and a wide score spread (weights that underflow to 0 in the kernel's exp)."""
    _compiled()
    n_q, n_head, n_head_kv, hd, hd_v, n_kv = shape
    W = _lanes()
    assert hd % W == 0 and hd_v % (4 * W) == 0, "the shape should take the vector kernel"
    for spread in (1.0, 6.0):
        q, k, v, vis = _case(*shape, spread=spread)
        vis &= RNG.random(vis.shape) > 0.25
        vis[:, n_kv - n_q] |= True  # every row sees at least its first key ...
        if n_q > 1:
            vis[1] = False  # ... but this one
        bias = np.where(vis, 0.0, -np.inf).astype(np.float32)
        y = ops.attention(q, k, v, scale=1 / math.sqrt(hd), causal=False, bias=bias)
        np.testing.assert_allclose(y, reference(q, k, v, 1 / math.sqrt(hd), vis), rtol=2e-5, atol=2e-6)
        if n_q > 1:
            assert np.array_equal(y[1], np.zeros_like(y[1]))


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_vector_kernel_row_is_its_decode_step(shape):
    """Row i of a verify batch (n_kv keys, the ones past it masked) gives the bits a decode step with
    only its own keys gives (fewer keys, no bias), and the same bits whatever the thread count (which
    changes how the query heads are split into tasks)."""
    mod = _compiled()
    n_q, n_head, n_head_kv, hd, hd_v, n_kv = shape
    q, k, v, vis = _case(*shape)
    bias = np.where(vis, 0.0, -np.inf).astype(np.float32)
    scale = 1 / math.sqrt(hd)
    y = ops.attention(q, k, v, scale=scale, causal=False, bias=bias)
    for i in range(n_q):
        n_i = n_kv - n_q + i + 1
        alone = ops.attention(q[i:i + 1], k[:n_i], v[:n_i], scale=scale, causal=False)
        assert np.array_equal(alone[0], y[i]), f"row {i}"
    for threads in (1, 3, 64):
        out = np.empty_like(y)
        t = np.array([[0, n_q, n_kv, k.ctypes.data, v.ctypes.data, bias.ctypes.data]], dtype=np.int64)
        mod.attention_groups(q, t, n_head_kv, hd_v, scale, 0.0, out, threads)
        assert np.array_equal(out, y), threads


def test_eight_lane_form_matches_reference():
    """The AVX2 form (8 lanes: other blocks, another reduction tree) compiled here too: it runs on any
    host with AVX2, so it is checked against the reference wherever the host's form has 16."""
    _compiled()
    from numba import njit

    from plinth.ops.attend_simd import make_attend, scratch_floats

    attend8 = make_attend(8)

    @njit
    def run(q, k, v, bias, out):
        n_q, n_head, hd = q.shape
        n_kv, n_head_kv, hd_v = v.shape
        g = n_head // n_head_kv
        scratch = np.empty(scratch_floats(n_kv, g, hd, hd_v, 8), np.float32)
        for i in range(n_q):
            for hk in range(n_head_kv):
                attend8(q.ctypes.data + (i * n_head + hk * g) * hd * 4, g, hd, k.ctypes.data + hk * hd * 4,
                        v.ctypes.data + hk * hd_v * 4, n_kv, n_head_kv * hd, n_head_kv * hd_v, hd, hd_v,
                        np.float32(1 / np.sqrt(hd)), bias.ctypes.data + i * n_kv * 4, scratch.ctypes.data,
                        out.ctypes.data + (i * n_head + hk * g) * hd_v * 4, hd_v, g, 0, 0, 0, 0)

    for shape in ((3, 6, 2, 32, 32, 21), (2, 4, 1, 64, 96, 40)):
        q, k, v, vis = _case(*shape)
        bias = np.where(vis, 0.0, -np.inf).astype(np.float32)
        out = np.empty((shape[0], shape[1], shape[4]), np.float32)
        run(q, k, v, bias, out)
        np.testing.assert_allclose(out, reference(q, k, v, 1 / math.sqrt(shape[3]), vis), rtol=2e-5, atol=2e-6)


def test_other_shapes_take_the_plain_loop():
    """A head size the vector kernel does not take (and soft-capping) still goes through the compiled
    call, with the plain per-head loop: same reference."""
    _compiled()
    q, k, v, vis = _case(3, 4, 2, 24, 24, 19)
    bias = np.where(vis, 0.0, -np.inf).astype(np.float32)
    y = ops.attention(q, k, v, scale=0.2, causal=False, bias=bias)
    np.testing.assert_allclose(y, reference(q, k, v, 0.2, vis), rtol=2e-5, atol=2e-6)


def test_vector_kernel_and_plain_loop_agree():
    """The two paths of the compiled entry point on the same shape (the benchmark compares their speed):
    equal to float rounding."""
    mod = _compiled()
    q, k, v, vis = _case(8, 9, 3, 64, 64, 77)
    bias = np.where(vis, 0.0, -np.inf).astype(np.float32)
    t = np.array([[0, 8, 77, k.ctypes.data, v.ctypes.data, bias.ctypes.data]], dtype=np.int64)
    outs = []
    for plain in (True, False):
        out = np.empty((8, 9, 64), np.float32)
        mod.attention_groups(q, t, 3, 64, 0.125, 0.0, out, 2, plain)
        outs.append(out)
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6)


def test_kernels_prefetch_their_rows_into_the_l2_cache():
    """The float32 kernel asks for the keys and values a block ahead, the typed one (float row types) two
    blocks ahead, both into the L2 cache (``llvm.prefetch`` read, locality 2, data): a server step's rows come
    from memory, and into the L1 the prefetches waited on its miss buffers (benchmarks/README.md, "Attention's
    rows from memory"). A hint only: the bits are the tests above."""
    from llvmlite import ir

    simd = importlib.import_module("plinth.ops.attend_simd")
    qsimd = importlib.import_module("plinth.ops.attend_qsimd")
    for make in (simd._rows_fn, qsimd._rows_fn):
        module = ir.Module()
        make(module, 16)
        text = str(module)
        calls = [line for line in text.splitlines() if "call void @\"llvm.prefetch" in line
                 or "call void @llvm.prefetch" in line]
        # the keys' first blocks and block ahead, the values' the same: four sites at least
        assert len(calls) >= 4, text[:2000]
        assert all(line.rstrip().endswith("i32 0, i32 2, i32 1)") for line in calls), calls

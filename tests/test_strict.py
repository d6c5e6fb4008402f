"""The strict device stand-in (plinth.testing.strict) and the device discipline it checks.

The stand-in must refuse what cupy refuses (a host array inside a device op, an implicit
numpy conversion) and count every device-to-host transfer; the ops and every architecture
must then run on it, and a plain decode step must read back at most one thing (the logits
row the sampler needs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth import ops
from plinth.testing import count_transfers, decode_step_transfers, load_module, make_backend
from plinth.testing.strict import HostArrayError, StrictArray, module as xp

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def a():
    return xp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))


# ---------------------------------------------------------------------------- what cupy refuses


@pytest.mark.parametrize("op", [
    lambda a, h: a + h,
    lambda a, h: h * a,
    lambda a, h: xp.add(a, h),
    lambda a, h: xp.exp(h),
    lambda a, h: xp.where(h > 0, a, 0.0),
    lambda a, h: xp.where(a > 0, h, 0.0),
    lambda a, h: xp.concatenate([a, h]),
    lambda a, h: xp.stack([a, h]),
    lambda a, h: xp.matmul(a, h.T),
    lambda a, h: a @ h.T,
    lambda a, h: a.__setitem__(slice(0, 2), h),
    lambda a, h: a.__setitem__(np.array([0, 1]), h),
    lambda a, h: xp.maximum(a, h),
])
def test_host_arrays_are_refused_inside_device_ops(a, op):
    host = np.ones((2, 3), np.float32)
    with pytest.raises(HostArrayError, match="host numpy array"):
        op(a, host)


def test_implicit_numpy_conversion_is_refused(a):
    with pytest.raises(TypeError, match="implicit conversion"):
        np.asarray(a)
    with pytest.raises(TypeError, match="implicit conversion"):
        np.float32(a)


def test_what_cupy_accepts(a):
    host_idx = np.array([1, 0])
    assert isinstance(a[host_idx], StrictArray) and a[host_idx].shape == (2, 3)  # host index arrays
    assert a[[1]].shape == (1, 3) and a[:, 1:].shape == (2, 2)
    b = a * np.float32(2.0) + 1.0  # numpy and Python scalars
    a[0] = xp.zeros(3, dtype=np.float32)  # device values
    a[1, 0] = 7.0  # scalars
    assert isinstance(np.concatenate([a, b]), StrictArray)  # numpy functions dispatch to the device module
    assert isinstance(xp.asarray(np.ones(3)), StrictArray)  # host -> device copy is allowed
    assert ops.array_module(a) is xp


def test_host_to_device_copies_do_not_alias():
    h = np.zeros(3, np.float32)
    d = xp.asarray(h)
    h[0] = 5.0
    assert xp.asnumpy(d)[0] == 0.0


# ---------------------------------------------------------------------------- what is counted


def test_every_device_to_host_transfer_is_counted(a):
    with count_transfers() as n:
        s = a.sum()  # a 0-d device array, as in cupy: no transfer yet
        assert isinstance(s, StrictArray) and n.count == 0
        float(s)
        int(a[0, 1])
        bool(a[0, 0] > 0)
        a.max().item()
        a.tolist()
        a.get()
        xp.asnumpy(a)
        make_backend("strict").to_numpy(a)
        xp.nonzero(a > 1)
        a[a > 1]  # boolean mask: its size is read on the host
    assert n.count == 10, n.sites
    assert all("test_strict.py" in s for s in n.sites)


def test_device_only_work_is_not_counted(a):
    with count_transfers() as n:
        b = xp.exp(a) @ a.T
        b = xp.where(b > 1, b, 0.0)
        c = xp.concatenate([b, b], axis=0)[np.array([0, 3])]
        c += 1.0
        ops.softmax(c)
    assert n.count == 0, n.sites


# ---------------------------------------------------------------------------- ops on the device


def test_attention_masks_from_host_positions_run_on_the_device():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((3, 4, 8), (7, 2, 8), (7, 2, 8)))
    qp, kp = np.arange(4, 7), np.arange(7)
    ref = ops.attention(q, k, v, qp, kp, causal=True, sliding_window=4)
    with count_transfers() as n:
        got = ops.attention(xp.asarray(q), xp.asarray(k), xp.asarray(v), qp, kp, causal=True, sliding_window=4)
        bias = ops.attention_bias(qp, kp, causal=True, sliding_window=4, xp=xp)
        out = ops.attention(xp.asarray(q), xp.asarray(k), xp.asarray(v), causal=False, bias=bias)
    assert n.count == 0, n.sites
    np.testing.assert_allclose(xp.asnumpy(got), ref, atol=1e-6, rtol=0)
    np.testing.assert_allclose(xp.asnumpy(out), ref, atol=1e-6, rtol=0)
    assert ops.attention_bias(np.array([6]), kp, causal=True, xp=xp) is None  # sees every key: no bias


def test_rope_cache_reads_nothing_back():
    freqs = ops.rope_freqs(8, xp=xp)
    cache = ops.RopeCache(freqs)
    with count_transfers() as n:
        c, s = cache(np.array([3, 4, 300]))
    assert n.count == 0, n.sites
    rc, rs = ops.rope_cos_sin(ops.rope_freqs(8), np.array([3, 4, 300]))
    np.testing.assert_allclose(xp.asnumpy(c), rc, atol=1e-6)
    np.testing.assert_allclose(xp.asnumpy(s), rs, atol=1e-6)


@pytest.mark.parametrize("n_tok", [1, 3, 40])
@pytest.mark.parametrize("gated", [True, False])
def test_moe_on_the_device_matches_the_host_and_reads_back_at_most_once(n_tok, gated):
    rng = np.random.default_rng(n_tok)
    n_exp, e, ff, k = 8, 16, 12, 3
    x = rng.standard_normal((n_tok, e)).astype(np.float32)
    logits = rng.standard_normal((n_tok, n_exp)).astype(np.float32)
    gate = rng.standard_normal((n_exp, ff, e)).astype(np.float32) if gated else None
    up = rng.standard_normal((n_exp, ff, e)).astype(np.float32)
    down = rng.standard_normal((n_exp, e, ff)).astype(np.float32)
    route = ops.moe_route(logits, k, norm_topk=True)
    # independent expectation: every token's k experts run one by one
    expect = np.zeros((n_tok, e), np.float32)
    for t in range(n_tok):
        for j in range(k):
            ex = route.ids[t, j]
            h = up[ex] @ x[t]
            h = ops.silu(gate[ex] @ x[t]) * h if gated else ops.silu(h)
            expect[t] += route.weights[t, j] * (down[ex] @ h)
    dev = ops.moe_route(xp.asarray(logits), k, norm_topk=True)
    with count_transfers() as n:
        got = ops.moe_ffn(xp.asarray(x), dev, None if gate is None else xp.asarray(gate), xp.asarray(up),
                          xp.asarray(down), act="silu")
    assert n.count == (0 if n_tok * k <= ops.moe.GATHER_MAX_PAIRS else 1), n.sites
    np.testing.assert_allclose(xp.asnumpy(got), expect, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(ops.moe_ffn(x, route, gate, up, down, act="silu"), expect, atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------------------- every architecture


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "nemotron_h", "nemotron_h_moe",
                                  "toy-recurrent"])
def test_a_decode_step_reads_back_one_thing(tmp_path, arch):
    """Through the real generation loop on the strict backend: exactly one transfer per token (the logits row)."""
    import plinth

    bench = load_module(ROOT / "benchmarks" / "bench_host_syncs.py")
    path, reg = bench.write_target(tmp_path, arch)
    model = plinth.load_model(path, backend="strict", registry=reg)
    assert model.backend.name == "strict"
    counts = decode_step_transfers(model, [3, 17, 42, 8, 23], n_steps=4)
    assert counts and all(c == 1 for c in counts), counts

"""Attention over a typed K/V cache (:mod:`plinth.ops.attend_q`, its vector kernel and its plain loops):
against plain attention over the dequantized rows (gguf-py's dequantization is the oracle of
:mod:`plinth.kvtypes`), with and without the rotation, and a row's bits alone against the same row in
batches with random neighbours (``tests/test_attend_qsimd.py``: the vector kernel bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest

from plinth import kvtypes, ops
from plinth.ops.attend_q import attention_rows_q

TYPES = ["f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]


def _seq(rng, n, n_head_kv, hd, hd_v, kc, vc):
    k = rng.standard_normal((n, n_head_kv, hd)).astype(np.float32)
    k[:, :, 3] *= 8.0  # an outlier channel
    v = rng.standard_normal((n, n_head_kv, hd_v)).astype(np.float32)
    kb = kc.encode(k) if kc else k
    vb = vc.encode(v) if vc else v
    kd = kc.decode(kb, hd) if kc else k
    vd = vc.decode(vb, hd_v) if vc else v
    return np.ascontiguousarray(kb), np.ascontiguousarray(vb), kd, vd


def _table(groups):
    return np.array([(s, e, n, kb.ctypes.data, vb.ctypes.data, b.ctypes.data if b is not None else 0)
                     for s, e, n, kb, vb, b in groups], dtype=np.int64)


@pytest.mark.parametrize("kt,vt,rot", [(t, t, False) for t in TYPES] + [("q8_0", "q8_0", True), ("q4_0", "q4_0", True),
                                                                      ("q8_0", "f32", True), ("f32", "q4_1", True)])
@pytest.mark.parametrize("plain", [False, True], ids=["vector", "plain"])
def test_against_dequantized(kt, vt, rot, plain):
    rng = np.random.default_rng(7)
    types = kvtypes.CacheTypes(k=kt, v=vt, rotate=rot)
    n_head, n_head_kv, hd = 6, 2, 64
    kc, vc = types.codec("k", (n_head_kv, hd)), types.codec("v", (n_head_kv, hd))
    assert bool(kc and kc.rot) == (rot and kt != "f32") and bool(vc and vc.rot) == (rot and vt != "f32")
    n = 45
    kb, vb, kd, vd = _seq(rng, n, n_head_kv, hd, hd, kc, vc)
    q = rng.standard_normal((3, n_head, hd)).astype(np.float32)
    pos = np.arange(n - 3, n)
    bias = ops.attention_bias(pos, np.arange(n), causal=True)
    bias = np.ascontiguousarray(bias, dtype=np.float32)
    got = attention_rows_q(q, _table([(0, 3, n, kb, vb, bias)]), n_head_kv, hd, kc, vc, 0.125, plain=plain)
    want = ops.attention(q, kd, vd, q_pos=pos, k_pos=np.arange(n), scale=0.125)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # the soft-cap and no bias
    got = attention_rows_q(q, _table([(0, 3, n, kb, vb, None)]), n_head_kv, hd, kc, vc, 0.125, soft_cap=5.0,
                           plain=plain)
    want = ops.attention(q, kd, vd, scale=0.125, causal=False, soft_cap=5.0)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_rotation_helps_outliers():
    """The reason for the rotation: keys with an outlier channel lose less in q4_0 when turned first."""
    rng = np.random.default_rng(3)
    k = rng.standard_normal((256, 1, 64)).astype(np.float32)
    k[:, :, 5] = 30.0 + rng.standard_normal((256, 1))
    errs = []
    for rot in (False, True):
        c = kvtypes.CacheTypes(k="q4_0", rotate=rot).codec("k", (1, 64))
        errs.append(float(np.abs(c.decode(c.encode(k), 64) - k).mean()))
    assert errs[1] < 0.6 * errs[0]


@pytest.mark.parametrize("kt", ["q8_0", "q4_0", "f16"])
@pytest.mark.parametrize("plain", [False, True], ids=["vector", "plain"])
def test_row_bits_do_not_depend_on_the_batch(kt, plain):
    rng = np.random.default_rng(11)
    n_head, n_head_kv, hd = 9, 3, 64
    types = kvtypes.CacheTypes(k=kt, v=kt)
    kc, vc = types.codec("k", (n_head_kv, hd)), types.codec("v", (n_head_kv, hd))
    n, n0 = 120, 70  # the buffers' rows; keys before the row
    kb, vb, _, _ = _seq(rng, n, n_head_kv, hd, hd, kc, vc)
    q0 = rng.standard_normal((1, n_head, hd)).astype(np.float32)
    alone = attention_rows_q(q0, _table([(0, 1, n0 + 1, kb, vb, None)]), n_head_kv, hd, kc, vc, 0.125, plain=plain)
    keep = [kb, vb]
    for m in (1, 2, 5, 16, 33):
        # row 0 of a verify batch of 1 + m rows (the later rows' keys masked for it) beside another sequence
        qs = [q0[0]] + [rng.standard_normal((n_head, hd)).astype(np.float32) for _ in range(m)]
        n_kv = n0 + 1 + m
        pos = np.arange(n0, n0 + 1 + m)
        bias = np.ascontiguousarray(ops.attention_bias(pos, np.arange(n_kv), causal=True), dtype=np.float32)
        groups = []
        other = rng.integers(5, 60)
        kb2, vb2, _, _ = _seq(rng, other, n_head_kv, hd, hd, kc, vc)
        keep += [kb2, vb2, bias]
        qn = rng.standard_normal((2, n_head, hd)).astype(np.float32)
        groups.append((0, 2, other, kb2, vb2, None))
        groups.append((2, 3 + m, n_kv, kb, vb, bias))
        q = np.concatenate([qn, np.stack(qs)])
        got = attention_rows_q(q, _table(groups), n_head_kv, hd, kc, vc, 0.125, plain=plain)
        np.testing.assert_array_equal(got[2].view(np.uint32), alone[0].view(np.uint32))

"""The vector kernel of attention over a typed K/V cache (plinth.ops.attend_qsimd, through
plinth.ops.attend_q.attention_rows_q): bit for bit the float32 vector kernel's result over the rows
gguf-py dequantizes, near a float64 reference and the plain typed kernel, and a row's bits independent
of its batch (1..256 rows, random neighbours, other sequences, thread splits)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from plinth import kvtypes
from plinth.ops.attend_q import attention_rows_q, attention_table_qv, task_address, vector_suits

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
GGUF_TYPE = {"bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1}
TYPES = ["f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
#: n_head, n_head_kv, head size: SmolLM2-135M, Gemma-3-270M, a one-head-a-kv-head model
SHAPES = [(9, 3, 64), (4, 1, 256), (2, 2, 128)]


def _compiled():
    from plinth.ops._xp import compiled_ops

    c = compiled_ops()
    if c is None:
        pytest.skip("the compiled kernels are off here")
    return c


def _oracle_rows(b: np.ndarray, name: str, n: int) -> np.ndarray:
    """Stored rows [..., bytes] as gguf-py dequantizes them (f16: numpy's half; f32: the bytes)."""
    flat = np.ascontiguousarray(b).reshape(-1, b.shape[-1])
    if name == "f32":
        out = flat.view(np.float32)
    elif name == "f16":
        out = flat.view(np.float16).astype(np.float32)
    else:
        out = np.asarray(gguf.quants.dequantize(flat, GGUF_TYPE[name]), dtype=np.float32)
    return np.ascontiguousarray(out.reshape(b.shape[:-1] + (n,)))


def _store(rng, n, n_head_kv, hd, codec):
    x = rng.standard_normal((n, n_head_kv, hd)).astype(np.float32)
    x[:, :, 3] *= 8.0  # an outlier channel
    return np.ascontiguousarray(codec.encode(x)) if codec else x


def _causal_bias(pos: np.ndarray, n_kv: int) -> np.ndarray:
    """[len(pos), n_kv] float32: 0 where key j <= the row's position, else -inf."""
    return np.where(np.arange(n_kv)[None, :] <= pos[:, None], 0.0, -np.inf).astype(np.float32)


def _table(groups):
    return np.array([(s, e, n, kb.ctypes.data, vb.ctypes.data, b.ctypes.data if b is not None else 0)
                     for s, e, n, kb, vb, b in groups], dtype=np.int64)


def _reference(q, k, v, scale, vis):
    """float64 softmax attention (grouped heads); vis [n_q, n_kv] bool; a row that sees nothing gives zeros."""
    n_q, n_head, _ = q.shape
    n_head_kv = k.shape[1]
    g = n_head // n_head_kv
    out = np.zeros((n_q, n_head, v.shape[2]))
    for i in range(n_q):
        keep = np.flatnonzero(vis[i])
        if not len(keep):
            continue
        for h in range(n_head):
            s = k[keep, h // g].astype(np.float64) @ q[i, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[i, h] = p @ v[keep, h // g].astype(np.float64) / p.sum()
    return out


def _case(kt, vt, rot, shape, n, n_q, seed):
    rng = np.random.default_rng(seed)
    n_head, n_head_kv, hd = shape
    types = kvtypes.CacheTypes(k=kt, v=vt, rotate=rot)
    kc, vc = types.codec("k", (n_head_kv, hd)), types.codec("v", (n_head_kv, hd))
    kb, vb = _store(rng, n, n_head_kv, hd, kc), _store(rng, n, n_head_kv, hd, vc)
    q = rng.standard_normal((n_q, n_head, hd)).astype(np.float32)
    return q, kc, vc, kb, vb


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kt,vt,rot", [(t, t, False) for t in TYPES] + [(t, t, True) for t in TYPES[2:]]
                         + [("q8_0", "f32", True), ("f32", "q4_1", True), ("f16", "q8_0", True)])
def test_bits_of_the_float_kernel_over_gguf_rows(kt, vt, rot, shape):
    """The typed kernel's output is, bit for bit, the float32 vector kernel's over gguf-py's dequantized
    rows (in the cache's rotated space, the queries turned in and the outputs back as the kernel does);
    and near a float64 reference in the model's space and the plain typed kernel."""
    c = _compiled()
    n_head, n_head_kv, hd = shape
    if not vector_suits(hd, hd, None):
        pytest.skip("head size not taken by the vector kernel on this host")
    for n, seed in ((1, 1), (13, 2), (16, 3), (45, 4), (300, 5)):
        n_q = min(3, n)
        q, kc, vc, kb, vb = _case(kt, vt, rot, shape, n, n_q, seed)
        pos = np.arange(n - n_q, n)
        bias = _causal_bias(pos, n)
        table = _table([(0, n_q, n, kb, vb, bias)])
        got = attention_rows_q(q, table, n_head_kv, hd, kc, vc, 0.125)
        # the float32 kernel over gguf-py's rows, in the stored (rotated) space
        kd, vd = _oracle_rows(kb, kt, hd), _oracle_rows(vb, vt, hd)
        kr, vr = (kc.rot if kc else 0), (vc.rot if vc else 0)
        qr = np.ascontiguousarray(kvtypes.rotate(q, kr), dtype=np.float32)
        out = np.empty((n_q, n_head, hd), np.float32)
        c.attention_groups(qr, _table([(0, n_q, n, kd, vd, bias)]), n_head_kv, hd, 0.125, 0.0, out, 1)
        want = kvtypes.rotate(out, vr)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{n} keys"
        # a float64 reference in the model's space, and the plain typed kernel
        vis = np.isfinite(bias)
        ref = _reference(q, kvtypes.rotate(kd, kr), kvtypes.rotate(vd, vr), 0.125, vis)
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
        plain = attention_rows_q(q, table, n_head_kv, hd, kc, vc, 0.125, plain=True)
        np.testing.assert_allclose(got, plain, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kt", ["q8_0", "f16", "q4_0", "q5_1"])
def test_row_bits_do_not_depend_on_the_batch(kt):
    """A decode row alone, then the same row at a random place of a verify batch of 1..256 rows (random
    queries around it, the later rows' keys masked for it) beside other sequences with random rows, over
    several thread splits: the same bits."""
    _compiled()
    rng = np.random.default_rng(5)
    n_head, n_head_kv, hd = 9, 3, 64
    if not vector_suits(hd, hd, None):
        pytest.skip("head size not taken by the vector kernel on this host")
    types = kvtypes.CacheTypes(k=kt, v=kt)
    kc, vc = types.codec("k", (n_head_kv, hd)), types.codec("v", (n_head_kv, hd))
    n_cap = 40 + 256
    kb, vb = _store(rng, n_cap, n_head_kv, hd, kc), _store(rng, n_cap, n_head_kv, hd, vc)
    row = rng.standard_normal((n_head, hd)).astype(np.float32)
    fn = task_address()
    keep = []
    for m in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 100, 255, 256):
        at = int(rng.integers(m))
        n0 = 40 - at  # keys before the batch: the row sits at position 40 every time
        n_kv = n0 + m
        alone_q = np.ascontiguousarray(kvtypes.rotate(row[None], kc.rot), dtype=np.float32)
        alone = np.empty((1, n_head, hd), np.float32)
        attention_table_qv(fn, alone_q, _table([(0, 1, 41, kb, vb, None)]), n_head_kv, hd, kc.type.code,
                           vc.type.code, kc.type.row_bytes(hd), vc.type.row_bytes(hd), 0.125, alone, 1)
        q = (rng.standard_normal((m, n_head, hd)) * rng.choice([0.01, 1.0, 30.0], (m, 1, 1))).astype(np.float32)
        q[at] = row
        bias = _causal_bias(np.arange(n0, n_kv), n_kv)
        other = int(rng.integers(1, 70))
        kb2, vb2 = _store(rng, other, n_head_kv, hd, kc), _store(rng, other, n_head_kv, hd, vc)
        n2 = int(rng.integers(1, 4))
        q2 = rng.standard_normal((n2, n_head, hd)).astype(np.float32)
        keep += [bias, kb2, vb2]
        qs = np.ascontiguousarray(kvtypes.rotate(np.concatenate([q2, q]), kc.rot), dtype=np.float32)
        table = _table([(0, n2, other, kb2, vb2, None), (n2, n2 + m, n_kv, kb, vb, bias)])
        for threads in (1, 2, 7):
            out = np.empty((n2 + m, n_head, hd), np.float32)
            attention_table_qv(fn, qs, table, n_head_kv, hd, kc.type.code, vc.type.code, kc.type.row_bytes(hd),
                               vc.type.row_bytes(hd), 0.125, out, threads)
            assert np.array_equal(out[n2 + at].view(np.uint32), alone[0].view(np.uint32)), \
                f"{kt}: the row's bits changed in a batch of {m} (row {at}, {threads} threads)"


def test_window_and_rows_that_see_nothing():
    """Leading masked keys (a sliding window: whole value blocks of weight 0 are not unpacked) and a row
    that sees no key (zeros): the float32 kernel's bits over gguf-py's rows."""
    c = _compiled()
    rng = np.random.default_rng(9)
    n_head, n_head_kv, hd, n = 4, 1, 256, 200
    if not vector_suits(hd, hd, None):
        pytest.skip("head size not taken by the vector kernel on this host")
    types = kvtypes.CacheTypes(k="q8_0", v="q4_0", rotate=False)
    kc, vc = types.codec("k", (n_head_kv, hd)), types.codec("v", (n_head_kv, hd))
    kb, vb = _store(rng, n, n_head_kv, hd, kc), _store(rng, n, n_head_kv, hd, vc)
    q = rng.standard_normal((3, n_head, hd)).astype(np.float32)
    bias = np.zeros((3, n), np.float32)
    bias[0, :150] = -np.inf  # a window of the last 50 keys
    bias[1, :] = -np.inf  # sees nothing
    bias[2, 7:100] = -np.inf  # a hole
    got = attention_rows_q(q, _table([(0, 3, n, kb, vb, bias)]), n_head_kv, hd, kc, vc, 0.0625)
    kd, vd = _oracle_rows(kb, "q8_0", hd), _oracle_rows(vb, "q4_0", hd)
    out = np.empty_like(got)
    c.attention_groups(q, _table([(0, 3, n, kd, vd, bias)]), n_head_kv, hd, 0.0625, 0.0, out, 1)
    assert np.array_equal(got.view(np.uint32), out.view(np.uint32))
    assert not got[1].any()
    np.testing.assert_allclose(got, _reference(q, kd, vd, 0.0625, np.isfinite(bias)), rtol=2e-5, atol=2e-5)


def test_eight_lane_form_matches_the_reference():
    """The AVX2 form (8 lanes: other chunks of each block, another reduction tree) compiled here too, every
    type, against a float64 reference over gguf-py's rows."""
    _compiled()
    from numba import njit

    from plinth.ops.attend_qsimd import make_attend, scratch_floats

    attend8 = make_attend(8)

    @njit
    def run(q, kb, vb, kbytes, vbytes, kcode, vcode, hd, bias, out):
        n_q, n_head, _ = q.shape
        n_kv, n_head_kv = kb.shape[0], kb.shape[1]
        g = n_head // n_head_kv
        scratch = np.empty(scratch_floats(n_kv, g, hd, hd, 8), np.float32)
        for i in range(n_q):
            for hk in range(n_head_kv):
                attend8(q.ctypes.data + (i * n_head + hk * g) * hd * 4, g, hd, kb.ctypes.data + hk * kbytes,
                        vb.ctypes.data + hk * vbytes, n_kv, n_head_kv * kbytes, n_head_kv * vbytes, hd, hd,
                        np.float32(1 / np.sqrt(hd)), bias.ctypes.data + i * n_kv * 4, scratch.ctypes.data,
                        out.ctypes.data + (i * n_head + hk * g) * hd * 4, hd, kcode, vcode, kbytes, vbytes)

    for t in TYPES:
        for shape, n in (((6, 2, 32), 21), ((4, 1, 64), 40)):
            q, kc, vc, kb, vb = _case(t, t, False, shape, n, 2, 3)
            hd = shape[2]
            vis = np.ones((2, n), bool)
            vis[0, n - 1:] = False
            vis[1, :5] = False
            bias = np.where(vis, 0.0, -np.inf).astype(np.float32)
            out = np.empty(q.shape, np.float32)
            run(q, kb, vb, kc.type.row_bytes(hd), vc.type.row_bytes(hd), kc.type.code, vc.type.code, hd, bias, out)
            ref = _reference(q, _oracle_rows(kb, t, hd), _oracle_rows(vb, t, hd), 1 / math.sqrt(hd), vis)
            np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6, err_msg=t)

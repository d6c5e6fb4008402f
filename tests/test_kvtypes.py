"""K/V cache storage types against gguf-py's quantize / dequantize (the oracle; the cache's fitted q4_0 / q5_0
scales against gguf-py's decoding and the reference coding's error), float16 bits against numpy, and the
Hadamard rotation against the matrix llama.cpp builds."""

from __future__ import annotations

import numpy as np
import pytest

from plinth import kvtypes
from plinth.errors import UserError

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

GGUF_TYPE = {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0,
             "q5_1": Q.Q5_1}


def _rows(rng, n_rows=64, n=128):
    x = rng.standard_normal((n_rows, n)).astype(np.float32)
    x[0] = 0.0  # a zero block: scale 0
    x[1, :32] = 7.0  # a constant block (the _1 types: d = 0)
    x[2, 5] = 40.0  # an outlier
    x[3] *= 1e-6  # tiny values (float16 subnormal scales)
    x[4] *= 3e4  # large ones
    x[5, :32] = -x[5, :32].__abs__()  # all negative
    x[6, 3], x[6, 9] = 2.0, -2.0  # a tie of magnitudes (the first sets q4_0's scale)
    return x


@pytest.mark.parametrize("name", list(GGUF_TYPE))
def test_encode_decode_bit_exact(name):
    rng = np.random.default_rng(1)
    x = _rows(rng)
    t = kvtypes.cache_type(name)
    mine = kvtypes.encode(x, t)
    ref = np.asarray(gguf.quants.quantize(x, GGUF_TYPE[name])).view(np.uint8).reshape(x.shape[0], -1)
    assert mine.shape == ref.shape == (x.shape[0], t.row_bytes(x.shape[1]))
    np.testing.assert_array_equal(mine, ref)
    back = kvtypes.decode(mine, t, x.shape[1])
    want = gguf.quants.dequantize(ref, GGUF_TYPE[name]).astype(np.float32)
    np.testing.assert_array_equal(back.view(np.uint32), want.reshape(back.shape).view(np.uint32))


@pytest.mark.parametrize("name", ["q4_0", "q5_0"])
def test_fitted_scales_keep_the_layout_and_never_lose(name):
    """What the cache stores (``fit``): q4_0 / q5_0 blocks in the same layout (gguf-py decodes them to what
    plinth does), each block's squared error at most the reference coding's, smaller on most blocks of
    Gaussian rows and of rows with an outlier channel; a block the reference coding wins keeps its bytes;
    the other types are unaffected."""
    rng = np.random.default_rng(3)
    x = np.concatenate([_rows(rng), rng.standard_normal((64, 128)).astype(np.float32) * np.float32(0.3)])
    x[70:, 5] *= 9.0  # an outlier channel
    t = kvtypes.cache_type(name)
    ref, fit = kvtypes.encode(x, t), kvtypes.encode(x, t, fit=True)
    assert fit.shape == ref.shape
    back = kvtypes.decode(fit, t, x.shape[1])
    want = gguf.quants.dequantize(fit, GGUF_TYPE[name]).astype(np.float32).reshape(back.shape)
    np.testing.assert_array_equal(back.view(np.uint32), want.view(np.uint32))
    x64 = x.astype(np.float64)
    e_ref = ((kvtypes.decode(ref, t, x.shape[1]) - x64) ** 2).reshape(-1, 32).sum(1)
    e_fit = ((back - x64) ** 2).reshape(-1, 32).sum(1)
    ok = np.isfinite(e_ref)  # (the rows of 3e4: beyond float16, as in the reference)
    assert np.all(e_fit[ok] <= e_ref[ok] * (1 + 1e-6) + 1e-30)
    assert (e_fit[ok] < e_ref[ok]).mean() > 0.5 and e_fit[ok].sum() < 0.97 * e_ref[ok].sum()
    size = t.row_bytes(32)
    same = (e_fit == e_ref)
    blocks_ref, blocks_fit = ref.reshape(-1, size), fit.reshape(-1, size)
    np.testing.assert_array_equal(blocks_fit[same], blocks_ref[same])
    assert np.array_equal(back[0], np.zeros(x.shape[1], np.float32))  # a zero block stays zero
    # a row's bytes do not depend on the other rows
    np.testing.assert_array_equal(kvtypes.encode(x[70:71], t, fit=True), fit[70:71])
    for other in ("q8_0", "q4_1", "q5_1", "f16", "bf16"):
        np.testing.assert_array_equal(kvtypes.encode(x, other, fit=True), kvtypes.encode(x, other))


def test_the_cache_stores_fitted_blocks():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 2, 64)).astype(np.float32)
    codec = kvtypes.Codec(kvtypes.cache_type("q4_0"), 64)
    np.testing.assert_array_equal(codec.encode(x), kvtypes.encode(kvtypes.rotate(x, 64), "q4_0", fit=True))


def test_f16_bits_against_numpy():
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    edge = np.array([0x477FEFFF, 0x477FF000, 0x38800000, 0x387FFFFF, 0x33000000, 0x33000001, 0x32FFFFFF,
                     0x7F800000, 0xFF800000, 0x80000000, 0], dtype=np.uint32)
    v = np.concatenate([bits, edge]).view(np.float32)
    v = v[~np.isnan(v)]
    got = kvtypes.encode(v[:, None], "f16")[:, :2].copy().view(np.uint16).ravel()
    np.testing.assert_array_equal(got, v.astype(np.float16).view(np.uint16))
    h = np.arange(65536, dtype=np.uint16)
    h = h[~np.isnan(h.view(np.float16))]
    back = kvtypes.decode(h.view(np.uint8).reshape(-1, 2), "f16", 1).ravel()
    np.testing.assert_array_equal(back, h.view(np.float16).astype(np.float32))


def test_hadamard_matches_llama_cpp_and_rotation():
    for n in (64, 128, 256):
        h = kvtypes.hadamard(n)
        np.testing.assert_allclose(h @ h, np.eye(n), atol=1e-6)
        assert np.all(np.abs(np.abs(h) - h[0, 0]) == 0) and h[0, 0] == np.float32(1.0 / np.sqrt(np.float32(n)))
        x = np.random.default_rng(n).standard_normal((5, 2 * n)).astype(np.float32)
        r = kvtypes.rotate(x, n)
        np.testing.assert_allclose(r, (x.reshape(-1, n) @ h).reshape(x.shape), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(kvtypes.rotate(r, n), x, rtol=1e-5, atol=1e-5)
        # a row's bits do not depend on the other rows
        np.testing.assert_array_equal(kvtypes.rotate(x[2:3], n), r[2:3])


def test_rotation_sizes_and_switch(monkeypatch):
    q8, f16 = kvtypes.cache_type("q8_0"), kvtypes.cache_type("f16")
    assert kvtypes.k_rotation(q8, 64) == 64 and kvtypes.k_rotation(q8, 256) == 256
    assert kvtypes.k_rotation(q8, 192) == 64 and kvtypes.k_rotation(q8, 96) == 0
    assert kvtypes.k_rotation(f16, 128) == 0
    assert kvtypes.v_rotation(q8, 256) == 64 and kvtypes.v_rotation(q8, 32) == 0
    monkeypatch.setenv("PLINTH_ATTN_ROT_DISABLE", "1")
    assert kvtypes.k_rotation(q8, 64) == 0 and kvtypes.v_rotation(q8, 64) == 0
    assert kvtypes.CacheTypes(k="q8_0").codec("k", (3, 128), always_rotate=True).rot == 128
    monkeypatch.setenv("PLINTH_ATTN_ROT_DISABLE", "yes")
    with pytest.raises(UserError, match="PLINTH_ATTN_ROT_DISABLE"):
        kvtypes.rotation_disabled()


def test_unknown_type_refused():
    with pytest.raises(UserError, match="unknown cache type 'q6_k'"):
        kvtypes.cache_type("q6_k")
    with pytest.raises(UserError, match="multiples of 32"):
        kvtypes.CacheTypes(k="q8_0").codec("k", (2, 48))

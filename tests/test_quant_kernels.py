"""Quantized weights (plinth.quant): kernel products against gguf-py's dequantizer, per type.

Oracle: ``gguf.quants.dequantize`` (gguf-py, an independent implementation of the block
formats) times x in float64. The f32-activation kernels must agree within 1e-5 relative
(max abs error over max abs reference) for decode-sized (1..16 rows, the block kernels)
and prompt-sized batches (dequantized tiles into BLAS). The int8-activation kernels quantize
x per 32 values as gguf-py's Q8_0 quantizer does (checked against it) and must then agree
within 1e-5 with the dequantized weight times the dequantized activations.
"""

from __future__ import annotations

import sys

import gguf
import numpy as np
import pytest

import plinth.quant as quant
from plinth.errors import UserError
from plinth.gguf.constants import GGMLType
from plinth.quant import QuantWeight, simd
from plinth.testing import quantized_rows

N_OUT, N_IN = 70, 512  # 70 rows: not a multiple of any thread split
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "NVFP4", "F16", "BF16"]


def _packed(type_name: str, seed: int = 0) -> np.ndarray:
    """A [N_OUT, row_bytes] tensor of the type: gguf-py's quantizer where it has one, else random
    blocks with O(1) f16 super-block scales (gguf-py cannot quantize K-quants)."""
    return quantized_rows(type_name, N_OUT, N_IN, seed)


def _reference(raw: np.ndarray, type_name: str) -> np.ndarray:
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return np.asarray(w, dtype=np.float64).reshape(N_OUT, N_IN)


def _rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(y.astype(np.float64) - ref).max() / np.abs(ref).max())


@pytest.fixture
def f32_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The f32-activation kernels (as with PLINTH_INT8=0 or a CPU without AVX2)."""
    monkeypatch.setitem(quant._state, "i8", False)


needs_int8 = pytest.mark.skipif(quant.compiled_i8() is None, reason="int8 kernels off here (no AVX2/F16C or numba)")
I8_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("kernel_rows", [quant.F32_KERNEL_MAX_ROWS, 16])  # the kernels also at larger m
def test_kernel_product_matches_gguf_dequantizer(type_name: str, kernel_rows: int, monkeypatch,
                                                 f32_activations) -> None:
    monkeypatch.setattr(quant, "KERNEL_MAX_ROWS", kernel_rows)
    monkeypatch.setattr(quant, "F32_KERNEL_MAX_ROWS", kernel_rows)
    raw = _packed(type_name)
    ref_w = _reference(raw, type_name)
    w = QuantWeight(raw, int(GGMLType[type_name]), (N_OUT, N_IN))
    rng = np.random.default_rng(1)
    for m in (1, 3, 8, 16, 40):  # block kernels up to KERNEL_MAX_ROWS, tiles + BLAS beyond
        x = rng.standard_normal((m, N_IN)).astype(np.float32)
        y = w.matmul(x)
        assert y.shape == (m, N_OUT) and y.dtype == np.float32
        err = _rel_err(y, x.astype(np.float64) @ ref_w.T)
        assert err < 1e-5, f"{type_name} m={m}: relative error {err:.2e}"
    rows = np.array([5, 0, 69, 5])
    assert np.array_equal(w.take(rows), ref_w[rows].astype(np.float32))
    assert np.array_equal(np.asarray(w), ref_w.astype(np.float32))


def _q8_round_trip(x: np.ndarray) -> np.ndarray:
    """x as the int8 kernels see it: quantized per 32 values and back (float64)."""
    k8 = quant.compiled_i8()
    m, n = x.shape
    xq, xdt = np.empty((m, n), np.int8), np.empty((n // 32, m), np.float32)
    k8.quantize_rows(x, xq, xdt, np.empty((n // 32, m), np.float32), np.empty((n // 16, m), np.int32))
    return (xq.reshape(m, -1, 32).astype(np.float64) * xdt.T[:, :, None]).reshape(m, n)


@needs_int8
def test_int8_activations_are_gguf_q8_0() -> None:
    """quantize_rows makes the blocks gguf-py's Q8_0 quantizer makes (llama.cpp's activation format;
    it stores the scale as f16, the kernels keep it f32)."""
    k8 = quant.compiled_i8()
    x = (np.random.default_rng(6).standard_normal((5, N_IN)) * 3).astype(np.float32)
    x[1, :32] = 0.0  # an all-zero block
    xq, xdt, xsdt = np.empty((5, N_IN), np.int8), np.empty((N_IN // 32, 5), np.float32), np.empty((N_IN // 32, 5),
                                                                                                     np.float32)
    k8.quantize_rows(x, xq, xdt, xsdt, np.empty((x.shape[1] // 16, x.shape[0]), np.int32))
    xd = xdt.T
    blocks = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(-1, 34)
    ref_d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(5, -1)
    ref_q = blocks[:, 2:].view(np.int8).reshape(5, N_IN)
    assert np.allclose(xd, ref_d, rtol=1e-3, atol=0)
    assert np.abs(xq.astype(int) - ref_q).max() <= 1 and (xq == ref_q).mean() > 0.999
    assert np.array_equal(xsdt.T, xd * xq.reshape(5, -1, 32).sum(-1).astype(np.float32))  # the offset factor


@needs_int8
def test_int8_activations_follow_the_rule_exactly() -> None:
    """The vector quantizer's bytes are numpy's float32 rule to the bit: d = max|x| / 127, q =
    rint(x * (1 / d)) (halves to even, 0 for an all-zero block), the 16-value sums and d * sum(q);
    blocks of zeros, negative zeros, exact halves, tiny and large magnitudes, rows of any count."""
    k8 = quant.compiled_i8()
    rng = np.random.default_rng(23)
    for m, n in ((1, 64), (3, 576), (9, 1536)):
        x = (rng.standard_normal((m, n)) * 10.0 ** rng.uniform(-6, 6, (m, n // 32)).repeat(32, 1)).astype(np.float32)
        x[0, :32] = 0.0
        x[-1, 32:64] = -0.0
        x[0, -32:] = np.arange(32) - np.float32(15.5)  # d = 1 (the 127 below): every product a half
        x[0, -1] = 127.0
        xq, xdt = np.empty((m, n), np.int8), np.empty((n // 32, m), np.float32)
        xsdt, xit = np.empty_like(xdt), np.empty((n // 16, m), np.int32)
        k8.quantize_rows(x, xq, xdt, xsdt, xit)
        blocks = x.reshape(m, -1, 32)
        d = np.abs(blocks).max(-1) / np.float32(127.0)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0.0), np.float32(1.0) / d).astype(np.float32)
        q = np.rint(blocks * inv[..., None]).astype(np.int32)
        assert np.array_equal(xq, q.reshape(m, n).astype(np.int8)), (m, n)
        assert np.array_equal(xdt, d.T)
        assert np.array_equal(xit, q.reshape(m, -1, 16).sum(-1).T)
        assert np.array_equal(xsdt, (d * q.sum(-1).astype(np.float32)).T)


@needs_int8
@pytest.mark.parametrize("type_name", I8_TYPES)
def test_int8_kernel_product_matches_gguf_dequantizer(type_name: str) -> None:
    raw = _packed(type_name, seed=7)
    ref_w = _reference(raw, type_name)
    w = QuantWeight(raw, int(GGMLType[type_name]), (N_OUT, N_IN))
    rng = np.random.default_rng(8)
    for m in (1, 2, 3, 4, 7, 8, 15, 16, 21, quant.KERNEL_MAX_ROWS):  # one row, the row groups and their tails
        x = (rng.standard_normal((m, N_IN)) + 0.5).astype(np.float32)
        y = w.matmul(x)
        assert y.shape == (m, N_OUT) and y.dtype == np.float32
        err = _rel_err(y, _q8_round_trip(x) @ ref_w.T)
        assert err < 1e-5, f"{type_name} m={m}: relative error {err:.2e} against the Q8_0 activations"
        assert _rel_err(y, x.astype(np.float64) @ ref_w.T) < 3e-2  # what the activation rounding costs
    x = rng.standard_normal((quant.KERNEL_MAX_ROWS + 1, N_IN)).astype(np.float32)  # beyond: f32 tiles
    assert _rel_err(w.matmul(x), x.astype(np.float64) @ ref_w.T) < 1e-5


@needs_int8
def test_int8_rows_do_not_depend_on_the_batch() -> None:
    """A row's product is bit for bit the same alone or among others (row groups of 8 or 4 and their
    tails): a verify batch or a server step computes each row as a lone decode would."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((23, N_IN)).astype(np.float32)
    for name in I8_TYPES:
        w = QuantWeight(_packed(name, seed=3), int(GGMLType[name]), (N_OUT, N_IN))
        together = w.matmul(x)
        for r in range(23):
            assert np.array_equal(w.matmul(x[r:r + 1])[0], together[r]), f"{name} row {r}"
        assert np.array_equal(w.matmul(x[5:11]), together[5:11]), name



@needs_int8
@pytest.mark.parametrize("type_name", ["Q4_1", "Q6_K"])
def test_int8_prompt_batches_go_in_tiles_with_the_same_rows(type_name: str) -> None:
    """A prompt batch wider than TILE_BYTES of int8 rows runs in tiles of rows; each row is still
    bit for bit its lone product, and the product is still gguf-py's."""
    k8 = quant.compiled_i8()
    n_in = 4096
    tile = max(64, k8.TILE_BYTES // n_in // 8 * 8)
    m = 2 * tile + 21  # two tiles and a ragged third
    rng = np.random.default_rng(30)
    raw = quantized_rows(type_name, 40, n_in, seed=31)
    w = QuantWeight(raw, int(GGMLType[type_name]), (40, n_in))
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    y = w.matmul(x)
    for r in (0, tile - 1, tile, 2 * tile, m - 1):
        assert np.array_equal(w.matmul(x[r:r + 1])[0], y[r]), f"row {r} of {m} (tiles of {tile})"
    ref_w = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]), np.float64)
    assert _rel_err(y, _q8_round_trip(x) @ ref_w.reshape(40, n_in).T) < 1e-5


@needs_int8
@pytest.mark.skipif(not simd.has_vnni(), reason="no AVX512-VNNI here")
def test_int8_avx2_and_vnni_forms_agree_exactly() -> None:
    """The AVX2 form (pmaddubsw + pmaddwd, what a CPU without VNNI runs) and the VNNI form give the
    same bits: the same integers (no int16 saturation is reachable), then the same float steps."""
    from numba import njit

    k8 = quant.compiled_i8()
    rng = np.random.default_rng(21)
    m = 13
    x = (rng.standard_normal((m, N_IN)) * 4).astype(np.float32)
    x[2, :64] = 127.0  # saturated activations against the largest quants
    xq, xdt, xsdt = np.empty((m, N_IN), np.int8), np.empty((N_IN // 32, m), np.float32), np.empty((N_IN // 32, m),
                                                                                                    np.float32)
    xit = np.empty((N_IN // 16, m), np.int32)
    k8.quantize_rows(x, xq, xdt, xsdt, xit)
    for name in I8_TYPES:
        raw = _packed(name, seed=5)
        if name == "Q8_0":
            raw.reshape(-1, 34)[:, 2:34] = 128  # -128: the |w| = 128 case of the sign trick
        grp = simd.repack(raw, name.lower())
        grp.flags.writeable = False
        outs = []
        for vnni in (True, False):
            gdot = simd.make_group_dot(name.lower(), vnni=vnni)

            @njit
            def run_groups(grp, xq, xdt, xsdt, xit, out, gdot=gdot):
                for g in range(grp.shape[0]):
                    gdot(grp[g], xq, xdt, xsdt, xit, out, 8 * g, 0, xq.shape[0])

            out = np.empty((m, grp.shape[0] * 8), np.float32)
            run_groups(grp, xq, xdt, xsdt, xit, out)
            outs.append(out)
        assert np.array_equal(outs[0], outs[1]), name
        assert not outs[0][:, N_OUT:].any(), name  # the padding rows
        y = QuantWeight(raw, int(GGMLType[name]), (N_OUT, N_IN)).matmul(x)
        assert np.array_equal(y, outs[0][:, :N_OUT]), name  # the compiled kernels are the VNNI form


def _i8_linear_args(specs: list[tuple[str, int, int]], lanes: str, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """``kernels_i8.linear``'s weight arguments for stacked parts (type, rows, seed) of N_IN columns, as the
    weights' first product settles them (``quant._i8_args``) with ``PLINTH_KERNEL_LANES=lanes``."""
    monkeypatch.setenv("PLINTH_KERNEL_LANES", lanes)
    parts = [QuantWeight(quantized_rows(name, n_out, N_IN, seed), int(GGMLType[name]), (n_out, N_IN))
             for name, n_out, seed in specs]
    return quant._i8_args(parts)


@needs_int8
@pytest.mark.skipif(not simd.has_vnni(), reason="no AVX512-VNNI here")
def test_int8_sixteen_lane_form_gives_the_eight_lane_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sixteen-lane loops (two groups of eight weight rows a call, in 512-bit vectors, on the paired
    layout; the types of ``WIDE_KINDS``) give every output the bits of the eight-lane loops: stacked
    parts with an odd last group (which goes alone), every row count of a row group and its tails, a
    tiled prompt batch."""
    k8 = quant.compiled_i8()
    rng = np.random.default_rng(40)
    for name in [t for t in I8_TYPES if t.lower() in simd.WIDE_KINDS]:
        specs = [(name, 200, 1), (name, 64, 2), (name, 24, 3)]  # 25, 8 and 3 groups
        narrow, wide = _i8_linear_args(specs, "8", monkeypatch), _i8_linear_args(specs, "16", monkeypatch)
        assert wide[0][:, 1].all() and not narrow[0][:, 1].any()
        for m in [*range(1, 18), 23, 2 * max(64, k8.TILE_BYTES // N_IN // 8 * 8) + 5]:
            x = (rng.standard_normal((m, N_IN)) * 3).astype(np.float32)
            a, b = np.empty((m, 288), np.float32), np.empty((m, 288), np.float32)
            k8.linear(*narrow, x, a)
            k8.linear(*wide, x, b)
            assert np.array_equal(a, b), f"{name}, {m} rows"


def test_repack_pairs_interleaves_blocks_of_two_groups() -> None:
    """``repack(pairs=True)``: groups 2t and 2t + 1 block by block in one stretch (the first group's block,
    then the second's), an odd last group as the plain layout has it."""
    for name in I8_TYPES:
        raw = _packed(name, seed=7)  # 70 rows: 9 groups
        plain, paired = simd.repack(raw, name.lower()), simd.repack(raw, name.lower(), pairs=True)
        assert paired.shape == plain.shape == (9, plain.shape[1])
        gbs = simd.LAYOUTS[name.lower()][2]
        nb = plain.shape[1] // gbs
        expect = plain[:8].reshape(4, 2, nb, gbs).swapaxes(1, 2).reshape(8, -1)
        assert np.array_equal(paired[:8], expect), name
        assert np.array_equal(paired[8], plain[8]), name


def test_sixteen_lanes_off_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PLINTH_KERNEL_LANES=8`` keeps the eight-lane loops (and the plain layout) on a VNNI host; without
    VNNI there is no sixteen-lane form to ask for."""
    monkeypatch.setenv("PLINTH_KERNEL_LANES", "8")
    assert not simd.wide_available()
    monkeypatch.delenv("PLINTH_KERNEL_LANES")
    assert simd.wide_available() == simd.has_vnni()
    with pytest.raises(ValueError, match="16 lanes for q4_k"):
        simd.kernel_address(int(GGMLType.Q4_K), 16)  # (a K-quant keeps the eight-lane loops)
    if not simd.has_vnni():
        with pytest.raises(ValueError, match="16 lanes"):
            simd.kernel_address(int(GGMLType.Q4_0), 16)


@needs_int8
@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K", "Q4_1"])
def test_precise_products_redo_the_top_values_in_f32(type_name: str, monkeypatch) -> None:
    """A weight marked ``precise`` (the LM head) recomputes each row's values near its maximum from
    f32 activations: those match the f32 product to float rounding, the argmax is the f32 one, the
    rest stay the int8 products, and a row's result is the same alone or in a batch."""
    raw = _packed(type_name, seed=15)
    ref_w = _reference(raw, type_name)
    w = QuantWeight(raw, int(GGMLType[type_name]), (N_OUT, N_IN))
    x = np.random.default_rng(16).standard_normal((9, N_IN))
    x = (x * 4 / np.abs(x @ ref_w.T).max()).astype(np.float32)  # logits of an LM head's size
    ref = x.astype(np.float64) @ ref_w.T
    plain = w.matmul(x)
    w.precise = True
    y = w.matmul(x)
    near = plain >= plain.max(1, keepdims=True) - quant.PRECISE_MARGIN
    assert near.sum() > 9  # a test that recomputes more than the maxima
    assert np.abs(y - ref)[near].max() < 1e-4 * np.abs(ref).max()
    assert np.array_equal(y[~near], plain[~near])
    assert np.array_equal(y.argmax(1), ref.argmax(1))
    for r in (0, 4, 8):
        assert np.array_equal(w.matmul(x[r:r + 1])[0], y[r])
    monkeypatch.setattr(quant, "PRECISE_MAX", 2)  # more near the maximum than that: fewer, the largest
    y2 = w.matmul(x)
    assert np.array_equal(y2.argmax(1), ref.argmax(1)) and (y2 != plain).sum(1).max() <= 2


@needs_int8
def test_int8_output_rows_of_4k_are_padded() -> None:
    """A product with a multiple of 1024 outputs (an LM head) goes to rows ``ROW_PAD`` floats longer,
    returned as a view of the first columns: the same values (against gguf-py's dequantizer), the
    precise head's refinement confined to them, a row the same alone or in the batch."""
    n_out, n_in = 2048, 64
    raw = quantized_rows("Q8_0", n_out, n_in, 21)
    ref_w = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0), np.float64).reshape(n_out, n_in)
    w = QuantWeight(raw, int(GGMLType.Q8_0), (n_out, n_in))
    x = np.random.default_rng(22).standard_normal((9, n_in)).astype(np.float32)
    y = w.matmul(x)
    assert y.shape == (9, n_out) and y.strides[0] == 4 * (n_out + quant.ROW_PAD)
    assert _rel_err(y, _q8_round_trip(x) @ ref_w.T) < 1e-5
    w.precise = True
    yp = w.matmul(x)
    assert np.array_equal(yp.argmax(1), (x.astype(np.float64) @ ref_w.T).argmax(1))
    for r in (0, 8):
        alone = w.matmul(x[r:r + 1])
        assert alone.flags.c_contiguous and np.array_equal(alone[0], yp[r])


@needs_int8
def test_release_pages_only_for_mapped_files(tmp_path) -> None:
    """Repacked weights hand their mapped file pages back (they leave the resident set and read the
    same afterwards); an array in anonymous memory is never touched (MADV_DONTNEED would zero it)."""
    import mmap

    data = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        view = np.frombuffer(mm, np.uint8, count=data.size - 100, offset=100).reshape(-1, 4)
        assert view.sum() > 0
        released = quant.release_pages(view)
        assert 0 < released <= view.nbytes and released % mmap.PAGESIZE == 0
        assert np.array_equal(view.reshape(-1), data[100:])  # mapped again from the page cache
        del view
        mm.close()
    anon = data.copy()
    assert quant.release_pages(anon) == 0 and np.array_equal(anon, data)


@needs_int8
def test_int8_stacked_parts_in_one_product() -> None:
    """A stack of parts of different types (a fused QKV) is one int8 product, equal to the parts'."""
    names = ["Q5_0", "Q6_K", "Q8_0"]
    raws = [_packed(n, seed=10 + i) for i, n in enumerate(names)]
    parts = [QuantWeight(r, int(GGMLType[n]), (N_OUT, N_IN)) for r, n in zip(raws, names)]
    s = quant.stack(parts)
    x = np.random.default_rng(9).standard_normal((5, N_IN)).astype(np.float32)
    ref = _q8_round_trip(x) @ np.concatenate([_reference(r, n) for r, n in zip(raws, names)]).T
    assert _rel_err(s.matmul(x), ref) < 1e-5
    assert np.array_equal(s.matmul(x), np.concatenate([p.matmul(x) for p in parts], axis=1))


def test_stack_and_views_stay_quantized(f32_activations) -> None:
    import plinth.ops as ops

    a, b = _packed("Q4_K", 2), _packed("Q4_K", 3)
    t = int(GGMLType.Q4_K)
    wa, wb = QuantWeight(a, t, (N_OUT, N_IN)), QuantWeight(b, t, (N_OUT, N_IN))
    s = quant.stack([wa, wb])
    assert isinstance(s, quant.StackedWeight) and s.shape == (2 * N_OUT, N_IN)
    assert s[:N_OUT] is wa and quant.stack([wa]) is wa
    assert np.array_equal(np.asarray(s[N_OUT:]), np.asarray(wb))
    x = np.random.default_rng(4).standard_normal((2, N_IN)).astype(np.float32)
    ref = x.astype(np.float64) @ np.concatenate([_reference(a, "Q4_K"), _reference(b, "Q4_K")]).T
    assert _rel_err(ops.linear(x, s), ref) < 1e-5
    # mixed types stack too: each part keeps its own blocks
    q8 = _packed("Q8_0")
    mixed = quant.stack([wa, QuantWeight(q8, int(GGMLType.Q8_0), (N_OUT, N_IN))])
    assert isinstance(mixed, quant.StackedWeight) and mixed.shape == (2 * N_OUT, N_IN)
    ref = x.astype(np.float64) @ np.concatenate([_reference(a, "Q4_K"), _reference(q8, "Q8_0")]).T
    assert _rel_err(ops.linear(x, mixed), ref) < 1e-5
    assert np.array_equal(np.asarray(mixed[N_OUT:]), _reference(q8, "Q8_0").astype(np.float32))
    # a plain array among the parts: the caller stacks float32 itself
    assert quant.stack([wa, np.asarray(wb)]) is None
    with pytest.raises(TypeError, match="linear_t"):
        ops.linear_t(x, s)


def test_numpy_fallback_without_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels off (numba missing), products go through dequantized tiles, same values."""
    raw = _packed("Q5_1")
    w = QuantWeight(raw, int(GGMLType.Q5_1), (N_OUT, N_IN))
    monkeypatch.setitem(quant._state, "kernels", False)
    x = np.random.default_rng(5).standard_normal((2, N_IN)).astype(np.float32)
    assert _rel_err(w.matmul(x), x.astype(np.float64) @ _reference(raw, "Q5_1").T) < 1e-5
    assert np.array_equal(w.take([3]), _reference(raw, "Q5_1")[[3]].astype(np.float32))


def test_int8_off_without_avx2_or_when_asked(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """No AVX2/F16C: a one-line note and the f32-activation kernels (exact to 1e-5); PLINTH_INT8=0 the
    same without a note; a wrong value is named."""
    raw = _packed("Q4_1")
    x = np.random.default_rng(13).standard_normal((3, N_IN)).astype(np.float32)
    ref = x.astype(np.float64) @ _reference(raw, "Q4_1").T
    monkeypatch.setattr(simd, "available", lambda: False)
    monkeypatch.setitem(quant._state, "i8", None)
    monkeypatch.setitem(quant._state, "note", None)
    assert quant.compiled_i8() is None
    assert "lacks AVX2" in capsys.readouterr().err
    assert _rel_err(QuantWeight(raw, int(GGMLType.Q4_1), (N_OUT, N_IN)).matmul(x), ref) < 1e-5
    monkeypatch.setenv("PLINTH_INT8", "0")
    monkeypatch.setitem(quant._state, "i8", None)
    assert quant.compiled_i8() is None
    monkeypatch.setenv("PLINTH_INT8", "yes")
    monkeypatch.setitem(quant._state, "i8", None)
    with pytest.raises(UserError, match="PLINTH_INT8='yes'"):
        quant.compiled_i8()
    monkeypatch.setitem(quant._state, "i8", None)


def test_default_threads_count_physical_cores(tmp_path) -> None:
    """SMT siblings count once (sysfs thread_siblings_list), and without sysfs every CPU counts."""
    for cpu, sib in ((0, "0,2"), (1, "1,3"), (2, "0,2"), (3, "1,3"), (4, "4")):
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(sib + "\n")
    assert quant.physical_cores([0, 1, 2, 3, 4], str(tmp_path)) == 3
    assert quant.physical_cores([0, 2], str(tmp_path)) == 1
    assert quant.physical_cores([0, 7], str(tmp_path)) == 2  # cpu7 unknown: count the CPUs
    assert quant.default_threads() >= 1


def test_omp_wait_defaults_keep_a_users_setting() -> None:
    from plinth import runtime

    env: dict[str, str] = {}
    runtime.omp_wait_defaults(env, "linux")
    assert env == {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "300000", "KMP_BLOCKTIME": "200"}
    for mine in ({"OMP_WAIT_POLICY": "passive"}, {"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "ACTIVE"},
                 {"KMP_BLOCKTIME": "0"}):
        env = dict(mine)
        runtime.omp_wait_defaults(env, "linux")
        assert env == mine  # neither overridden nor completed
    for other in ("darwin", "win32"):  # (other OpenMP runtimes: not measured, left alone)
        env = {}
        runtime.omp_wait_defaults(env, other)
        assert env == {}


_OMP_ENV = """
import ctypes
import numba
import plinth.runtime as runtime
if runtime.compiled() is None or numba.threading_layer() != "omp":
    print("no OpenMP layer")
else:
    ctypes.CDLL("libgomp.so.1").omp_display_env(1)  # (verbose: the GOMP_ settings too)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp: Linux")
def test_libgomp_reads_the_wait_settings_plinth_sets(tmp_path) -> None:
    """The kernels' OpenMP pool starts with :data:`plinth.runtime.OMP_WAIT` where the environment names no
    wait setting (libgomp reads it once, when it loads: the settings must be in place before numba loads its
    OpenMP layer), and with the user's where it does. ``omp_display_env`` prints what libgomp took."""
    import os
    import subprocess

    pytest.importorskip("numba")
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_DISPLAY_ENV")}

    def shown(**extra: str) -> str:
        got = subprocess.run([sys.executable, "-c", _OMP_ENV], env={**base, **extra}, capture_output=True,
                             text=True, timeout=300)
        assert got.returncode == 0, got.stderr[-2000:]
        if "no OpenMP layer" in got.stdout:
            pytest.skip("the kernels do not run on numba's OpenMP layer here")
        return got.stderr

    out = shown()
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in out and "GOMP_SPINCOUNT = '300000'" in out, out
    out = shown(OMP_WAIT_POLICY="passive")
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in out and "GOMP_SPINCOUNT = '300000'" not in out, out


def test_thread_count_is_validated() -> None:
    assert quant.parse_threads("3", "--threads") == 3
    with pytest.raises(UserError, match="--threads"):
        quant.parse_threads("0", "--threads")
    with pytest.raises(UserError, match="PLINTH_THREADS"):
        quant.parse_threads("many", "PLINTH_THREADS")



@needs_int8
def test_prepare_repacks_before_the_first_request() -> None:
    """Model.prepare runs one throwaway token: the quantized weights a forward multiplies are repacked
    then, not on the first request (whose prompt speed --stats reports)."""
    import plinth

    model = plinth.load_model("smollm2-135m-instruct")
    weights = [w for w in model.weights.values() if isinstance(w, QuantWeight)]
    assert weights and all(w._i8 is None for w in weights)
    assert model.prepare() > 0
    repacked = [w for w in weights if w._i8]
    assert repacked, "no weight was repacked by prepare()"
    head = max(weights, key=lambda w: w.shape[0])
    assert head._i8 and head.precise  # the tied LM head: repacked and marked precise


def _near_max_numpy(y: np.ndarray, margin: float, cap: int) -> np.ndarray:
    """The selection rule in numpy: columns within margin of the maximum, the margin halved in float32
    (at most 24 times) while more than cap are that close, then the first cap of them."""
    mx = y.max()
    lo = mx - np.float32(margin)
    for _ in range(24):
        if np.count_nonzero(y >= lo) <= cap:
            break
        lo = mx - (mx - lo) * np.float32(0.5)
    return np.flatnonzero(y >= lo)[:cap]


@needs_int8
def test_near_max_row_is_the_numpy_rule_on_made_rows() -> None:
    """The compiled selection of the precise head (``near_max_row``): the numpy rule's columns, with the
    margin halved, ties beyond the cap, a row of equal values (halving cannot separate them), and columns
    past a multiple of 64; the columns past ``n`` of longer rows (the padded output of an LM head) are not
    looked at."""
    k8 = quant.compiled_i8()
    rng = np.random.default_rng(5)
    y = (rng.standard_normal((6, 1000)) * 3).astype(np.float32)
    y[1, 500:540] = y[1].max() + 0.01  # 40 near-equal maxima
    y[2] = 1.0  # all equal
    y[3, 999] = 50.0  # the maximum in the last, partial chunk
    y[4] = np.linspace(0, 1, 1000, dtype=np.float32)  # a dense ramp: the margin halves several times
    longer = np.concatenate([y, np.full((6, 16), 99.0, np.float32)], axis=1)
    cand = np.empty(k8.CANDIDATES, np.int64)
    for cap in (256, 16, 3):
        for r in range(6):
            cols = np.zeros(cap, np.int64)
            count = k8.near_max_row(longer, r, 1000, 1.5, cap, cols, cand)
            assert np.array_equal(cols[:count], _near_max_numpy(y[r], 1.5, cap)), (cap, r)


@needs_int8
def test_near_max_row_one_pass_is_the_numpy_rule() -> None:
    """The one-pass selection the refinement runs (``near_max_row``: the maximum and a list of candidates
    within twice the margin of the running maximum, the rule's whole passes where the list overflows): the
    numpy rule's columns on random rows of every scale and length, ramps up and down (the list overflows on
    a rising one), all-equal rows, rounded values (ties), rows holding +inf, a row of -inf, and a NaN (which,
    as numpy's maximum, selects nothing)."""
    k8 = quant.compiled_i8()
    rng = np.random.default_rng(12)
    cand = np.empty(k8.CANDIDATES, np.int64)
    for trial in range(400):
        n = int(rng.integers(1, 3000))
        y = (rng.standard_normal(n + int(rng.integers(0, 20))) * rng.choice([0.1, 1.0, 3.0, 30.0])).astype(np.float32)
        kind = trial % 8
        if kind == 1:
            y[:n] = np.linspace(0, rng.uniform(0.1, 5), n, dtype=np.float32)
        elif kind == 2:
            y[:] = 1.0
        elif kind == 3:
            y[rng.integers(0, n)] = np.nan
        elif kind == 4:
            y[rng.integers(0, n, 3)] = np.inf
        elif kind == 5:
            y[:] = -np.inf
        elif kind == 6:
            y[:n] = np.round(y[:n])
        elif kind == 7:
            y[:n] = np.linspace(5, 0, n, dtype=np.float32)
        y[n:] = 99.0  # (past n: never looked at)
        cap = int(rng.choice([256, 16, 3, 1]))
        cols = np.zeros(cap, np.int64)
        with np.errstate(invalid="ignore"):
            want = _near_max_numpy(y[:n], 1.5, cap)
        got = k8.near_max_row(y[None], 0, n, 1.5, cap, cols, cand)
        assert np.array_equal(cols[:got], want), (trial, kind, n, cap)


@needs_int8
@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K", "Q4_K", "MXFP4", "F16"])
def test_refine_head_is_take_then_fixed_order_dots(type_name: str) -> None:
    """The precise head's compiled refinement (``refine_head``, rows over the kernel threads) against its steps
    one by one: the numpy rule's columns, those weight rows through ``QuantWeight.take`` (unscaled), their
    fixed-order dots with the f32 activations (``_dot16``): the same bits, every other value untouched."""
    k8 = quant.compiled_i8()
    n_out, n_in = 1024, 256
    w = QuantWeight(quantized_rows(type_name, n_out, n_in, 4), int(GGMLType[type_name]), (n_out, n_in))
    rng = np.random.default_rng(13)
    x = rng.standard_normal((9, n_in)).astype(np.float32)
    y = (rng.standard_normal((9, n_out + 64)) * 2).astype(np.float32)  # (rows longer than n_out: the padded output)
    y[3, :n_out] = np.linspace(0, 1, n_out, dtype=np.float32)  # more than the cap that close: the margin halves
    want = y.copy()
    for r in range(9):
        cols = _near_max_numpy(y[r, :n_out], quant.PRECISE_MARGIN, quant.PRECISE_MAX)
        for c, row in zip(cols, w.take(cols, unscaled=True)):
            want[r, c] = k8._dot16(row, x[r])
    k = quant.compiled()
    got = y.copy()
    k8.refine_head(got, n_out, quant.PRECISE_MARGIN, quant.PRECISE_MAX, w.ggml_type in k.FAST_TYPES, w.ggml_type, w.qk,
                   w.raw, w.raw16, k.F16_TABLE, k.FP4_VALUES, x)
    assert (got != y).any()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@needs_int8
def test_dot16_fixed_order() -> None:
    """The refinement's f32 dot (``_dot16``): float32 accuracy against float64, and the same bits
    for a row alone or among others, at any length modulo 16."""
    k8 = quant.compiled_i8()
    rng = np.random.default_rng(6)

    def dots(w: np.ndarray, x: np.ndarray) -> np.ndarray:  # every row of w with x, through _dot16
        return np.array([k8._dot16(row, x) for row in w], np.float32)

    for n in (576, 640, 37, 16, 5):
        w = rng.standard_normal((9, n)).astype(np.float32)
        x = rng.standard_normal(n).astype(np.float32)
        out = dots(w, x)
        ref = w.astype(np.float64) @ x.astype(np.float64)
        assert np.abs(out - ref).max() <= 1e-5 * np.abs(w).sum(1).max() * np.abs(x).max()
        one = dots(w[4:5].copy(), x)
        assert one[0] == out[4]


_LOOPS = """
import sys
import numpy as np
import plinth.quant as quant
from plinth.ops import compiled
from plinth.quant import kernels, simd
simd.kernel_address(int(sys.argv[1]))
compiled.task_address(True)
compiled.task_address(False)
kernels.rows_address()
"""


@needs_int8
def test_compiled_loops_come_from_the_disk_cache_in_a_second_process(tmp_path) -> None:
    """The loops compiled as C functions of their own (an int8 type's, the attention tasks, the
    f32 row loop) are cached under one key per machine: a second process loads them and adds
    nothing to the cache (a key that changed per process, e.g. from an object in a closure, would
    compile them again in every process and write another entry each time)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    code = int(GGMLType.Q4_0)

    def entries() -> set[str]:
        return {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.nb[ci]")}

    subprocess.run([sys.executable, "-c", _LOOPS, str(code)], env=env, check=True, timeout=300)
    first = entries()
    assert any("kernel_q4_0" in e for e in first) and any("_vector_task" in e for e in first), first
    subprocess.run([sys.executable, "-c", _LOOPS, str(code)], env=env, check=True, timeout=300)
    assert entries() == first


@needs_int8
def test_address_call_checks_its_arguments() -> None:
    """``address_call`` calls a C function by address with the arguments cast to its signature, and
    says so when the count is wrong."""
    from numba import carray, cfunc, njit, types

    from plinth.quant.jitcache import address_call, pointer_to

    sig = types.void(types.int64, types.int64, types.float32)
    f32_at = pointer_to(types.float32, "f32_at")

    @cfunc(sig)
    def fill(at, n, value):
        a = carray(f32_at(at), (n,))
        for i in range(n):
            a[i] = value + i

    call = address_call(sig, "call_fill")

    @njit
    def run(fn, out):
        call(fn, out.ctypes.data, out.shape[0], 1.5)

    out = np.zeros(5, np.float32)
    run(fill.address, out)
    assert out.tolist() == [1.5, 2.5, 3.5, 4.5, 5.5]

    @njit
    def wrong(fn, out):
        call(fn, out.ctypes.data, 1.5)

    with pytest.raises(TypeError, match="call_fill: 3 arguments after the address, got 2"):
        wrong(fill.address, out)


@pytest.mark.parametrize("type_name", ["Q8_0", "NVFP4", "Q4_K"])
def test_scaled_weights_stay_quantized(type_name: str) -> None:
    """A weight with a ``.scale`` companion (one value, or one a row) keeps its blocks: products (int8 and
    f32 kernels, tiles), rows taken, row slices and stacks are the scaled dequantized weight's."""
    raw = _packed(type_name)
    ref_w = _reference(raw, type_name)
    rng = np.random.default_rng(4)
    for scale in (np.array([0.37], np.float32), rng.uniform(0.5, 2.0, N_OUT).astype(np.float32)):
        w = QuantWeight(raw, int(GGMLType[type_name]), (N_OUT, N_IN), scale)
        ref = ref_w * scale.astype(np.float64)[:, None]
        for m in (1, 5, 40):
            x = rng.standard_normal((m, N_IN)).astype(np.float32)
            tol = 1e-5 if type_name == "NVFP4" else 2e-2  # (int8 activations for the block types)
            assert _rel_err(w.matmul(x), x.astype(np.float64) @ ref.T) < tol
        np.testing.assert_allclose(w.take(np.array([3, 0])), ref[[3, 0]], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(w[10:20]), ref[10:20], rtol=1e-6)
        other = QuantWeight(raw, int(GGMLType[type_name]), (N_OUT, N_IN))
        st = quant.stack([w, other])
        x = rng.standard_normal((3, N_IN)).astype(np.float32)
        y = st.matmul(x)
        np.testing.assert_allclose(y[:, :N_OUT], w.matmul(x), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(y[:, N_OUT:], other.matmul(x), rtol=1e-6, atol=1e-6)

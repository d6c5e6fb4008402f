"""The GGUF reader against gguf-py's reader, its errors, and the dequantizers against gguf.quants."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from plinth.gguf import GGUFError, GGUFFile, dequantize, dequantize_rows  # noqa: E402
from plinth.testing import write_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType


@pytest.fixture
def sample(tmp_path):
    path = tmp_path / "sample.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -3)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -1234)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -5)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float32("t.f32", 0.25)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.strs", ["a", "", "ünï", "<|im_start|>"])
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    rng = np.random.default_rng(0)
    w.add_tensor("a.f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b.f16", rng.standard_normal((2, 32)).astype(np.float16))
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("c.q8", gguf.quants.quantize(x, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_metadata_and_tensors_match_gguf_reader(sample):
    ours = GGUFFile(sample)
    ref = gguf.GGUFReader(str(sample))
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.metadata[key]
        got = got.tolist() if isinstance(got, np.ndarray) else got
        if isinstance(want, float):
            assert got == pytest.approx(want)
        else:
            assert got == want, key
    assert ours.metadata["t.str"] == "héllo" and ours.metadata["t.strs"][2] == "ünï"
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.ne == tuple(int(d) for d in t.shape)
        assert info.ggml_type == int(t.tensor_type)
        np.testing.assert_array_equal(ours.raw(t.name).reshape(-1).view(np.uint8),
                                      np.asarray(t.data).reshape(-1).view(np.uint8))


def test_raw_is_zero_copy(sample):
    f = GGUFFile(sample)
    arr = f.raw("a.f32")
    assert not arr.flags.owndata and not arr.flags.writeable
    assert arr.shape == (3, 64) and f.raw("c.q8").shape == (4, 2 * 34)


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b"", "empty file at offset 0"),
    (lambda b: b"GGML" + b[4:], "not a GGUF file"),
    (lambda b: b[:20], "truncated"),
    (lambda b: b[:-200], "runs past the end of the file"),
    (lambda b: b[:24] + (2**60).to_bytes(8, "little") + b[32:], "offset"),
])
def test_bad_files_give_named_errors(sample, tmp_path, mutate, message):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(mutate(sample.read_bytes()))
    with pytest.raises(GGUFError) as err:
        GGUFFile(bad)
    assert str(bad) in str(err.value) and message in str(err.value)


def test_missing_file():
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile("/nonexistent/model.gguf")


QUANTIZABLE = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"]
RANDOM_BLOCKS = {"Q4_K": [(0, 4)], "Q5_K": [(0, 4)], "Q6_K": [(208, 210)], "NVFP4": [], "Q2_K": [(80, 84)],
                 "Q3_K": [(108, 110)]}


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_dequantize_bit_exact_quantized(name):
    qt = getattr(Q, name)
    x = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32) * 3
    packed = gguf.quants.quantize(x, qt)
    ref = gguf.quants.dequantize(packed, qt)
    np.testing.assert_array_equal(dequantize(packed, int(qt), x.shape), ref)


@pytest.mark.parametrize("name", sorted(RANDOM_BLOCKS))
def test_dequantize_bit_exact_random_blocks(name):
    qt = getattr(Q, name)
    block, size = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(2)
    n_blocks = 16 * 512 // block
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for start, end in RANDOM_BLOCKS[name]:  # finite f16 scale fields
        n_half = (end - start) // 2
        vals = rng.uniform(1e-3, 0.1, (n_blocks, n_half)).astype("<f2")
        raw[:, start:end] = vals.view(np.uint8).reshape(n_blocks, end - start)
    raw = raw.reshape(16, -1)
    ref = gguf.quants.dequantize(raw, qt)
    np.testing.assert_array_equal(dequantize(raw, int(qt), (16, 512)), ref)


def test_dequantize_rows_picks_rows():
    x = np.random.default_rng(3).standard_normal((10, 64)).astype(np.float32)
    packed = gguf.quants.quantize(x, Q.Q8_0)
    full = dequantize(packed, int(Q.Q8_0), x.shape)
    np.testing.assert_array_equal(dequantize_rows(packed, int(Q.Q8_0), np.array([7, 2]), 64), full[[7, 2]])


def test_synthetic_writer_roundtrip(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", {"general.architecture": "toy", "toy.n": 3},
                      {"w": np.ones((2, 32), np.float32)}, qtypes={"w": Q.Q8_0})
    f = GGUFFile(path)
    assert f.metadata["toy.n"] == 3 and f.tensors["w"].type_name == "Q8_0"
    np.testing.assert_allclose(dequantize(f.raw("w"), f.tensors["w"].ggml_type, (2, 32)), 1.0, atol=1e-3)

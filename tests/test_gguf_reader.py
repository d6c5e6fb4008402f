"""plinth's GGUF reader against gguf-py's GGUFReader (the oracle), zero-copy views and error cases."""

from __future__ import annotations

import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from plinth.gguf import GGMLType, GGUFError, GGUFFile  # noqa: E402

Q = gguf.GGMLQuantizationType


def _write(path, with_tensors=True):
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_uint8("k.u8", 255)
    w.add_int8("k.i8", -128)
    w.add_uint16("k.u16", 65535)
    w.add_int16("k.i16", -32768)
    w.add_uint32("k.u32", 2**32 - 1)
    w.add_int32("k.i32", -(2**31))
    w.add_uint64("k.u64", 2**64 - 1)
    w.add_int64("k.i64", -(2**63))
    w.add_float32("k.f32", 1.5)
    w.add_float64("k.f64", -2.0**-1000)
    w.add_bool("k.true", True)
    w.add_bool("k.false", False)
    w.add_string("k.str", "Grüße 🙂")
    w.add_string("k.empty", "")
    w.add_array("k.strs", ["", "a", "ĠThe", "<|endoftext|>", "日本"])
    w.add_array("k.ints", [-1, 0, 7])
    w.add_array("k.floats", [0.25, -1.0, 3.5])
    w.add_array("k.bools", [True, False])
    w.add_array("k.empty_arr", [])
    if with_tensors:
        rng = np.random.default_rng(0)
        w.add_tensor("t.f32", rng.standard_normal((3, 5, 32)).astype(np.float32))
        w.add_tensor("t.f16", rng.standard_normal((4, 64)).astype(np.float16))
        w.add_tensor("t.i32", np.arange(12, dtype=np.int32).reshape(3, 4))
        w.add_tensor("t.q8_0", gguf.quants.quantize(rng.standard_normal((6, 64)).astype(np.float32), Q.Q8_0),
                     raw_dtype=Q.Q8_0)
        q4k = rng.integers(0, 256, size=(2, 2 * 144), dtype=np.uint8)
        w.add_tensor("t.q4_k", q4k, raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def sample(tmp_path):
    return _write(tmp_path / "sample.gguf")


def _plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


def test_metadata_matches_gguf_reader(sample):
    ref = gguf.GGUFReader(str(sample))
    with GGUFFile(sample) as f:
        assert f.version == 3 and f.alignment == 32 and f.architecture == "qwen3"
        keys = [k for k in ref.fields if not k.startswith("GGUF.")]
        assert list(f.metadata) == keys
        for key in keys:
            assert _plain(f.metadata[key]) == ref.fields[key].contents(), key
        assert f.metadata["k.u64"] == 2**64 - 1 and f.metadata["k.f64"] == -2.0**-1000
        assert f.metadata["k.strs"] == ["", "a", "ĠThe", "<|endoftext|>", "日本"]
        assert isinstance(f.metadata["k.ints"], np.ndarray)
        assert f.get("k.str") == "Grüße 🙂" and f.get("missing", 42) == 42


def test_tensors_match_gguf_reader(sample):
    ref = {t.name: t for t in gguf.GGUFReader(str(sample)).tensors}
    with GGUFFile(sample) as f:
        assert list(f.tensors) == list(ref)
        for name, r in ref.items():
            info = f.tensors[name]
            assert info.ne == tuple(int(x) for x in r.shape), name
            assert info.shape == tuple(reversed(info.ne))
            assert info.ggml_type == r.tensor_type.value
            assert info.offset == r.data_offset and info.n_bytes == r.n_bytes
            raw = f.raw(name)
            assert raw.tobytes() == r.data.tobytes(), name
        assert f.raw("t.f32").dtype == np.float32 and f.raw("t.f32").shape == (3, 5, 32)
        assert f.raw("t.f16").dtype == np.float16 and f.raw("t.i32").dtype == np.int32
        np.testing.assert_array_equal(f.raw("t.i32"), np.arange(12).reshape(3, 4))
        assert f.raw("t.q8_0").shape == (6, 2 * 34) and f.raw("t.q8_0").dtype == np.uint8
        assert f.tensors["t.q4_k"].ggml_type == GGMLType.Q4_K and f.raw("t.q4_k").shape == (2, 288)


def test_raw_is_zero_copy(sample):
    with GGUFFile(sample) as f:
        for name in f.tensors:
            view = f.raw(name)
            assert not view.flags.owndata and not view.flags.writeable, name
            base = view
            while isinstance(base, np.ndarray) and base.base is not None:
                base = base.base
            assert not isinstance(base, (bytes, bytearray)), name  # backed by the mapping
        a, b = f.raw("t.f32"), f.raw("t.f32")
        assert np.shares_memory(a, b)


def test_views_outlive_close(sample):
    f = GGUFFile(sample)
    view = f.raw("t.f32")
    want = view.copy()
    f.close()
    np.testing.assert_array_equal(view, want)


def test_unknown_tensor_name(sample):
    with GGUFFile(sample) as f, pytest.raises(KeyError, match="nope"):
        f.raw("nope")


def test_v2_header(tmp_path):
    path = tmp_path / "v2.gguf"
    key = b"general.architecture"
    val = b"llama"
    data = b"GGUF" + struct.pack("<IQQ", 2, 0, 1) + struct.pack("<Q", len(key)) + key
    data += struct.pack("<IQ", 8, len(val)) + val
    path.write_bytes(data)
    with GGUFFile(path) as f:
        assert f.version == 2 and f.architecture == "llama" and f.tensors == {}


def _expect_error(path, *words):
    with pytest.raises(GGUFError) as exc:
        GGUFFile(path)
    msg = str(exc.value)
    assert str(path) in msg and "offset" in msg, msg
    for w in words:
        assert w in msg, msg
    assert isinstance(exc.value, ValueError)


def test_empty_file(tmp_path):
    (tmp_path / "e.gguf").write_bytes(b"")
    _expect_error(tmp_path / "e.gguf", "empty")


def test_wrong_magic(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"PK\x03\x04" + bytes(40))
    _expect_error(tmp_path / "m.gguf", "magic")


def test_big_endian_refused(tmp_path):
    (tmp_path / "be.gguf").write_bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 0))
    _expect_error(tmp_path / "be.gguf", "big-endian")


@pytest.mark.parametrize("cut", [6, 20, 30, 60, 200])
def test_truncated_header(sample, tmp_path, cut):
    path = tmp_path / "cut.gguf"
    path.write_bytes(sample.read_bytes()[:cut])
    _expect_error(path)


def test_truncated_tensor_data(sample, tmp_path):
    path = tmp_path / "short.gguf"
    path.write_bytes(sample.read_bytes()[:-10])
    _expect_error(path, "past the end")


def test_bogus_string_length(tmp_path):
    path = tmp_path / "len.gguf"
    key = b"general.architecture"
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    data += struct.pack("<IQ", 8, 2**62) + b"llama"
    path.write_bytes(data)
    _expect_error(path, "string length")


def test_bogus_array_count(tmp_path):
    path = tmp_path / "arr.gguf"
    key = b"tokenizer.ggml.scores"
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    data += struct.pack("<IIQ", 9, 6, 2**40) + bytes(16)
    path.write_bytes(data)
    _expect_error(path)


def test_unknown_value_type(tmp_path):
    path = tmp_path / "vt.gguf"
    key = b"x"
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    data += struct.pack("<I", 99) + bytes(16)
    path.write_bytes(data)
    _expect_error(path, "unknown value type 99")

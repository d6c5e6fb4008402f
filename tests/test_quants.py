"""plinth's dequantizers, bit-exact against gguf-py's reference dequantizers (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from plinth.gguf import GGMLType, dequantize, dequantize_rows  # noqa: E402
from plinth.gguf.constants import BLOCK_SIZES  # noqa: E402

Q = gguf.GGMLQuantizationType

QUANTIZABLE = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"]
#: type -> byte offsets of the f16 scale fields inside one block
RANDOM_BLOCK_SCALES = {
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "NVFP4": (),
}


def _weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0, :5] = [0.0, -0.0, 1e-8, 65504.0, -3.5]  # zeros, tiny and large values
    return x


def _random_blocks(name: str, n_blocks: int, seed: int = 1) -> np.ndarray:
    """Random block bytes whose f16 scale fields hold finite f16 values."""
    block, type_size = BLOCK_SIZES[GGMLType[name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in RANDOM_BLOCK_SCALES[name]:
        scale = (rng.standard_normal(n_blocks) * 0.05).astype("<f2")
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return raw


def test_type_ids_and_sizes_match_gguf():
    for t in GGMLType:
        assert Q[t.name].value == t.value, t.name
        if t is GGMLType.Q8_1:
            continue  # gguf-py lists 40 bytes (f32 d, s); ggml's block_q8_1 is 36 (two f16); never stored in files
        assert gguf.GGML_QUANT_SIZES[Q[t.name]] == BLOCK_SIZES[t], t.name


@pytest.mark.parametrize("name", QUANTIZABLE)
@pytest.mark.parametrize("shape", [(4, 256), (3, 2, 64)])
def test_quantized_data_bit_exact(name, shape):
    x = _weights(int(np.prod(shape[:-1])), shape[-1]).reshape(shape)
    qtype = Q[name]
    stored = gguf.quants.quantize(x, qtype)
    want = gguf.quants.dequantize(stored, qtype)
    if name in ("F16", "BF16"):
        raw = stored.view("<f2" if name == "F16" else "<u2")
    else:
        raw = stored.reshape(-1, stored.shape[-1])
    got = dequantize(raw, GGMLType[name], shape)
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_f32_passthrough():
    x = _weights(2, 64)
    np.testing.assert_array_equal(dequantize(x, GGMLType.F32, (2, 64)), x)


@pytest.mark.parametrize("name", sorted(RANDOM_BLOCK_SCALES))
def test_random_blocks_bit_exact(name):
    block, type_size = BLOCK_SIZES[GGMLType[name]]
    raw = _random_blocks(name, 48)
    want = gguf.quants.dequantize(raw.reshape(-1), Q[name]).reshape(-1)
    got = dequantize(raw.reshape(6, -1), GGMLType[name], (6, 8 * block))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.reshape(-1), want.astype(np.float32))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_dequantize_rows_matches_full(name):
    block, type_size = BLOCK_SIZES[GGMLType[name]]
    if name in RANDOM_BLOCK_SCALES:
        raw = _random_blocks(name, 10 * 2).reshape(10, 2 * type_size)
    else:
        raw = gguf.quants.quantize(_weights(10, 2 * block), Q[name])
    full = dequantize(raw, GGMLType[name], (10, 2 * block))
    rows = np.array([7, 0, 7, 3])
    np.testing.assert_array_equal(dequantize_rows(raw, GGMLType[name], rows, 2 * block), full[rows])


def test_unsupported_type_names_it():
    with pytest.raises(Exception, match="Q8_K"):
        dequantize(np.zeros((1, 292), np.uint8), GGMLType.Q8_K, (1, 256))

"""plinth.testing.synthetic.write_quantized_llama: a random llama in llama.cpp's Q4_K_M mix that plinth
loads with the types asked for, and whose products are the dequantized blocks' (the file bench_peer's
--synthetic-1b writes at TinyLlama-1.1B's shape, here at a tiny one)."""

from __future__ import annotations

import numpy as np

import plinth
from plinth.testing.synthetic import q4_k_m_types, random_blocks, write_quantized_llama

SHAPE = dict(n_vocab=300, n_embd=256, n_layer=8, n_head=4, n_head_kv=2, n_ff=512, n_ctx=64)


def test_q4_k_m_mix_follows_llama_cpp():
    types = q4_k_m_types(22)  # TinyLlama's 22 layers: use_more_bits picks 0, 1, 4, 7, 10, 13, 16, 19, 20, 21
    more = [il for il in range(22) if types[f"blk.{il}.ffn_down.weight"] == "Q6_K"]
    assert more == [0, 1, 4, 7, 10, 13, 16, 19, 20, 21]
    assert all(types[f"blk.{il}.attn_v.weight"] == ("Q6_K" if il in more else "Q4_K") for il in range(22))
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert {types[f"blk.3.{t}.weight"] for t in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == {"Q4_K"}


def test_random_blocks_scales():
    from plinth.gguf.constants import GGMLType
    from plinth.quant import QuantWeight

    for t in ("Q4_K", "Q6_K"):
        w = QuantWeight(random_blocks(t, 16, 512, seed=1), int(GGMLType[t]), (16, 512)).dequantize()
        assert np.isfinite(w).all() and 0.005 < np.abs(w).mean() < 0.2, (t, np.abs(w).mean())


def test_written_file_loads_with_its_types(tmp_path):
    path = write_quantized_llama(tmp_path / "q.gguf", **SHAPE)
    want = q4_k_m_types(SHAPE["n_layer"])
    model = plinth.load_model(str(path))
    assert {n: t for n, t in model.tensor_types.items() if n in want} == want
    assert model.n_vocab == SHAPE["n_vocab"]
    ctx = model.new_context()
    logits = model.backend.to_numpy(ctx.decode([1, 5, 9, 200], output="all").logits)
    assert logits.shape == (4, SHAPE["n_vocab"]) and np.isfinite(logits).all()
    # the head's product is the dequantized Q6_K head's (up to the int8 activations' rounding)
    h = model.graph.final_norm(np.ones((1, SHAPE["n_embd"]), np.float32))
    ref = h @ np.asarray(model.graph.head.weight).T
    assert np.abs(model.graph.head(h) - ref).max() < 0.02 * np.abs(ref).max()

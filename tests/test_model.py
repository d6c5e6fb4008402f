"""Loading synthetic GGUFs through the plugin path: load_model, logits, named tensor errors, generation."""

from __future__ import annotations

import numpy as np
import pytest

import plinth
from plinth.context import Batch
from plinth.errors import UserError
from plinth.tensors import TensorCheckError
from plinth.testing import byte_vocab, tiny_metadata, write_synthetic_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture
def registry(plinth_registry):
    from plinth_llama.plugin import plugin

    return plinth_registry(plugin)


@pytest.fixture
def tiny_path(tmp_path, registry):
    md = tiny_metadata("llama", n_vocab=257) | byte_vocab()
    return write_synthetic_gguf(tmp_path / "tiny-llama.gguf", "llama", md, registry, seed=4)


def test_load_model_logits_match_direct_graph(tiny_path, registry):
    model = plinth.load_model(tiny_path, registry=registry)
    assert model.arch == "llama" and model.plugin == "llama"
    tokens = [5, 9, 200, 17]
    logits = model.logits(tokens)
    assert logits.shape == (4, 257) and logits.dtype == np.float32
    ctx = model.new_context()
    step = [ctx.decode(tokens[:2], output="all").logits] + [ctx.decode([t]).logits for t in tokens[2:]]
    np.testing.assert_allclose(np.concatenate(step), logits, atol=1e-5, rtol=0)


def test_quantized_weights_load(tmp_path, registry):
    md = tiny_metadata("qwen3")
    qtypes = {f"blk.{i}.{n}.weight": gguf.GGMLQuantizationType.Q8_0 for i in range(2)
              for n in ("attn_q", "attn_k", "attn_v", "ffn_up")}
    path = write_synthetic_gguf(tmp_path / "q.gguf", "qwen3", md, registry, qtypes=qtypes)
    model = plinth.load_model(path, registry=registry)
    assert model.tensor_types["blk.0.attn_q.weight"] == "Q8_0"
    assert np.isfinite(model.logits([1, 2, 3])).all()


def test_missing_and_misshaped_tensors_are_all_named(tmp_path, registry):
    md = tiny_metadata("llama")
    path = write_synthetic_gguf(tmp_path / "broken.gguf", "llama", md, registry,
                                drop=["blk.1.ffn_up.weight", "output_norm.weight"])
    with pytest.raises(TensorCheckError) as err:
        plinth.load_model(path, registry=registry)
    text = str(err.value)
    assert "broken.gguf" in text and "blk.1.ffn_up.weight" in text and "output_norm.weight" in text


def test_unknown_architecture_is_named(tmp_path, registry):
    from plinth.plugins import PluginError
    from plinth.testing import write_gguf

    path = write_gguf(tmp_path / "x.gguf", {"general.architecture": "mystery"}, {"w": np.zeros((1, 32), np.float32)})
    with pytest.raises(PluginError, match="architecture 'mystery'.*available: gemma3, llama, qwen2, qwen3"):
        plinth.load_model(path, registry=registry)


def test_taps_out_of_range(tiny_path, registry):
    model = plinth.load_model(tiny_path, registry=registry)
    with pytest.raises(ValueError, match="feature tap 3 out of range"):
        model.new_context(taps=[3])


def test_generation_greedy_matches_argmax_loop(tiny_path, registry):
    from plinth.generate import Generator

    model = plinth.load_model(tiny_path, registry=registry)
    prompt = model.tokenizer.encode("hello")
    gen = Generator(model)
    text = "".join(gen.stream(prompt, max_tokens=12))
    # an independent greedy loop over full forwards
    ids = list(prompt)
    expect = []
    for _ in range(12):
        nxt = int(np.argmax(model.logits(ids)[-1]))
        if nxt == 256:
            break
        expect.append(nxt)
        ids.append(nxt)
    assert gen.tokens_out == expect
    assert text == model.tokenizer.decode(expect)
    assert gen.stats.n_generated == len(expect)


def test_context_limit_is_a_clear_error(tiny_path, registry):
    model = plinth.load_model(tiny_path, registry=registry, n_ctx=8)
    with pytest.raises(UserError, match="context limit exceeded"):
        model.new_context().forward(Batch.from_tokens(list(range(9))))
    from plinth.generate import Generator

    with pytest.raises(UserError, match="the context holds 8"):
        list(Generator(model).stream(list(range(10))))


def test_stop_string(tiny_path, registry):
    from plinth.generate import Generator

    model = plinth.load_model(tiny_path, registry=registry)
    full = "".join(Generator(model).stream([104, 105], max_tokens=10))
    if len(full) >= 3:
        stop = full[2]
        cut = "".join(Generator(model).stream([104, 105], max_tokens=10, stop=[stop]))
        assert cut == full[: full.index(stop)]

"""Contract tests of gemma4 on tiny synthetic files, and its keys and tensors as llama.cpp writes them.

``plinth.testing.check_architecture`` on the numpy and strict backends (prefill + decode == one
forward, batches of two sequences, logits only where asked, cache rollback kind by kind, plain ==
speculative generation) for a dense model and one with every feature (per-layer embeddings, KV
sharing, MoE, k_eq_v full layers, double-wide MLP); named errors for missing keys and tensors,
refusal of keys and tensors the architecture does not read.
"""

from __future__ import annotations

import numpy as np
import pytest

from plinth.errors import UserError
from plinth.graph import HParamsError
from plinth.testing import CONTRACT_BACKENDS, check_architecture, tiny_metadata, write_synthetic_gguf

VARIANTS = {
    # sliding, sliding, full; soft-capping
    "dense": dict(n_layer=3, attention__sliding_window_pattern=[True, True, False], final_logit_softcapping=30.0),
    # E2B / 26B-A4B features together: per-layer embeddings, the last two layers share K/V (double-wide MLP),
    # MoE, one KV head on full layers
    "all": dict(n_layer=4, n_head_kv=[2, 1, 2, 1], n_ff=[96, 96, 192, 192],
                attention__sliding_window_pattern=[True, False, True, False], attention__shared_kv_layers=2,
                embedding_length_per_layer_input=8, final_logit_softcapping=30.0, expert_count=4,
                expert_used_count=2, expert_feed_forward_length=24),
}


def metadata(variant: str, **over) -> dict:
    kw = dict(attention__key_length=32, attention__key_length_swa=16, attention__value_length=32,
              attention__value_length_swa=16, attention__sliding_window=5, rope__freq_base=1e6,
              rope__freq_base_swa=1e4, rope__dimension_count=32, rope__dimension_count_swa=16)
    kw.update(VARIANTS[variant])
    kw.update(over)
    return tiny_metadata("gemma4", n_vocab=257, **kw)


@pytest.fixture
def registry(plinth_registry):
    from plinth_gemma.plugin import plugin

    return plinth_registry(plugin)


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_check_architecture(registry, variant, backend, tmp_path):
    model = check_architecture(registry, "gemma4", metadata(variant), tmp_path, backend=backend)
    hp = model.hparams
    kinds = [type(k[0]).__name__ for k in model.graph.cache_layout()]
    if variant == "all":
        assert kinds == ["KV", "KV", "SharedKV", "SharedKV"]
        assert hp.kv_source == (0, 1, 0, 1)
    else:
        assert kinds == ["KV"] * 3


def test_missing_key_is_named(registry, tmp_path):
    md = metadata("dense")
    del md["gemma4.attention.sliding_window"]
    with pytest.raises(HParamsError, match=r"gemma4\.attention\.sliding_window"):
        registry.arch_hparams("gemma4", md, "tiny.gguf")


def test_sliding_pattern_must_be_one_bool_per_layer(registry):
    md = metadata("dense", attention__sliding_window_pattern=[True, False])
    with pytest.raises(HParamsError, match="sliding_window_pattern.*3 booleans"):
        registry.arch_hparams("gemma4", md, "tiny.gguf")


def test_shared_layer_needs_a_source_of_its_kind(registry):
    md = metadata("dense", attention__sliding_window_pattern=[False, True, False], attention__shared_kv_layers=2)
    with pytest.raises(HParamsError, match="shared layer 1 is sliding attention"):
        registry.arch_hparams("gemma4", md, "tiny.gguf")


def test_kv_sources_follow_transformers(registry):
    md = metadata("dense", n_layer=6, attention__sliding_window_pattern=[True, False, True, True, False, True],
                  attention__shared_kv_layers=3)
    hp = registry.arch_hparams("gemma4", md, "tiny.gguf")
    assert hp.kv_source == (0, 1, 2, 2, 1, 2)


def test_missing_tensor_is_named(registry, tmp_path):
    from plinth.model import load_model

    path = write_synthetic_gguf(tmp_path / "m.gguf", "gemma4", metadata("all"), registry,
                                drop=["blk.1.ffn_gate_inp.scale"])
    with pytest.raises(UserError, match=r"blk\.1\.ffn_gate_inp\.scale"):
        load_model(path, registry=registry)


def test_rope_scaling_key_is_refused_by_name(registry, tmp_path):
    """Gemma 4 files carry no RoPE scaling; one that does is refused rather than computed without it."""
    from plinth.model import load_model

    md = dict(metadata("dense"), **{"gemma4.rope.scaling.type": "yarn", "gemma4.rope.scaling.factor": 8.0})
    path = write_synthetic_gguf(tmp_path / "m.gguf", "gemma4", md, registry)
    with pytest.raises(UserError, match=r"gemma4\.rope\.scaling\.factor"):
        load_model(path, registry=registry)


def test_fused_qkv_is_refused_by_name(registry, tmp_path):
    """llama.cpp may read a fused ``attn_qkv``; plinth's gemma4 does not, and says so."""
    from plinth.model import load_model
    from plinth.testing import random_tensors, write_gguf

    md = metadata("dense")
    hp = registry.arch_hparams("gemma4", md, "m.gguf")
    arch = registry.architecture("gemma4")
    tensors = random_tensors(arch.synthetic_tensors(hp))
    tensors["blk.0.attn_qkv.weight"] = np.zeros((4 * 16 + 2 * 2 * 16, 64), np.float32)
    path = write_gguf(tmp_path / "m.gguf", md, tensors)
    with pytest.raises(UserError, match=r"blk\.0\.attn_qkv\.weight"):
        load_model(path, registry=registry)


def test_unused_kv_weights_of_shared_layers_are_accepted(registry, tmp_path):
    """Checkpoints may carry K/V weights for the KV-shared layers; both references ignore them, so does plinth."""
    from plinth.model import load_model
    from plinth.testing import random_tensors, write_gguf

    md = metadata("all")
    hp = registry.arch_hparams("gemma4", md, "m.gguf")
    arch = registry.architecture("gemma4")
    tensors = random_tensors(arch.synthetic_tensors(hp))
    plain = load_model(write_gguf(tmp_path / "a.gguf", md, tensors), registry=registry).logits([1, 2, 3])
    for il in (2, 3):
        for name, shape in arch.unused_kv_tensors(hp, il):
            tensors[name] = np.ones(shape, np.float32)
    got = load_model(write_gguf(tmp_path / "b.gguf", md, tensors), registry=registry).logits([1, 2, 3])
    np.testing.assert_array_equal(got, plain)


def test_separate_gate_and_up_experts_equal_fused(registry, tmp_path):
    """``ffn_gate_exps`` + ``ffn_up_exps`` (llama.cpp reads either layout) compute what ``ffn_gate_up_exps`` does."""
    from plinth.model import load_model
    from plinth.testing import random_tensors, write_gguf

    md = metadata("all")
    hp = registry.arch_hparams("gemma4", md, "m.gguf")
    tensors = random_tensors(registry.architecture("gemma4").synthetic_tensors(hp))
    fused = load_model(write_gguf(tmp_path / "a.gguf", md, tensors), registry=registry).logits([5, 6, 7, 8])
    for il in range(hp.n_layer):
        gu = tensors.pop(f"blk.{il}.ffn_gate_up_exps.weight")
        tensors[f"blk.{il}.ffn_gate_exps.weight"] = np.ascontiguousarray(gu[:, :24])
        tensors[f"blk.{il}.ffn_up_exps.weight"] = np.ascontiguousarray(gu[:, 24:])
    split = load_model(write_gguf(tmp_path / "b.gguf", md, tensors), registry=registry).logits([5, 6, 7, 8])
    np.testing.assert_allclose(split, fused, atol=1e-6, rtol=0)


def test_embedding_row_takes_token_0s_per_layer_embedding(registry, tmp_path):
    """An embedding row (no token id) is scaled like a token row and takes token 0's per-layer embedding,
    as llama.cpp does for image rows: the embedding of token 0 as a row equals token 0."""
    from plinth.graph import Batch
    from plinth.model import load_model

    model = load_model(write_synthetic_gguf(tmp_path / "m.gguf", "gemma4", metadata("all"), registry),
                       registry=registry)
    table = np.asarray(model.weights["token_embd.weight"])
    rows = Batch.concat([Batch.from_tokens([5, 0], output="all"),
                         Batch.from_embeddings(table[[0, 5]], start=2, output="all")])
    tokens = Batch.from_tokens([5, 0, 0, 0], output="all")
    got = model.graph.forward(rows, model.new_context().cache).logits
    ref = model.graph.forward(tokens, model.new_context().cache).logits
    np.testing.assert_allclose(got[:3], ref[:3], atol=1e-5, rtol=0)
    assert not np.allclose(got[3], model.graph.forward(Batch.from_tokens([5, 0, 0, 5], output="all"),
                                                       model.new_context().cache).logits[3], atol=1e-3)

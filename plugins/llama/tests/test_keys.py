"""The llama.cpp keys plinth-llama reads: rope scaling, experts, head sizes, Gemma 3 sliding pattern."""

from __future__ import annotations

import pytest

from plinth.errors import UserError
from plinth.testing import tiny_metadata


@pytest.fixture
def registry(plinth_registry):
    from plinth_llama.plugin import plugin

    return plinth_registry(plugin)


def hparams(registry, arch="llama", **extra):
    return registry.arch_hparams(arch, tiny_metadata(arch, **extra), f"tiny-{arch}.gguf")


def test_no_rope_scaling_keys_mean_none(registry):
    hp = hparams(registry)
    assert (hp.rope_scaling, hp.rope_factor, hp.rope_ctx_orig) == ("none", 1.0, 256)


def test_a_factor_without_a_type_is_linear_as_in_llama_cpp(registry):
    hp = hparams(registry, rope__scaling__factor=4.0)
    assert (hp.rope_scaling, hp.rope_factor) == ("linear", 4.0)


def test_the_old_scale_linear_key_is_the_factor(registry):
    hp = hparams(registry, rope__scale_linear=2.0)
    assert (hp.rope_scaling, hp.rope_factor) == ("linear", 2.0)
    hp = hparams(registry, rope__scale_linear=2.0, rope__scaling__factor=3.0)  # the new key wins
    assert hp.rope_factor == 3.0


def test_type_none_ignores_a_factor(registry):
    hp = hparams(registry, rope__scaling__type="none", rope__scaling__factor=4.0)
    assert hp.rope_scaling == "none"


def test_yarn_keys(registry):
    hp = hparams(registry, "qwen2", rope__scaling__type="yarn", rope__scaling__factor=4.0,
                 rope__scaling__original_context_length=64, rope__scaling__yarn_beta_fast=16.0,
                 rope__scaling__yarn_beta_slow=2.0)
    assert (hp.rope_scaling, hp.rope_ctx_orig, hp.yarn_beta_fast, hp.yarn_beta_slow) == ("yarn", 64, 16.0, 2.0)
    assert hp.rope_attn_factor == 1.0


@pytest.mark.parametrize("kind", ["longrope", "dynamic", "su"])
def test_an_unimplemented_rope_scaling_type_is_refused_by_name(registry, kind):
    with pytest.raises(UserError, match=f"rope.scaling.type.*{kind}"):
        hparams(registry, rope__scaling__type=kind, rope__scaling__factor=4.0)


def test_ntk_alpha_is_refused(registry):
    with pytest.raises(UserError, match="rope.scaling.alpha"):
        hparams(registry, rope__scaling__alpha=1000.0)


def test_experts(registry):
    hp = hparams(registry, expert_count=4, expert_used_count=2)
    assert (hp.n_expert, hp.n_expert_used) == (4, 2)
    names = {s.name for s in registry.arch_tensors("llama", hp)}
    assert {"blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight"} <= names
    assert "blk.0.ffn_gate.weight" not in names and "blk.0.ffn_gate.bias" not in names
    with pytest.raises(UserError, match="expert_used_count"):
        hparams(registry, expert_count=4, expert_used_count=5)
    for arch in ("qwen2", "qwen3", "gemma3"):
        with pytest.raises(UserError, match="expert_count"):
            hparams(registry, arch, expert_count=4, expert_used_count=2)


def test_value_length_must_equal_key_length(registry):
    assert hparams(registry, attention__key_length=16, attention__value_length=16).head_dim == 16
    with pytest.raises(UserError, match="value_length"):
        hparams(registry, attention__key_length=16, attention__value_length=32)


def test_optional_tensors_as_llama_cpp_declares_them(registry):
    def declared(arch):
        specs = registry.arch_tensors(arch, hparams(registry, arch))
        return {s.name: s.required for s in specs}

    llama = declared("llama")
    for name in ("rope_freqs.weight", "blk.0.attn_q.bias", "blk.0.attn_qkv.weight", "blk.0.attn_qkv.bias",
                 "blk.0.attn_output.bias", "blk.0.ffn_gate.bias", "blk.0.ffn_up.bias", "blk.0.ffn_down.bias"):
        assert llama[name] is False, name
    qwen2 = declared("qwen2")
    assert qwen2["blk.0.attn_q.bias"] is False and "blk.0.attn_output.bias" not in qwen2
    assert "rope_freqs.weight" not in qwen2  # llama.cpp's qwen2 does not read it either
    for arch in ("qwen3", "gemma3"):
        d = declared(arch)
        assert d["blk.0.attn_v.bias"] is False and d["blk.1.attn_qkv.weight"] is False


@pytest.mark.parametrize("pattern, expected", [
    (None, [True] * 5 + [False] + [True]),  # llama.cpp's default period 6
    (3, [True, True, False, True, True, False, True]),
    (0, [True] * 7),  # 0: every layer slides
    ([False, True, True, False, True, True, True], [False, True, True, False, True, True, True]),
])
def test_gemma3_sliding_window_pattern(registry, pattern, expected):
    extra = {"attention__sliding_window": 5, "n_layer": 7}
    if pattern is not None:
        extra["attention__sliding_window_pattern"] = pattern
    hp = hparams(registry, "gemma3", **extra)
    assert [w > 0 for w in hp.sliding_window] == expected


def test_gemma3_sliding_window_pattern_of_the_wrong_length_is_refused(registry):
    with pytest.raises(UserError, match="sliding_window_pattern"):
        hparams(registry, "gemma3", attention__sliding_window=5, attention__sliding_window_pattern=[True, False, True])


def test_qwen2_lm_head_bias(registry):
    """``output.bias`` (llama.cpp's qwen2 reads it when present) is added to every logit row."""
    import numpy as np

    from plinth.graph import Batch
    from plinth.testing import new_cache, random_tensors

    hp = hparams(registry, "qwen2")
    arch = registry.architecture("qwen2")
    weights = random_tensors(arch.synthetic_tensors(hp), seed=5)
    be = registry.make_backend("numpy")
    ids = [3, 9, 27, 4]

    def logits(w):
        graph = registry.arch_build("qwen2", hp, dict(w), be)
        return graph.forward(Batch.from_tokens(ids, output="all"), new_cache(graph, hp.n_layer)).logits

    bias = np.linspace(-1, 1, hp.n_vocab, dtype=np.float32)
    np.testing.assert_allclose(logits({**weights, "output.bias": bias}), logits(weights) + bias, atol=1e-5, rtol=0)

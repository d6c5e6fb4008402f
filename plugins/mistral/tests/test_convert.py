"""Converter pieces: text config forms, the YaRN attention factor and softmax scale against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from plinth.testing import load_module
from plinth_mistral.convert import metadata, text_config, yarn_attention_factor

golden = load_module(Path(__file__).resolve().parent / "golden" / "make_golden.py")
A = "mistral_large4"


def test_flat_and_nested_text_configs_give_the_same_metadata():
    cfg = golden.config("issue")
    assert metadata(text_config(cfg), "x") == metadata(text_config(cfg["text_config"]), "x")


def test_missing_rope_parameters_take_the_reference_default():
    md = metadata(text_config(golden.config("issue")), "x")
    assert (md[f"{A}.rope.scaling.type"], md[f"{A}.rope.scaling.factor"],
            md[f"{A}.rope.scaling.original_context_length"], md[f"{A}.rope.scaling.attn_factor"]) == \
        ("yarn", 2048.0, 512, 1.0)


def test_yarn_attention_factor_without_an_explicit_value():
    assert yarn_attention_factor({"factor": 1.0}) == 1.0
    assert abs(yarn_attention_factor({"factor": 40.0}) - (0.1 * 3.6888794541139363 + 1)) < 1e-12
    assert yarn_attention_factor({"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}) == 1.0


@pytest.mark.ref
@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 512},
])
def test_attention_factor_and_scale_match_transformers(rope):
    pytest.importorskip("torch")
    from transformers import MistralLarge4TextConfig
    from transformers.models.mistral_large4 import modeling_mistral_large4 as m

    tc = dict(golden.CASES["issue"]["text"], rope_parameters=dict(rope))
    cfg = MistralLarge4TextConfig(**tc)
    md = metadata(tc, "x")
    assert abs(md[f"{A}.rope.scaling.attn_factor"] - m.MistralLarge4TextRotaryEmbedding(cfg).attention_scaling) < 1e-6
    assert abs(md[f"{A}.attention.scale"] - m.MistralLarge4TextAttention(cfg, 0).scaling) < 1e-7

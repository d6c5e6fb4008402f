"""The compressed layers' YaRN RoPE: frequencies ramped, cos/sin NOT multiplied by an attention factor.

transformers 5.24 multiplies a YaRN rope's cos/sin by ``attention_factor``; its DeepseekV4Config sets
that to 1.0 for a flat ``rope_scaling`` / ``rope_parameters`` (the form DeepSeek's config.json has),
but a config already nested per rope type (``{"main": .., "compress": {"rope_type": "yarn", ..}}``)
without the key gets YaRN's default ``0.1 ln(factor) + 1`` (1.1386 at factor 4), and then differs
from plinth. plinth follows DeepSeek's reference inference code (``precompute_freqs_cis`` returns
unit-modulus ``torch.polar(ones, angles)``) and llama.cpp (``deepseek4.cpp`` passes
``attn_factor = 1 / (1 + 0.1 ln(1 / freq_scale))``, which cancels the mscale ggml's YaRN rope
multiplies in). See the README's "Compressed layers' RoPE".
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from plinth.errors import UserError
from plinth.testing import load_module
from plinth_deepseek41.convert import gguf_metadata

golden = load_module(Path(__file__).resolve().parent / "golden" / "make_golden.py")


def reference_angles(dim: int, positions: np.ndarray, orig_ctx: int, base: float, factor: float,
                     beta_fast: float, beta_slow: float) -> np.ndarray:
    """The reference's YaRN angles, written here from its recipe: correction dims floored / ceiled and
    clamped, a linear ramp between them, ``freqs / factor * (1 - smooth) + freqs * smooth``."""
    def corr_dim(rot: float) -> float:
        return dim * math.log(orig_ctx / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr_dim(beta_fast)), 0), min(math.ceil(corr_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    smooth = 1.0 - np.clip((np.arange(dim // 2) - low) / (high - low), 0.0, 1.0)
    freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return np.outer(positions, freqs)


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory):
    return golden.plinth_model("yarn_hc2", tmp_path_factory.mktemp("yarn"))


def test_compressed_rope_is_unit_modulus_yarn(yarn_model):
    hp = yarn_model.hparams
    assert hp.rope_yarn_factor == 4.0 and hp.rope_yarn_orig_ctx == 256
    pos = np.arange(0, 1024, 7)
    cos, sin = (np.asarray(a, dtype=np.float64) for a in yarn_model.graph.rope_comp(pos))
    # no attention factor: |cos + i sin| = 1 (transformers' nested-config default would give 1.1386)
    np.testing.assert_allclose(cos ** 2 + sin ** 2, 1.0, atol=1e-5)
    ang = reference_angles(hp.n_rot, pos, hp.rope_yarn_orig_ctx, hp.compress_rope_base, hp.rope_yarn_factor,
                           hp.rope_yarn_beta_fast, hp.rope_yarn_beta_slow)
    np.testing.assert_allclose(cos, np.cos(ang), atol=2e-4)
    np.testing.assert_allclose(sin, np.sin(ang), atol=2e-4)
    # the window layers: the main base, no YaRN
    cos_w, sin_w = (np.asarray(a, dtype=np.float64) for a in yarn_model.graph.rope_main(pos))
    plain = np.outer(pos, 1.0 / hp.rope_base ** (np.arange(0, hp.n_rot, 2) / hp.n_rot))
    np.testing.assert_allclose(cos_w, np.cos(plain), atol=2e-4)


def test_nested_config_without_attention_factor_converts_unscaled_and_an_explicit_one_is_refused():
    cfg = dict(golden.CASES["yarn_hc2"]["config"])
    yarn = dict(cfg.pop("rope_parameters"))
    nested = dict(cfg, rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0},
                                        "compress": dict(yarn, rope_theta=160000.0)})
    md = gguf_metadata(nested, "nested/config.json", "n")
    assert md["deepseek4.rope.scaling.type"] == "yarn" and md["deepseek4.rope.scaling.factor"] == 4.0
    bad = dict(cfg, rope_parameters={"main": {"rope_type": "default"},
                                     "compress": dict(yarn, attention_factor=1.1386)})
    with pytest.raises(UserError, match="attention_factor 1.1386 != 1"):
        gguf_metadata(bad, "bad/config.json", "b")


@pytest.mark.ref
def test_transformers_scales_only_a_nested_config_without_attention_factor():
    """What the reporter saw: transformers' compress-rope scaling is 1.0 for DeepSeek's flat config and
    ``0.1 ln 4 + 1`` for a nested one lacking ``attention_factor``; plinth's logits equal the former (the golden)."""
    pytest.importorskip("torch")
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    fields = {k: v for k, v in golden.CASES["yarn_hc2"]["config"].items() if k not in ("architectures", "model_type")}
    flat = DeepseekV4RotaryEmbedding(DeepseekV4Config(**fields))
    assert flat.compress_attention_scaling == 1.0
    yarn = dict(fields.pop("rope_parameters"))
    nested = DeepseekV4Config(**fields, rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "compress": dict(yarn, rope_theta=160000.0, partial_rotary_factor=0.5)})
    assert DeepseekV4RotaryEmbedding(nested).compress_attention_scaling == pytest.approx(0.1 * math.log(4) + 1)

"""Write the golden reference files of plinth-mistral (tiny random Mistral Large 4 models).

Run by hand (needs torch and transformers, ``pip install -e 'plugins/mistral[ref]'``)::

    python plugins/mistral/tests/golden/make_golden.py            # all cases
    python plugins/mistral/tests/golden/make_golden.py issue      # one case

Each case is a ``MistralLarge4Config`` (a tiny pixtral vision tower plus the text config of
``CASES``). Its weights are drawn with numpy from the case's seed under the Mistral-native names
transformers' ``save_pretrained`` writes, and saved as an HF folder by :func:`write_hf_folder`
without torch. Parameters the reference initialises to a constant are drawn at O(1) scale: the
LeRoPE ``alpha`` (init 0), the log-position query scaling (init scale 0 / bias 1), the router
(init 0), the LayerNorm biases.

The reference is ``MistralLarge4ForConditionalGeneration.from_pretrained(folder)`` (float32,
eager attention; loading must report no missing or unexpected tensor): all-position logits for
prompts of 1, 7, 24 and 200 tokens and a 16-token greedy continuation of each (full recompute
per step). ``<case>.npz`` stores those with the config and seeds, not the weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent

PROMPT_LENGTHS = (1, 7, 24, 200)
N_GREEDY = 16

VISION: dict[str, Any] = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, patch_size=4, image_size=16, head_dim=16)

_TEXT: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    index_n_heads=16, index_head_dim=16, max_position_embeddings=1048576, first_k_dense_replace=1,
    rms_norm_eps=1e-5, routed_scaling_factor=1.0, final_logit_softcapping=30.0,
)

CASES: dict[str, dict[str, Any]] = {
    # the config: store / reuse / reuse_but_indexer / own, full-shared-full-shared, last layer NoPE;
    # top-k 5 is below every prompt length but the first
    "issue": dict(seed=501, prompt_seed=601, text=dict(
        _TEXT, index_topk=5, indexer_types=["full", "shared", "full", "shared"], kv_source_layers=[0, 0, 0, 3],
        no_rope_layers=[1, 1, 1, 0])),
    # no sharing, every layer its own indexer, all RoPE, top-k above every prompt (dense attention),
    # two dense layers, routed scaling, no group limit
    "dense_topk": dict(seed=502, prompt_seed=602, text=dict(
        _TEXT, index_topk=256, indexer_types=["full"] * 4, kv_source_layers=[0, 1, 2, 3], no_rope_layers=[1] * 4,
        first_k_dense_replace=2, n_group=1, topk_group=1, routed_scaling_factor=2.5)),
    # NoPE layers sharing with NoPE layers, RoPE with RoPE: reuse (shared indexer) and reuse_but_indexer;
    # top-k 16 (between the prompt lengths); another YaRN (theta 1e6, factor 64 over 256, beta_fast 16)
    "nope_share": dict(seed=503, prompt_seed=603, text=dict(
        _TEXT, index_topk=16, indexer_types=["full", "full", "shared", "full"], kv_source_layers=[0, 1, 0, 1],
        no_rope_layers=[0, 1, 0, 1], max_position_embeddings=16384,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 64.0, "attention_factor": 1.0,
                         "original_max_position_embeddings": 256, "beta_fast": 16.0, "beta_slow": 1.0})),
    # six layers, two shared-indexer runs, a store layer read by two later layers, 4 groups of 2 used
    "deep": dict(seed=504, prompt_seed=604, text=dict(
        _TEXT, num_hidden_layers=6, index_topk=40, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
        topk_group=2, indexer_types=["full", "shared", "shared", "full", "shared", "full"],
        kv_source_layers=[0, 0, 2, 3, 2, 0], no_rope_layers=[1, 1, 0, 1, 0, 1])),
}


def config(case: str) -> dict[str, Any]:
    """The full HF config.json of ``case``."""
    return {"architectures": ["MistralLarge4ForConditionalGeneration"], "model_type": "mistral_large4",
            "text_config": dict(CASES[case]["text"], model_type="mistral_large4_text"),
            "vision_config": dict(VISION), "image_token_index": 10, "spatial_merge_size": 2,
            "projector_hidden_act": "gelu", "multimodal_projector_bias": False, "vision_feature_layer": -1,
            "tie_word_embeddings": False}


# --------------------------------------------------------------------------- HF-format weights (no torch)

def hf_random_state(cfg: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Random weights under the Mistral-native names, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    t = cfg["text_config"]
    d, n = t["hidden_size"], t["num_hidden_layers"]
    h, r, nope, rot, v = (t["num_attention_heads"], t["kv_lora_rank"], t["qk_nope_head_dim"],
                          t["qk_rope_head_dim"], t["v_head_dim"])
    ni, di = t["index_n_heads"], t["index_head_dim"]
    kv_source, idx_types, rope = t["kv_source_layers"], t["indexer_types"], t["no_rope_layers"]
    n_dense = t.get("first_k_dense_replace", 1)

    def lin(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        return (gain * rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def vec(n_: int, mean: float, std: float) -> np.ndarray:
        return (mean + std * rng.standard_normal(n_)).astype(np.float32)

    sd = {"tok_embeddings.weight": rng.standard_normal((t["vocab_size"], d)).astype(np.float32),
          "lerope.alpha": vec(rot // 2, 0.0, 0.5)}
    for i in range(n):
        p = f"layers.{i}."
        sd[p + "attention_norm.weight"] = vec(d, 1.0, 0.1)
        sd[p + "ffn_norm.weight"] = vec(d, 1.0, 0.1)
        a = p + "attention."
        rw = rot if rope[i] else 0
        sd[a + "wq.weight"] = lin(h * (nope + rot), d)
        if kv_source[i] == i:
            sd[a + "wkv_a_with_mqa.weight"] = lin(r + rw, d)
            sd[a + "kv_a_norm.weight"] = vec(r, 1.0, 0.1)
        sd[a + "wkv_b.weight"] = lin(h * (nope + rot - rw + v), r)
        sd[a + "wo.weight"] = lin(d, h * v)
        sd[a + "ssmax_scaling.s"] = vec(h, 0.0, 0.3)
        sd[a + "ssmax_scaling.b"] = vec(h, 1.0, 0.3)
        if idx_types[i] == "full":
            x = a + "indexer."
            sd[x + "wq_b.weight"] = lin(ni * di, d)
            sd[x + "wk.weight"] = lin(di, d)
            sd[x + "k_norm.weight"] = vec(di, 1.0, 0.2)
            sd[x + "k_norm.bias"] = vec(di, 0.0, 0.2)
            sd[x + "q_input_norm.weight"] = vec(d, 1.0, 0.2)
            sd[x + "q_input_norm.bias"] = vec(d, 0.0, 0.2)
            sd[x + "weights_proj.weight"] = lin(ni, d, 2.0)
            sd[x + "ssmax_scaling.s"] = vec(ni, 0.0, 0.3)
            sd[x + "ssmax_scaling.b"] = vec(ni, 1.0, 0.3)
        if i < n_dense:
            ff = t["intermediate_size"]
            sd[p + "feed_forward.w1.weight"] = lin(ff, d)
            sd[p + "feed_forward.w2.weight"] = lin(d, ff)
            sd[p + "feed_forward.w3.weight"] = lin(ff, d)
        else:
            ff, e = t["moe_intermediate_size"], t["n_routed_experts"]
            sd[p + "gate.weight"] = lin(e, d, 3.0)
            for j in range(e):
                sd[p + f"experts.{j}.w1.weight"] = lin(ff, d)
                sd[p + f"experts.{j}.w2.weight"] = lin(d, ff)
                sd[p + f"experts.{j}.w3.weight"] = lin(ff, d)
            sh = ff * t["n_shared_experts"]
            sd[p + "shared_experts.w1.weight"] = lin(sh, d)
            sd[p + "shared_experts.w2.weight"] = lin(d, sh)
            sd[p + "shared_experts.w3.weight"] = lin(sh, d)
    sd["norm.weight"] = vec(d, 1.0, 0.1)
    sd["output.weight"] = lin(t["vocab_size"], d, 2.0)
    sd.update(vision_state(cfg, rng))
    return sd


def vision_state(cfg: dict[str, Any], rng: Any) -> dict[str, np.ndarray]:
    """The tiny pixtral tower and projector (the converter skips them; the reference needs them)."""
    vc, d = cfg["vision_config"], cfg["text_config"]["hidden_size"]
    hv, fv, p, m = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"], cfg["spatial_merge_size"]

    def w(*shape: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    sd = {"vision_encoder.ln_pre.weight": w(hv) + 1, "vision_encoder.patch_conv.weight": w(hv, 3, p, p),
          "patch_merger.merging_layer.weight": w(hv, hv * m * m), "pre_mm_projector_norm.weight": w(hv) + 1,
          "vision_language_adapter.w_in.weight": w(d, hv), "vision_language_adapter.w_out.weight": w(d, d)}
    for i in range(vc["num_hidden_layers"]):
        b = f"vision_encoder.transformer.layers.{i}."
        for x in ("wq", "wk", "wv", "wo"):
            sd[b + f"attention.{x}.weight"] = w(hv, hv)
        sd[b + "attention_norm.weight"] = w(hv) + 1
        sd[b + "ffn_norm.weight"] = w(hv) + 1
        sd[b + "feed_forward.w1.weight"] = w(fv, hv)
        sd[b + "feed_forward.w2.weight"] = w(hv, fv)
        sd[b + "feed_forward.w3.weight"] = w(fv, hv)
    return sd


def write_hf_folder(case: str, folder: Path, state: dict[str, np.ndarray] | None = None,
                    cfg: dict[str, Any] | None = None) -> Path:
    cfg = cfg or config(case)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    from plinth.testing import write_safetensors

    write_safetensors(folder / "model.safetensors", state or hf_random_state(cfg, CASES[case]["seed"]))
    return folder


def registry() -> Any:
    from plinth.testing import make_registry
    from plinth_mistral.plugin import plugin

    return make_registry(plugin)


def plinth_model(case: str, tmp: Path, reg: Any = None, backend: str = "numpy") -> Any:
    """The case converted by plinth's converter and loaded through the plugin (on ``backend``)."""
    from plinth.model import load_model
    from plinth.testing.golden import convert_and_load

    reg = reg or registry()
    out = tmp / f"{case}.gguf"
    if out.exists():
        return load_model(out, registry=reg, backend=backend)
    return convert_and_load(write_hf_folder(case, tmp / f"{case}-hf"), out, reg, backend=backend)


def prompts(case: str) -> list[list[int]]:
    """Prompts of distinct tokens: on a NoPE indexer layer two equal tokens have equal index keys, an exact
    tie whose order at the top-k boundary neither implementation defines."""
    rng = np.random.default_rng(CASES[case]["prompt_seed"])
    return [rng.permutation(CASES[case]["text"]["vocab_size"])[:n].tolist() for n in PROMPT_LENGTHS]


# --------------------------------------------------------------------------- reference side (torch)

def hf_reference(folder: Path) -> Any:
    """``MistralLarge4ForConditionalGeneration.from_pretrained(folder)``: float32, eager attention, every
    tensor loaded."""
    from transformers import MistralLarge4ForConditionalGeneration

    from plinth.testing.reference import HFReference

    return HFReference(MistralLarge4ForConditionalGeneration, folder)


def reference(case: str, tmp: Path, with_greedy: bool = True) -> dict[str, Any]:
    """The golden record of ``case`` computed now (``with_greedy=False``: logits only, much faster)."""
    from plinth.testing.reference import reference_record

    c = CASES[case]
    info = {"seed": c["seed"], "prompt_seed": c["prompt_seed"], "config": config(case)}
    return reference_record(info, prompts(case), lambda: hf_reference(write_hf_folder(case, tmp / f"{case}-hf")),
                            N_GREEDY, with_greedy=with_greedy)


def main(argv: list[str]) -> int:
    from plinth.testing.golden import write_golden_files

    write_golden_files(HERE, argv or sorted(CASES), reference)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

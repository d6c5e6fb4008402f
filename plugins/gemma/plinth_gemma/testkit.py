"""Tiny random Gemma 4 targets and Gemma 4 assistants as Hugging Face folders (numpy only; tests and benchmarks).

``write_target(folder, case)`` and ``write_assistant(folder, case)`` write ``config.json`` +
``model.safetensors`` + ``tokenizer.json`` (a byte-level BPE padded with reserved tokens to the
vocabulary size). Every weight is drawn, including those transformers initialises to 0 or 1 (norm
weights, ``layer_scalar``); the assistant's ``token_ordering`` is a random permutation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

S, F = "sliding_attention", "full_attention"
N_VOCAB = 320  # 16 centroid clusters of 20 tokens
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}

_TARGET: dict[str, Any] = dict(
    architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=N_VOCAB, hidden_size=64,
    intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    sliding_window=8, max_position_embeddings=1024, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
    pad_token_id=None, bos_token_id=None, eos_token_id=256, hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=N_VOCAB, num_kv_shared_layers=0, attention_k_eq_v=False, enable_moe_block=False,
    use_double_wide_mlp=False, final_logit_softcapping=30.0, tie_word_embeddings=True, rope_parameters=ROPE,
)

#: target configs: a plain S S F model, and one whose last two layers share K/V (store layers 1 and 2)
TARGETS: dict[str, dict[str, Any]] = {
    "plain": dict(_TARGET, num_hidden_layers=3, layer_types=[S, S, F]),
    "shared": dict(_TARGET, num_hidden_layers=5, layer_types=[S, S, F, S, F], num_kv_shared_layers=2),
}

#: assistant configs (over a target of hidden size 64: head sizes 16 / 32, 2 K/V heads)
ASSISTANTS: dict[str, dict[str, Any]] = {
    "plain": dict(layer_types=[S, F], use_ordered_embeddings=False),
    "ordered": dict(layer_types=[S, S, F], use_ordered_embeddings=True, num_centroids=16,
                    centroid_intermediate_top_k=4),
}


def tokenizer(n_vocab: int = N_VOCAB) -> dict[str, Any]:
    from plinth.testing.hf import byte_bpe_tokenizer

    tok = byte_bpe_tokenizer()
    tok["added_tokens"] += [{"id": i, "content": f"<unused{i}>", "special": True} for i in range(257, n_vocab)]
    return tok


def _lin(rng: np.random.Generator, n_out: int, n_in: int) -> np.ndarray:
    return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)


def _norm(rng: np.random.Generator, n: int) -> np.ndarray:
    return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)


def target_state(c: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Random weights of a dense Gemma 4 text config (no per-layer embeddings, no MoE, no k_eq_v) under
    transformers' saved names."""
    rng = np.random.default_rng(seed)
    d, v, n_layer = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    first_shared = n_layer - c["num_kv_shared_layers"]
    sd = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(np.float32) * np.float32(0.5)}
    for il, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{il}."
        hd = c["head_dim"] if kind == S else c["global_head_dim"]
        n_kv, ff = c["num_key_value_heads"], c["intermediate_size"]
        sd.update({p + "layer_scalar": rng.uniform(0.5, 1.5, 1).astype(np.float32),
                   p + "input_layernorm.weight": _norm(rng, d),
                   p + "self_attn.q_proj.weight": _lin(rng, c["num_attention_heads"] * hd, d),
                   p + "self_attn.q_norm.weight": _norm(rng, hd)})
        if il < first_shared:
            sd.update({p + "self_attn.k_proj.weight": _lin(rng, n_kv * hd, d),
                       p + "self_attn.k_norm.weight": _norm(rng, hd),
                       p + "self_attn.v_proj.weight": _lin(rng, n_kv * hd, d)})
        sd.update({p + "self_attn.o_proj.weight": _lin(rng, d, c["num_attention_heads"] * hd),
                   p + "post_attention_layernorm.weight": _norm(rng, d),
                   p + "pre_feedforward_layernorm.weight": _norm(rng, d),
                   p + "mlp.gate_proj.weight": _lin(rng, ff, d), p + "mlp.up_proj.weight": _lin(rng, ff, d),
                   p + "mlp.down_proj.weight": _lin(rng, d, ff),
                   p + "post_feedforward_layernorm.weight": _norm(rng, d)})
    sd["model.norm.weight"] = _norm(rng, d)
    return sd


def write_target(folder: str | Path, case: str = "plain", seed: int = 0) -> Path:
    from plinth.testing.hf import write_hf_folder

    cfg = TARGETS[case]
    return write_hf_folder(folder, cfg, target_state(cfg, seed), tokenizer=tokenizer(cfg["vocab_size"]))


def assistant_config(case: str = "plain", target: dict[str, Any] | None = None) -> dict[str, Any]:
    t = target or TARGETS["plain"]
    a = ASSISTANTS[case]
    n = len(a["layer_types"])
    text = dict(_TARGET, hidden_size=48, intermediate_size=80, num_hidden_layers=n, layer_types=list(a["layer_types"]),
                num_attention_heads=4, num_key_value_heads=t["num_key_value_heads"], head_dim=t["head_dim"],
                global_head_dim=t["global_head_dim"], sliding_window=t["sliding_window"], num_kv_shared_layers=n,
                vocab_size=t["vocab_size"], vocab_size_per_layer_input=0)
    text.pop("architectures")
    cfg = dict(architectures=["Gemma4AssistantForCausalLM"], model_type="gemma4_assistant", text_config=text,
               backbone_hidden_size=t["hidden_size"], tie_word_embeddings=True,
               use_ordered_embeddings=a["use_ordered_embeddings"])
    if a["use_ordered_embeddings"]:
        cfg.update(num_centroids=a["num_centroids"], centroid_intermediate_top_k=a["centroid_intermediate_top_k"])
    return cfg


def assistant_state(cfg: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = cfg["text_config"]
    d, v, eb = t["hidden_size"], t["vocab_size"], cfg["backbone_hidden_size"]
    sd = {"model.embed_tokens.weight": (0.5 * rng.standard_normal((v, d))).astype(np.float32),
          "model.norm.weight": _norm(rng, d),
          "pre_projection.weight": _lin(rng, d, 2 * eb),
          "post_projection.weight": _lin(rng, eb, d)}
    for il, kind in enumerate(t["layer_types"]):
        p, hd = f"model.layers.{il}.", t["head_dim"] if kind == S else t["global_head_dim"]
        ff = t["intermediate_size"]
        sd.update({p + "layer_scalar": rng.uniform(0.5, 1.5, 1).astype(np.float32),
                   p + "input_layernorm.weight": _norm(rng, d),
                   p + "self_attn.q_proj.weight": _lin(rng, t["num_attention_heads"] * hd, d),
                   p + "self_attn.q_norm.weight": _norm(rng, hd),
                   p + "self_attn.o_proj.weight": _lin(rng, d, t["num_attention_heads"] * hd),
                   p + "post_attention_layernorm.weight": _norm(rng, d),
                   p + "pre_feedforward_layernorm.weight": _norm(rng, d),
                   p + "mlp.gate_proj.weight": _lin(rng, ff, d), p + "mlp.up_proj.weight": _lin(rng, ff, d),
                   p + "mlp.down_proj.weight": _lin(rng, d, ff),
                   p + "post_feedforward_layernorm.weight": _norm(rng, d)})
    if cfg.get("use_ordered_embeddings"):
        sd["masked_embedding.centroids.weight"] = _lin(rng, cfg["num_centroids"], d)
        sd["masked_embedding.token_ordering"] = rng.permutation(v).astype(np.int64)
    return sd


def write_assistant(folder: str | Path, case: str = "plain", seed: int = 1, target: str = "plain") -> Path:
    from plinth.testing.hf import write_hf_folder

    cfg = assistant_config(case, TARGETS[target])
    return write_hf_folder(folder, cfg, assistant_state(cfg, seed), tokenizer=tokenizer(cfg["text_config"]["vocab_size"]))


def convert_pair(tmp: str | Path, target: str = "plain", assistant: str = "plain") -> tuple[Path, Path, Path, Path]:
    """(target folder, target GGUF, assistant folder, assistant GGUF), converted by plinth's converters (the
    assistant's centroid tensors kept: ``--option centroids=yes``)."""
    from .assistant import Gemma4AssistantConverter
    from .convert import Gemma4Converter

    tmp = Path(tmp)
    tf = write_target(tmp / f"target-{target}", target)
    af = write_assistant(tmp / f"assistant-{assistant}-{target}", assistant, target=target)
    tg, ag = tmp / f"target-{target}.gguf", tmp / f"assistant-{assistant}-{target}.gguf"
    Gemma4Converter().convert(str(tf), str(tg), {})
    Gemma4AssistantConverter().convert(str(af), str(ag), {"centroids": "yes"})
    return tf, tg, af, ag

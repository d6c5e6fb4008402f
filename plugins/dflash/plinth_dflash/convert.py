"""``plinth convert``: published DFlash / DFlash2 (and LiLiCorr) HF drafts to ``dflash`` GGUFs.

The HF layout (z-lab): ``config.json`` is a Qwen3 config plus ``dflash_config``
(``target_layer_ids``, ``block_size``, ``mask_token_id``; DFlash2 adds the conv and
selector sizes); the safetensors hold ``fc``, ``hidden_norm``, ``norm`` and
``layers.N.*`` with no ``model.`` prefix and, usually, no embedding or LM head.

What the converter does (llama.cpp ``conversion/qwen.py`` ``DFlashModel`` semantics):

* the +1 rule: ``dflash.target_layers = [id + 1 for id in target_layer_ids]`` (taps are
  layer *inputs*); without ids, z-lab's ``build_target_layer_ids`` rule is used;
* ``layer_types`` -> ``attention.sliding_window`` and a **bool** ``sliding_window_pattern``;
  the reference makes sliding layers causal unless ``is_causal`` is set, which is written
  as the per-layer ``attention.causal_layers`` (see README);
* the tied flag ``dflash.tie_word_embeddings`` only when the draft ships its own
  embedding and no ``lm_head`` (the head is then that embedding);
* every ``dflash_config`` key it does not understand, quantised checkpoints, biases,
  other decoder types and reduced vocabularies are refused with the reason.

Options (``--option KEY=VALUE``): ``target=TARGET.gguf`` copies the tokenizer and checks
the hidden size and layer count; ``drop_embeddings=1`` leaves out an untrained
``embed_tokens`` (llama.cpp #26905); ``outtype=f32|f16``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from plinth.convert import SafetensorsDir, read_config, write_gguf
from plinth.errors import UserError

from . import constants as C

A = C.ARCH

LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
GLOBAL_MAP = {
    "fc.weight": C.T_FC,
    "hidden_norm.weight": C.T_ENC_NORM,
    "norm.weight": C.T_OUTPUT_NORM,
    "embed_tokens.weight": C.T_TOKEN_EMBD,
    "lm_head.weight": C.T_OUTPUT,
    "candidate_selector.predecessor_codebook.weight": C.T_SEL_PRED,
    "candidate_selector.predecessor_codebook": C.T_SEL_PRED,
    "candidate_selector.successor_codebook.weight": C.T_SEL_SUCC,
    "candidate_selector.successor_codebook": C.T_SEL_SUCC,
    "candidate_selector.hidden_projection.weight": C.T_SEL_HIDDEN,
}
# LiLiCorr head (plinth's assumed HF layout, see README); its layers stay in their own namespace
LILI_GLOBAL_MAP = {
    "token_proj": "token_proj", "pass_hidden_proj": "pass_hidden_proj", "feature_mlp.0": "feat_norm",
    "feature_mlp.1": "feat_up", "feature_mlp.3": "feat_down", "slot_embedding": "slot_embd",
    "rank_embedding": "rank_embd", "output_norm": "output_norm", "context_proj": "ctx_proj",
    "anchor_norm": "anchor_norm", "factor_in": "factor_in", "out_head": "out_head", "in_head": "in_head",
    "anchor_out_head": "anchor_out_head",
}
LILI_LAYER_MAP = {
    "attn_norm.weight": "attn_norm.weight", "attn.in_proj_weight": "attn_qkv.weight",
    "attn.in_proj_bias": "attn_qkv.bias", "attn.out_proj.weight": "attn_output.weight",
    "attn.out_proj.bias": "attn_output.bias", "relative_slot_bias": "attn_rel_bias",
    "same_slot_bias": "attn_same_bias", "mlp_norm.weight": "ffn_norm.weight", "mlp.0.weight": "ffn_up.weight",
    "mlp.0.bias": "ffn_up.bias", "mlp.2.weight": "ffn_down.weight", "mlp.2.bias": "ffn_down.bias",
}

#: dflash_config keys the converter understands (anything else is refused)
KNOWN_DFLASH_KEYS = {
    "target_layer_ids", "block_size", "mask_token_id", "num_anchors", "loss_decay_gamma", "causal", "use_swa",
    "swa_window_size", "input_embedding_scale", "conv_kernel_size", "conv_group_size", "selector_rank",
    "selector_top_k", "output_multiplier", "final_logit_softcapping", "selector_loss_weight",
}
LILI_KEYS = ("lilicorr_enabled", "lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers",
             "lilicorr_num_heads", "lilicorr_mlp_ratio", "lilicorr_factor_dim", "lilicorr_vector_eps",
             "lilicorr_logit_scale")
TRAINING_ONLY = {"num_anchors", "loss_decay_gamma", "selector_loss_weight"}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default taps (HF ids, before +1): [L//2] for one layer, else spread over [1, L-3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def map_tensor_name(name: str, backbone: str = "qwen3") -> str | None:
    """HF tensor name -> GGUF name; None for tensors that are dropped; raises for unknown ones. ``backbone``: the
    decoder ``model_type`` (a Gemma 4 layer has post norms, a pre-FFN norm and a layer scale)."""
    n = name[len("model."):] if name.startswith("model.") else name
    if n in GLOBAL_MAP:
        return GLOBAL_MAP[n]
    if n in ("d2t", "t2d"):
        return None
    layer_map = GEMMA4_LAYER_MAP if backbone == "gemma4_text" else LAYER_MAP
    m = re.match(r"^layers\.(\d+)\.(.+)$", n)  # anchored: 'lilicorr.layers.N' never matches here
    if m and m.group(2) in layer_map:
        return f"blk.{m.group(1)}.{layer_map[m.group(2)]}"
    m = re.match(r"^lilicorr\.layers\.(\d+)\.(.+)$", n)
    if m and m.group(2) in LILI_LAYER_MAP:
        return f"lilicorr.blk.{m.group(1)}.{LILI_LAYER_MAP[m.group(2)]}"
    m = re.match(r"^lilicorr\.(.+)\.(weight|bias)$", n)
    if m and m.group(1) in LILI_GLOBAL_MAP:
        return f"lilicorr.{LILI_GLOBAL_MAP[m.group(1)]}.{m.group(2)}"
    raise UserError(f"tensor {name!r} is not part of the DFlash/DFlash2/LiLiCorr layout plinth understands"
                    + (" (Gemma 4 backbone)" if backbone == "gemma4_text" else ""))


def generated_tensors(md: dict[str, Any]) -> dict[str, np.ndarray]:
    """Tensors the backbone's config implies (a Gemma 4 draft's ``rope_freqs``), taken out of ``md``."""
    out = {}
    if GEMMA4_ROPE_FREQS in md:
        out[C.T_ROPE_FREQS] = md.pop(GEMMA4_ROPE_FREQS)
    return out


def gemma4_tensor(name: str, arr: np.ndarray) -> np.ndarray:
    """Gemma 4's ``layer_scalar`` is a 1-element buffer (GGUF [1])."""
    return arr.reshape(1) if name.endswith(C.T_LAYER_OUT_SCALE) else arr


def _refuse(model_dir: Any, why: str) -> UserError:
    return UserError(f"{model_dir}: cannot convert this draft: {why}")


#: decoder ``model_type`` values of a draft backbone
BACKBONES = ("qwen3", "gemma4_text")

#: a Gemma 4 layer's names where they differ from the Qwen3 map (post norms, the pre-FFN norm, the layer scale)
GEMMA4_LAYER_MAP = {
    **LAYER_MAP,
    "post_attention_layernorm.weight": C.T_POST_ATTN_NORM,
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": C.T_POST_FFN_NORM,
    "layer_scalar": C.T_LAYER_OUT_SCALE,
    "layer_scalar.weight": C.T_LAYER_OUT_SCALE,
}
#: Gemma 4 text-config features a draft backbone does not have (each refused by name when on)
GEMMA4_REFUSED = {
    "hidden_size_per_layer_input": "per-layer input embeddings",
    "num_kv_shared_layers": "KV sharing between layers",
    "enable_moe_block": "the MoE block",
    "final_logit_softcapping": "final logit soft-capping (llama.cpp's Gemma 4 draft converter refuses it too)",
}


def gemma4_layer_geometry(cfg: Mapping[str, Any], model_dir: Any, n_layer: int) -> tuple[list[int], list[int]]:
    """Per layer (head size, KV heads) of a ``gemma4_text`` config: sliding layers ``head_dim`` /
    ``num_key_value_heads``; full layers ``global_head_dim`` and, with ``attention_k_eq_v``,
    ``num_global_key_value_heads`` (the released configs), or what ``per_layer_config`` says (transformers 5.24
    saves the same overrides there, keyed by layer index)."""
    types = cfg["layer_types"]
    hd, nkv = int(cfg.get("head_dim") or 256), int(cfg["num_key_value_heads"])
    plc = cfg.get("per_layer_config")
    if plc is None:
        ghd = int(cfg.get("global_head_dim") or 512)
        gkv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
        plc = {il: {"head_dim": ghd, **({"num_key_value_heads": int(gkv)} if gkv else {})}
               for il, t in enumerate(types) if t == "full_attention"}
    over: dict[int, Mapping[str, Any]] = {}
    for key, val in plc.items():
        il = int(key)
        if not 0 <= il < n_layer:
            raise _refuse(model_dir, f"per_layer_config names layer {key!r} of {n_layer}")
        bad = sorted(set(val) - {"head_dim", "num_key_value_heads"})
        if bad:
            raise _refuse(model_dir, f"per_layer_config[{key!r}] sets {bad}; a draft layer may differ in head_dim "
                          "and num_key_value_heads only")
        over[il] = val
    dims = [int(over.get(il, {}).get("head_dim", hd)) for il in range(n_layer)]
    kvs = [int(over.get(il, {}).get("num_key_value_heads", nkv)) for il in range(n_layer)]
    for layer_type in ("sliding_attention", "full_attention"):
        got = {(dims[il], kvs[il]) for il in range(n_layer) if types[il] == layer_type}
        if len(got) > 1:
            raise _refuse(model_dir, f"{layer_type} layers of different head sizes {sorted(got)}; a dflash draft "
                          "has one head size per layer type")
    return dims, kvs


def gemma4_backbone(cfg: Mapping[str, Any], d: Mapping[str, Any], model_dir: Any, n_layer: int) -> dict[str, Any]:
    """GGUF keys of a Gemma 4 draft backbone (``model_type = "gemma4_text"``): each layer as transformers'
    Gemma4TextDecoderLayer computes it (post norms, layer scale, V norm, K = V on full layers with
    ``attention_k_eq_v``, tanh GELU, attention scale 1, embeddings times sqrt(hidden_size)), sliding layers
    with their head size and default RoPE, full ones with the default RoPE (the whole head, as transformers'
    Gemma 4 computes it) or the proportional one (written as
    llama.cpp's Gemma 4 draft converter does: ``rope_freqs`` 1e30 for the pairs that do not turn). Also
    returns ``n_kv`` (scalar or per layer), ``head_dim`` and ``theta`` for the common keys."""
    for key, what in GEMMA4_REFUSED.items():
        if cfg.get(key):
            raise _refuse(model_dir, f"{key} = {cfg[key]!r}: {what} is not part of a DFlash draft backbone")
    if cfg.get("use_bidirectional_attention"):
        raise _refuse(model_dir, f"use_bidirectional_attention = {cfg['use_bidirectional_attention']!r}: the "
                      "draft's own attention pattern is set by the DFlash keys (causal, layer_types)")
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise _refuse(model_dir, f"hidden_activation {act!r}; a Gemma 4 backbone's MLP is gelu_pytorch_tanh")
    if float(d.get("input_embedding_scale", 1.0)) != 1.0:
        raise _refuse(model_dir, "input_embedding_scale != 1 on a Gemma 4 backbone (its embeddings are scaled by "
                      "sqrt(hidden_size))")
    types = cfg.get("layer_types")
    if types is None or len(types) != n_layer:
        raise _refuse(model_dir, f"a Gemma 4 backbone needs layer_types with {n_layer} entries")
    dims, kvs = gemma4_layer_geometry(cfg, model_dir, n_layer)
    rp = cfg.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
    swa = [t == "sliding_attention" for t in types]
    e = int(cfg["hidden_size"])
    out: dict[str, Any] = {
        f"{A}.{C.KEY_EMBD_SCALE}": float(e) ** 0.5,
        f"{A}.{C.KEY_ATTN_SCALE}": 1.0,
        f"{A}.{C.KEY_HIDDEN_ACT}": "gelu_pytorch_tanh",
        f"{A}.{C.KEY_VALUE_NORM}": True,
        "n_kv": kvs if len(set(kvs)) > 1 else kvs[0],
    }

    def rope(layer_type: str) -> Mapping[str, Any]:
        p = rp.get(layer_type, rp) if isinstance(rp, Mapping) else None
        if not isinstance(p, Mapping):
            raise _refuse(model_dir, f"rope_parameters has no {layer_type!r} entry")
        return p

    if any(swa):
        sw = rope("sliding_attention")
        if sw.get("rope_type", "default") != "default" or sw.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise _refuse(model_dir, f"sliding layers' RoPE {dict(sw)!r}; Gemma 4 sliding layers use the default one")
        hd_swa = dims[swa.index(True)]
        out.update({f"{A}.attention.key_length_swa": hd_swa, f"{A}.attention.value_length_swa": hd_swa,
                    f"{A}.rope.freq_base_swa": float(sw["rope_theta"]), f"{A}.rope.dimension_count_swa": hd_swa})
    if all(swa):  # no full layer: the sliding geometry is the only one
        out = {k: v for k, v in out.items() if "_swa" not in k}
        out.update(head_dim=dims[0], theta=float(rope("sliding_attention")["rope_theta"]))
        return out
    full = rope("full_attention")
    hd = dims[swa.index(False)]
    rtype, frac = full.get("rope_type", "default"), float(full.get("partial_rotary_factor", 1.0) or 1.0)
    n_rot = int(round(hd * frac / 2))
    if not 0 < frac <= 1 or hd * frac != 2 * n_rot:
        raise _refuse(model_dir, f"partial_rotary_factor {frac} of head size {hd} gives no even rotary dimension count")
    if rtype == "proportional":
        out[GEMMA4_ROPE_FREQS] = np.array([1.0] * n_rot + [1e30] * (hd // 2 - n_rot), dtype=np.float32)
        out[f"{A}.rope.dimension_count"] = hd
    elif rtype == "default":  # transformers' Gemma 4 default RoPE turns the whole head (no partial factor)
        out[f"{A}.rope.dimension_count"] = hd
    else:
        raise _refuse(model_dir, f"full layers' rope_type {rtype!r}; Gemma 4 drafts take 'default' or 'proportional'")
    out.update(head_dim=hd, theta=float(full["rope_theta"]))
    return out


#: the rope_freqs tensor a Gemma 4 backbone's metadata carries to the converter (popped before writing)
GEMMA4_ROPE_FREQS = "__rope_freqs__"


def config_to_metadata(cfg: Mapping[str, Any], model_dir: Any, variant: str) -> dict[str, Any]:
    """config.json -> dflash GGUF metadata (no tokenizer); refuses what it does not understand."""
    d = dict(cfg.get("dflash_config") or {})
    unknown = sorted(k for k in d if k not in KNOWN_DFLASH_KEYS and k not in LILI_KEYS)
    if unknown:
        raise _refuse(model_dir, f"dflash_config keys {unknown} are not understood")
    backbone = cfg.get("model_type", "qwen3")
    if backbone not in BACKBONES:
        raise _refuse(model_dir, f"decoder model_type {backbone!r}; DFlash backbones are "
                      f"{', '.join(repr(b) for b in BACKBONES)}")
    if cfg.get("quantization_config"):
        raise _refuse(model_dir, "quantised checkpoints (quantization_config) are not supported; convert the "
                      "bf16/f32 release")
    if cfg.get("attention_bias"):
        raise _refuse(model_dir, "attention_bias = true (DFlash drafts have bias-free projections)")
    n_layer = int(cfg["num_hidden_layers"])
    e = int(cfg["hidden_size"])
    n_head = int(cfg["num_attention_heads"])
    if backbone == "gemma4_text":
        geometry = gemma4_backbone(cfg, d, model_dir, n_layer)
        n_kv, head_dim, theta = geometry.pop("n_kv"), geometry.pop("head_dim"), geometry.pop("theta")
    else:
        geometry = {}
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise _refuse(model_dir, f"hidden_act {act!r}; a Qwen3-style backbone takes 'silu' or "
                          "'gelu_pytorch_tanh' (plinth's GELU is the tanh approximation)")
        if act != "silu":
            geometry[f"{A}.{C.KEY_HIDDEN_ACT}"] = act
        rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rp.get("rope_type", rp.get("type", "default")) not in ("default", None):
            raise _refuse(model_dir, f"rope scaling {rp!r} is not supported for drafts")
        scale = float(d.get("input_embedding_scale", 1.0))
        if scale != 1.0:
            geometry[f"{A}.{C.KEY_EMBD_SCALE}"] = scale
        theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        n_kv = int(cfg.get("num_key_value_heads") or n_head)
        head_dim = int(cfg.get("head_dim") or e // n_head)
    ids = d.get("target_layer_ids", cfg.get("target_layer_ids"))
    if ids is None:
        if "num_target_layers" not in cfg:
            raise _refuse(model_dir, "neither dflash_config.target_layer_ids nor num_target_layers is given")
        ids = build_target_layer_ids(int(cfg["num_target_layers"]), n_layer)
    block = int(d.get("block_size", cfg.get("block_size", 16)))
    mask = d.get("mask_token_id", cfg.get("mask_token_id"))
    if mask is None:
        raise _refuse(model_dir, "no mask_token_id (dflash_config.mask_token_id)")

    md: dict[str, Any] = {
        "general.architecture": A,
        "general.name": str(cfg.get("_name_or_path") or Path(str(model_dir)).name),
        f"{A}.block_count": n_layer,
        f"{A}.embedding_length": e,
        f"{A}.feed_forward_length": int(cfg["intermediate_size"]),
        f"{A}.attention.head_count": n_head,
        f"{A}.attention.head_count_kv": n_kv,  # a per-layer list for Gemma 4 backbones
        f"{A}.attention.key_length": head_dim,
        f"{A}.attention.value_length": head_dim,
        f"{A}.{C.KEY_EPS}": float(cfg.get("rms_norm_eps", 1e-6)),
        f"{A}.rope.freq_base": theta,
        f"{A}.context_length": int(cfg.get("max_position_embeddings", 4096)),
        f"{A}.vocab_size": int(cfg["vocab_size"]),
        f"{A}.{C.KEY_TARGET_LAYERS}": [int(i) + 1 for i in ids],  # the +1 rule
        f"{A}.{C.KEY_BLOCK_SIZE}": block,
        C.KEY_MASK_TOKEN_TOK: int(mask),
        f"{A}.{C.KEY_MASK_TOKEN}": int(mask),
    }
    md.update(geometry)
    if "num_target_layers" in cfg:
        md[f"{A}.{C.KEY_TARGET_HIDDEN}"] = e
    layer_types = cfg.get("layer_types")
    if d.get("use_swa"):
        layer_types = ["sliding_attention"] * n_layer
    if layer_types is not None:
        if len(layer_types) != n_layer:
            raise _refuse(model_dir, f"layer_types has {len(layer_types)} entries for {n_layer} layers")
        bad = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if bad:
            raise _refuse(model_dir, f"layer_types {bad} are not understood")
    swa = [t == "sliding_attention" for t in (layer_types or ["full_attention"] * n_layer)]
    causal_flag = cfg.get("is_causal", d.get("causal"))
    if any(swa):
        window = d.get("swa_window_size", cfg.get("sliding_window"))
        if not window:
            raise _refuse(model_dir, "sliding layers but no sliding_window / swa_window_size")
        md[f"{A}.{C.KEY_SWA}"] = int(window)
        md[f"{A}.{C.KEY_SWA_PATTERN}"] = [bool(s) for s in swa]
        if causal_flag is None:  # reference semantics: sliding layers are causal in legacy checkpoints
            md[f"{A}.{C.KEY_CAUSAL_LAYERS}"] = [bool(s) for s in swa]
    if causal_flag is not None:
        md[f"{A}.{C.KEY_CAUSAL}"] = bool(causal_flag)
    if variant == "dflash2":
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if key not in d and key not in cfg:
                raise _refuse(model_dir, f"a DFlash2 draft needs dflash_config.{key}")
            md[f"{A}.{key}"] = int(d.get(key, cfg.get(key)))
    mult = d.get("output_multiplier", cfg.get("output_multiplier"))
    if mult is not None and float(mult) != 1.0:
        md[f"{A}.{C.KEY_LOGIT_SCALE}"] = float(mult)
    cap = d.get("final_logit_softcapping", cfg.get("final_logit_softcapping"))
    if cap is not None and float(cap) > 0:
        md[f"{A}.{C.KEY_SOFTCAP}"] = float(cap)
    if variant == "lilicorr":
        missing = [k for k in LILI_KEYS if k not in d]
        if missing:
            raise _refuse(model_dir, f"a LiLiCorr draft needs dflash_config {missing} (no defaults)")
        if not d["lilicorr_enabled"]:
            raise _refuse(model_dir, "lilicorr_enabled is false")
        md.update({
            f"{A}.{C.KEY_LILI_TOP_K}": int(d["lilicorr_candidate_topk"]),
            f"{A}.{C.KEY_LILI_HIDDEN}": int(d["lilicorr_hidden_size"]),
            f"{A}.{C.KEY_LILI_LAYERS}": int(d["lilicorr_num_layers"]),
            f"{A}.{C.KEY_LILI_HEADS}": int(d["lilicorr_num_heads"]),
            f"{A}.{C.KEY_LILI_MLP_RATIO}": float(d["lilicorr_mlp_ratio"]),
            f"{A}.{C.KEY_LILI_FACTOR}": int(d["lilicorr_factor_dim"]),
            f"{A}.{C.KEY_LILI_VEC_EPS}": float(d["lilicorr_vector_eps"]),
            f"{A}.{C.KEY_LILI_LAMBDA}": float(d["lilicorr_logit_scale"]),
        })
        if "conv_kernel_size" in d:
            md[f"{A}.conv_kernel_size"] = int(d["conv_kernel_size"])
            md[f"{A}.conv_group_size"] = int(d["conv_group_size"])
    return md


#: speculators (vllm-project/speculators, SpecForge exports) top-level keys the flat reading understands
SPECULATORS_KEYS = {
    "speculators_model_type", "speculators_version", "speculators_config", "architectures", "transformer_layer_config",
    "draft_vocab_size", "block_size", "target_hidden_size", "aux_hidden_state_layer_ids", "mask_token_id",
    "sliding_window_non_causal", "sample_from_anchor", "torch_dtype", "dtype", "transformers_version",
    "has_no_defaults_at_init", "auto_map", "markov_rank", "markov_head_type", "enable_confidence_head",
    "confidence_head_with_markov", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
    "output_multiplier", "final_logit_softcapping", "tie_word_embeddings", "model_type",
}


def is_speculators_config(cfg: Mapping[str, Any]) -> bool:
    return "transformer_layer_config" in cfg


def flatten_speculators_config(cfg: Mapping[str, Any], model_dir: Any, extra_keys: Any = ()) -> dict[str, Any]:
    """A speculators-format config (backbone under ``transformer_layer_config``, taps in
    ``aux_hidden_state_layer_ids``, ``mask_token_id``, ``block_size``, ``draft_vocab_size``) as the flat z-lab
    shape :func:`config_to_metadata` reads. ``extra_keys``: more top-level keys the caller handles itself."""
    unknown = sorted(k for k in cfg if k not in SPECULATORS_KEYS and k not in extra_keys)
    if unknown:
        raise _refuse(model_dir, f"speculators config keys {unknown} are not understood")
    flat = dict(cfg["transformer_layer_config"])
    d: dict[str, Any] = {}
    ids = cfg.get("aux_hidden_state_layer_ids")
    if ids is None:
        raise _refuse(model_dir, "a speculators draft needs aux_hidden_state_layer_ids (the target taps)")
    # speculators' ids index the hidden-state list (0 = the embeddings): already the GGUF tap, so the z-lab id
    # is one less (speculators' own converter writes aux = z-lab id + 1; llama.cpp's reads aux - 1)
    d["target_layer_ids"] = [int(i) - 1 for i in ids]
    if cfg.get("block_size") is not None:
        d["block_size"] = int(cfg["block_size"])
    if cfg.get("mask_token_id") is None:
        raise _refuse(model_dir, "no mask_token_id in the speculators config")
    d["mask_token_id"] = int(cfg["mask_token_id"])
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "output_multiplier",
                "final_logit_softcapping"):
        if cfg.get(key) is not None:
            d[key] = cfg[key]
    # speculators' mask: full layers are never causal; sliding layers are causal within the block unless
    # sliding_window_non_causal (create_anchor_block_mask_mod). Unset is_causal makes the sliding layers alone
    # causal (config_to_metadata's reference rule); is_causal = false makes none causal.
    if cfg.get("sliding_window_non_causal") and any(t == "sliding_attention" for t in flat.get("layer_types") or ()):
        flat["is_causal"] = False
    flat.pop("dflash_config", None)
    flat["dflash_config"] = d
    flat["architectures"] = list(cfg.get("architectures") or [])
    return flat


def speculators_d2t(d2t_offsets: np.ndarray, vocab: int, model_dir: Any) -> np.ndarray:
    """speculators' d2t holds offsets (target = draft + d2t[draft]); GGUF ``d2t`` holds absolute target ids."""
    ids = np.arange(d2t_offsets.shape[0], dtype=np.int64) + d2t_offsets.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise _refuse(model_dir, f"d2t maps draft ids outside the target vocabulary 0..{vocab - 1}")
    return ids


def _truthy(v: Any) -> bool:
    return str(v).lower() in ("1", "true", "yes", "on")


class DFlashConverter:
    hf_arch = "DFlashDraftModel"
    variant = "dflash"

    def convert(self, model_dir: str, out_path: str, options: Mapping[str, Any]) -> None:
        cfg = read_config(model_dir)
        if is_speculators_config(cfg):
            if cfg.get("sample_from_anchor"):
                raise _refuse(model_dir, "sample_from_anchor = true: a DFlash draft here drafts from the 1+N "
                              "bonus-anchor block only (re-export with sample_from_anchor = false)")
            if int(cfg.get("draft_vocab_size") or cfg["transformer_layer_config"]["vocab_size"]) != int(
                    cfg["transformer_layer_config"]["vocab_size"]):
                raise _refuse(model_dir, "a reduced draft vocabulary (d2t) is not supported")
            cfg = flatten_speculators_config(cfg, model_dir)
        md = config_to_metadata(cfg, model_dir, self.variant)
        backbone = cfg.get("model_type", "qwen3")
        st = SafetensorsDir(model_dir)
        tensors: dict[str, np.ndarray] = generated_tensors(md)
        drop_embd = _truthy(options.get("drop_embeddings", "0"))
        for name in st.names():
            gname = map_tensor_name(name, backbone)
            if gname is None:
                if name.endswith("d2t"):
                    d2t = st.get(name, dtype=np.int64)
                    v = int(cfg["vocab_size"])
                    same = d2t.shape == (v,) and (not d2t.any() or np.array_equal(d2t, np.arange(v)))
                    if not same:
                        raise _refuse(model_dir, "a reduced draft vocabulary (d2t) is not supported")
                continue
            if gname == C.T_TOKEN_EMBD and drop_embd:
                continue
            tensors[gname] = gemma4_tensor(gname, st.get(name))
        if self.variant == "dflash" and any(n.startswith(("selector_", "lilicorr.")) or "_conv_" in n for n in tensors):
            raise _refuse(model_dir, "DFlashDraftModel config with DFlash2/LiLiCorr tensors")
        own_embd, own_head = C.T_TOKEN_EMBD in tensors, C.T_OUTPUT in tensors
        if bool(cfg.get("tie_word_embeddings")) and own_embd and not own_head:
            md[f"{A}.{C.KEY_TIED}"] = True
        elif own_embd or own_head:
            md[f"{A}.{C.KEY_TIED}"] = False
        target = options.get("target")
        if target:
            md.update(self._from_target(target, md, model_dir))
        qtypes = None
        if str(options.get("outtype", "f32")).lower() == "f16":
            import gguf

            qtypes = {n: gguf.GGMLQuantizationType.F16 for n, a in tensors.items() if a.ndim == 2}
        write_gguf(out_path, md, tensors, qtypes)
        # a converted file must load: check names and shapes now rather than at first use
        from plinth.gguf import GGUFFile

        from .format import load_hparams, tensor_specs
        from plinth.graph import check_tensors

        gf = GGUFFile(out_path)
        hp = load_hparams(dict(gf.metadata), str(out_path), gf.tensors.keys())
        if hp.n_vocab is None:
            raise _refuse(model_dir, "no vocab_size")
        check_tensors(tensor_specs(hp), {n: (tuple(i.shape), i.type_name) for n, i in gf.tensors.items()},
                      str(out_path))

    @staticmethod
    def _from_target(path: str, md: Mapping[str, Any], model_dir: Any) -> dict[str, Any]:
        from plinth.gguf import GGUFFile

        tmd = dict(GGUFFile(path).metadata)
        arch = tmd.get("general.architecture")
        e = tmd.get(f"{arch}.embedding_length")
        n_layer = tmd.get(f"{arch}.block_count")
        if e is not None and int(e) != int(md[f"{A}.embedding_length"]):
            raise _refuse(model_dir, f"the target {path} has n_embd {e}, the draft {md[f'{A}.embedding_length']}")
        taps = md[f"{A}.{C.KEY_TARGET_LAYERS}"]
        if n_layer is not None and max(taps) > int(n_layer):
            raise _refuse(model_dir, f"taps {taps} exceed the target's {n_layer} layers")
        out = {k: v for k, v in tmd.items() if k.startswith("tokenizer.") and k != C.KEY_MASK_TOKEN_TOK}
        return out


class DFlash2Converter(DFlashConverter):
    hf_arch = "DFlash2DraftModel"
    variant = "dflash2"


class LiLiCorrConverter(DFlashConverter):
    hf_arch = "LiLiCorrDraftModel"
    variant = "lilicorr"

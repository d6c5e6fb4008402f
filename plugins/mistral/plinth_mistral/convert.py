"""``MistralLarge4ForConditionalGeneration`` checkpoints to a ``mistral_large4`` GGUF (text tower).

The checkpoint uses Mistral's native tensor names (what transformers' ``save_pretrained`` writes
and the published files use): ``tok_embeddings``, ``layers.N.attention.wq`` ... (see the README's
table). The vision tower and projector (``vision_encoder.*``, ``patch_merger.*``,
``pre_mm_projector_norm.*``, ``vision_language_adapter.*``) are skipped with a note: plinth has
no image input for this model. A checkpoint whose config has no vision tower but that carries
vision tensors is refused. The ``mtp_dspark.*`` draft head is not part of the text model; with
the option ``draft=PATH`` it is written as a DSpark draft GGUF (:mod:`plinth_mistral.dspark_head`).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from plinth.convert import SafetensorsDir, read_config, write_gguf
from plinth.errors import UserError

from .mistral_large4 import ARCH, MistralLarge4, sharing_modes

VISION_PREFIXES = ("vision_encoder.", "patch_merger.", "pre_mm_projector_norm.", "vision_language_adapter.")
DRAFT_PREFIX = "mtp_dspark."

# Mistral-native per-layer names -> GGUF names (after "layers.N." / "blk.N.")
LAYER_NAMES = {
    "attention_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attention.wq.weight": "attn_q.weight",
    "attention.wkv_a_with_mqa.weight": "attn_kv_a_mqa.weight",
    "attention.kv_a_norm.weight": "attn_kv_a_norm.weight",
    "attention.wkv_b.weight": "attn_kv_b.weight",
    "attention.wo.weight": "attn_output.weight",
    "attention.ssmax_scaling.s": "attn_log_scale.weight",
    "attention.ssmax_scaling.b": "attn_log_scale.bias",
    "attention.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "attention.indexer.wk.weight": "indexer.attn_k.weight",
    "attention.indexer.k_norm.weight": "indexer.k_norm.weight",
    "attention.indexer.k_norm.bias": "indexer.k_norm.bias",
    "attention.indexer.q_input_norm.weight": "indexer.q_norm.weight",
    "attention.indexer.q_input_norm.bias": "indexer.q_norm.bias",
    "attention.indexer.weights_proj.weight": "indexer.proj.weight",
    "attention.indexer.ssmax_scaling.s": "indexer.log_scale.weight",
    "attention.indexer.ssmax_scaling.b": "indexer.log_scale.bias",
    "feed_forward.w1.weight": "ffn_gate.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
    "gate.weight": "ffn_gate_inp.weight",
    "shared_experts.w1.weight": "ffn_gate_shexp.weight",
    "shared_experts.w2.weight": "ffn_down_shexp.weight",
    "shared_experts.w3.weight": "ffn_up_shexp.weight",
}
EXPERT_NAMES = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}
# the reference config's RoPE when config.json has none: YaRN over a 512-token window, no magnitude scaling
DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2048.0, "original_max_position_embeddings": 512,
                "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0}
TOP_NAMES = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "output.weight": "output.weight"}


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text tower's config (nested ``text_config``, or a flat text-only config)."""
    return dict(config.get("text_config") or config)


def yarn_attention_factor(rope: Mapping[str, Any]) -> float:
    """The cos/sin magnitude transformers' YaRN uses: ``attention_factor``, else from factor/mscale."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = float(rope.get("factor") or 1.0)

    def mscale(s: float, m: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"])
    return mscale(factor)


def metadata(tc: Mapping[str, Any], source: str) -> dict[str, Any]:
    """GGUF metadata of the text tower (keys under ``mistral_large4.``)."""
    a = ARCH
    n = int(tc["num_hidden_layers"])
    nope, rot = int(tc["qk_nope_head_dim"]), int(tc["qk_rope_head_dim"])
    if int(tc.get("num_key_value_heads") or tc["num_attention_heads"]) != int(tc["num_attention_heads"]):
        raise UserError(f"{source}: num_key_value_heads != num_attention_heads; MLA expands the latent per query "
                        "head, and grouped heads are not part of this architecture")
    kv_source = list(tc.get("kv_source_layers") or range(n))
    idx_types = list(tc.get("indexer_types") or [])
    if len(idx_types) != n:
        raise UserError(f"{source}: 'indexer_types' has {len(idx_types)} entries for {n} layers")
    rope_layers = [int(bool(x)) for x in (tc.get("no_rope_layers") or [1] * n)][:n]
    mlp_types = list(tc.get("mlp_layer_types") or (["dense"] * int(tc.get("first_k_dense_replace", 1))
                                                    + ["sparse"] * n)[:n])
    n_dense = mlp_types.count("dense")
    if mlp_types != ["dense"] * n_dense + ["sparse"] * (n - n_dense):
        raise UserError(f"{source}: 'mlp_layer_types' {mlp_types} has a dense layer after a sparse one; the GGUF "
                        "key leading_dense_block_count can only describe leading dense layers")
    rope = dict(tc.get("rope_parameters") or DEFAULT_ROPE)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("yarn", "default"):
        raise UserError(f"{source}: rope_type {rope_type!r} is not supported (yarn or default)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UserError(f"{source}: partial_rotary_factor is not supported")
    scale = 1.0 / math.sqrt(nope + rot)
    if rope_type != "default" and rope.get("mscale_all_dim"):
        m = 0.1 * float(rope["mscale_all_dim"]) * math.log(float(rope["factor"])) + 1.0
        scale *= m * m
    md: dict[str, Any] = {
        "general.architecture": a,
        "general.name": str(tc.get("_name_or_path") or "mistral-large4"),
        f"{a}.context_length": int(tc.get("max_position_embeddings", 1048576)),
        f"{a}.embedding_length": int(tc["hidden_size"]),
        f"{a}.block_count": n,
        f"{a}.vocab_size": int(tc["vocab_size"]),
        f"{a}.attention.head_count": int(tc["num_attention_heads"]),
        f"{a}.attention.head_count_kv": int(tc["num_attention_heads"]),
        f"{a}.attention.layer_norm_rms_epsilon": float(tc.get("rms_norm_eps", 1e-5)),
        f"{a}.attention.kv_lora_rank": int(tc["kv_lora_rank"]),
        f"{a}.attention.key_length": nope + rot,
        f"{a}.attention.value_length": int(tc["v_head_dim"]),
        f"{a}.attention.scale": scale,
        f"{a}.attention.kv_source_layers": kv_source,
        f"{a}.attention.kv_sharing": sharing_modes(kv_source, idx_types),
        f"{a}.attention.indexer.types": idx_types,
        f"{a}.attention.indexer.head_count": int(tc["index_n_heads"]),
        f"{a}.attention.indexer.key_length": int(tc["index_head_dim"]),
        f"{a}.attention.indexer.top_k": int(tc["index_topk"]),
        f"{a}.rope.dimension_count": rot,
        f"{a}.rope.freq_base": float(rope.get("rope_theta", 10000.0)),
        f"{a}.rope.layers": rope_layers,
        f"{a}.leading_dense_block_count": n_dense,
        f"{a}.feed_forward_length": int(tc["intermediate_size"]),
        f"{a}.expert_count": int(tc["n_routed_experts"]),
        f"{a}.expert_used_count": int(tc["num_experts_per_tok"]),
        f"{a}.expert_feed_forward_length": int(tc["moe_intermediate_size"]),
        f"{a}.expert_shared_count": int(tc.get("n_shared_experts") or 0),
        f"{a}.expert_group_count": int(tc.get("n_group") or 1),
        f"{a}.expert_group_used_count": int(tc.get("topk_group") or 1),
        f"{a}.expert_weights_scale": float(tc.get("routed_scaling_factor") or 1.0),
        f"{a}.expert_weights_norm": True,
        f"{a}.expert_gating_func": 1,  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        f"{a}.final_logit_softcapping": float(tc.get("final_logit_softcapping") or 0.0),
    }
    if rope_type == "yarn":
        md.update({
            f"{a}.rope.scaling.type": "yarn",
            f"{a}.rope.scaling.factor": float(rope["factor"]),
            f"{a}.rope.scaling.original_context_length": int(rope["original_max_position_embeddings"]),
            f"{a}.rope.scaling.yarn_beta_fast": float(rope.get("beta_fast") or 32.0),
            f"{a}.rope.scaling.yarn_beta_slow": float(rope.get("beta_slow") or 1.0),
            f"{a}.rope.scaling.attn_factor": yarn_attention_factor(rope),
        })
    for key in ("bos_token_id", "eos_token_id"):
        v = tc.get(key)
        if isinstance(v, int):
            md[f"tokenizer.ggml.{key}"] = v
    return md


def text_tensors(st: SafetensorsDir, tc: Mapping[str, Any], source: str, has_vision: bool) -> dict[str, np.ndarray]:
    """Every text-tower tensor under its GGUF name; experts stacked; LeRoPE's alpha as rope_alpha."""
    n = int(tc["num_hidden_layers"])
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    skipped = 0
    for name in st.names():
        if name.startswith(VISION_PREFIXES):
            if not has_vision:
                raise UserError(f"{source}: vision tensor '{name}' in a text-only checkpoint (config.json has no "
                                "vision_config); remove it or convert the full MistralLarge4 checkpoint")
            skipped += 1
            continue
        if name.startswith(DRAFT_PREFIX):
            continue
        if name in TOP_NAMES:
            out[TOP_NAMES[name]] = st.get(name)
            continue
        if name == "lerope.alpha":
            out["rope_alpha.weight"] = st.get(name)
            continue
        parts = name.split(".")
        if parts[0] != "layers" or len(parts) < 3 or not parts[1].isdigit() or int(parts[1]) >= n:
            raise UserError(f"{source}: unexpected tensor '{name}' (not part of the MistralLarge4 text tower)")
        il, rest = int(parts[1]), ".".join(parts[2:])
        if rest in LAYER_NAMES:
            out[f"blk.{il}.{LAYER_NAMES[rest]}"] = st.get(name)
        elif parts[2] == "experts" and len(parts) == 6 and parts[3].isdigit() and parts[4] in EXPERT_NAMES:
            experts.setdefault((il, parts[4]), {})[int(parts[3])] = st.get(name)
        else:
            raise UserError(f"{source}: unexpected tensor '{name}' (not part of the MistralLarge4 text tower)")
    n_exp = int(tc["n_routed_experts"])
    for (il, w), per in sorted(experts.items()):
        if sorted(per) != list(range(n_exp)):
            missing = sorted(set(range(n_exp)) - set(per))
            raise UserError(f"{source}: layer {il} expert '{w}' is missing for experts {missing}")
        out[f"blk.{il}.{EXPERT_NAMES[w]}"] = np.stack([per[e] for e in range(n_exp)])
    if skipped:
        print(f"note: skipped {skipped} vision-tower/projector tensors (plinth-mistral converts the text tower only)",
              file=sys.stderr)
    return out


class MistralLarge4Converter:
    """``MistralLarge4ForConditionalGeneration`` -> ``mistral_large4`` GGUF (text tower).

    Options: ``draft`` (a path): also write the ``mtp_dspark.*`` head as a DSpark draft GGUF
    (with ``target_layers`` and ``block_size``; see :mod:`plinth_mistral.dspark_head`).
    """

    hf_arch = "MistralLarge4ForConditionalGeneration"

    def convert(self, model_dir: str, out_path: str, options: Mapping[str, Any]) -> None:
        config = read_config(model_dir)
        tc = text_config(config)
        source = f"{model_dir}"
        st = SafetensorsDir(model_dir)
        has_vision = bool(config.get("vision_config"))
        md = metadata(tc, source)
        MistralLarge4().load_hparams(md, source)  # refuse a layer pattern the graph cannot run before writing anything
        write_gguf(out_path, md, text_tensors(st, tc, source, has_vision))
        n_draft = sum(name.startswith(DRAFT_PREFIX) for name in st.names())
        if options.get("draft"):
            from .dspark_head import write_draft

            write_draft(st, tc, source, Path(str(options["draft"])), options)
        elif n_draft:
            print(f"note: the checkpoint carries an mtp_dspark draft head ({n_draft} tensors), not written; "
                  "add --option draft=DRAFT.gguf (with block_size and mask_token_id) to convert it", file=sys.stderr)


__all__ = ["MistralLarge4Converter", "metadata", "text_config", "text_tensors", "yarn_attention_factor"]

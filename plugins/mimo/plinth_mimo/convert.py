"""``MiMoV2FlashForCausalLM`` folder (config.json + safetensors [+ tokenizer.json]) -> ``mimo2`` GGUF.

The keys and tensor names are those llama.cpp's converter writes for MiMo-V2-Flash (its
``conversion/mimo.py``), so the file opens in llama.cpp too. The config is read as transformers 5.24's
``MiMoV2FlashConfig`` reads it (the oracle), and the release config's own spellings are taken where
transformers has none: ``layer_types`` or ``hybrid_layer_pattern`` (1 = sliding), ``mlp_layer_types``
(else layer 0 dense, the rest MoE), ``rope_parameters`` per layer type or the top-level
``rope_theta`` / ``swa_rope_theta`` / ``partial_rotary_factor``, the sliding layers' KV heads
(``swa_num_key_value_heads``, else twice ``num_key_value_heads``), ``sliding_window_size + 1`` over
``sliding_window``. Where both spellings are given they must agree. Tensors: transformers' names
(fused ``experts.gate_up_proj``, ``self_attn.sinks``) or the release's (per-expert projections,
``attention_sink_bias``). The MTP blocks (``model.mtp.layers.N.*``, which transformers ignores) become
blocks ``num_hidden_layers + N`` with ``nextn_predict_layers`` (llama.cpp's layout; plinth drafts with
them: drafter ``mtp``); option ``mtp=no`` (``plinth convert --no-mtp``) leaves them out with a note.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from plinth.convert import SafetensorsDir, map_names, padded_tokenizer_metadata, read_config, write_gguf
from plinth.errors import UserError

from .mimo2 import ARCH, GATING_SIGMOID, MiMo2

L = "model.layers.{layer}."
NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    L + "input_layernorm.weight": "blk.{layer}.attn_norm.weight",
    L + "self_attn.q_proj.weight": "blk.{layer}.attn_q.weight",
    L + "self_attn.k_proj.weight": "blk.{layer}.attn_k.weight",
    L + "self_attn.v_proj.weight": "blk.{layer}.attn_v.weight",
    L + "self_attn.qkv_proj.weight": "blk.{layer}.attn_qkv.weight",
    L + "self_attn.o_proj.weight": "blk.{layer}.attn_output.weight",
    L + "self_attn.sinks": "blk.{layer}.attn_sinks.weight",
    L + "self_attn.attention_sink_bias": "blk.{layer}.attn_sinks.weight",
    L + "post_attention_layernorm.weight": "blk.{layer}.ffn_norm.weight",
    L + "mlp.gate_proj.weight": "blk.{layer}.ffn_gate.weight",
    L + "mlp.up_proj.weight": "blk.{layer}.ffn_up.weight",
    L + "mlp.down_proj.weight": "blk.{layer}.ffn_down.weight",
    L + "mlp.gate.weight": "blk.{layer}.ffn_gate_inp.weight",
    L + "mlp.gate.e_score_correction_bias": "blk.{layer}.exp_probs_b.bias",
    L + "mlp.experts.gate_up_proj": "blk.{layer}.ffn_gate_up_exps",  # split below
    L + "mlp.experts.down_proj": "blk.{layer}.ffn_down_exps.weight",
    # the MTP blocks, renumbered after the trunk (model.mtp.layers.N -> model.layers.{n_layer + N})
    L + "eh_proj.weight": "blk.{layer}.nextn.eh_proj.weight",
    L + "enorm.weight": "blk.{layer}.nextn.enorm.weight",
    L + "hnorm.weight": "blk.{layer}.nextn.hnorm.weight",
    L + "embed_tokens.weight": "blk.{layer}.nextn.embed_tokens.weight",
    L + "shared_head.head.weight": "blk.{layer}.nextn.shared_head_head.weight",
    L + "shared_head.norm.weight": "blk.{layer}.nextn.shared_head_norm.weight",
    L + "final_layernorm.weight": "blk.{layer}.layer_output_norm.weight",
}
MTP = re.compile(r"^model\.mtp\.layers\.(\d+)\.(.+)$")
EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
S, F = "sliding_attention", "full_attention"
DEFAULT_ROPE = {F: {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
                S: {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334}}


def _refuse(source: str, key: str, value: Any, why: str) -> UserError:
    return UserError(f"{source}: {key} = {value!r}: {why}")


def _agree(source: str, key: str, a: Any, other: str, b: Any) -> None:
    if a != b:
        raise UserError(f"{source}: {key} = {a!r} but {other} = {b!r}; the two spellings must agree")


def layout(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The model's shape as transformers reads ``cfg`` (with the release spellings; see the module docstring)."""
    try:
        n_layer, n_head = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        n_embd, n_vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    except KeyError as exc:
        raise UserError(f"{source}: missing {exc.args[0]!r}, which a MiMo-V2-Flash config needs") from None
    types = cfg.get("layer_types")
    if cfg.get("hybrid_layer_pattern") is not None:
        from_pattern = [S if int(v) == 1 else F for v in cfg["hybrid_layer_pattern"]]
        if types is not None:
            _agree(source, "layer_types", list(types), "hybrid_layer_pattern", from_pattern)
        types = from_pattern
    if types is None:
        types = [F if (i == 0 or not (i + 1) % 6) else S for i in range(n_layer)]
    if len(types) != n_layer or set(types) - {S, F}:
        raise _refuse(source, "layer_types", types, f"expected {n_layer} of {S} / {F}")
    mlp = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n_layer - 1)
    if len(mlp) != n_layer or set(mlp) - {"dense", "sparse"}:
        raise _refuse(source, "mlp_layer_types", mlp, f"expected {n_layer} of dense / sparse")
    rope = cfg.get("rope_parameters")
    if rope is None:
        rope = {F: dict(DEFAULT_ROPE[F]), S: dict(DEFAULT_ROPE[S])}
        for key, kind in (("rope_theta", F), ("swa_rope_theta", S)):
            if cfg.get(key) is not None:
                rope[kind]["rope_theta"] = float(cfg[key])
        if cfg.get("partial_rotary_factor") is not None:
            for kind in (F, S):
                rope[kind]["partial_rotary_factor"] = float(cfg["partial_rotary_factor"])
    for kind in set(types):
        p = rope.get(kind) or {}
        if p.get("rope_type", "default") != "default" or "rope_theta" not in p:
            raise _refuse(source, f"rope_parameters[{kind!r}]", p, "plinth's mimo2 computes default RoPE with a "
                                                                   "rope_theta per layer type")
    head_k = int(cfg.get("head_dim", 192))
    factors = {rope[kind].get("partial_rotary_factor", 0.334) for kind in set(types)}
    if len(factors) != 1:
        raise _refuse(source, "partial_rotary_factor", sorted(factors), "one rotary width for every layer")
    n_rot = int(head_k * factors.pop())
    for key, want in (("swa_head_dim", head_k), ("swa_v_head_dim", cfg.get("v_head_dim", 128)),
                      ("swa_num_attention_heads", n_head)):
        if cfg.get(key) is not None:
            _agree(source, key, cfg[key], "the full layers' value", want)
    n_kv = int(cfg.get("num_key_value_heads", 4))
    n_kv_swa = int(cfg.get("swa_num_key_value_heads") or 2 * n_kv)
    for key, ok in (("attention_bias", (False, None)), ("hidden_act", ("silu", None)),
                    ("topk_method", ("noaux_tc", None)), ("scoring_func", ("sigmoid", None)),
                    ("n_shared_experts", (0, None))):
        if cfg.get(key) not in ok:
            raise _refuse(source, key, cfg.get(key), f"plinth's mimo2 computes {ok[0]!r}")
    window = int(cfg["sliding_window_size"]) + 1 if cfg.get("sliding_window_size") is not None \
        else int(cfg.get("sliding_window", 129))
    scale = cfg.get("attention_value_scale", 0.707)
    return dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_vocab=n_vocab, types=types, mlp=mlp, rope=rope,
                head_k=head_k, head_v=int(cfg.get("v_head_dim", 128)), n_rot=n_rot, n_kv=n_kv, n_kv_swa=n_kv_swa,
                window=window, value_scale=1.0 if scale is None else float(scale))


def gguf_metadata(cfg: Mapping[str, Any], source: str = "config.json", n_mtp: int = 0) -> dict[str, Any]:
    """The ``mimo2.*`` keys of ``cfg``, as llama.cpp's converter writes them (tokenizer keys not included);
    ``n_mtp`` MTP blocks after the trunk (sliding-window blocks, as llama.cpp counts them)."""
    lay = layout(cfg, source)
    a, swa = ARCH, [t == S for t in lay["types"]] + [True] * n_mtp
    n_group = int(cfg.get("n_group") or 1)
    md: dict[str, Any] = {
        "general.architecture": a,
        "general.name": str(cfg.get("_name_or_path") or "MiMo-V2-Flash"),
        f"{a}.block_count": lay["n_layer"] + n_mtp,
        f"{a}.context_length": int(cfg.get("max_position_embeddings", 131072)),
        f"{a}.embedding_length": lay["n_embd"],
        f"{a}.feed_forward_length": int(cfg.get("intermediate_size", 16384)),
        f"{a}.attention.head_count": lay["n_head"],
        f"{a}.attention.head_count_kv": [lay["n_kv_swa"] if s else lay["n_kv"] for s in swa],
        f"{a}.attention.key_length": lay["head_k"],
        f"{a}.attention.value_length": lay["head_v"],
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.get("rms_norm_eps", cfg.get("layernorm_epsilon", 1e-5))),
        f"{a}.attention.sliding_window": lay["window"],
        f"{a}.attention.sliding_window_pattern": swa,
        f"{a}.attention.value_scale": lay["value_scale"],
        f"{a}.rope.dimension_count": lay["n_rot"],
        f"{a}.rope.freq_base": float(lay["rope"][F]["rope_theta"]) if F in lay["rope"] else 10000.0,
        f"{a}.rope.freq_base_swa": float(lay["rope"][S]["rope_theta"]) if S in lay["rope"] else 10000.0,
        f"{a}.vocab_size": lay["n_vocab"],
    }
    if n_mtp:
        md[f"{a}.nextn_predict_layers"] = n_mtp
    # the expert keys, on an all-dense model too (as llama.cpp's converter writes them)
    md.update({f"{a}.expert_count": int(cfg.get("n_routed_experts", 256)),
               f"{a}.expert_used_count": int(cfg.get("num_experts_per_tok", 8)),
               f"{a}.expert_feed_forward_length": int(cfg.get("moe_intermediate_size", 2048)),
               f"{a}.expert_gating_func": GATING_SIGMOID,
               f"{a}.expert_group_count": n_group,
               f"{a}.expert_group_used_count": int(cfg.get("topk_group") or n_group)})
    # transformers applies these; llama.cpp's converter does not write them (the release: 1.0 and true)
    scale = cfg.get("routed_scaling_factor")
    if scale not in (None, 1.0):
        md[f"{a}.expert_weights_scale"] = float(scale)
    if not cfg.get("norm_topk_prob", True):
        md[f"{a}.expert_weights_norm"] = False
    return md


class MiMo2Converter:
    hf_arch = "MiMoV2FlashForCausalLM"

    def convert(self, model_dir: str, out_path: str, options: Mapping[str, Any]) -> list[str]:
        """Write ``out_path``; return (and print to stderr) notes on what was left out or assumed."""
        unknown = sorted(set(options) - {"mtp"})
        if unknown:
            raise UserError(f"the mimo2 converter takes the option mtp (yes / no), got {unknown}")
        if options.get("mtp") not in (None, "yes", "no"):
            raise UserError(f"option mtp = {options['mtp']!r}: yes or no")
        cfg = read_config(model_dir)
        source = str(Path(model_dir) / "config.json")
        notes: list[str] = []
        st = SafetensorsDir(model_dir)
        n_layer = int(cfg.get("num_hidden_layers", 0))
        mtp = {}  # HF name -> the name of the block it becomes
        for name in st.names():
            m = MTP.match(name)
            if m:
                mtp[name] = f"model.layers.{n_layer + int(m.group(1))}.{m.group(2)}"
        n_mtp = len({int(MTP.match(n).group(1)) for n in mtp})
        if mtp and options.get("mtp") == "no":
            notes.append(f"{len(mtp)} MTP tensors (model.mtp.*) left out (option mtp=no)")
            n_mtp = 0
        elif n_mtp and sorted({int(MTP.match(n).group(1)) for n in mtp}) != list(range(n_mtp)):
            raise UserError(f"{model_dir}: the MTP blocks are not numbered 0..{n_mtp - 1}")
        md = gguf_metadata(cfg, source, n_mtp)
        tok_md, note = padded_tokenizer_metadata(model_dir, cfg, md[f"{ARCH}.vocab_size"])
        md.update(tok_md)
        if note:
            notes.append(note)
        names, experts = {}, {}  # (the name it maps as -> the stored name)
        for name in st.names():
            as_name = mtp.get(name, name)
            if name in mtp and not n_mtp:
                continue
            m = EXPERT.match(as_name)
            if m:
                experts.setdefault(int(m.group(1)), set()).add(name)
            else:
                names[as_name] = name
        tensors: dict[str, np.ndarray] = {}
        for hf_as, gg in map_names(list(names), NAMES, source).items():
            hf = names[hf_as]
            if gg.endswith("ffn_gate_up_exps"):  # transformers' fused [E, 2F, H]: gate rows first
                gu = st.get(hf)
                half = gu.shape[1] // 2
                tensors[gg.replace("gate_up", "gate") + ".weight"] = np.ascontiguousarray(gu[:, :half])
                tensors[gg.replace("gate_up", "up") + ".weight"] = np.ascontiguousarray(gu[:, half:])
            else:
                tensors[gg] = st.get(hf)
        n_exp = md.get(f"{ARCH}.expert_count", 0)
        for il, found in sorted(experts.items()):
            for proj in ("gate", "up", "down"):
                pattern = f"model.layers.{il}.mlp.experts.{{e}}.{proj}_proj.weight"
                if len(found) != 3 * n_exp:
                    raise UserError(f"{model_dir}: layer {il} has {len(found)} per-expert tensors, expected "
                                    f"3 x {n_exp} (n_routed_experts)")
                tensors[f"blk.{il}.ffn_{proj}_exps.weight"] = np.stack([st.get(pattern.format(e=e))
                                                                        for e in range(n_exp)])
        if cfg.get("tie_word_embeddings") and tensors.pop("output.weight", None) is not None:
            notes.append("lm_head.weight left out: the config ties it to the embedding")
        if n_mtp:
            notes.append(f"{n_mtp} MTP block(s) written as blocks {n_layer}..{n_layer + n_mtp - 1} "
                         "(nextn_predict_layers; drafter mtp)")
        lay = layout(cfg, source)
        for il, kind in enumerate(lay["mlp"]):
            has_router = f"blk.{il}.ffn_gate_inp.weight" in tensors
            if has_router != (kind == "sparse"):
                raise UserError(f"{model_dir}: layer {il} is {kind!r} in mlp_layer_types but its tensors "
                                f"{'have' if has_router else 'lack'} a router (mlp.gate.weight)")
        MiMo2().check(md, {k: (tuple(v.shape), "F32") for k, v in tensors.items()}, f"converted {model_dir}")
        write_gguf(out_path, md, tensors)
        for n in notes:
            print(f"plinth-mimo: {n}", file=sys.stderr)
        return notes


__all__ = ["MiMo2Converter", "gguf_metadata", "layout"]

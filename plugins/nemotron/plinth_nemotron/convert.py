"""Hugging Face NemotronH / NemotronH-Puzzle folders to GGUF (``plinth convert DIR -o OUT.gguf``).

Reads ``config.json`` (top level or under ``text_config``) and the safetensors, and writes
``nemotron_h`` (no MoE layer) or ``nemotron_h_moe`` in llama.cpp's key and tensor names:

* the layer pattern comes from ``layers_block_type`` (``mamba``/``linear_attention``,
  ``attention``/``full_attention``, ``mlp``, ``moe``), ``hybrid_override_pattern``
  (``M * - E``), or, for ``NemotronHPuzzleForCausalLM``, each ``block_configs[i].block_type``;
  a Puzzle block's other fields override the global config for that layer (expert count
  per layer, ``num_experts_per_tok``, ``moe_intermediate_size``, ...);
* ``expert_used_count`` / ``expert_feed_forward_length`` are written as scalars when every
  FFN layer is an identical MoE, else as per-layer arrays (0 on layers without experts);
* tensor names may carry the ``backbone.`` or the ``model.`` prefix; the router bias may be
  spelled ``e_score_correction_bias`` or ``e_score_correction.bias``; experts may be stored
  one by one (``experts.{e}.up_proj.weight``) or stacked (``experts.up_proj``);
* the MTP head (``mtp.layers.{i}.*``; blocks from ``mtp_block_configs`` for Puzzle, else
  ``mtp_layers_block_type`` / ``mtp_hybrid_override_pattern``) is appended as ``blk.{n_layer + i}``
  with ``nextn.{eh_proj,enorm,hnorm}`` on the first and ``nextn.shared_head_norm`` on the last, and
  ``nextn_predict_layers`` = 2 (option ``mtp``: auto = when present, yes = required, no = dropped);
* ``A_log`` is written as ``ssm_a = -exp(A_log)``; ``conv1d.weight [C, 1, K]`` as ``[C, K]``;
  the gated norm weight as ``[G, d_inner / G]``.

Before writing, the converted names and shapes are checked against the architecture's own
hparams and tensor declarations, so a written file always loads. Anything the architecture
does not implement (another activation, sliding-window attention, per-layer Mamba sizes,
per-layer expert counts, a tensor no rule maps) is refused with the reason.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from plinth.convert import SafetensorsDir, check_converted, padded_tokenizer_metadata, read_config, write_gguf
from plinth.errors import UserError

from .nemotron_h import ATTENTION, MAMBA, MLP, MOE, load_hparams, tensor_specs

BLOCK_TYPES = {"mamba": MAMBA, "linear_attention": MAMBA, "M": MAMBA,
               "attention": ATTENTION, "full_attention": ATTENTION, "*": ATTENTION,
               "mlp": MLP, "-": MLP, "moe": MOE, "E": MOE}
OUTTYPES = ("f32", "f16", "bf16")
MTP_CHOICES = ("auto", "yes", "no", "true", "false", "1", "0")

# per-layer renames (after the prefix is stripped): HF suffix -> GGUF suffix
_LAYER_MAP = {
    "norm.weight": "attn_norm.weight",
    "mixer.in_proj.weight": "ssm_in.weight",
    "mixer.in_proj.bias": "ssm_in.bias",
    "mixer.conv1d.weight": "ssm_conv1d.weight",
    "mixer.conv1d.bias": "ssm_conv1d.bias",
    "mixer.dt_bias": "ssm_dt.bias",
    "mixer.A_log": "ssm_a",
    "mixer.D": "ssm_d",
    "mixer.norm.weight": "ssm_norm.weight",
    "mixer.out_proj.weight": "ssm_out.weight",
    "mixer.out_proj.bias": "ssm_out.bias",
    "mixer.q_proj.weight": "attn_q.weight",
    "mixer.k_proj.weight": "attn_k.weight",
    "mixer.v_proj.weight": "attn_v.weight",
    "mixer.o_proj.weight": "attn_output.weight",
    "mixer.q_proj.bias": "attn_q.bias",
    "mixer.k_proj.bias": "attn_k.bias",
    "mixer.v_proj.bias": "attn_v.bias",
    "mixer.o_proj.bias": "attn_output.bias",
    "mixer.up_proj.weight": "ffn_up.weight",
    "mixer.down_proj.weight": "ffn_down.weight",
    "mixer.up_proj.bias": "ffn_up.bias",
    "mixer.down_proj.bias": "ffn_down.bias",
    "mixer.gate.weight": "ffn_gate_inp.weight",
    "mixer.gate.e_score_correction.bias": "exp_probs_b.bias",
    "mixer.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mixer.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mixer.fc1_latent_proj.weight": "ffn_latent_down.weight",
    "mixer.fc2_latent_proj.weight": "ffn_latent_up.weight",
    "mixer.experts.up_proj": "ffn_up_exps.weight",  # already stacked [E, I, D]
    "mixer.experts.down_proj": "ffn_down_exps.weight",
}
_GLOBAL_MAP = {"embeddings.weight": "token_embd.weight", "embed_tokens.weight": "token_embd.weight",
               "norm_f.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"mixer\.experts\.(\d+)\.(up|down)_proj\.weight")


# the MTP head's own tensors (``mtp.layers.{i}.<name>``; the rest are ordinary block tensors, all written to
# the one folded block blk.{n_layer}, where the MoE sub-block's norm is post_attention_norm)
_MTP_MAP = {"enorm.weight": "nextn.enorm.weight", "hnorm.weight": "nextn.hnorm.weight",
            "eh_proj.weight": "nextn.eh_proj.weight", "final_layernorm.weight": "nextn.shared_head_norm.weight"}
_MTP_RE = re.compile(r"mtp\.layers\.(\d+)\.(.+)")


def normalise_name(name: str) -> str:
    """HF tensor name -> prefix-free name with the router-bias spelling unified (``mtp.*`` keeps its prefix).

    A VL checkpoint nests the text model under ``language_model.`` (then ``backbone.`` or ``model.``).
    """
    if name.startswith("language_model."):
        name = name[len("language_model."):]
    for prefix in ("backbone.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return name.replace("e_score_correction_bias", "e_score_correction.bias")


# ============================================================================ config

def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    cfg = dict(config)
    if isinstance(config.get("text_config"), Mapping):
        cfg.update(config["text_config"])
    return cfg


def mtp_configs(config: Mapping[str, Any], source: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(per-block configs, kinds) of the MTP head a NemotronH / Puzzle config declares (empty: none).

    Puzzle lists its MTP blocks in ``mtp_block_configs`` (each overriding the global config, like
    ``block_configs``); NemotronH repeats ``mtp_layers_block_type`` (or the legacy
    ``mtp_hybrid_override_pattern``) ``num_nextn_predict_layers`` times.
    """
    cfg = _text_config(config)
    depth = int(cfg.get("num_nextn_predict_layers") or 0)
    blocks = cfg.get("mtp_block_configs")
    if blocks:
        if depth > 1:
            raise UserError(f"{source}: num_nextn_predict_layers = {depth} with mtp_block_configs; plinth-nemotron "
                            "exports one MTP depth")
        kinds, per = [], []
        for i, blk in enumerate(blocks):
            bt = blk.get("block_type")
            if bt not in BLOCK_TYPES:
                raise UserError(f"{source}: mtp_block_configs[{i}].block_type is {bt!r}; expected attention or moe")
            kinds.append(BLOCK_TYPES[bt])
            per.append({**cfg, **{k: v for k, v in blk.items() if v is not None}})
        return per, kinds
    if depth == 0:
        return [], []
    if depth > 1:
        raise UserError(f"{source}: num_nextn_predict_layers = {depth}; plinth-nemotron exports one MTP depth")
    types = cfg.get("mtp_layers_block_type") or list(cfg.get("mtp_hybrid_override_pattern") or "*E")
    bad = [t for t in types if t not in BLOCK_TYPES]
    if bad:
        raise UserError(f"{source}: unknown MTP layer type(s) {sorted(set(map(str, bad)))}")
    return [dict(cfg) for _ in types], [BLOCK_TYPES[t] for t in types]


def layer_configs(config: Mapping[str, Any], source: str) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """(global config, per-layer configs, per-layer kinds) of a NemotronH or Puzzle config (the trunk)."""
    cfg = _text_config(config)
    blocks = cfg.get("block_configs")
    if blocks:
        kinds = []
        per_layer = []
        for i, blk in enumerate(blocks):
            bt = blk.get("block_type")
            if bt not in BLOCK_TYPES:
                raise UserError(f"{source}: block_configs[{i}].block_type is {bt!r}; expected one of "
                                "mamba, attention, mlp, moe")
            kinds.append(BLOCK_TYPES[bt])
            per_layer.append({**cfg, **{k: v for k, v in blk.items() if v is not None}})
        return cfg, per_layer, kinds
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if types is None and cfg.get("hybrid_override_pattern"):
        types = list(cfg["hybrid_override_pattern"])
    if not types:
        raise UserError(f"{source}: config has none of block_configs, layers_block_type, hybrid_override_pattern; "
                        "cannot tell the layer pattern")
    bad = [t for t in types if t not in BLOCK_TYPES]
    if bad:
        raise UserError(f"{source}: unknown layer type(s) {sorted(set(map(str, bad)))} in the layer pattern")
    return cfg, [dict(cfg) for _ in types], [BLOCK_TYPES[t] for t in types]


def _uniform(values: list[Any], what: str, source: str) -> Any:
    if len(set(values)) > 1:
        raise UserError(f"{source}: {what} differs between layers ({sorted(set(values))}); plinth-nemotron needs "
                        "one value for the whole model")
    return values[0] if values else None


def gguf_metadata(config: Mapping[str, Any], source: str, name: str, mtp: bool = False) -> dict[str, Any]:
    """The GGUF metadata of a NemotronH(-Puzzle) config; ``mtp``: append its MTP blocks after the trunk."""
    cfg, per, kinds = layer_configs(config, source)
    n_trunk = len(kinds)
    if mtp:
        mtp_per, mtp_kinds = mtp_configs(config, source)
        if mtp_kinds != [ATTENTION, MOE]:
            raise UserError(f"{source}: the MTP head has blocks {mtp_kinds}; plinth-nemotron exports an MTP head of "
                            "one attention block then one MoE block")
        per, kinds = per + mtp_per, kinds + mtp_kinds
    n_layer = len(kinds)
    has_moe = MOE in kinds
    arch = "nemotron_h_moe" if has_moe else "nemotron_h"
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        got = [str(c.get(key, want)) for c in per]
        if any(g != want for g in got):
            raise UserError(f"{source}: {key} = {sorted(set(got))}; plinth-nemotron implements only {want!r}")
    window = [c.get("sliding_window") for c, k in zip(per, kinds) if k == ATTENTION]
    if any(w for w in window):
        raise UserError(f"{source}: sliding-window attention layers (sliding_window = {window}) are not supported")
    mamba = [c for c, k in zip(per, kinds) if k == MAMBA] or [cfg]
    m = {key: _uniform([int(c.get(key, d)) for c in mamba], key, source)
         for key, d in (("mamba_num_heads", 128), ("mamba_head_dim", 64), ("ssm_state_size", 128),
                        ("n_groups", 8), ("conv_kernel", 4))}
    hidden = int(cfg["hidden_size"])
    attn = [c for c, k in zip(per, kinds) if k == ATTENTION]
    head_dim = _uniform([int(c.get("head_dim") or hidden // int(c["num_attention_heads"])) for c in attn],
                        "head_dim", source) if attn else 0
    n_head = [int(c.get("num_attention_heads", 0)) if k == ATTENTION else 0 for c, k in zip(per, kinds)]
    n_head_kv = [int(c.get("num_key_value_heads") or c.get("num_attention_heads", 0)) if k == ATTENTION else 0
                 for c, k in zip(per, kinds)]
    heads = sorted(set(h for h in n_head if h))
    n_ff = []
    for c, k in zip(per, kinds):
        n_ff.append(int(c["intermediate_size"]) if k == MLP else int(c["moe_intermediate_size"]) if k == MOE else 0)
        if k in (MLP, MOE) and n_ff[-1] <= 0:
            raise UserError(f"{source}: layer {len(n_ff) - 1} ({k}) has no intermediate size")
    a = arch
    md: dict[str, Any] = {
        "general.architecture": arch,
        "general.name": name,
        f"{a}.vocab_size": int(cfg["vocab_size"]),
        f"{a}.context_length": int(cfg.get("max_position_embeddings", 4096)),
        f"{a}.embedding_length": hidden,
        f"{a}.block_count": n_layer,  # the MTP blocks included, as llama.cpp counts them
        f"{a}.feed_forward_length": n_ff,
        f"{a}.attention.head_count": heads[0] if len(heads) == 1 else (n_head if heads else 0),
        f"{a}.attention.head_count_kv": n_head_kv,
        # llama.cpp's loader requires layer_norm_epsilon (and reads layer_norm_rms_epsilon when present)
        f"{a}.attention.layer_norm_epsilon": float(cfg.get("layer_norm_epsilon", 1e-5)),
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.get("layer_norm_epsilon", 1e-5)),
        f"{a}.ssm.conv_kernel": m["conv_kernel"],
        f"{a}.ssm.inner_size": m["mamba_num_heads"] * m["mamba_head_dim"],
        f"{a}.ssm.state_size": m["ssm_state_size"],
        f"{a}.ssm.time_step_rank": m["mamba_num_heads"],
        f"{a}.ssm.group_count": m["n_groups"],
    }
    if n_layer > n_trunk:  # llama.cpp's layout: one folded MTP block, counted in block_count
        md[f"{a}.nextn_predict_layers"] = 1
    if head_dim:
        md[f"{a}.attention.key_length"] = head_dim
        md[f"{a}.attention.value_length"] = head_dim
    if has_moe:
        moe = [c for c, k in zip(per, kinds) if k == MOE]
        only_moe = MLP not in kinds

        def per_layer(key: str) -> int | list[int]:
            vals = [int(c.get(key) or 0) if k == MOE else 0 for c, k in zip(per, kinds)]
            moe_vals = [v for v, k in zip(vals, kinds) if k == MOE]
            return moe_vals[0] if only_moe and len(set(moe_vals)) == 1 else vals

        md.update({
            f"{a}.expert_count": _uniform([int(c["n_routed_experts"]) for c in moe], "n_routed_experts", source),
            f"{a}.expert_used_count": per_layer("num_experts_per_tok"),
            f"{a}.expert_feed_forward_length": per_layer("moe_intermediate_size"),
            f"{a}.expert_shared_feed_forward_length": per_layer("moe_shared_expert_intermediate_size"),
            f"{a}.expert_shared_count": int(cfg.get("n_shared_experts", 1)),
            f"{a}.expert_weights_norm": bool(cfg.get("norm_topk_prob", True)),
            f"{a}.expert_weights_scale": float(_uniform([float(c.get("routed_scaling_factor", 1.0)) for c in moe],
                                                        "routed_scaling_factor", source)),
            f"{a}.expert_group_count": int(cfg.get("n_group", 1)),
            f"{a}.expert_group_used_count": int(cfg.get("topk_group", 1)),
        })
        latent = [int(c.get("moe_latent_size") or 0) for c in moe]
        if any(latent):
            md[f"{a}.moe_latent_size"] = per_layer("moe_latent_size")
        # llama.cpp reads these two as one value for the model: write a scalar when the MoE layers agree
        for key, hf in (("expert_shared_feed_forward_length", "moe_shared_expert_intermediate_size"),
                        ("moe_latent_size", "moe_latent_size")):
            vals = {int(c.get(hf) or 0) for c in moe}
            if f"{a}.{key}" in md and len(vals) == 1:
                md[f"{a}.{key}"] = vals.pop()
    if n_layer > n_trunk:
        fold_mtp_block(md, n_trunk)
    return md


def fold_mtp_block(md: dict[str, Any], n_trunk: int) -> None:
    """Per-layer arrays over trunk + (attention, MoE) MTP blocks -> trunk + one block holding both (llama.cpp's
    layout): the attention keys from the attention block, every other one from the MoE block."""
    a = md["general.architecture"]
    md[f"{a}.block_count"] = n_trunk + 1
    for key, value in list(md.items()):
        if isinstance(value, list) and len(value) == n_trunk + 2:
            attn = key in (f"{a}.attention.head_count", f"{a}.attention.head_count_kv")
            md[key] = value[:n_trunk] + [value[n_trunk] if attn else value[n_trunk + 1]]


# ============================================================================ tensors

def convert_tensors(st: SafetensorsDir, n_layer: int, n_groups: int,
                    n_mtp: int = 0) -> tuple[dict[str, np.ndarray], list[str]]:
    """GGUF-named float32 tensors, and notes about what was left out.

    n_mtp: 1 folds the MTP head (``mtp.layers.{0,1}.*``) into ``blk.{n_layer}.*``; 0 drops ``mtp.*``
    with a note.
    """
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, str]] = {}
    dropped_mtp = []
    for hf_name in st.names():
        name = normalise_name(hf_name)
        mtp = _MTP_RE.fullmatch(name)
        if name.startswith("mtp.") and (not n_mtp or mtp is None):
            dropped_mtp.append(hf_name)
            continue
        if name in _GLOBAL_MAP:
            out[_GLOBAL_MAP[name]] = st.get(hf_name)
            continue
        if mtp is not None:
            i, rest = int(mtp.group(1)), mtp.group(2)
            if i >= 2:
                raise UserError(f"{st.dir}: tensor {hf_name!r} belongs to MTP block {i}; a Nemotron-H MTP head has "
                                "two (attention, MoE)")
            if rest in _MTP_MAP:
                out[f"blk.{n_layer}.{_MTP_MAP[rest]}"] = st.get(hf_name)
                continue
            if i == 1 and rest == "norm.weight":
                out[f"blk.{n_layer}.post_attention_norm.weight"] = st.get(hf_name)
                continue
            m = _LAYER_RE.fullmatch(f"layers.{n_layer}.{rest}")
        else:
            m = _LAYER_RE.fullmatch(name)
        if m is None:
            raise UserError(f"{st.dir}: tensor {hf_name!r} has no GGUF name in plinth-nemotron's mapping")
        il, rest = int(m.group(1)), m.group(2)
        if il >= n_layer + (n_mtp if mtp is not None else 0):
            raise UserError(f"{st.dir}: tensor {hf_name!r} belongs to layer {il}, but the config has {n_layer} layers")
        e = _EXPERT_RE.fullmatch(rest)
        if e is not None:
            experts.setdefault((il, e.group(2)), {})[int(e.group(1))] = hf_name
            continue
        if rest not in _LAYER_MAP:
            raise UserError(f"{st.dir}: tensor {hf_name!r} has no GGUF name in plinth-nemotron's mapping")
        gguf = f"blk.{il}.{_LAYER_MAP[rest]}"
        t = st.get(hf_name)
        if rest == "mixer.A_log":
            t = -np.exp(t.astype(np.float64)).astype(np.float32).reshape(-1, 1)
        elif rest == "mixer.D":
            t = t.reshape(-1, 1)
        elif rest == "mixer.conv1d.weight":
            t = t.reshape(t.shape[0], t.shape[-1])
        elif rest == "mixer.norm.weight":
            t = t.reshape(n_groups, -1)
        out[gguf] = t
    for (il, which), by_index in sorted(experts.items()):
        idx = sorted(by_index)
        if idx != list(range(len(idx))):
            missing = sorted(set(range(max(idx) + 1)) - set(idx))
            raise UserError(f"{st.dir}: layer {il} is missing {which}_proj of expert(s) {missing}")
        out[f"blk.{il}.ffn_{which}_exps.weight"] = np.stack([st.get(by_index[i]) for i in idx])
    notes = []
    if dropped_mtp:
        notes.append(f"dropped {len(dropped_mtp)} MTP tensor(s) (mtp.*): the MTP head is not exported "
                     "(mtp=no, or the config declares no MTP layers)")
    return out, notes


# ============================================================================ converter

#: the folder's tokenizer padded to the vocabulary size as llama.cpp pads it
tokenizer_metadata = padded_tokenizer_metadata


class NemotronHConverter:
    """``NemotronHForCausalLM`` folder -> ``nemotron_h`` / ``nemotron_h_moe`` GGUF."""

    hf_arch = "NemotronHForCausalLM"
    #: options this converter reads besides outtype and mtp
    extra_options: tuple[str, ...] = ()

    def text_tensors(self, model_dir: str) -> Any:
        """The safetensors of the text model (all of them here; a VL converter hides the vision tower's)."""
        return SafetensorsDir(model_dir)

    def convert(self, model_dir: str, out_path: str, options: Mapping[str, Any]) -> list[str]:
        """Write ``out_path``; returns (and prints to stderr) notes on what was left out.

        options: ``outtype`` = f32 (default), f16 or bf16 for matrices (norms, biases and
        the SSM vectors stay f32).
        """
        outtype = str(options.get("outtype", "f32")).lower()
        mtp_opt = str(options.get("mtp", "auto")).lower()
        unknown = sorted(set(options) - {"outtype", "mtp", *self.extra_options})
        if unknown or outtype not in OUTTYPES or mtp_opt not in MTP_CHOICES:
            raise UserError(f"plinth-nemotron converter options: outtype in {', '.join(OUTTYPES)}, mtp in "
                            f"{', '.join(MTP_CHOICES)}; got {dict(options)}")
        source = str(Path(model_dir) / "config.json")
        config = read_config(model_dir)
        name = str(config.get("_name_or_path") or Path(model_dir).name)
        st = self.text_tensors(model_dir)
        has_mtp = bool(mtp_configs(config, source)[1]) and any(normalise_name(n).startswith("mtp.") for n in st.names())
        if mtp_opt in ("yes", "true", "1") and not has_mtp:
            raise UserError(f"{model_dir}: mtp=yes, but the checkpoint has no MTP head (num_nextn_predict_layers / "
                            "mtp_block_configs and mtp.* tensors)")
        export_mtp = has_mtp and mtp_opt not in ("no", "false", "0")
        md = gguf_metadata(config, source, name, mtp=export_mtp)
        arch = md["general.architecture"]
        n_mtp = int(md.get(f"{arch}.nextn_predict_layers", 0))
        n_layer = md[f"{arch}.block_count"] - n_mtp
        cfg = _text_config(config)
        tensors, notes = convert_tensors(st, n_layer, md[f"{arch}.ssm.group_count"], n_mtp)
        if cfg.get("tie_word_embeddings") and "output.weight" in tensors:
            del tensors["output.weight"]  # tied: the LM head is token_embd
        # check against the architecture's own declaration, so the file we write loads
        hp = load_hparams(md, source, arch)
        if hp.n_vocab == -1 and "token_embd.weight" in tensors:
            import attrs

            hp = attrs.evolve(hp, n_vocab=tensors["token_embd.weight"].shape[0])
        specs = tensor_specs(hp)
        check_converted(specs, tensors, model_dir, arch, f"layer pattern {hp.pattern!r}")
        qtypes = None
        if outtype != "f32":
            import gguf

            q = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16}[outtype]
            keep_f32 = ("ssm_a", "ssm_d", "ssm_norm.weight", "ssm_conv1d.weight")
            qtypes = {k: q for k, v in tensors.items() if v.ndim >= 2 and not k.endswith(keep_f32)}
        if (cfg.get("num_nextn_predict_layers") or cfg.get("mtp_block_configs")) and not has_mtp and not notes:
            notes.append("the config declares MTP layers, but no mtp.* tensors were found; none exported")
        tok_md, tok_note = tokenizer_metadata(model_dir, cfg, int(md.get(f"{arch}.vocab_size", 0)))
        md.update(tok_md)
        notes += [tok_note] if tok_note else []
        write_gguf(out_path, md, tensors, qtypes)
        for note in notes:
            print(f"plinth-nemotron: {note}", file=sys.stderr)
        return notes


class NemotronHPuzzleConverter(NemotronHConverter):
    """``NemotronHPuzzleForCausalLM`` (per-block ``block_configs``) folder -> ``nemotron_h_moe`` GGUF."""

    hf_arch = "NemotronHPuzzleForCausalLM"

    def convert(self, model_dir: str, out_path: str, options: Mapping[str, Any]) -> list[str]:
        cfg = _text_config(read_config(model_dir))
        if not cfg.get("block_configs"):
            raise UserError(f"{model_dir}/config.json: NemotronHPuzzleForCausalLM without block_configs")
        return super().convert(model_dir, out_path, options)


class _TextOnly:
    """A :class:`SafetensorsDir` seen without the tensors whose names start with ``hidden``."""

    def __init__(self, st: SafetensorsDir, hidden: tuple[str, ...]) -> None:
        self._st, self._hidden, self.dir = st, hidden, st.dir

    def names(self) -> list[str]:
        return [n for n in self._st.names() if not n.startswith(self._hidden)]

    def get(self, name: str, dtype: Any = np.float32) -> np.ndarray:
        return self._st.get(name, dtype)


# the vision tower and projector of a NemotronH_Omni checkpoint (release names, as save_pretrained writes them)
_VISION_PREFIXES = ("vision_model.", "mlp1.", "vision_projector.", "audio_tower.", "sound_encoder.",
                    "sound_projection.")
_RADIO = "vision_model.radio_model.model."
_RADIO_BLOCK = {"norm1.weight": "ln1.weight", "norm1.bias": "ln1.bias", "norm2.weight": "ln2.weight",
                "norm2.bias": "ln2.bias", "attn.proj.weight": "attn_out.weight", "attn.proj.bias": "attn_out.bias",
                "mlp.fc1.weight": "ffn_up.weight", "mlp.fc1.bias": "ffn_up.bias", "mlp.fc2.weight": "ffn_down.weight",
                "mlp.fc2.bias": "ffn_down.bias", "layer_scale1.lambda1": "ls1", "layer_scale2.lambda1": "ls2"}


def vision_config(config: Mapping[str, Any], source: str) -> Any:
    """The :class:`~plinth_nemotron.vision.VisionConfig` of a NemotronH_Omni config (refusing what is not run)."""
    from .vision import VisionConfig

    v = dict(config.get("vision_config") or {})
    if not v:
        raise UserError(f"{source}: no vision_config")
    for key, want in (("hidden_act", "gelu"), ("use_swiglu_ffn", False), ("qkv_bias", True), ("num_channels", 3)):
        if v.get(key, want) != want:
            raise UserError(f"{source}: vision_config.{key} = {v.get(key)!r}; plinth-nemotron's RADIO tower runs "
                            f"{want!r} only")
    ratio = float(config.get("downsample_ratio", 0.5))
    if ratio != 0.5:
        raise UserError(f"{source}: downsample_ratio = {ratio}; plinth-nemotron's pixel shuffle merges 2x2 (0.5) only")
    text = _text_config(config)
    d = int(v.get("hidden_size", 1280))
    ps = int(v.get("patch_size", 16))
    return VisionConfig(
        n_embd=d, n_layer=int(v.get("num_hidden_layers", 32)), n_head=int(v.get("num_attention_heads", 16)),
        n_ff=int(d * float(v.get("mlp_ratio", 4.0))), patch_size=ps,
        n_prefix=int(v.get("num_cls_tokens", 3)) + int(v.get("num_registers", 7)),
        max_grid=int(v.get("max_img_size", 2048)) // ps, text_n_embd=int(text["hidden_size"]),
        projector_n_ff=int(config.get("projector_hidden_size", 4096)), eps=float(v.get("layer_norm_eps", 1e-6)),
        downsample_ratio=ratio, final_norm=int(text.get("num_nextn_predict_layers") or 0) > 0,
        image_mean=tuple(float(x) for x in v.get("norm_mean", (0.48145466, 0.4578275, 0.40821073))),
        image_std=tuple(float(x) for x in v.get("norm_std", (0.26862954, 0.26130258, 0.27577711))),
        video=v.get("video_temporal_patch_size") is not None)


def vision_tensors(st: SafetensorsDir, cfg: Any) -> tuple[dict[str, np.ndarray], list[str]]:
    """The tower's and projector's tensors under :mod:`plinth_nemotron.vision` names, and notes."""
    out: dict[str, np.ndarray] = {}
    notes = []
    d = cfg.n_embd
    for hf in st.names():
        if not hf.startswith(_VISION_PREFIXES):
            continue
        if hf.startswith(("audio_tower.", "sound_")):
            notes.append(f"dropped the audio tower ({hf.split('.')[0]}.*): plinth-nemotron takes images only")
            continue
        name = hf[len(_RADIO):] if hf.startswith(_RADIO) else hf
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
        if m is not None:
            b, rest = f"v.blk.{int(m.group(1))}.", m.group(2)
            if rest in ("attn.qkv.weight", "attn.qkv.bias"):
                t = st.get(hf)
                for i, part in enumerate(("attn_q", "attn_k", "attn_v")):
                    out[b + part + (".weight" if rest.endswith("weight") else ".bias")] = t[i * d:(i + 1) * d]
                continue
            if rest in _RADIO_BLOCK:
                out[b + _RADIO_BLOCK[rest]] = st.get(hf)
                continue
        simple = {"patch_generator.embedder.weight": "v.patch_embd.weight",
                  "patch_generator.cls_token.token": "v.cls_embd.weight",
                  "vision_projector.vision_final_layernorm.weight": "v.post_ln.weight",
                  "vision_projector.vision_final_layernorm.bias": "v.post_ln.bias",
                  "mlp1.0.weight": "mm.norm.weight", "mlp1.1.weight": "mm.1.weight", "mlp1.3.weight": "mm.2.weight"}
        if name in simple:
            out[simple[name]] = st.get(hf)
        elif name == "patch_generator.pos_embed":
            out["v.position_embd.weight"] = st.get(hf).reshape(-1, d)
        elif name in ("patch_generator.video_embedder.weight", "vision_model.radio_model.summary_idxs"):
            if "video" in name:
                notes.append("the tower's video patch projection is not exported: plinth-nemotron takes images "
                             "only (video input is refused)")
        else:
            raise UserError(f"{st.dir}: vision tensor {hf!r} has no GGUF name in plinth-nemotron's mapping")
    if not cfg.final_norm:
        out.pop("v.post_ln.weight", None)
        out.pop("v.post_ln.bias", None)
    return out, sorted(set(notes))


class NemotronHOmniConverter(NemotronHConverter):
    """``NemotronH_Omni_Reasoning_V3`` (Nemotron-H VL) folder -> the text GGUF plus the vision tower's own GGUF.

    The tower goes to its own file (llama.cpp's mmproj convention; option ``mmproj=PATH``, default
    ``<out>.mmproj.gguf`` beside the text file): the text file stays an ordinary ``nemotron_h(_moe)``
    file that every text tool reads, and one tower can serve several quantisations of the text model.
    """

    hf_arch = "NemotronH_Omni_Reasoning_V3"
    extra_options = ("mmproj",)

    def text_tensors(self, model_dir: str) -> Any:
        return _TextOnly(SafetensorsDir(model_dir), _VISION_PREFIXES)

    def convert(self, model_dir: str, out_path: str, options: Mapping[str, Any]) -> list[str]:
        from .vision import save_vision_gguf

        source = str(Path(model_dir) / "config.json")
        config = read_config(model_dir)
        cfg = vision_config(config, source)
        notes = super().convert(model_dir, out_path, options)
        weights, vnotes = vision_tensors(SafetensorsDir(model_dir), cfg)
        mmproj = Path(options.get("mmproj") or Path(out_path).with_suffix(".mmproj.gguf"))
        save_vision_gguf(mmproj, cfg, weights)
        vnotes.append(f"wrote the vision tower to {mmproj} (use it with --mmproj)")
        for note in vnotes:
            print(f"plinth-nemotron: {note}", file=sys.stderr)
        return notes + vnotes


__all__ = ["NemotronHConverter", "NemotronHOmniConverter", "NemotronHPuzzleConverter", "convert_tensors", "gguf_metadata",
           "layer_configs", "mtp_configs", "normalise_name"]

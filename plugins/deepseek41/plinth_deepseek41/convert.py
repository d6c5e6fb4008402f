"""Hugging Face ``DeepseekV4ForCausalLM`` folders to ``deepseek4`` GGUF (``plinth convert DIR -o OUT.gguf``).

Tensor names: the upstream (original release) names, which transformers 5.24's
``save_pretrained`` also writes (``model.layers.N.attn.wq_a``, ``hc_attn_fn``, ``ffn.experts.E.w1``,
``head.weight`` ...), with or without the ``model.`` prefix, and the release's top-level
spellings (``embed.weight``, ``norm.weight``, ``hc_head_fn``). Experts are stacked into
``ffn_{gate,up,down}_exps`` ([n_expert, n_ff, E] / [n_expert, E, n_ff]); ``tid2eid`` is written as
I32, as llama.cpp writes it (plinth files written before hold it as F32; both load). A release checkpoint's MTP
block ``mtp.D.*`` (``enorm``, ``hnorm``, ``e_proj``, ``h_proj``, ``norm``, ``hc_head_*`` and an ordinary
block) becomes ``blk.{n_layer + D}.*`` with ``nextn.eh_proj = [e_proj | h_proj]`` (window attention,
``compress_ratios`` extended with 0), written by default to a head-only file in llama.cpp's ``--mtp``
layout (:func:`write_mtp_head_file`; option ``mtp=inline`` keeps it in the one file, ``mtp=no``
drops it); an incomplete block is dropped with a note. transformers 5.24's ``save_pretrained``
writes no MTP tensors (it builds no MTP module). The folder's byte-level BPE tokenizer is written too.

Quantised release weights are dequantized to float32 on the way: FP8 e4m3 matrices with a
``<name>.scale`` (or ``weight_scale_inv``) per 128×128 block, and FP4 (e2m1, two per int8 byte,
low nibble first) routed experts with an E8M0 scale per 32 inputs (MXFP4).

Config: ``layer_types`` + ``compress_rates`` (or the legacy ``compress_ratios`` list) give
``attention.compress_ratios`` per layer; a CSA / HCA rate other than 4 / 128 is written as
``attention.csa_ratio`` / ``attention.hca_ratio``. ``mlp_layer_types`` (or ``num_hash_layers``)
must put every ``hash_moe`` layer first (``hash_layer_count``). The compress RoPE's YaRN comes
from ``rope_parameters["compress"]`` or the legacy ``rope_scaling``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from plinth.convert import SafetensorsDir, check_converted, padded_tokenizer_metadata, read_config, write_gguf
from plinth.errors import UserError
from plinth.graph import check_tensors

from .deepseek4 import ARCH, GATING_SQRT_SOFTPLUS, load_hparams, tensor_specs

LAYER_TYPE_KIND = {"sliding_attention": "window", "compressed_sparse_attention": "csa",
                   "heavily_compressed_attention": "hca"}

_GLOBAL = {"embed.weight": "token_embd.weight", "embed_tokens.weight": "token_embd.weight",
           "head.weight": "output.weight", "lm_head.weight": "output.weight", "norm.weight": "output_norm.weight",
           "hc_head_fn": "output_hc_fn.weight", "hc_head.hc_fn": "output_hc_fn.weight",
           "hc_head_base": "output_hc_base.weight", "hc_head.hc_base": "output_hc_base.weight",
           "hc_head_scale": "output_hc_scale.weight", "hc_head.hc_scale": "output_hc_scale.weight"}
_LAYER = {
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "hc_attn_fn": "hc_attn_fn.weight", "hc_attn_base": "hc_attn_base.weight", "hc_attn_scale": "hc_attn_scale.weight",
    "hc_ffn_fn": "hc_ffn_fn.weight", "hc_ffn_base": "hc_ffn_base.weight", "hc_ffn_scale": "hc_ffn_scale.weight",
    "attn.attn_sink": "attn_sinks.weight", "attn.wq_a.weight": "attn_q_a.weight",
    "attn.q_norm.weight": "attn_q_a_norm.weight", "attn.wq_b.weight": "attn_q_b.weight",
    "attn.wkv.weight": "attn_kv.weight", "attn.norm.weight": "attn_kv_a_norm.weight",
    "attn.kv_norm.weight": "attn_kv_a_norm.weight",  # the release's spelling
    "attn.wo_a.weight": "attn_output_a.weight", "attn.wo_b.weight": "attn_output_b.weight",
    "attn.compressor.wkv.weight": "attn_compressor_kv.weight",
    "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
    "attn.compressor.ape": "attn_compressor_ape.weight", "attn.compressor.norm.weight": "attn_compressor_norm.weight",
    "attn.indexer.weights_proj.weight": "indexer.proj.weight", "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
    "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
    "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
    "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight", "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight", "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
    "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
}
_EXPERT = {"w1": "gate", "w2": "down", "w3": "up"}
# an MTP block's own tensors (``mtp.D.<name>``; the rest are ordinary block tensors)
_MTP = {"enorm.weight": "nextn.enorm.weight", "hnorm.weight": "nextn.hnorm.weight",
        "norm.weight": "nextn.shared_head_norm.weight", "hc_head_fn": "nextn.hc_head_fn.weight",
        "hc_head_base": "nextn.hc_head_base.weight", "hc_head_scale": "nextn.hc_head_scale.weight"}
_LAYER_RE = re.compile(r"(layers|mtp)\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")

# FP4 e2m1 code -> value (sign in bit 3)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      dtype=np.float32)


# ============================================================================ dequantization

def e8m0_to_f32(raw: np.ndarray) -> np.ndarray:
    """E8M0 scales (uint8 exponents, bias 127) -> float32 2^(e-127)."""
    return np.ldexp(np.float32(1.0), raw.astype(np.int32) - 127).astype(np.float32)


def e4m3_to_f32(raw: np.ndarray) -> np.ndarray:
    """FP8 e4m3fn bytes (uint8) -> float32 (bias 7, no infinities, 0x7f/0xff are NaN)."""
    raw = raw.astype(np.int32)
    sign = np.where(raw & 0x80, -1.0, 1.0)
    exp = (raw >> 3) & 0xF
    man = raw & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * np.exp2(exp - 7.0))
    val = np.where((exp == 0xF) & (man == 0x7), np.nan, val)
    return (sign * val).astype(np.float32)


def dequant_fp8_blocks(w: np.ndarray, scale: np.ndarray, block: int = 128) -> np.ndarray:
    """W = W_fp8 · scale[i // block, j // block]. w: [n_out, n_in] float32; scale: [ceil(n_out/b), ceil(n_in/b)]."""
    s = np.repeat(np.repeat(scale, block, axis=0), block, axis=1)[:w.shape[0], :w.shape[1]]
    return (w * s).astype(np.float32)


def dequant_mxfp4(packed: np.ndarray, scale: np.ndarray, group: int = 32) -> np.ndarray:
    """FP4 e2m1 pairs (int8/uint8 [n_out, n_in/2], low nibble first) × E8M0-as-float scale per ``group``
    inputs ([n_out, n_in/group]) -> float32 [n_out, n_in]."""
    b = packed.view(np.uint8)
    vals = np.empty((b.shape[0], b.shape[1] * 2), dtype=np.float32)
    vals[:, 0::2] = FP4_VALUES[b & 0xF]
    vals[:, 1::2] = FP4_VALUES[b >> 4]
    return vals * np.repeat(scale, group, axis=1)[:, :vals.shape[1]]


def _read(st: SafetensorsDir, name: str) -> np.ndarray:
    """A tensor as float32, dequantizing FP8 e4m3 blocks and FP4 experts that carry a scale companion."""
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    scale_name = next((base + s for s in _SCALE_SUFFIXES if base + s in st), None)
    dtype = st.dtype(name)
    if scale_name is None:
        if dtype in ("F8_E4M3", "I8", "U8") and not name.endswith("tid2eid"):
            raise UserError(f"{st.dir}: tensor {name!r} is {dtype} without a scale companion "
                            f"({' or '.join(base + s for s in _SCALE_SUFFIXES)}); cannot dequantize it")
        return st.get(name)
    sdt = st.dtype(scale_name)
    scale = e8m0_to_f32(st.get(scale_name, None).view(np.uint8)) if sdt in ("F8_E8M0", "U8") else st.get(scale_name)
    if dtype == "F8_E4M3":
        return dequant_fp8_blocks(e4m3_to_f32(st.get(name, None).view(np.uint8)), scale)
    if dtype in ("I8", "U8"):
        return dequant_mxfp4(st.get(name, None), scale)
    return dequant_fp8_blocks(st.get(name), scale)


# ============================================================================ config

def layer_kinds(cfg: Mapping[str, Any], source: str) -> tuple[list[str], int, int]:
    """Per-layer kinds ("window" / "csa" / "hca") and the CSA / HCA compression rates."""
    n = int(cfg["num_hidden_layers"])
    rates = dict(cfg.get("compress_rates") or {})
    csa = int(rates.get("compressed_sparse_attention", cfg.get("compress_rate_csa", 4)))
    hca = int(rates.get("heavily_compressed_attention", cfg.get("compress_rate_hca", 128)))
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        legacy = list(cfg["compress_ratios"])
        by_ratio = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
        bad = sorted({r for r in legacy if r not in by_ratio})
        if bad:
            raise UserError(f"{source}: compress_ratios has ratio(s) {bad}; DeepSeek V4 defines 0, 4 and 128")
        types = [by_ratio[r] for r in legacy]
    if types is None:
        raise UserError(f"{source}: neither layer_types nor compress_ratios; cannot tell the attention of each layer")
    types = list(types)[:n]
    bad = sorted({t for t in types if t not in LAYER_TYPE_KIND})
    if bad or len(types) != n:
        raise UserError(f"{source}: layer_types must have {n} entries from {sorted(LAYER_TYPE_KIND)} (got {types})")
    return [LAYER_TYPE_KIND[t] for t in types], csa, hca


def hash_layer_count(cfg: Mapping[str, Any], source: str) -> int:
    n = int(cfg["num_hidden_layers"])
    mlp = cfg.get("mlp_layer_types")
    if mlp is None:
        return min(n, int(cfg.get("num_hash_layers", 3)))
    k = sum(1 for t in mlp[:n] if t == "hash_moe")
    if list(mlp[:n]) != ["hash_moe"] * k + ["moe"] * (n - k):
        raise UserError(f"{source}: mlp_layer_types {list(mlp)} puts a hash_moe layer after a routed one; "
                        "deepseek4 keeps hash-routed layers first (hash_layer_count)")
    return k


def gguf_metadata(cfg: Mapping[str, Any], source: str, name: str) -> dict[str, Any]:
    if cfg.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise UserError(f"{source}: scoring_func is {cfg.get('scoring_func')!r}; deepseek4 supports sqrtsoftplus only")
    kinds, csa, hca = layer_kinds(cfg, source)
    ratio = {"window": 0, "csa": csa, "hca": hca}
    n = int(cfg["num_hidden_layers"])
    head_dim = int(cfg["head_dim"])
    prf = cfg.get("partial_rotary_factor")
    n_rot = int(cfg["qk_rope_head_dim"]) if prf is None and "qk_rope_head_dim" in cfg else \
        int(head_dim * (prf if prf is not None else 64 / 512))
    a = ARCH
    md: dict[str, Any] = {
        "general.architecture": a,
        "general.name": name,
        f"{a}.context_length": int(cfg.get("max_position_embeddings", 1048576)),
        f"{a}.embedding_length": int(cfg["hidden_size"]),
        f"{a}.block_count": n,
        f"{a}.vocab_size": int(cfg["vocab_size"]),
        f"{a}.attention.head_count": int(cfg["num_attention_heads"]),
        f"{a}.attention.head_count_kv": 1,
        f"{a}.attention.key_length": head_dim,
        f"{a}.attention.value_length": head_dim,
        f"{a}.rope.dimension_count": n_rot,
        f"{a}.rope.freq_base": float(cfg.get("rope_theta", 10000.0)),
        f"{a}.attention.compress_rope_freq_base": float(cfg.get("compress_rope_theta", 160000.0)),
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        f"{a}.attention.q_lora_rank": int(cfg["q_lora_rank"]),
        f"{a}.attention.output_group_count": int(cfg["o_groups"]),
        f"{a}.attention.output_lora_rank": int(cfg["o_lora_rank"]),
        f"{a}.attention.sliding_window": int(cfg["sliding_window"]),
        f"{a}.attention.compress_ratios": [ratio[k] for k in kinds],
        f"{a}.hyper_connection.count": int(cfg.get("hc_mult", 4)),
        f"{a}.hyper_connection.sinkhorn_iterations": int(cfg.get("hc_sinkhorn_iters", 20)),
        f"{a}.hyper_connection.epsilon": float(cfg.get("hc_eps", 1e-6)),
        f"{a}.expert_count": int(cfg["n_routed_experts"]),
        f"{a}.expert_used_count": int(cfg["num_experts_per_tok"]),
        f"{a}.expert_feed_forward_length": int(cfg["moe_intermediate_size"]),
        f"{a}.expert_shared_count": int(cfg.get("n_shared_experts", 1)),
        f"{a}.expert_weights_scale": float(cfg.get("routed_scaling_factor", 1.0)),
        f"{a}.expert_weights_norm": True,  # the reference always renormalises the chosen weights
        f"{a}.expert_gating_func": GATING_SQRT_SOFTPLUS,
        f"{a}.swiglu_clamp_exp": float(cfg.get("swiglu_limit", 0.0) or 0.0),
        f"{a}.hash_layer_count": hash_layer_count(cfg, source),
        f"{a}.nextn_predict_layers": 0,  # set by the converter when it exports MTP blocks
    }
    if csa != 4:
        md[f"{a}.attention.csa_ratio"] = csa
    if hca != 128:
        md[f"{a}.attention.hca_ratio"] = hca
    md[f"{a}.embedding_length_out"] = int(cfg["hidden_size"]) * int(cfg.get("hc_mult", 4))  # llama.cpp writes it
    if "csa" in kinds or "index_n_heads" in cfg:  # llama.cpp's loader requires the indexer keys on every file
        md.update({f"{a}.attention.indexer.head_count": int(cfg["index_n_heads"]),
                   f"{a}.attention.indexer.key_length": int(cfg["index_head_dim"]),
                   f"{a}.attention.indexer.top_k": int(cfg["index_topk"])})
    rp = cfg.get("rope_parameters") or {}
    if isinstance(rp.get("compress"), Mapping):  # nested per rope type (as transformers saves it)
        yarn = rp["compress"]
    else:  # flat: its scaling applies to the compressed layers only (as transformers reads it)
        yarn = {k: v for k, v in rp.items() if k != "main"} or (cfg.get("rope_scaling") or {})
    kind = yarn.get("rope_type", yarn.get("type", "default"))
    if kind == "yarn":
        md.update({f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": float(yarn["factor"]),
                   f"{a}.rope.scaling.original_context_length": int(yarn["original_max_position_embeddings"]),
                   f"{a}.rope.scaling.yarn_beta_fast": float(yarn.get("beta_fast", 32.0)),
                   f"{a}.rope.scaling.yarn_beta_slow": float(yarn.get("beta_slow", 1.0))})
        if float(yarn.get("attention_factor", 1.0)) != 1.0:
            raise UserError(f"{source}: compress rope attention_factor {yarn['attention_factor']} != 1 "
                            "(the V4 reference does not scale cos/sin)")
    elif kind not in ("default", None):
        raise UserError(f"{source}: compress rope type {kind!r} is not supported (default or yarn)")
    return md


# ============================================================================ tensors

def convert_tensors(st: SafetensorsDir, n_layer: int) -> tuple[dict[str, np.ndarray], int, list[str]]:
    """GGUF-named float32 tensors of the folder, experts stacked; the number of MTP blocks exported
    (``mtp.D.*`` -> ``blk.{n_layer + D}.*``, ``e_proj``/``h_proj`` joined into ``nextn.eh_proj``); notes."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, str]] = {}
    eh: dict[int, dict[str, np.ndarray]] = {}
    for hf_name in st.names():
        name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
        if name.endswith(_SCALE_SUFFIXES):
            continue  # read with its tensor
        if name in _GLOBAL:
            out[_GLOBAL[name]] = _read(st, hf_name)
            continue
        m = _LAYER_RE.fullmatch(name)
        if m is None:
            raise UserError(f"{st.dir}: tensor {hf_name!r} has no GGUF name in plinth-deepseek41's mapping")
        il, rest = int(m.group(2)), m.group(3)
        if m.group(1) == "mtp":
            il += n_layer
            if rest in ("e_proj.weight", "h_proj.weight"):
                eh.setdefault(il, {})[rest[0]] = _read(st, hf_name)
                continue
            if rest in _MTP:
                out[f"blk.{il}.{_MTP[rest]}"] = _read(st, hf_name)
                continue
        e = _EXPERT_RE.fullmatch(rest)
        if e is not None:
            experts.setdefault((il, _EXPERT[e.group(2)]), {})[int(e.group(1))] = hf_name
            continue
        if rest not in _LAYER:
            raise UserError(f"{st.dir}: tensor {hf_name!r} has no GGUF name in plinth-deepseek41's mapping")
        if rest == "ffn.gate.tid2eid":  # expert ids: I32, as llama.cpp writes them
            ids = st.get(hf_name, None) if st.dtype(hf_name) in ("I64", "I32", "I16", "I8", "U8") else _read(st, hf_name)
            out[f"blk.{il}.{_LAYER[rest]}"] = np.asarray(ids).astype(np.int32)
            continue
        t = _read(st, hf_name)
        out[f"blk.{il}.{_LAYER[rest]}"] = t.astype(np.float32)
    for (il, which), by_index in sorted(experts.items()):
        idx = sorted(by_index)
        if idx != list(range(len(idx))):
            missing = sorted(set(range(max(idx) + 1)) - set(idx))
            raise UserError(f"{st.dir}: layer {il} is missing expert(s) {missing} ({which})")
        out[f"blk.{il}.ffn_{which}_exps.weight"] = np.stack([_read(st, by_index[i]) for i in idx])
    lone = 0
    for il, parts in eh.items():
        if set(parts) == {"e", "h"}:  # eh_proj · [e; h] = e_proj · e + h_proj · h
            out[f"blk.{il}.nextn.eh_proj.weight"] = np.concatenate([parts["e"], parts["h"]], axis=1)
        else:
            lone += len(parts)
    n_mtp = 0
    while f"blk.{n_layer + n_mtp}.nextn.eh_proj.weight" in out:
        n_mtp += 1
    notes = []
    stray = sorted(k for k in out if k.startswith("blk.") and int(k.split(".")[1]) >= n_layer + n_mtp)
    if stray or lone:  # an incomplete MTP block (no e_proj/h_proj pair): leave the MTP layers out
        for k in stray:
            del out[k]
        notes.append(f"dropped {len(stray) + lone} tensor(s) of incomplete MTP block(s) (no mtp.D.e_proj/h_proj "
                     "pair)")
    return out, n_mtp, notes


#: the folder's tokenizer padded to the vocabulary size as llama.cpp pads it
tokenizer_metadata = padded_tokenizer_metadata


def write_mtp_head_file(path: str, md: Mapping[str, Any], trunk: Mapping[str, np.ndarray],
                        head: Mapping[str, np.ndarray], n_layer: int, n_mtp: int, source: str) -> None:
    """llama.cpp's ``--mtp`` head file: block_count counting the MTP block, the block, the shared embedding /
    head / final norm, and the block's own hc head as the root ``output_hc_*``."""
    if n_mtp != 1:
        raise UserError(f"{source}: {n_mtp} MTP blocks; llama.cpp's head file holds one hc head (use mtp=inline)")
    out = {k: trunk[k] for k in ("token_embd.weight", "output.weight", "output_norm.weight")}
    prefix = f"blk.{n_layer}.nextn.hc_head_"
    for k, v in head.items():
        out["output_hc_" + k[len(prefix):] if k.startswith(prefix) else k] = v
    hmd = dict(md)
    hmd[f"{ARCH}.block_count"] = n_layer + 1
    hmd[f"{ARCH}.nextn_predict_layers"] = 1
    hmd[f"{ARCH}.attention.compress_ratios"] = list(md[f"{ARCH}.attention.compress_ratios"]) + [0]
    hp = load_hparams(hmd, path)
    specs = tensor_specs(hp)
    check_tensors(specs, {k: (v.shape, "I32" if v.dtype.kind in "iu" else "F32") for k, v in out.items()}, path)
    write_gguf(path, hmd, out)


class DeepseekV4Converter:
    """``DeepseekV4ForCausalLM`` folder -> ``deepseek4`` GGUF."""

    hf_arch = "DeepseekV4ForCausalLM"

    def convert(self, model_dir: str, out_path: str, options: Mapping[str, Any]) -> list[str]:
        """Write ``out_path`` (float32 tensors); returns (and prints to stderr) notes on what was left out.

        options: ``mtp`` = separate (default: a checkpoint's MTP block goes to a head-only file beside
        ``out_path``, ``<out>.mtp.gguf`` or ``mtp_out=PATH``, in llama.cpp's ``--mtp`` layout; the trunk
        file is then one llama.cpp opens), inline (plinth's combined layout, which llama.cpp does not
        open), or no (dropped)."""
        options = dict(options or {})
        mtp = str(options.get("mtp", "separate")).lower()
        if set(options) - {"mtp", "mtp_out"} or mtp not in ("separate", "inline", "no"):
            raise UserError(f"plinth-deepseek41 converter options: mtp in separate, inline, no (mtp_out=PATH); "
                            f"got {options}")
        source = str(Path(model_dir) / "config.json")
        cfg = read_config(model_dir)
        md = gguf_metadata(cfg, source, str(cfg.get("_name_or_path") or Path(model_dir).name))
        n_layer = md[f"{ARCH}.block_count"]
        tensors, n_mtp, notes = convert_tensors(SafetensorsDir(model_dir), n_layer)
        head: dict[str, np.ndarray] = {}
        if n_mtp and mtp in ("no", "separate"):
            moved = [k for k in tensors if k.startswith("blk.") and int(k.split(".")[1]) >= n_layer]
            head = {k: tensors.pop(k) for k in moved}
            if mtp == "no":
                notes.append(f"dropped the MTP block ({len(moved)} tensors, mtp=no)")
                head = {}
            n_mtp, n_head_blocks = 0, n_mtp
        elif n_mtp:
            notes.append("the MTP block is written inline (plinth's layout, for --spec mtp); llama.cpp does not "
                         "open such a file (it keeps V4's MTP head in a file of its own: mtp=separate)")
        tok_md, tok_note = tokenizer_metadata(model_dir, cfg, md[f"{ARCH}.vocab_size"])
        md.update(tok_md)
        notes += [tok_note] if tok_note else []
        if n_mtp:
            md[f"{ARCH}.nextn_predict_layers"] = n_mtp
            md[f"{ARCH}.attention.compress_ratios"] = md[f"{ARCH}.attention.compress_ratios"] + [0] * n_mtp
        hp = load_hparams(md, source)
        specs = tensor_specs(hp)
        check_converted(specs, tensors, model_dir, "deepseek4",
                        f"compress_ratios {list(hp.compress_ratios)}, hash layers {hp.n_hash_layers}")
        write_gguf(out_path, md, tensors)
        if head:
            head_path = options.get("mtp_out") or str(Path(out_path).with_suffix("")) + ".mtp.gguf"
            write_mtp_head_file(head_path, md, tensors, head, n_layer, n_head_blocks, source)
            notes.append(f"the MTP head is in {head_path} (llama.cpp's --mtp layout; plinth: --spec mtp --draft "
                         f"{head_path})")
        for note in notes:
            print(f"plinth-deepseek41: {note}", file=sys.stderr)
        return notes


__all__ = ["DeepseekV4Converter", "convert_tensors", "dequant_fp8_blocks", "dequant_mxfp4", "e4m3_to_f32",
           "e8m0_to_f32", "gguf_metadata", "layer_kinds"]

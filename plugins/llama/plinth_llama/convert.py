"""Hugging Face dense decoders to GGUF (``plinth convert DIR -o OUT.gguf``), as llama.cpp names them.

``LlamaForCausalLM`` / ``MixtralForCausalLM`` -> ``llama``, ``Qwen2ForCausalLM`` -> ``qwen2``,
``Qwen3ForCausalLM`` -> ``qwen3``, ``Gemma3ForCausalLM`` -> ``gemma3``. The keys, their types and
the tensor names are llama.cpp's (its converter writes the same for these models), so llama.cpp
opens the files:

* llama's Q and K rows (and biases) are reordered for RoPE on adjacent pairs
  (:func:`plinth.convert.permute_qk`, per K/V head for K); the others keep NeoX order;
* RoPE scaling from ``rope_parameters`` (or the older ``rope_theta`` / ``rope_scaling``): linear
  and YaRN as ``rope.scaling.*`` keys; ``llama3`` as the ``rope_freqs.weight`` tensor of
  per-frequency divisors (transformers' llama3 rule); any other type is refused by name;
* Mixtral's experts ``block_sparse_moe.experts.{e}.w1/w3/w2`` stacked as
  ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, the router as ``ffn_gate_inp``;
* Gemma 3's norm weights are stored as ``1 + w``; its sliding layers (``layer_types``) are
  written as ``attention.sliding_window_pattern`` (one bool per layer) with the window and the
  local RoPE base ``rope.freq_base_swa``;
* the tokenizer: a byte-level BPE ``tokenizer.json`` (:func:`plinth.convert.bpe_tokenizer_metadata`),
  its pre-tokenizer named as llama.cpp names it (:func:`pre_tokenizer_name`), and the chat
  template of ``tokenizer_config.json``; a SentencePiece tokenizer is refused.

Before writing, the file's keys and tensors are checked against plinth-llama's own declaration,
so a written file always loads. Options: ``outtype`` f32 (default), f16 or bf16 for matrices
(norms, biases, ``rope_freqs`` and the MoE router stay f32, as in llama.cpp's files).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from plinth.convert import SafetensorsDir, bpe_tokenizer_metadata, permute_qk, read_config, write_gguf
from plinth.errors import UserError

OUTTYPES = {"f32": 0, "f16": 1, "bf16": 32}  # -> general.file_type (llama.cpp's LLAMA_FTYPE_*)

# per-layer HF suffix -> GGUF suffix (llama, qwen2, qwen3; gemma3 overrides the norms)
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    **{f"self_attn.{p}_proj.{k}": f"attn_{p}.{k}" for p in "qkv" for k in ("weight", "bias")},
    **{f"self_attn.o_proj.{k}": f"attn_output.{k}" for k in ("weight", "bias")},
    **{f"mlp.{p}_proj.{k}": f"ffn_{p}.{k}" for p in ("gate", "up", "down") for k in ("weight", "bias")},
}
_GEMMA3_NORMS = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_EXPERT_GGUF = {"w1": "ffn_gate_exps.weight", "w3": "ffn_up_exps.weight", "w2": "ffn_down_exps.weight"}


def rope_parameters(cfg: Mapping[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """The RoPE settings of ``layer_type`` layers: transformers 5's ``rope_parameters`` (flat, or per
    layer type), else the older ``rope_theta`` + ``rope_scaling``."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, Mapping) and rp:
        if layer_type in rp or "full_attention" in rp:
            rp = rp.get(layer_type) or {}
        return dict(rp)
    out = dict(cfg.get("rope_scaling") or {})
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out.pop("type")
    if layer_type == "sliding_attention" and cfg.get("rope_local_base_freq") is not None:
        return {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
    if cfg.get("rope_theta") is not None:
        out["rope_theta"] = cfg["rope_theta"]
    return out


def llama3_rope_factors(rp: Mapping[str, Any], head_dim: int) -> np.ndarray:
    """Per-frequency divisors [head_dim / 2] of transformers' ``llama3`` RoPE (GGUF ``rope_freqs.weight``):
    1 for wavelengths below ``original / high_freq_factor``, ``factor`` above ``original /
    low_freq_factor``, and a smooth blend in between."""
    base = float(rp.get("rope_theta", 10000.0))
    factor = float(rp.get("factor", 8.0))
    low, high = float(rp.get("low_freq_factor", 1.0)), float(rp.get("high_freq_factor", 4.0))
    orig = float(rp.get("original_max_position_embeddings", 8192))
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2.0 * math.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    # the blended frequency is inv_freq * ((1 - smooth) / factor + smooth); its divisor is the inverse
    blended = 1.0 / ((1.0 - smooth) / factor + smooth)
    out = np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, blended))
    return out.astype(np.float32)


# tokenizer.json Split regexes of the byte-level BPE families llama.cpp names (its tokenizer.ggml.pre)
_LLAMA3_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                 "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_QWEN2_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def pre_tokenizer_name(tok: Mapping[str, Any], source: str) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a byte-level BPE ``tokenizer.json``'s pre-tokenizer.

    GPT-2's (ByteLevel with its regex): ``gpt-2``; digits one by one, then GPT-2's: ``smollm``;
    Llama 3's and Qwen 2's split regexes before a regex-free ByteLevel: ``llama-bpe`` (with the model's
    ``ignore_merges``, as llama.cpp's llama-bpe) and ``qwen2`` (without).
    Any other pre-tokenizer is refused: written under another name, text would split differently.
    """
    pt = tok.get("pre_tokenizer") or {}
    steps = list(pt.get("pretokenizers") or []) if pt.get("type") == "Sequence" else [pt]
    kinds = [s.get("type") for s in steps]
    ignore_merges = bool((tok.get("model") or {}).get("ignore_merges", False))
    if ignore_merges and kinds != ["Split", "ByteLevel"]:
        kinds = ["ignore_merges"]  # no llama.cpp name below takes whole-word tokens with these splits

    def byte_level(use_regex: bool) -> bool:
        return steps[-1].get("type") == "ByteLevel" and bool(steps[-1].get("use_regex", True)) == use_regex

    if kinds == ["ByteLevel"] and byte_level(True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and byte_level(True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and byte_level(False) and steps[0].get("behavior") == "Isolated":
        regex = (steps[0].get("pattern") or {}).get("Regex")
        # llama.cpp's llama-bpe takes a word that is a token whole (Llama 3's "ignore_merges"): only then
        if regex == _LLAMA3_SPLIT and ignore_merges:
            return "llama-bpe"
        if regex == _QWEN2_SPLIT and not ignore_merges:
            return "qwen2"
    raise UserError(f"{source}: pre-tokenizer {json.dumps(pt)[:200]} is not one plinth names for llama.cpp "
                    "(GPT-2, SmolLM, Llama 3, Qwen 2); convert with llama.cpp's convert_hf_to_gguf.py")


class DenseConverter:
    """One HF architecture of plinth-llama to its GGUF architecture."""

    hf_arch = "LlamaForCausalLM"
    arch = "llama"

    def convert(self, model_dir: str, out_path: str, options: Mapping[str, Any]) -> list[str]:
        """Write ``out_path``; returns notes (none: nothing is left out silently, it is refused)."""
        outtype = str(options.get("outtype", "f32")).lower()
        unknown = sorted(set(options) - {"outtype"})
        if unknown or outtype not in OUTTYPES:
            raise UserError(f"plinth-llama converter options: outtype in {', '.join(OUTTYPES)}; got {dict(options)}")
        cfg = read_config(model_dir)
        source = str(Path(model_dir) / "config.json")
        md = self.metadata(cfg, source)
        md["general.name"] = str(cfg.get("_name_or_path") or Path(model_dir).name)
        md["general.file_type"] = OUTTYPES[outtype]
        md.update(self.tokenizer(model_dir, cfg))
        tensors = self.tensors(SafetensorsDir(model_dir), cfg, source)
        rp = rope_parameters(cfg)
        if str(rp.get("rope_type", "default")).lower() == "llama3":
            tensors["rope_freqs.weight"] = llama3_rope_factors(rp, self.head_dim(cfg))
        self.check(md, tensors, model_dir)
        qtypes = None
        if outtype != "f32":
            import gguf

            q = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16}[outtype]
            # the MoE router stays f32, as llama.cpp's converter keeps it (routing is sensitive to rounding)
            qtypes = {k: q for k, v in tensors.items() if v.ndim >= 2 and not k.endswith("ffn_gate_inp.weight")}
        write_gguf(out_path, md, tensors, qtypes)
        return []

    # -------------------------------------------------------------- metadata

    @staticmethod
    def head_dim(cfg: Mapping[str, Any]) -> int:
        return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])

    def metadata(self, cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
        a = self.arch
        n_head = int(cfg["num_attention_heads"])
        md: dict[str, Any] = {
            "general.architecture": a,
            f"{a}.block_count": int(cfg["num_hidden_layers"]),
            f"{a}.context_length": int(cfg.get("max_position_embeddings") or (131072 if a == "gemma3" else 2048)),
            f"{a}.embedding_length": int(cfg["hidden_size"]),
            f"{a}.feed_forward_length": int(cfg["intermediate_size"]),
            f"{a}.attention.head_count": n_head,
            f"{a}.attention.head_count_kv": int(cfg.get("num_key_value_heads") or n_head),
            f"{a}.attention.layer_norm_rms_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        }
        if cfg.get("head_dim") is not None:
            md[f"{a}.attention.key_length"] = md[f"{a}.attention.value_length"] = int(cfg["head_dim"])
        md.update(self.rope_metadata(rope_parameters(cfg), source))
        if cfg.get("hidden_act", cfg.get("hidden_activation", "silu")) != "silu" and a != "gemma3":
            raise UserError(f"{source}: hidden_act {cfg.get('hidden_act')!r}; '{a}' computes SwiGLU (silu)")
        return md

    def rope_metadata(self, rp: Mapping[str, Any], source: str) -> dict[str, Any]:
        a, kind = self.arch, str(rp.get("rope_type", "default")).lower()
        md: dict[str, Any] = {}
        if rp.get("rope_theta") is not None:
            md[f"{a}.rope.freq_base"] = float(rp["rope_theta"])
        if kind == "default":
            return md
        if kind == "linear":
            md[f"{a}.rope.scaling.type"] = "linear"
            md[f"{a}.rope.scaling.factor"] = float(rp["factor"])
        elif kind == "yarn":
            md[f"{a}.rope.scaling.type"] = "yarn"
            md[f"{a}.rope.scaling.factor"] = float(rp["factor"])
            md[f"{a}.rope.scaling.original_context_length"] = int(rp["original_max_position_embeddings"])
            for hf, key in (("extrapolation_factor", "yarn_ext_factor"), ("attention_factor", "yarn_attn_factor"),
                            ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
                if rp.get(hf) is not None:
                    md[f"{a}.rope.scaling.{key}"] = float(rp[hf])
            for hf in ("mscale", "mscale_all_dim"):
                if rp.get(hf) not in (None, 0, 0.0, 1, 1.0):
                    raise UserError(f"{source}: YaRN {hf} = {rp[hf]} is not converted for '{a}'")
        elif kind == "llama3" and a == "llama":
            pass  # rope_freqs.weight (see convert)
        else:
            raise UserError(f"{source}: rope_type {kind!r}; plinth converts default, linear, yarn"
                            f"{' and llama3' if a == 'llama' else ''} RoPE for '{a}', not {kind!r}")
        return md

    def tokenizer(self, model_dir: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file() and (Path(model_dir) / "tokenizer.model").is_file():
            raise UserError(f"{model_dir}: a SentencePiece tokenizer (tokenizer.model); plinth converts byte-level "
                            "BPE tokenizers (tokenizer.json) only, use llama.cpp's convert_hf_to_gguf.py")
        if path.is_file():
            tok = json.loads(path.read_text())
            model = tok.get("model") or {}
            if model.get("byte_fallback") or (tok.get("pre_tokenizer") or {}).get("type") == "Metaspace":
                raise UserError(f"{path}: a SentencePiece-style tokenizer (byte fallback / metaspace); plinth "
                                "converts byte-level BPE tokenizers only, use llama.cpp's convert_hf_to_gguf.py")
        md = bpe_tokenizer_metadata(model_dir, cfg)
        md["tokenizer.ggml.pre"] = pre_tokenizer_name(tok, str(path))
        tc = Path(model_dir) / "tokenizer_config.json"
        if tc.is_file():
            template = json.loads(tc.read_text()).get("chat_template")
            if isinstance(template, str):
                md["tokenizer.chat_template"] = template
        return md

    # -------------------------------------------------------------- tensors

    def layer_name(self, suffix: str) -> str | None:
        return _LAYER.get(suffix)

    def tensors(self, st: SafetensorsDir, cfg: Mapping[str, Any], source: str) -> dict[str, np.ndarray]:
        n_layer = int(cfg["num_hidden_layers"])
        n_head = int(cfg["num_attention_heads"])
        n_head_kv = int(cfg.get("num_key_value_heads") or n_head)
        out: dict[str, np.ndarray] = {}
        experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
        unknown = []
        for name in st.names():
            key = name[len("model."):] if name.startswith("model.") else name
            if key == "embed_tokens.weight":
                out["token_embd.weight"] = st.get(name)
            elif key == "norm.weight":
                out["output_norm.weight"] = self.norm(st.get(name))
            elif name == "lm_head.weight":
                out["output.weight"] = st.get(name)
            elif (m := re.match(r"^layers\.(\d+)\.(.+)$", key)) is not None:
                il, suffix = int(m.group(1)), m.group(2)
                if suffix.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed from the rope keys
                if (e := _EXPERT.match(suffix)) is not None:
                    experts.setdefault((il, _EXPERT_GGUF[e.group(2)]), {})[int(e.group(1))] = st.get(name)
                    continue
                gg = self.layer_name(suffix)
                if gg is None:
                    unknown.append(name)
                    continue
                w = st.get(name)
                if gg.endswith("norm.weight"):
                    w = self.norm(w)
                if self.arch == "llama" and gg.startswith(("attn_q.", "attn_k.")):
                    w = permute_qk(w, n_head if gg.startswith("attn_q.") else n_head_kv)
                out[f"blk.{il}.{gg}"] = w
            else:
                unknown.append(name)
        if unknown:
            raise UserError(f"{source}: tensor(s) with no GGUF name for '{self.arch}': {', '.join(sorted(unknown))}")
        n_expert = int(cfg.get("num_local_experts") or 0)
        for (il, gg), by_e in experts.items():
            if sorted(by_e) != list(range(n_expert)):
                raise UserError(f"{source}: layer {il} has experts {sorted(by_e)} of {gg}, expected 0..{n_expert - 1}")
            out[f"blk.{il}.{gg}"] = np.stack([by_e[e] for e in range(n_expert)])
        if cfg.get("tie_word_embeddings") and "output.weight" in out:
            if not np.array_equal(out["output.weight"], out["token_embd.weight"]):
                raise UserError(f"{source}: tie_word_embeddings, but lm_head.weight differs from embed_tokens")
            del out["output.weight"]
        return out

    def norm(self, w: np.ndarray) -> np.ndarray:
        return w

    def check(self, md: Mapping[str, Any], tensors: Mapping[str, np.ndarray], model_dir: str) -> None:
        """The file about to be written against plinth-llama's own reading of it (keys and tensors)."""
        from .gemma3 import Gemma3
        from .llama import Llama, Qwen2, Qwen3

        arch = {"llama": Llama, "qwen2": Qwen2, "qwen3": Qwen3, "gemma3": Gemma3}[self.arch]()
        arch.check(md, {k: (tuple(v.shape), "F32") for k, v in tensors.items()}, f"converted {model_dir}")


class LlamaConverter(DenseConverter):
    hf_arch = "LlamaForCausalLM"
    arch = "llama"

    def metadata(self, cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
        md = super().metadata(cfg, source)
        md["llama.vocab_size"] = int(cfg["vocab_size"])
        md["llama.rope.dimension_count"] = self.head_dim(cfg)
        if cfg.get("num_local_experts"):
            md["llama.expert_count"] = int(cfg["num_local_experts"])
            md["llama.expert_used_count"] = int(cfg["num_experts_per_tok"])
        if cfg.get("sliding_window") not in (None, 0) and cfg.get("use_sliding_window", True):
            raise UserError(f"{source}: sliding_window = {cfg['sliding_window']}; arch llama attends to the whole "
                            "context, so the converted model would answer differently")
        return md


class MixtralConverter(LlamaConverter):
    hf_arch = "MixtralForCausalLM"  # (router_jitter_noise is training-time noise: nothing to convert)


class Qwen2Converter(DenseConverter):
    hf_arch = "Qwen2ForCausalLM"
    arch = "qwen2"

    def metadata(self, cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
        if cfg.get("use_sliding_window") and "sliding_attention" in (cfg.get("layer_types") or ["sliding_attention"]):
            raise UserError(f"{source}: use_sliding_window; '{self.arch}' attends to the whole context")
        return super().metadata(cfg, source)


class Qwen3Converter(Qwen2Converter):
    hf_arch = "Qwen3ForCausalLM"
    arch = "qwen3"


class Gemma3Converter(DenseConverter):
    hf_arch = "Gemma3ForCausalLM"
    arch = "gemma3"

    def layer_name(self, suffix: str) -> str | None:
        return _GEMMA3_NORMS.get(suffix) or super().layer_name(suffix)

    def norm(self, w: np.ndarray) -> np.ndarray:
        return w + np.float32(1.0)  # transformers' Gemma3RMSNorm computes (1 + w)

    def metadata(self, cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
        md = super().metadata(cfg, source)
        n_layer, hd = int(cfg["num_hidden_layers"]), self.head_dim(cfg)
        md["gemma3.attention.key_length"] = md["gemma3.attention.value_length"] = hd
        if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise UserError(f"{source}: hidden_activation {cfg.get('hidden_activation')!r}; gemma3 computes "
                            "GeGLU with tanh-approximated gelu")
        scalar = cfg.get("query_pre_attn_scalar")
        expected = cfg["hidden_size"] // cfg["num_attention_heads"] if n_layer == 62 else hd
        if scalar is not None and int(scalar) != expected:
            raise UserError(f"{source}: query_pre_attn_scalar = {scalar}; plinth's gemma3 scales attention by "
                            f"1/sqrt({expected}) for {n_layer} layers")
        if cfg.get("attn_logit_softcapping"):
            md["gemma3.attn_logit_softcapping"] = float(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping"):
            md["gemma3.final_logit_softcapping"] = float(cfg["final_logit_softcapping"])
        types = cfg.get("layer_types")
        if types is None:
            period = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
            types = ["full_attention" if (il + 1) % period == 0 else "sliding_attention" for il in range(n_layer)]
        if len(types) != n_layer or not set(types) <= {"sliding_attention", "full_attention"}:
            raise UserError(f"{source}: layer_types {types!r}; expected {n_layer} of sliding_attention / "
                            "full_attention")
        sliding = [t == "sliding_attention" for t in types]
        if any(sliding):
            md["gemma3.attention.sliding_window"] = int(cfg["sliding_window"])
            md["gemma3.attention.sliding_window_pattern"] = sliding
            local = rope_parameters(cfg, "sliding_attention")
            if str(local.get("rope_type", "default")) != "default":
                raise UserError(f"{source}: rope_type {local.get('rope_type')!r} on the sliding layers; plinth's "
                                "gemma3 scales RoPE on the global layers only")
            md["gemma3.rope.freq_base_swa"] = float(local.get("rope_theta", 10000.0))
        return md


__all__ = ["DenseConverter", "Gemma3Converter", "LlamaConverter", "MixtralConverter", "Qwen2Converter",
           "Qwen3Converter", "llama3_rope_factors", "rope_parameters"]

"""``Gemma4ForCausalLM`` folder (config.json + safetensors + tokenizer.json) -> ``gemma4`` GGUF; of a
``Gemma4ForConditionalGeneration`` folder (the released checkpoints), its text model.

The keys and tensor names are those llama.cpp's own converter writes for Gemma 4, so the file opens
in llama.cpp too (the plugin README lists them). Config features the architecture does not compute
are refused by name (``attention_bias``, ``use_bidirectional_attention="all"``, another activation,
RoPE scaling factors, a per-layer vocabulary different from the main one, ...).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from plinth.convert import SafetensorsDir, bpe_tokenizer_metadata, map_names, read_config, write_gguf
from plinth.errors import UserError

from .gemma4 import Gemma4

ARCH = "gemma4"

# HF name -> GGUF name; {layer} is the layer number; "" leaves a tensor out on purpose
NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
    "model.layers.{layer}.input_layernorm.weight": "blk.{layer}.attn_norm.weight",
    "model.layers.{layer}.self_attn.q_proj.weight": "blk.{layer}.attn_q.weight",
    "model.layers.{layer}.self_attn.k_proj.weight": "blk.{layer}.attn_k.weight",
    "model.layers.{layer}.self_attn.v_proj.weight": "blk.{layer}.attn_v.weight",
    "model.layers.{layer}.self_attn.o_proj.weight": "blk.{layer}.attn_output.weight",
    "model.layers.{layer}.self_attn.q_norm.weight": "blk.{layer}.attn_q_norm.weight",
    "model.layers.{layer}.self_attn.k_norm.weight": "blk.{layer}.attn_k_norm.weight",
    "model.layers.{layer}.post_attention_layernorm.weight": "blk.{layer}.post_attention_norm.weight",
    "model.layers.{layer}.pre_feedforward_layernorm.weight": "blk.{layer}.ffn_norm.weight",
    "model.layers.{layer}.post_feedforward_layernorm.weight": "blk.{layer}.post_ffw_norm.weight",
    "model.layers.{layer}.mlp.gate_proj.weight": "blk.{layer}.ffn_gate.weight",
    "model.layers.{layer}.mlp.up_proj.weight": "blk.{layer}.ffn_up.weight",
    "model.layers.{layer}.mlp.down_proj.weight": "blk.{layer}.ffn_down.weight",
    "model.layers.{layer}.layer_scalar": "blk.{layer}.layer_output_scale.weight",
    "model.layers.{layer}.per_layer_input_gate.weight": "blk.{layer}.inp_gate.weight",
    "model.layers.{layer}.per_layer_projection.weight": "blk.{layer}.proj.weight",
    "model.layers.{layer}.post_per_layer_input_norm.weight": "blk.{layer}.post_norm.weight",
    "model.layers.{layer}.router.proj.weight": "blk.{layer}.ffn_gate_inp.weight",
    "model.layers.{layer}.router.scale": "blk.{layer}.ffn_gate_inp.scale",
    "model.layers.{layer}.router.per_expert_scale": "blk.{layer}.ffn_down_exps.scale",
    "model.layers.{layer}.experts.gate_up_proj": "blk.{layer}.ffn_gate_up_exps.weight",
    "model.layers.{layer}.experts.down_proj": "blk.{layer}.ffn_down_exps.weight",
    "model.layers.{layer}.pre_feedforward_layernorm_2.weight": "blk.{layer}.pre_ffw_norm_2.weight",
    "model.layers.{layer}.post_feedforward_layernorm_1.weight": "blk.{layer}.post_ffw_norm_1.weight",
    "model.layers.{layer}.post_feedforward_layernorm_2.weight": "blk.{layer}.post_ffw_norm_2.weight",
}

#: tokens llama.cpp's converter marks user-defined (always rendered) in a Gemma 4 vocabulary
VISIBLE_TOKENS = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                  "<tool_response|>", "<|\"|>"}

#: Gemma4TextConfig's defaults for what a config.json may leave out
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}
DEFAULT_GLOBAL_HEAD_DIM = 512


class Gemma4Converter:
    hf_arch = "Gemma4ForCausalLM"

    def convert(self, model_dir: str, out_path: str, options: Mapping[str, Any]) -> list[str]:
        """Write ``out_path``; return (and print to stderr) notes on what was left out or assumed."""
        if options:
            raise UserError(f"the gemma4 converter takes no options, got {sorted(options)}")
        cfg = read_config(model_dir)
        source = str(Path(model_dir) / "config.json")
        notes: list[str] = []
        st = SafetensorsDir(model_dir)
        stored = {n: n for n in st.names()}  # the text model's HF name -> the name in the folder
        if "text_config" in cfg:  # Gemma4ForConditionalGeneration: its text model, the towers left out
            cfg, stored, towers = text_part(cfg, stored)
            if towers:
                notes.append(f"{towers} vision / audio tensors left out (plinth's gemma4 is the text model; "
                             "llama.cpp writes them to a separate mmproj file)")
        md, layout = gguf_metadata(cfg, source)
        md.update(tokenizer_metadata(model_dir, cfg, layout["n_vocab"]))
        names = map_names(list(stored), NAMES, str(model_dir))
        tensors: dict[str, np.ndarray] = {}
        shared_kv = set(range(layout["n_layer"] - layout["n_shared"], layout["n_layer"]))
        dropped = []
        for hf, gg in names.items():
            m = re.match(r"blk\.(\d+)\.attn_(k|v|k_norm)\.weight$", gg)
            if m and int(m.group(1)) in shared_kv:  # K/V of a KV-shared layer: never read (transformers ignores them)
                dropped.append(hf)
                continue
            tensors[gg] = st.get(stored[hf])
        if dropped:
            notes.append(f"{len(dropped)} K/V tensors of KV-shared layers left out (unused by the model)")
        if cfg.get("tie_word_embeddings", True) and tensors.pop("output.weight", None) is not None:
            notes.append("lm_head.weight left out: the config ties it to the embedding")
        tensors["rope_freqs.weight"] = layout["rope_freqs"]
        Gemma4().check(md, {k: (tuple(v.shape), "F32") for k, v in tensors.items()}, f"converted {model_dir}")
        write_gguf(out_path, md, tensors)
        for note in notes:
            print(f"plinth-gemma: {note}", file=sys.stderr)
        return notes


class Gemma4MultimodalConverter(Gemma4Converter):
    """``Gemma4ForConditionalGeneration`` (the released Gemma 4 checkpoints): its text model."""

    hf_arch = "Gemma4ForConditionalGeneration"


TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def text_part(cfg: Mapping[str, Any], stored: dict[str, str]) -> tuple[dict[str, Any], dict[str, str], int]:
    """A multimodal Gemma 4 folder's text model: its config (``text_config``, the head tied as the outer
    config says), its tensors under the text model's names, and how many tower tensors are left out."""
    text = dict(cfg["text_config"] or {})
    if "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    out: dict[str, str] = {}
    towers = 0
    for name in stored:
        if name.startswith("model.language_model."):
            out["model." + name[len("model.language_model."):]] = name
        elif name.startswith(TOWERS):
            towers += 1
        else:
            out[name] = name
    return text, out, towers


def _refuse(source: str, key: str, value: Any, why: str) -> UserError:
    return UserError(f"{source}: {key} = {value!r}: {why}; plinth's gemma4 does not compute it, so the model is "
                     "not converted")


def gguf_metadata(cfg: Mapping[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``gemma4.*`` keys of a Gemma 4 text config (as llama.cpp's converter writes them), and the layout
    facts the tensor step needs (n_layer, n_shared, n_vocab, rope_freqs)."""
    try:
        n_layer = int(cfg["num_hidden_layers"])
        n_embd = int(cfg["hidden_size"])
        n_vocab = int(cfg["vocab_size"])
        n_head = int(cfg["num_attention_heads"])
        head_dim_swa = int(cfg["head_dim"])
        n_ff = int(cfg["intermediate_size"])
    except KeyError as exc:
        raise UserError(f"{source}: missing {exc.args[0]!r}, which a Gemma 4 text config needs") from None
    n_kv = int(cfg.get("num_key_value_heads", n_head))
    for key, ok in (("hidden_activation", ("gelu_pytorch_tanh", None)), ("attention_bias", (False, None)),
                    ("use_bidirectional_attention", (None, "vision"))):
        if cfg.get(key) not in ok:
            raise _refuse(source, key, cfg.get(key), f"plinth computes {ok[0]!r}")
    if cfg.get("rope_scaling"):
        raise _refuse(source, "rope_scaling", cfg["rope_scaling"], "Gemma 4 sets RoPE in rope_parameters")
    layer_types = list(cfg.get("layer_types") or
                       ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layer)])
    if len(layer_types) != n_layer or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise _refuse(source, "layer_types", layer_types, f"expected {n_layer} of sliding_attention / full_attention")
    layer_types[-1] = "full_attention"  # as Gemma4TextConfig forces it
    swa = [t == "sliding_attention" for t in layer_types]

    # full-attention layers: their own head size and (with attention_k_eq_v) KV head count
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    per_layer = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    head_dim_full = cfg.get("global_head_dim")
    n_kv_full = cfg.get("num_global_key_value_heads") if k_eq_v else None
    for il, over in sorted(per_layer.items()):
        if not 0 <= il < n_layer or swa[il] or set(over) - {"head_dim", "num_key_value_heads"}:
            raise _refuse(source, f"per_layer_config[{il}]", over, "only full-attention layers may override "
                                                                   "head_dim / num_key_value_heads")
        if "head_dim" in over:
            if head_dim_full is not None and over["head_dim"] != head_dim_full:
                raise _refuse(source, f"per_layer_config[{il}].head_dim", over["head_dim"],
                              f"full-attention layers must share one head size ({head_dim_full})")
            head_dim_full = over["head_dim"]
        if "num_key_value_heads" in over:
            if n_kv_full is not None and over["num_key_value_heads"] != n_kv_full:
                raise _refuse(source, f"per_layer_config[{il}].num_key_value_heads", over["num_key_value_heads"],
                              f"full-attention layers must share one KV head count ({n_kv_full})")
            n_kv_full = over["num_key_value_heads"]
    head_dim_full = int(head_dim_full if head_dim_full is not None else DEFAULT_GLOBAL_HEAD_DIM)
    n_kv_full = int(n_kv_full if n_kv_full is not None else n_kv)

    rope = dict(cfg.get("rope_parameters") or DEFAULT_ROPE)
    if set(rope) != {"sliding_attention", "full_attention"}:
        raise _refuse(source, "rope_parameters", rope, "expected settings for sliding_attention and full_attention")
    sl, fu = dict(rope["sliding_attention"]), dict(rope["full_attention"])
    if sl.get("rope_type", "default") != "default" or sl.get("partial_rotary_factor", 1.0) != 1.0 \
            or sl.get("factor", 1.0) != 1.0:
        raise _refuse(source, "rope_parameters.sliding_attention", sl, "plinth computes plain RoPE on sliding layers")
    if fu.get("rope_type", "default") not in ("default", "proportional") or fu.get("factor", 1.0) != 1.0:
        raise _refuse(source, "rope_parameters.full_attention", fu, "plinth computes default or proportional RoPE "
                                                                    "without a factor on full layers")
    prf = float(fu.get("partial_rotary_factor", 1.0)) if fu.get("rope_type") == "proportional" else 1.0
    n_turn = int(prf * head_dim_full // 2)  # rotated pairs, as transformers' proportional RoPE counts them
    rope_freqs = np.asarray([1.0] * n_turn + [1e30] * (head_dim_full // 2 - n_turn), dtype=np.float32)

    n_shared = int(cfg.get("num_kv_shared_layers") or 0)
    n_pl = int(cfg.get("hidden_size_per_layer_input") or 0)
    if n_pl and int(cfg.get("vocab_size_per_layer_input", n_vocab)) != n_vocab:
        raise _refuse(source, "vocab_size_per_layer_input", cfg.get("vocab_size_per_layer_input"),
                      f"the GGUF layout needs it equal to vocab_size ({n_vocab})")
    first_shared = n_layer - n_shared
    ff = [n_ff * 2 if cfg.get("use_double_wide_mlp") and il >= first_shared else n_ff for il in range(n_layer)]

    md: dict[str, Any] = {
        "general.architecture": ARCH,
        "general.name": str(cfg.get("_name_or_path") or "gemma4"),
        f"{ARCH}.block_count": n_layer,
        f"{ARCH}.context_length": int(cfg.get("max_position_embeddings", 131072)),
        f"{ARCH}.embedding_length": n_embd,
        f"{ARCH}.feed_forward_length": ff if len(set(ff)) > 1 else ff[0],
        f"{ARCH}.attention.head_count": n_head,
        f"{ARCH}.attention.head_count_kv": ([n_kv if s else n_kv_full for s in swa] if n_kv_full != n_kv else n_kv),
        f"{ARCH}.rope.freq_base": float(fu.get("rope_theta", 1_000_000.0)),
        f"{ARCH}.rope.freq_base_swa": float(sl.get("rope_theta", 10_000.0)),
        f"{ARCH}.attention.layer_norm_rms_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        f"{ARCH}.attention.key_length": head_dim_full,
        f"{ARCH}.attention.value_length": head_dim_full,
        f"{ARCH}.attention.sliding_window": int(cfg.get("sliding_window", 512)),
        f"{ARCH}.attention.shared_kv_layers": n_shared,
        f"{ARCH}.embedding_length_per_layer_input": n_pl,
        f"{ARCH}.attention.sliding_window_pattern": swa,
        f"{ARCH}.attention.key_length_swa": head_dim_swa,
        f"{ARCH}.attention.value_length_swa": head_dim_swa,
        f"{ARCH}.rope.dimension_count": head_dim_full,
        f"{ARCH}.rope.dimension_count_swa": head_dim_swa,
    }
    if cfg.get("final_logit_softcapping"):
        md[f"{ARCH}.final_logit_softcapping"] = float(cfg["final_logit_softcapping"])
    if cfg.get("enable_moe_block"):
        try:
            md[f"{ARCH}.expert_count"] = int(cfg["num_experts"])
            md[f"{ARCH}.expert_used_count"] = int(cfg["top_k_experts"])
            md[f"{ARCH}.expert_feed_forward_length"] = int(cfg["moe_intermediate_size"])
        except (KeyError, TypeError):
            raise UserError(f"{source}: enable_moe_block needs num_experts, top_k_experts and "
                            "moe_intermediate_size") from None
    return md, dict(n_layer=n_layer, n_shared=n_shared, n_vocab=n_vocab, rope_freqs=rope_freqs)


def tokenizer_metadata(model_dir: str, cfg: Mapping[str, Any], n_vocab: int) -> dict[str, Any]:
    """``tokenizer.*`` keys: a Gemma-style BPE (byte fallback) as llama.cpp's ``gemma4`` vocabulary, a
    byte-level BPE as ``gpt2``; the token count must equal the config's vocab_size."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{model_dir}: no tokenizer.json; plinth generate needs a tokenizer in the GGUF")
    tok = json.loads(path.read_text())
    model = tok.get("model") or {}
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        md = gemma_vocab(tok, Path(model_dir), cfg, path)
    else:
        md = bpe_tokenizer_metadata(model_dir, cfg)
    n_tok = len(md["tokenizer.ggml.tokens"])
    if n_tok != n_vocab:
        raise UserError(f"{path}: {n_tok} tokens, but config.json's vocab_size is {n_vocab}")
    return md


def gemma_vocab(tok: Mapping[str, Any], model_dir: Path, cfg: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """A Gemma 4 ``tokenizer.json`` (BPE with byte fallback) as llama.cpp's converter writes it."""
    model = tok["model"]
    added = {t["content"]: (int(t["id"]), bool(t.get("special"))) for t in tok.get("added_tokens") or []}
    by_id = {int(i): t for t, i in model.get("vocab", {}).items()}
    by_id.update({i: t for t, (i, _) in added.items()})
    n = max(by_id) + 1
    if sorted(by_id) != list(range(n)):
        raise UserError(f"{path}: token ids are not 0..{n - 1} without gaps")
    types = []
    for i in range(n):
        t = by_id[i]
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t):
            types.append(6)  # byte
        elif t in VISIBLE_TOKENS:
            types.append(4)  # user-defined (rendered)
        elif t in added:
            types.append(3 if added[t][1] else 4)
        else:
            types.append(1)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    md: dict[str, Any] = {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": [by_id[i] for i in range(n)],
        "tokenizer.ggml.scores": [-1000.0] * n,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }
    tc_path = model_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    ids = {t: i for i, t in by_id.items()}
    template = chat_template(model_dir, tc)
    if template is not None:
        md["tokenizer.chat_template"] = template
    for key, gg in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"), ("mask", "mask")):
        value = cfg.get(f"{key}_token_id") if key != "mask" else None
        if isinstance(value, list):
            value = value[0] if value else None
        if value is None:
            text = tc.get(f"{key}_token")
            text = text.get("content") if isinstance(text, dict) else text
            value = ids.get(text) if text is not None else None
        if value is None and key == "unk" and model.get("unk_token") in ids:
            value = ids[model["unk_token"]]
        if value is not None:
            md[f"tokenizer.ggml.{gg}_token_id"] = int(value)
    return md


def chat_template(model_dir: Path, tc: Mapping[str, Any]) -> str | None:
    """The folder's chat template, looked up as llama.cpp's converter does: ``tokenizer_config.json``'s
    ``chat_template``, else ``chat_template.jinja``, else ``chat_template.json``."""
    template: Any = tc.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    elif template is None and (model_dir / "chat_template.json").is_file():
        template = json.loads((model_dir / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


__all__ = ["Gemma4Converter", "Gemma4MultimodalConverter", "gguf_metadata", "tokenizer_metadata"]

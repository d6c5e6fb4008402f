"""``MiniDenseForCausalLM`` folder (config.json + safetensors + tokenizer.json) -> ``minidense`` GGUF."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping

from plinth.convert import SafetensorsDir, bpe_tokenizer_metadata, map_names, read_config, write_gguf
from plinth.errors import UserError

from .model import MiniDense

ARCH = "minidense"

# HF name -> GGUF name; {layer} is the layer number; "" leaves a tensor out on purpose
NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{layer}.input_layernorm.weight": "blk.{layer}.attn_norm.weight",
    "model.layers.{layer}.self_attn.q_proj.weight": "blk.{layer}.attn_q.weight",
    "model.layers.{layer}.self_attn.k_proj.weight": "blk.{layer}.attn_k.weight",
    "model.layers.{layer}.self_attn.v_proj.weight": "blk.{layer}.attn_v.weight",
    "model.layers.{layer}.self_attn.o_proj.weight": "blk.{layer}.attn_output.weight",
    "model.layers.{layer}.post_attention_layernorm.weight": "blk.{layer}.ffn_norm.weight",
    "model.layers.{layer}.mlp.gate_proj.weight": "blk.{layer}.ffn_gate.weight",
    "model.layers.{layer}.mlp.up_proj.weight": "blk.{layer}.ffn_up.weight",
    "model.layers.{layer}.mlp.down_proj.weight": "blk.{layer}.ffn_down.weight",
    "model.layers.{layer}.self_attn.rotary_emb.inv_freq": "",  # recomputed from rope.freq_base
}


class MiniDenseConverter:
    hf_arch = "MiniDenseForCausalLM"

    def convert(self, model_dir: str, out_path: str, options: Mapping[str, Any]) -> list[str]:
        """Write ``out_path``; return (and print to stderr) notes on what was left out or assumed."""
        if options:
            raise UserError(f"the minidense converter takes no options, got {sorted(options)}")
        cfg = read_config(model_dir)
        source = str(Path(model_dir) / "config.json")
        notes = []
        try:
            md = {
                "general.architecture": ARCH,
                "general.name": str(cfg.get("_name_or_path") or Path(model_dir).name),
                f"{ARCH}.vocab_size": cfg["vocab_size"],
                f"{ARCH}.embedding_length": cfg["hidden_size"],
                f"{ARCH}.block_count": cfg["num_hidden_layers"],
                f"{ARCH}.context_length": cfg["max_position_embeddings"],
                f"{ARCH}.attention.head_count": cfg["num_attention_heads"],
                f"{ARCH}.attention.head_count_kv": cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                f"{ARCH}.feed_forward_length": cfg["intermediate_size"],
                f"{ARCH}.attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
                f"{ARCH}.rope.freq_base": float(cfg.get("rope_theta", 10000.0)),
            }
        except KeyError as exc:
            raise UserError(f"{source}: missing {exc.args[0]!r}, which a MiniDenseForCausalLM config needs") from None
        if cfg.get("head_dim"):
            md[f"{ARCH}.attention.key_length"] = int(cfg["head_dim"])
        if cfg.get("rope_scaling"):
            raise UserError(f"{source}: rope_scaling {cfg['rope_scaling']} is not supported by minidense")
        md.update(bpe_tokenizer_metadata(model_dir, cfg))
        st = SafetensorsDir(model_dir)
        names = map_names(st.names(), NAMES, str(model_dir))
        tensors = {gg: st.get(hf) for hf, gg in names.items()}
        if cfg.get("tie_word_embeddings") and tensors.pop("output.weight", None) is not None:
            notes.append("lm_head.weight left out: the config ties it to the embedding")
        # check against the architecture's own reading of the file (keys and tensors), so the file loads
        MiniDense().check(md, tensors, f"converted {model_dir}")
        write_gguf(out_path, md, tensors)
        for note in notes:
            print(f"plinth-example: {note}", file=sys.stderr)
        return notes

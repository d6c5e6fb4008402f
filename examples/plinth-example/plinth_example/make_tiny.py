"""Write a tiny random ``MiniDenseForCausalLM`` folder to try the converter: ``python -m plinth_example.make_tiny DIR``."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def tiny_config(n_layer: int = 2, tied: bool = False) -> dict:
    return {"architectures": ["MiniDenseForCausalLM"], "vocab_size": 257, "hidden_size": 64,
            "num_hidden_layers": n_layer, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 96, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": tied, "eos_token_id": 256}


def tiny_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named random weights for ``cfg`` (norm weights near 1)."""
    rng = np.random.default_rng(seed)
    e, ff, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = e // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def mat(*shape: int) -> np.ndarray:
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(e)).astype(np.float32)

    t = {"model.embed_tokens.weight": mat(v, e), "model.norm.weight": norm()}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = mat(v, e)
    for il in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{il}."
        t |= {p + "input_layernorm.weight": norm(), p + "self_attn.q_proj.weight": mat(nq, e),
              p + "self_attn.k_proj.weight": mat(nkv, e), p + "self_attn.v_proj.weight": mat(nkv, e),
              p + "self_attn.o_proj.weight": mat(e, nq), p + "post_attention_layernorm.weight": norm(),
              p + "mlp.gate_proj.weight": mat(ff, e), p + "mlp.up_proj.weight": mat(ff, e),
              p + "mlp.down_proj.weight": mat(e, ff)}
    return t


def main(argv: list[str] | None = None) -> int:
    from plinth.testing import write_hf_folder

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m plinth_example.make_tiny DIR", file=sys.stderr)
        return 2
    cfg = tiny_config()
    print(write_hf_folder(Path(args[0]), cfg, tiny_tensors(cfg)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

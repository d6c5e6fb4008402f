"""Mistral Large 4 decode speed against transformers on the same CPU, and the cache size.

Usage: python benchmarks/bench_mistral.py [--threads 2] [--prompt-tokens 64] [--decode-tokens 32] [--runs 3]

A random ~100M-parameter Mistral Large 4 text tower (hidden 512, 8 layers, vocab 32000, 8 heads,
kv_lora_rank 128, nope/rope/v 32/32/64, 10 experts of width 512 with top-2 in 2 groups plus a
shared expert, one dense leading layer; DSA indexer 16 heads x 64 with top-k 48, shared-indexer
and KV-sharing layers, two NoPE layers) with a tiny vision tower is written as a Hugging Face
folder (Mistral-native names), converted by ``plinth convert`` (text tower) and loaded with the
numpy backend. transformers' ``MistralLarge4ForConditionalGeneration`` (float32, eager) loads
the same folder. Both prefill the same prompt, then decode greedily one token per step through
their caches; best of ``--runs`` (needs torch + transformers). Also printed: the cache bytes per
token (latent + indexer keys) beside an expanded K/V cache of the same model.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TEXT = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
    v_head_dim=64, n_routed_experts=10, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    index_n_heads=16, index_head_dim=64, index_topk=48, max_position_embeddings=1048576, first_k_dense_replace=1,
    rms_norm_eps=1e-5, routed_scaling_factor=1.0, final_logit_softcapping=30.0,
    indexer_types=["full", "shared", "full", "shared", "full", "shared", "full", "shared"],
    kv_source_layers=[0, 0, 2, 3, 4, 4, 6, 3], no_rope_layers=[1, 1, 1, 0, 1, 1, 1, 0],
)


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _maker():
    return _load("mistral_make_golden", ROOT / "plugins" / "mistral" / "tests" / "golden" / "make_golden.py")


# the same timed loops as the Nemotron-H benchmark: prefill, then greedy single-token steps through the cache
_decode_loops = _load("bench_nemotron", ROOT / "benchmarks" / "bench_nemotron.py")
plinth_decode, hf_decode = _decode_loops.plinth_decode, _decode_loops.hf_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-peer", action="store_true", help="plinth only (no torch needed)")
    args = parser.parse_args()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(args.threads))

    import numpy as np

    from plinth.convert import convert
    from plinth.model import load_model
    from plinth_mistral.mistral_large4 import cache_bytes_per_token

    g = _maker()
    cfg = g.config("issue")
    cfg["text_config"] = dict(TEXT, model_type="mistral_large4_text")
    prompt = np.random.default_rng(0).integers(0, TEXT["vocab_size"], args.prompt_tokens).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        folder = g.write_hf_folder("issue", Path(tmp) / "hf", state=g.hf_random_state(cfg, 0), cfg=cfg)
        t0 = time.perf_counter()
        convert(folder, Path(tmp) / "m.gguf")
        conv_s = time.perf_counter() - t0
        model = load_model(Path(tmp) / "m.gguf")
        hp = model.hparams
        latent, expanded = cache_bytes_per_token(hp)
        print(f"model: mistral_large4, {model.stats.n_params / 1e6:.1f} M parameters (convert {conv_s:.1f} s), "
              f"threads {args.threads}, load average {os.getloadavg()[0]:.2f}")
        print(f"cache: {latent} bytes/token (latent + indexer keys) vs {expanded} bytes/token expanded K/V "
              f"({expanded / latent:.1f}x); kv sharing {list(hp.kv_sharing)}")
        tg = plinth_decode(model, prompt, args.decode_tokens, args.runs)
        print(f"plinth       decode {tg:8.1f} tok/s  (prompt {args.prompt_tokens}, {args.decode_tokens} tokens, "
              f"best of {args.runs})")
        if args.no_peer:
            return
        import torch

        torch.set_num_threads(args.threads)
        from transformers import MistralLarge4ForConditionalGeneration

        ref = MistralLarge4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                                    attn_implementation="eager").eval()
        hf = hf_decode(ref, prompt, args.decode_tokens, args.runs)
        print(f"transformers decode {hf:8.1f} tok/s  (same prompt, eager, float32, best of {args.runs})")
        print(f"ratio        plinth / transformers = {tg / hf:.2f}x (load average now {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()

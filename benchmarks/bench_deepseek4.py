"""DeepSeek V4 (deepseek4) decode speed against transformers on the same CPU, and cache bytes per token.

Usage: python benchmarks/bench_deepseek4.py [--threads 2] [--prompt-tokens 64] [--decode-tokens 32] [--runs 3]
       python benchmarks/bench_deepseek4.py --cache-only [--context 4096]

A random ~110M-parameter DeepSeek V4 (hidden 512, 8 layers [window, window, CSA 4, HCA 128,
CSA 4, HCA 128, CSA 4, window], 8 heads over one 128-wide latent head, hc_mult 4, 12 experts of
width 512 with top-2 and a shared expert, 2 hash layers, vocab 32000, window 128, 16 indexer
heads of 64, top-k 64) is written as a Hugging Face folder (the golden maker's weight drawer),
converted by ``plinth convert`` and loaded with the numpy backend. transformers'
``DeepseekV4ForCausalLM`` (float32, eager) loads the same folder. Both prefill the same prompt,
then decode greedily one token per step through their caches; best of ``--runs`` (needs torch +
transformers for the peer; without them only plinth's figures print).

Cache bytes per token at ``--context`` tokens (no torch needed), per layer summed over layers:

* ``plinth``: what the cache holds (``Cache.nbytes``): per layer the window's raw keys, on compressed
  layers the entries and the raw compressor rows of the block being filled, on CSA layers the indexer
  keys likewise, each with its positions (8 bytes a row) and ``ROLLBACK_ROWS`` spare rows that let a
  verify batch be undone by a cut;
* ``V4 layout``: a raw window of ``sliding_window`` keys + one entry per ``ratio`` positions
  (+ indexer keys on CSA layers + the partial-block rows), i.e. what a windowed compressed
  cache kind holds;
* ``dense MQA``: one K and one V row of the same width d per position per layer (and ``K = V``:
  d only).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

CONFIG = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=32000, hidden_size=512,
    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=1, head_dim=128, partial_rotary_factor=0.5,
    q_lora_rank=256, o_groups=4, o_lora_rank=128, n_routed_experts=12, num_experts_per_tok=2,
    moe_intermediate_size=512, n_shared_experts=1, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    sliding_window=128, index_n_heads=16, index_head_dim=64, index_topk=64, rms_norm_eps=1e-6,
    routed_scaling_factor=1.5, swiglu_limit=10.0, scoring_func="sqrtsoftplus", rope_theta=10000.0,
    compress_rope_theta=160000.0, max_position_embeddings=65536, tie_word_embeddings=False, bos_token_id=None,
    eos_token_id=None, pad_token_id=None, num_nextn_predict_layers=0,
    layer_types=[S, S, C, H, C, H, C, S], compress_rates={C: 4, H: 128},
    mlp_layer_types=["hash_moe", "hash_moe"] + ["moe"] * 6,
)


def golden():
    from plinth.testing import load_module

    return load_module(ROOT / "plugins/deepseek41/tests/golden/make_golden.py")


def build(tmp: Path):
    import plinth
    from plinth.convert import convert

    g = golden()
    g.CASES["bench"] = dict(seed=1, prompt_seed=2, config=CONFIG)
    folder = g.write_hf_folder("bench", tmp / "hf")
    reg = g.registry()
    model = plinth.load_model(convert(folder, tmp / "bench.gguf", registry=reg), registry=reg, n_ctx=65536)
    return folder, model


def decode_plinth(model, prompt, n):
    from plinth.graph import Batch

    cache = model.new_context().cache
    t0 = time.perf_counter()
    logits = model.graph.forward(Batch.from_tokens(prompt), cache).logits
    t1 = time.perf_counter()
    out = []
    for i in range(n):
        tok = int(np.argmax(logits[-1]))
        out.append(tok)
        logits = model.graph.forward(Batch.from_tokens([tok], start=len(prompt) + i), cache).logits
    return out, t1 - t0, time.perf_counter() - t1


def decode_hf(model, prompt, n):
    import torch
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        logits = model(torch.tensor([prompt]), cache=cache, use_cache=True).logits
        t1 = time.perf_counter()
        out = []
        for _ in range(n):
            tok = int(logits[0, -1].argmax())
            out.append(tok)
            logits = model(torch.tensor([[tok]]), cache=cache, use_cache=True).logits
        return out, t1 - t0, time.perf_counter() - t1


def cache_bytes(model, n_ctx: int) -> dict[str, float]:
    """Bytes per token of what plinth's cache holds and of the V4 layout after a prompt of ``n_ctx`` tokens
    (float32), with the arithmetic of the V4 layout per layer type."""
    from plinth.graph import Batch

    hp = model.hparams
    ctx = model.new_context()
    rng = np.random.default_rng(0)
    step = 512
    for s in range(0, n_ctx, step):
        ctx.forward(Batch.from_tokens(rng.integers(0, hp.n_vocab, min(step, n_ctx - s)).tolist(), start=s,
                                      output="none"))
    held = ctx.cache.nbytes()
    d = hp.head_dim
    layout = 0
    for il in range(hp.n_layer):
        atype = hp.attention_type(il) if hasattr(hp, "attention_type") else hp.kind(il)
        layout += min(hp.n_swa, n_ctx) * d * 4  # the raw window (K = V)
        r = hp.ratio(il)
        if r:
            coff = 2 if atype == "csa" else 1
            # one entry per block + the partial block's kv and score rows (CSA: the last complete block too)
            layout += (n_ctx // r) * d * 4 + (n_ctx % r + (r if coff == 2 else 0)) * 2 * coff * d * 4
            if atype == "csa":
                di = hp.idx_head_dim
                layout += (n_ctx // r) * di * 4 + (n_ctx % r + r) * 2 * 2 * di * 4
    return {"plinth": held / n_ctx, "V4 layout": layout / n_ctx,
            "dense MQA K+V": hp.n_layer * 2 * d * 4, "dense MQA K=V": hp.n_layer * d * 4,
            "by kind": {k: v / n_ctx for k, v in ctx.cache.nbytes_by_kind().items() if v}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--cache-only", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        folder, model = build(Path(tmp))
        n_params = model.stats.n_params
        print(f"model: {n_params / 1e6:.1f}M parameters, layers {list(model.hparams.compress_ratios)}")
        b = cache_bytes(model, args.context)
        print(f"cache bytes per token at {args.context} tokens (float32, all layers):")
        by_kind = b.pop("by kind")
        for k, v in b.items():
            print(f"  {k:14s} {v:10.1f}   ({b['dense MQA K+V'] / v:5.2f}x smaller than dense MQA K+V)")
        print(f"  plinth / V4 layout: {b['plinth'] / b['V4 layout']:.3f}; plinth by kind: "
              + ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_kind.items())))
        if args.cache_only:
            return
        prompt = np.random.default_rng(3).integers(0, CONFIG["vocab_size"], args.prompt_tokens).tolist()
        best = min((decode_plinth(model, prompt, args.decode_tokens) for _ in range(args.runs)), key=lambda r: r[2])
        print(f"plinth: prefill {args.prompt_tokens} tok {best[1]:.3f} s, decode "
              f"{args.decode_tokens / best[2]:.1f} tok/s (best of {args.runs})")
        try:
            import torch
        except ImportError:
            print("transformers peer skipped (torch not installed)")
            return
        torch.set_num_threads(args.threads)
        ref = golden().reference_model(folder)
        hbest = min((decode_hf(ref, prompt, args.decode_tokens) for _ in range(args.runs)), key=lambda r: r[2])
        print(f"transformers: prefill {hbest[1]:.3f} s, decode {args.decode_tokens / hbest[2]:.1f} tok/s")
        same = next((i for i, (a, b) in enumerate(zip(best[0], hbest[0])) if a != b), len(best[0]))
        print(f"plinth / transformers decode speed: {hbest[2] / best[2]:.2f}x; greedy tokens agree on the first "
              f"{same} of {args.decode_tokens}")


if __name__ == "__main__":
    main()

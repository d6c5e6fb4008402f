"""Nemotron-H decode speed against transformers on the same CPU, and the cost of a rollback.

Usage: python benchmarks/bench_nemotron.py [--threads 2] [--prompt-tokens 64] [--decode-tokens 32] [--runs 3]

A random ~100M-parameter Nemotron-H MoE hybrid (pattern ``MEM*MEM-MEM*``: 6 Mamba-2, 3 MoE,
2 attention, 1 MLP; hidden 768, vocab 24000, 8 experts of width 768 with top-2 and a shared
expert of 1536) is written as a Hugging Face folder, converted by ``plinth convert`` and loaded
with the numpy backend. transformers' ``NemotronHForCausalLM`` (float32, eager, its PyTorch
Mamba fallbacks) loads the same folder. Both prefill the same prompt, then decode greedily
one token per step through their caches; best of ``--runs`` (needs torch + transformers).

Rollback: after the prompt, the engine's recurrent rollback of a rejected verify batch is
``snapshot`` (copy of every conv/SSM state, taken before the verify forward) + ``restore`` +
a replay forward of the kept rows. Printed as multiples of one plain decode step, for kept
rows a + 1 = 1 (everything rejected) and 3.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIG = dict(
    architectures=["NemotronHForCausalLM"], vocab_size=24000, hidden_size=768, max_position_embeddings=4096,
    layer_norm_epsilon=1e-5, hybrid_override_pattern="MEM*MEM-MEM*",
    mamba_num_heads=24, mamba_head_dim=64, ssm_state_size=64, n_groups=4, conv_kernel=4, chunk_size=64,
    num_attention_heads=12, num_key_value_heads=4, head_dim=64, intermediate_size=3072,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=768, moe_shared_expert_intermediate_size=1536,
    routed_scaling_factor=2.5, norm_topk_prob=True, n_group=1, topk_group=1,
    tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
)


def _maker():
    path = ROOT / "plugins" / "nemotron" / "tests" / "golden" / "make_golden.py"
    spec = importlib.util.spec_from_file_location("nemotron_make_golden", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def plinth_decode(model, prompt, n_decode, runs):
    import numpy as np

    best = float("inf")
    for _ in range(runs):
        ctx = model.new_context()
        tok = int(np.argmax(ctx.decode(prompt).logits[-1]))
        t0 = time.perf_counter()
        for _ in range(n_decode):
            tok = int(np.argmax(ctx.decode([tok]).logits[-1]))
        best = min(best, time.perf_counter() - t0)
    return n_decode / best


def hf_decode(model, prompt, n_decode, runs):
    import torch

    best = float("inf")
    with torch.no_grad():
        for _ in range(runs):
            out = model(torch.tensor([prompt]), use_cache=True)
            cache = out.cache
            tok = int(out.logits[0, -1].argmax())
            t0 = time.perf_counter()
            for _ in range(n_decode):
                out = model(torch.tensor([[tok]]), cache=cache, use_cache=True)
                cache = out.cache
                tok = int(out.logits[0, -1].argmax())
            best = min(best, time.perf_counter() - t0)
    return n_decode / best


def rollback_cost(model, prompt, reps=20):
    """(decode step s, snapshot s, restore s, replay of 1 row s, replay of 3 rows s), medians."""
    from plinth.graph import Batch

    ctx = model.new_context()
    ctx.decode(prompt)
    cache, pos = ctx.cache, len(prompt)
    step, snap_t, rest_t, rep1, rep3 = [], [], [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        snap = cache.snapshot(0)  # taken before every verify batch
        snap_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ctx.forward(Batch.from_tokens([1], start=pos))  # one plain decode step (with its LM head row)
        step.append(time.perf_counter() - t0)
        cache.restore(snap)
        for n, acc in ((1, rep1), (3, rep3)):
            ctx.forward(Batch.from_tokens([1, 2, 3, 4, 5], start=pos, output="all"))  # last token + 4 drafts
            t0 = time.perf_counter()
            cache.restore(snap)
            rest_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ctx.forward(Batch.from_tokens([1, 2, 3][:n], start=pos, output="none"))  # replay the kept rows
            acc.append(time.perf_counter() - t0)
            cache.restore(snap)
    med = statistics.median
    return med(step), med(snap_t), med(rest_t), med(rep1), med(rep3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(args.threads))

    import numpy as np

    from plinth.convert import convert
    from plinth.model import load_model

    g = _maker()
    prompt = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], args.prompt_tokens).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        folder.mkdir()
        import json

        (folder / "config.json").write_text(json.dumps(CONFIG))
        g.write_safetensors(folder / "model.safetensors", g.hf_random_state(CONFIG, seed=0))
        t0 = time.perf_counter()
        convert(folder, Path(tmp) / "m.gguf")
        conv_s = time.perf_counter() - t0
        model = load_model(Path(tmp) / "m.gguf")
        n_params = model.stats.n_params
        print(f"model: nemotron_h_moe {model.hparams.pattern}, {n_params / 1e6:.1f} M parameters "
              f"(convert {conv_s:.1f} s), threads {args.threads}")
        tg = plinth_decode(model, prompt, args.decode_tokens, args.runs)
        print(f"plinth       decode {tg:8.1f} tok/s  (prompt {args.prompt_tokens}, {args.decode_tokens} tokens, "
              f"best of {args.runs})")
        step, snap, rest, rep1, rep3 = rollback_cost(model, prompt)
        print(f"rollback     decode step {step * 1e3:.2f} ms; snapshot {snap * 1e3:.3f} ms ({snap / step:.3f}x), "
              f"restore {rest * 1e3:.3f} ms ({rest / step:.3f}x), replay 1 row {rep1 * 1e3:.2f} ms "
              f"({rep1 / step:.2f}x), replay 3 rows {rep3 * 1e3:.2f} ms ({rep3 / step:.2f}x)")
        print(f"rollback     total for a=0 (snapshot + restore + replay 1) = {(snap + rest + rep1) / step:.2f} "
              f"decode steps; for a=2 = {(snap + rest + rep3) / step:.2f}")
        try:
            import torch
            from transformers import NemotronHForCausalLM
        except ImportError:
            print("transformers  (not installed: pip install -e 'plugins/nemotron[ref]')")
            return
        torch.set_num_threads(args.threads)
        hf = NemotronHForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
        hf_tg = hf_decode(hf, prompt, args.decode_tokens, args.runs)
        print(f"transformers decode {hf_tg:8.1f} tok/s  (torch {torch.__version__}, {torch.get_num_threads()} "
              f"threads)")
        print(f"ratio        plinth / transformers decode = {tg / hf_tg:.2f}x")


if __name__ == "__main__":
    main()

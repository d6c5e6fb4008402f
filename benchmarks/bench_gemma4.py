"""Gemma 4 (MoE) decode speed against transformers on the same weights, in one run.

Usage: python benchmarks/bench_gemma4.py [--threads 2] [--prompt-tokens 64] [--decode-tokens 32] [--runs 3]

A random mid-size Gemma 4 text model of the 26B-A4B kind (``enable_moe_block``: experts beside the
dense MLP; sliding / full layers 3:1 with their own head sizes, ``attention_k_eq_v`` on the full
layers, final logit soft-capping, tied head; ~85 M parameters: hidden 512, 8 layers, vocabulary
32768, 16 experts of width 256 with top 4) is written as a Hugging Face folder. Every weight is
drawn (norm weights, ``layer_scalar`` and the router's scales too: nothing keeps transformers'
0 / 1 initialisation). ``plinth convert`` (the command, in a subprocess) turns it into a float32
GGUF that plinth loads with the numpy backend; transformers' ``Gemma4ForCausalLM`` (float32, eager)
loads the same folder. Both prefill the same prompt and decode greedily one token per step
through their caches. The rounds alternate (plinth, transformers, plinth, ...) so a burst of load
on a shared machine hits both; the figure is the best round of each. Both use ``--threads``
threads (plinth's kernels and BLAS; torch.set_num_threads). The greedy tokens of the two are
compared and the count of agreeing tokens printed (random weights have near-ties, so a late
divergence is possible without either being wrong; the logits are checked to 1e-4 by the plugin's
tests). Needs torch + transformers (``pip install -e 'plugins/gemma[ref]'``); ``--no-peer`` times
plinth alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
S, F = "sliding_attention", "full_attention"

CONFIG = dict(
    architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=32768, hidden_size=512,
    intermediate_size=1024, num_hidden_layers=8, layer_types=[S, S, S, F] * 2, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, global_head_dim=128, num_global_key_value_heads=2, attention_k_eq_v=True,
    sliding_window=512, max_position_embeddings=8192, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
    pad_token_id=None, bos_token_id=None, eos_token_id=256, hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=32768, num_kv_shared_layers=0, use_double_wide_mlp=False,
    enable_moe_block=True, num_experts=16, top_k_experts=4, moe_intermediate_size=256,
    final_logit_softcapping=30.0, tie_word_embeddings=True,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1_000_000.0}},
)


def _maker():
    path = ROOT / "plugins" / "gemma" / "tests" / "golden" / "make_golden.py"
    spec = importlib.util.spec_from_file_location("gemma_make_golden", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tokenizer(n_vocab: int) -> dict:
    """A byte-level BPE ``tokenizer.json`` of ``n_vocab`` tokens: the 256 byte tokens, the eos as 256, and
    reserved special tokens up to the vocabulary size (the benchmark feeds token ids, never text)."""
    from plinth.testing.hf import byte_bpe_tokenizer

    tok = byte_bpe_tokenizer()
    tok["added_tokens"] += [{"id": i, "content": f"<unused{i}>", "special": True} for i in range(257, n_vocab)]
    return tok


def plinth_round(model, prompt, n_decode):
    import numpy as np

    ctx = model.new_context()
    tok = int(np.argmax(ctx.decode(prompt).logits[-1]))
    out = [tok]
    t0 = time.perf_counter()
    for _ in range(n_decode):
        tok = int(np.argmax(ctx.decode([tok]).logits[-1]))
        out.append(tok)
    return time.perf_counter() - t0, out


def hf_round(model, prompt, n_decode):
    import torch

    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True)
        cache, tok = res.cache, int(res.logits[0, -1].argmax())
        out = [tok]
        t0 = time.perf_counter()
        for _ in range(n_decode):
            res = model(torch.tensor([[tok]]), cache=cache, use_cache=True)
            cache, tok = res.cache, int(res.logits[0, -1].argmax())
            out.append(tok)
        return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-peer", action="store_true", help="plinth only (no torch needed)")
    args = parser.parse_args()
    for var in ("PLINTH_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)

    import numpy as np

    from plinth.model import load_model
    from plinth.testing.hf import write_hf_folder

    g = _maker()
    prompt = np.random.default_rng(0).integers(0, 256, args.prompt_tokens).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_hf_folder(Path(tmp) / "hf", CONFIG, g.hf_random_state(CONFIG, 7),
                                 tokenizer=tokenizer(CONFIG["vocab_size"]))
        gguf = Path(tmp) / "gemma4-moe.gguf"
        plinth_cli = Path(sys.executable).with_name("plinth")
        t0 = time.perf_counter()
        subprocess.run([str(plinth_cli), "convert", str(folder), "-o", str(gguf)], check=True,
                       stdout=subprocess.DEVNULL)
        conv_s = time.perf_counter() - t0
        model = load_model(gguf)
        print(f"model: gemma4 MoE, {model.stats.n_params / 1e6:.1f} M parameters, {gguf.stat().st_size / 2**20:.0f} MiB "
              f"GGUF (plinth convert {conv_s:.1f} s); prompt {args.prompt_tokens}, decode {args.decode_tokens}, "
              f"threads {args.threads}, load average {os.getloadavg()[0]:.2f}")
        ref = None
        if not args.no_peer:
            import torch
            from transformers import Gemma4ForCausalLM

            torch.set_num_threads(args.threads)
            ref, info = Gemma4ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                          output_loading_info=True)
            bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
            if bad:
                raise SystemExit(f"transformers did not load every tensor: {bad}")
            ref.eval()
        best_p = best_h = float("inf")
        toks_p = toks_h = None
        for r in range(args.runs):
            dt, toks_p = plinth_round(model, prompt, args.decode_tokens)
            best_p = min(best_p, dt)
            line = f"round {r + 1}: plinth {args.decode_tokens / dt:7.1f} tok/s"
            if ref is not None:
                dt, toks_h = hf_round(ref, prompt, args.decode_tokens)
                best_h = min(best_h, dt)
                line += f", transformers {args.decode_tokens / dt:7.1f} tok/s"
            print(line, flush=True)
        tg = args.decode_tokens / best_p
        print(f"plinth       decode {tg:8.1f} tok/s  (best of {args.runs})")
        if ref is None:
            return
        hf = args.decode_tokens / best_h
        import torch

        print(f"transformers decode {hf:8.1f} tok/s  (best of {args.runs}; torch {torch.__version__}, eager, float32)")
        same = next((i for i, (a, b) in enumerate(zip(toks_p, toks_h)) if a != b), len(toks_p))
        print(f"greedy tokens: {same} of {len(toks_p)} identical from the start"
              + ("" if same == len(toks_p) else f" (first difference at step {same})"))
        print(f"ratio        plinth / transformers = {tg / hf:.2f}x (load average now {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()

"""Resident memory at a long context per K/V cache type, plinth beside llama.cpp (llama-cpp-python).

Each (engine, cache type) runs in a fresh process: load the GGUF, make one context of ``--ctx`` + 16
tokens with that cache type, prefill ``--ctx`` random tokens (the same for both engines), decode 4
more, then read the process's resident set (``VmRSS``) and its peak (``VmHWM``) from /proc. The
figure that the cache type decides is the growth over the loaded model: "context" = VmRSS after the
decode minus VmRSS after the load (plinth's after a short warm-up context, so that its compiled kernels are
loaded by then). plinth's f32 is its default cache; llama.cpp's default is f16.

    .venv/bin/python benchmarks/bench_kv_rss.py --model smollm2 --ctx 8192 --types f32 f16 q8_0 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}
GGML = {"f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


def _status() -> dict[str, float]:
    """VmRSS and VmHWM of this process, MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) / 1024
    return out


def _child(engine: str, path: str, ctx: int, cache: str, threads: int) -> dict:
    import numpy as np

    prompt = np.random.default_rng(0).integers(0, 49000, ctx).tolist()
    if engine == "plinth":
        import plinth
        from plinth import quant

        quant.set_threads(threads)
        model = plinth.load_model(path, n_ctx=ctx + 16)
        model.prepare()
        prompt = [t % model.n_vocab for t in prompt]
        warm = model.new_context(cache_type_k=cache, cache_type_v=cache)  # (the kernels loaded first, so that
        warm.decode(prompt[:520], output="last")  # "context" is what the context costs, not code)
        warm.decode(prompt[520:521])
        del warm
        loaded = _status()
        c = model.new_context(cache_type_k=cache, cache_type_v=cache)
        for i in range(0, ctx, 512):
            out = c.decode(prompt[i:i + 512], output="last")
        tok = int(np.argmax(model.backend.to_numpy(out.logits[-1])))
        for _ in range(4):
            out = c.decode([tok])
            tok = int(np.argmax(model.backend.to_numpy(out.logits[-1])))
        cache_bytes = int(c.cache.nbytes()) if hasattr(c.cache, "nbytes") else None
    else:
        from llama_cpp import Llama

        llm = Llama(path, n_ctx=ctx + 16, n_batch=512, n_threads=threads, n_threads_batch=threads,
                    type_k=GGML[cache], type_v=GGML[cache], flash_attn=True, verbose=False)
        prompt = [t % llm.n_vocab() for t in prompt]
        loaded = _status()  # (llama.cpp allocates its whole cache with the context)
        llm.eval(prompt)
        for t in range(4):
            llm.eval([prompt[t]])
        cache_bytes = None
    done = _status()
    return {"loaded": loaded["VmRSS"], "rss": done["VmRSS"], "peak": done["VmHWM"], "cache_bytes": cache_bytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=list(MODELS))
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--types", nargs="+", default=["f32", "f16", "q8_0"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", nargs=3, metavar=("ENGINE", "CACHE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        engine, cache, path = args.child
        print(json.dumps(_child(engine, path, args.ctx, cache, args.threads)))
        return 0
    path = Path(os.environ.get("PLINTH_CACHE", Path.home() / ".cache" / "plinth")) / MODELS[args.model]
    print(f"{args.model}, {args.ctx} tokens, {args.threads} threads; MiB")
    print("| engine | cache | RSS after load | RSS at the context | peak | context's growth |")
    print("|---|---|---|---|---|---|")
    for cache in args.types:
        for engine in ("plinth", "llama.cpp"):
            if engine == "llama.cpp" and cache not in GGML:
                continue  # (llama.cpp has no f32 cache type here: its f16 is its default)
            res = subprocess.run([sys.executable, __file__, "--ctx", str(args.ctx), "--threads", str(args.threads),
                                  "--child", engine, cache, str(path)], capture_output=True, text=True, check=True)
            r = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"| {engine} | {cache} | {r['loaded']:.1f} | {r['rss']:.1f} | {r['peak']:.1f} | "
                  f"{r['rss'] - r['loaded']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

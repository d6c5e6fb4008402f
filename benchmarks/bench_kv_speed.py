"""Long-context speed per K/V cache type, plinth beside llama.cpp (llama-cpp-python) on the same GGUF.

For each model and cache type: a prompt of ``--ctx`` random tokens prefilled in one call (tokens/s), then
``--decode`` tokens decoded one at a time after it (tokens/s at that depth), best of ``--runs``; llama.cpp
the same way (n_batch 512, flash attention on: llama.cpp needs it for a quantized V cache; its f16 cache
where plinth's is f32). Prints one line per run, the plinth / llama.cpp ratios and the load.

    .venv/bin/python benchmarks/bench_kv_speed.py --models smollm2 gemma3 --ctx 4096 --types f32 f16 q8_0
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}
GGML = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


def plinth_speed(path: Path, ctx: int, n_decode: int, cache_type: str, runs: int) -> tuple[float, float]:
    import plinth
    from plinth.generate import time_prefill_decode

    model = plinth.load_model(path, cache_type_k=cache_type, cache_type_v=cache_type, n_ctx=ctx + n_decode + 8)
    model.prepare()
    return time_prefill_decode(model, ctx, n_decode, runs=runs)


def llama_speed(path: Path, ctx: int, n_decode: int, cache_type: str, runs: int, threads: int) -> tuple[float, float]:
    from llama_cpp import Llama

    t = "f16" if cache_type == "f32" else cache_type
    llm = Llama(str(path), n_ctx=ctx + n_decode + 8, n_batch=512, n_threads=threads, n_threads_batch=threads,
                type_k=GGML[t], type_v=GGML[t], flash_attn=True, verbose=False)
    prompt = np.random.default_rng(0).integers(0, llm.n_vocab(), ctx).tolist()
    best_pp = best_tg = float("inf")
    for _ in range(runs):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        best_pp = min(best_pp, time.perf_counter() - t0)
        tok = int(prompt[-1])
        t0 = time.perf_counter()
        for _ in range(n_decode):
            llm.eval([tok])
            tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
        best_tg = min(best_tg, time.perf_counter() - t0)
    del llm
    return ctx / best_pp, n_decode / best_tg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--types", nargs="+", default=["f32", "f16", "q8_0"])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["plinth", "llama"], default=None)
    args = ap.parse_args()
    from plinth import quant

    quant.set_threads(args.threads)
    cache = Path(os.environ.get("PLINTH_CACHE", Path.home() / ".cache" / "plinth"))
    print(f"load before: {os.getloadavg()}", flush=True)
    out: dict[str, dict[str, list[float]]] = {}
    for key in args.models:
        path = cache / MODELS[key]
        for t in args.types:
            row = out.setdefault(f"{key} {t}", {})
            if args.only != "llama":
                row["plinth"] = list(plinth_speed(path, args.ctx, args.decode, t, args.runs))
                print(f"{key} {t} plinth: prompt {row['plinth'][0]:.1f} tok/s, decode at {args.ctx} "
                      f"{row['plinth'][1]:.1f} tok/s", flush=True)
            if args.only != "plinth":
                row["llama.cpp"] = list(llama_speed(path, args.ctx, args.decode, t, args.runs, args.threads))
                print(f"{key} {t} llama.cpp ({'f16' if t == 'f32' else t}): prompt {row['llama.cpp'][0]:.1f} "
                      f"tok/s, decode {row['llama.cpp'][1]:.1f} tok/s", flush=True)
            if len(row) == 2:
                print(f"{key} {t} plinth / llama.cpp: prompt {row['plinth'][0] / row['llama.cpp'][0]:.2f}x, "
                      f"decode {row['plinth'][1] / row['llama.cpp'][1]:.2f}x", flush=True)
    print(f"load after: {os.getloadavg()}")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode steps at a long context per K/V cache type, plinth and llama.cpp (llama-cpp-python) interleaved.

One plinth model with a context per cache type (f32, then each of ``--types``) and one llama.cpp context
per type (flash attention on; its f16 where plinth's is f32), each prefilled with the same ``--ctx``
random tokens (plinth in calls of 512, llama.cpp with n_batch 512), then ``--steps`` rounds of one greedy
decode step in every context in turn: on a loaded machine the noise falls on every engine and type
alike. Prints the prefill times, each context's best and median step, and the ratios.

    .venv/bin/python benchmarks/bench_kv_decode.py --model smollm2 --ctx 4096 --types f16 q8_0 --steps 12
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}
GGML = {"f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=list(MODELS))
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--types", nargs="+", default=["f16", "q8_0"], choices=list(GGML))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-llama", action="store_true", help="plinth's contexts only")
    args = ap.parse_args()

    import plinth
    from plinth import quant

    quant.set_threads(args.threads)
    path = Path(os.environ.get("PLINTH_CACHE", Path.home() / ".cache" / "plinth")) / MODELS[args.model]
    print(f"load before: {os.getloadavg()}", flush=True)
    n = args.ctx
    model = plinth.load_model(path, n_ctx=n + args.steps + 8)
    model.prepare()
    prompt = np.random.default_rng(0).integers(0, model.n_vocab, n).tolist()
    ctxs: dict[str, list] = {}
    for t in ["f32"] + args.types:
        c = model.new_context(cache_type_k=t, cache_type_v=t)
        t0 = time.perf_counter()
        for i in range(0, n, 512):
            out = c.decode(prompt[i:i + 512])
        print(f"plinth {t}: prefill {time.perf_counter() - t0:.1f} s", flush=True)
        ctxs[f"plinth {t}"] = [c, int(np.argmax(model.backend.to_numpy(out.logits[-1])))]
    if not args.no_llama:
        from llama_cpp import Llama

        for t in args.types:
            llm = Llama(str(path), n_ctx=n + args.steps + 8, n_batch=512, n_threads=args.threads,
                        n_threads_batch=args.threads, type_k=GGML[t], type_v=GGML[t], flash_attn=True, verbose=False)
            t0 = time.perf_counter()
            llm.eval(prompt)
            print(f"llama.cpp {t}: prefill {time.perf_counter() - t0:.1f} s", flush=True)
            ctxs[f"llama.cpp {t}"] = [llm, int(prompt[-1])]
    times: dict[str, list[float]] = {k: [] for k in ctxs}
    for _ in range(args.steps):
        for key, cc in ctxs.items():
            t0 = time.perf_counter()
            if key.startswith("llama"):
                llm = cc[0]
                llm.eval([cc[1]])
                logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
                times[key].append(time.perf_counter() - t0)
                cc[1] = int(np.argmax(logits))
            else:
                out = cc[0].decode([cc[1]])
                times[key].append(time.perf_counter() - t0)
                cc[1] = int(np.argmax(model.backend.to_numpy(out.logits[-1])))
    f32 = min(times["plinth f32"])
    for key, v in times.items():
        print(f"{key}: a decode step at {n}: best {min(v) * 1e3:.1f} ms, median {np.median(v) * 1e3:.1f} ms "
              f"(speed {f32 / min(v):.2f}x plinth f32's)")
    for t in args.types:
        if f"llama.cpp {t}" in times:
            a, b = times[f"plinth {t}"], times[f"llama.cpp {t}"]
            print(f"plinth / llama.cpp decode speed, {t} cache: best {min(b) / min(a):.2f}x, median "
                  f"{np.median(b) / np.median(a):.2f}x")
    print(f"load after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

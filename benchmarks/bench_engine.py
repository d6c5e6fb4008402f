"""Engine speed: load time, prompt and decode tokens/s, and decode against the memory roofline.

Usage: python benchmarks/bench_engine.py [-m MODEL] [--threads N] [--prompt-tokens 128] [--decode-tokens 32]

The roofline: each decode step reads every weight once as it is held in memory
(quantized blocks for the types plinth.quant keeps, f32 otherwise; the embedding
table only for the rows it gathers unless it is also the LM head). The machine's
read bandwidth is measured here with a large np.sum over a 1 GiB f32 array (best
of 5); the decode roofline is bandwidth / bytes per token, and the script prints
the fraction reached. It also prints the kernels' warm-up time in this process
(a compile on the first run on a machine, a cache load after).
For reference it also prints what one BLAS GEMV over the same 1 GiB reads per
second with the benchmark's threads (the fastest a decode step could stream its
weights through BLAS).
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import numpy as np

    import plinth
    from plinth.generate import time_prefill_decode

    from plinth import ops, quant

    quant.set_threads(args.threads)
    jit_s = ops.warm_up()
    t0 = time.perf_counter()
    model = plinth.load_model(args.model)
    load_s = time.perf_counter() - t0
    n_params = model.stats.n_params

    buf = np.ones(256 * 1024 * 1024, dtype=np.float32)  # 1 GiB
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    bandwidth = buf.nbytes / best
    mat = buf.reshape(-1, 4096)
    vec = np.ones(4096, dtype=np.float32)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        mat @ vec
        best = min(best, time.perf_counter() - t)
    gemv_bandwidth = buf.nbytes / best
    del buf, mat

    pp, tg = time_prefill_decode(model, args.prompt_tokens, args.decode_tokens, runs=args.runs)
    tied = "output.weight" not in model.weights
    per_token = sum(getattr(w, "nbytes", 0) for name, w in model.weights.items()
                    if tied or name != "token_embd.weight")
    roofline = bandwidth / per_token
    print(f"model            {model.path.name} ({model.arch}), {n_params / 1e6:.1f} M params, "
          f"{per_token / 2**20:.0f} MiB read per decoded token")
    print(f"kernels          warm-up {jit_s:.2f} s in this process")
    print(f"load             {load_s:.2f} s")
    print(f"prompt           {pp:.1f} tok/s ({args.prompt_tokens} tokens)")
    print(f"decode           {tg:.1f} tok/s ({args.decode_tokens} tokens after the prompt)")
    print(f"read bandwidth   {bandwidth / 1e9:.1f} GB/s (np.sum over 1 GiB f32); "
          f"BLAS GEMV over it {gemv_bandwidth / 1e9:.1f} GB/s ({args.threads} threads)")
    print(f"decode roofline  {roofline:.1f} tok/s -> {100 * tg / roofline:.0f}% reached "
          f"({tg * per_token / 1e9:.1f} GB/s of weights)")


if __name__ == "__main__":
    main()

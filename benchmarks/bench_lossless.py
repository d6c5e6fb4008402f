"""What the batch-invariant paths cost: step ratios, and prompts on the row kernels against the old shapes.

Usage::

    python benchmarks/bench_lossless.py [-m smollm2-135m-instruct] [-m gemma3-270m] [--runs 20] [--threads 2]

Per model, best of ``--runs`` forwards each (the cache cut back after each one):

* ``k=8 verify / 1``: a forward of 9 rows of one sequence (a k = 8 verify batch) against a one-token
  step of the same sequence (goal <= 2.0);
* ``16 seq / 1``: a server step of 16 sequences, one decode row each, against one sequence's step
  (goal <= 4.0);
* prompt prefill of 300 tokens: attention through the compiled row kernel (now, up to 1024 query
  rows) against BLAS (the old bound of 16 rows), and, with ``PLINTH_INT8=0``-style f32 activations, the
  row-invariant f32 kernel against dequantized tiles + BLAS (the old path past 5 rows).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def best(fn, runs: int) -> float:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out) * 1000.0


def measure(name: str, runs: int) -> dict:
    import importlib

    import plinth
    import plinth.quant as quant

    attn = importlib.import_module("plinth.ops.attention")  # (plinth.ops.attention is also the function)
    from plinth.graph import Batch

    model = plinth.load_model(name)
    model.prepare()
    rng = np.random.default_rng(0)
    n_vocab = model.n_vocab
    prompt = [int(t) for t in rng.integers(100, min(n_vocab, 20000), 70)]
    ctx = model.new_context()
    for s in range(16):
        ctx.forward(Batch.from_tokens(prompt, start=0, seq=s, output="none"))
    pos = len(prompt)

    def step(rows: list[tuple[int, list[int]]]) -> None:
        parts = [Batch.from_tokens(toks, start=pos, seq=s, output="all") for s, toks in rows]
        ctx.forward(parts[0] if len(parts) == 1 else Batch.concat(parts))
        for s, _ in rows:
            ctx.cache.seq_rm(s, pos)

    one = best(lambda: step([(0, [prompt[0]])]), runs)
    verify = best(lambda: step([(0, prompt[:9])]), runs)
    sixteen = best(lambda: step([(s, [prompt[s]]) for s in range(16)]), runs)

    long_prompt = [int(t) for t in rng.integers(100, min(n_vocab, 20000), 300)]

    def prefill() -> None:
        c = model.new_context()
        c.forward(Batch.from_tokens(long_prompt, start=0, seq=0, output="last"))

    n_prefill = max(2, runs // 5)
    kernel_attn = best(prefill, n_prefill)
    saved_q = attn.KERNEL_MAX_Q
    attn.KERNEL_MAX_Q = 16
    try:
        blas_attn = best(prefill, n_prefill)
    finally:
        attn.KERNEL_MAX_Q = saved_q
    saved_i8 = quant._state["i8"]
    quant._state["i8"] = False  # the f32-activation path, as PLINTH_INT8=0
    try:
        f32_kernel = best(prefill, n_prefill)
        saved_rows = quant.F32_KERNEL_MAX_ROWS
        quant.F32_KERNEL_MAX_ROWS = 5
        try:
            f32_tiles = best(prefill, n_prefill)
        finally:
            quant.F32_KERNEL_MAX_ROWS = saved_rows
        f32_one = best(lambda: step([(0, [prompt[0]])]), runs)
        f32_verify = best(lambda: step([(0, prompt[:9])]), runs)
    finally:
        quant._state["i8"] = saved_i8
    return dict(one=one, verify=verify, sixteen=sixteen, kernel_attn=kernel_attn, blas_attn=blas_attn,
                f32_kernel=f32_kernel, f32_tiles=f32_tiles, f32_one=f32_one, f32_verify=f32_verify)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", action="append", default=None)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import os

    os.environ.setdefault("PLINTH_THREADS", str(args.threads))
    import plinth.quant as quant

    quant.set_threads(args.threads)
    for name in args.model or ["smollm2-135m-instruct", "gemma3-270m"]:
        r = measure(name, args.runs)
        print(f"{name}: one-token step {r['one']:.2f} ms, k=8 verify {r['verify']:.2f} ms "
              f"(ratio {r['verify'] / r['one']:.2f}, goal <= 2.0), 16-sequence step {r['sixteen']:.2f} ms "
              f"(ratio {r['sixteen'] / r['one']:.2f}, goal <= 4.0)")
        print(f"  300-token prefill: attention kernel {r['kernel_attn']:.0f} ms vs BLAS {r['blas_attn']:.0f} ms "
              f"({r['kernel_attn'] / r['blas_attn']:.2f}x); f32 activations: row kernel {r['f32_kernel']:.0f} ms vs "
              f"tiles {r['f32_tiles']:.0f} ms ({r['f32_kernel'] / r['f32_tiles']:.2f}x); f32 one-token step "
              f"{r['f32_one']:.2f} ms, k=8 verify {r['f32_verify']:.2f} ms ({r['f32_verify'] / r['f32_one']:.2f}x)",
              flush=True)


if __name__ == "__main__":
    main()

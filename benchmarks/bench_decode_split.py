"""Where a decode step's time goes, against the bandwidth floor of the bytes it reads.

Times greedy decode steps after a short prompt and splits each step into the int8 weight products
(``plinth.quant.kernels_i8.linear``), the compiled attention (``plinth.ops.compiled``) and the
rest (norms, RoPE, cache appends, the Python of the layers). The floor is the quantized weight
bytes read per token (every quantized weight once; a tied embedding table as the LM head) over
the read bandwidth this machine reaches with the kernel threads, measured here too.

A llama-style model runs each layer as one compiled call (``plinth.ops.fused.dense_block``, which
holds the layer's four products and its attention): its rows show those calls' time as "fused
blocks", and the products and attention columns count only what runs outside them (the LM head). ``--general`` also times the model with that call off
(``graph.fused = None``, the same bits), where every product and attention is counted.

    OPENBLAS_NUM_THREADS=2 python benchmarks/bench_decode_split.py [-m MODEL ...] [--steps 64] [--runs 3] [--general]
"""

from __future__ import annotations

import argparse
import importlib
import os
import time

import numpy as np


def _weight_bytes(model) -> int:
    """Bytes of the distinct quantized weights the graph holds (what one decode step reads)."""
    import plinth.quant as quant

    seen: set[int] = set()
    total = 0

    def walk(o, depth):
        nonlocal total
        if depth > 6 or id(o) in seen:
            return
        seen.add(id(o))
        if isinstance(o, quant.QuantWeight):
            total += o.nbytes
        elif isinstance(o, quant.StackedWeight):
            for p in o.parts:
                walk(p, depth + 1)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v, depth + 1)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v, depth + 1)
        elif hasattr(o, "__dict__") and not isinstance(o, np.ndarray):
            for v in vars(o).values():
                walk(v, depth + 1)

    walk(model, 0)
    return total


def _read_bandwidth(n_bytes: int = 400_000_000) -> float:
    """Bytes/s of a strided read (one byte a cache line) of a large array over the kernel threads,
    best of 7: a shared machine's figure swings, and the floor is about the best it can do."""
    from numba import njit, prange

    @njit(parallel=True)
    def touch(a):
        s = 0
        for i in prange(a.shape[0] // 64):
            s += a[i * 64]
        return s

    a = np.ones(n_bytes, np.uint8)
    touch(a)
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        touch(a)
        best = min(best, time.perf_counter() - t0)
    return n_bytes / best


def split(name: str, steps: int, runs: int, general: bool = False) -> dict[str, float]:
    import plinth
    import plinth.quant as quant
    import plinth.ops.fused as fused

    model = plinth.load_model(name)
    if general:
        model.graph.fused = None
    k8 = quant.compiled_i8()
    attn_mod = importlib.import_module("plinth.ops._xp").compiled_ops()
    if k8 is None or attn_mod is None:
        raise SystemExit("the int8 kernels are off here (no AVX2, PLINTH_INT8=0 or no numba)")
    acc = {"products": 0.0, "attention": 0.0, "blocks": 0.0}
    real_linear, real_attn, real_block = k8.linear, attn_mod.attention_groups, fused.dense_block

    def linear(*a):
        t0 = time.perf_counter()
        real_linear(*a)
        acc["products"] += time.perf_counter() - t0

    def attention_groups(*a):
        t0 = time.perf_counter()
        real_attn(*a)
        acc["attention"] += time.perf_counter() - t0

    def dense_block(*a):
        t0 = time.perf_counter()
        out = real_block(*a)
        acc["blocks"] += time.perf_counter() - t0
        return out

    k8.linear, attn_mod.attention_groups, fused.dense_block = linear, attention_groups, dense_block
    try:
        best = None
        for _ in range(runs):
            ctx = model.new_context()
            ctx.decode(list(range(1, 65)))
            ctx.decode([5])  # one step first: the prompt's BLAS threads settle
            acc["products"] = acc["attention"] = acc["blocks"] = 0.0
            token = 7
            t0 = time.perf_counter()
            for _ in range(steps):
                token = int(np.argmax(ctx.decode([token]).logits[-1]))
            total = time.perf_counter() - t0
            if best is None or total < best["total"]:
                best = dict(acc, total=total)
    finally:
        k8.linear, attn_mod.attention_groups, fused.dense_block = real_linear, real_attn, real_block
    nbytes = _weight_bytes(model)
    bw = _read_bandwidth()
    ms = {k: v / steps * 1e3 for k, v in best.items()}
    return dict(ms, rest=ms["total"] - ms["products"] - ms["attention"] - ms["blocks"], mib=nbytes / 2**20, gbs=bw / 1e9,
                floor=nbytes / bw * 1e3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", action="append", default=None)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--general", action="store_true", help="also time each model with the fused blocks off")
    args = ap.parse_args(argv)
    print(f"load average at start: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print("| model | ms a token (tok/s) | fused blocks | int8 weight products | attention | the rest | weight bytes | "
          "read bandwidth | floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.model or ["smollm2-135m-instruct", "gemma3-270m"]:
        for general in ([False, True] if args.general else [False]):
            r = split(name, args.steps, args.runs, general)
            label = name + (" (fused off)" if general else "")
            print(f"| {label} | {r['total']:.2f} ({1e3 / r['total']:.1f}) | {r['blocks']:.2f} ms | {r['products']:.2f} ms "
                  f"| {r['attention']:.2f} ms | {r['rest']:.2f} ms | {r['mib']:.0f} MiB | {r['gbs']:.1f} GB/s "
                  f"| {r['floor']:.2f} ms |")
    print(f"load average at end: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

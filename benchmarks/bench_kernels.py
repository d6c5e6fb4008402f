"""Throughput of the quantized-weight products per block type and row count.

Times ``QuantWeight.matmul`` (the int8-activation kernels up to ``KERNEL_MAX_ROWS`` rows, on the
kernel threads) on a random weight of each type and prints G multiply-adds a second, best of
``--runs``: the figure that decides prompt, verify and server-step speed (one row is bandwidth-
and latency-bound instead; see ``bench_decode_split.py``). Weights: gguf-py's quantizer where it
has one, else random blocks with O(1) f16 scales (the K-quants). Use a quiet machine.

    python benchmarks/bench_kernels.py [--types Q4_1,Q8_0,Q5_0,Q4_K,Q6_K] [--rows 1,4,8,16,128]
                                       [--shape 2048,1024] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_1,Q8_0,Q5_0,Q4_K,Q6_K")
    ap.add_argument("--rows", default="1,4,8,16,128")
    ap.add_argument("--shape", default="2048,1024", help="n_out,n_in (n_in a multiple of 256 for the K-quants)")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    import plinth.quant as quant
    from plinth.gguf.constants import GGMLType
    from plinth.testing import quantized_rows

    n_out, n_in = (int(v) for v in args.shape.split(","))
    rows = [int(r) for r in args.rows.split(",")]
    path = "int8 kernels" if quant.compiled_i8() is not None else "f32 kernels / tiles (no int8 kernels here)"
    print(f"{path}, {quant.threads()} threads; {n_out} x {n_in}; load average {os.getloadavg()[0]:.2f}")
    print("| type | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for t in args.types.split(","):
        w = quant.QuantWeight(quantized_rows(t, n_out, n_in), int(GGMLType[t]), (n_out, n_in))
        cells = []
        for m in rows:
            x = np.random.default_rng(1).standard_normal((m, n_in)).astype(np.float32)
            w.matmul(x)
            reps = max(3, int(2e8 / (m * n_out * n_in)))
            best = float("inf")
            for _ in range(args.runs):
                t0 = time.perf_counter()
                for _ in range(reps):
                    w.matmul(x)
                best = min(best, (time.perf_counter() - t0) / reps)
            cells.append(f"{m * n_out * n_in / best / 1e9:.1f} G/s ({best * 1e6:.0f} us)")
        print(f"| {t} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

"""How fast each core runs a batch product, alone and with the other, over time: what a shared machine's
neighbours do to plinth's multi-row figures.

A product of 8 activation rows (a verify batch's, a server step's) is bound by the cores' SIMD work, and
its weight groups are split between the kernel threads in fixed halves. On a shared VM one core can run
~30% slower than the other for seconds at a time, and the pair then runs at the slow core's pace: a k = 8
verify forward swings between ~8.5 and ~11 ms while a one-token step (bound by memory) hardly moves. This
prints, every ``--every`` seconds for ``--duration`` seconds, the product's time on core 0 alone, on core 1
alone (the calling thread pinned, one kernel thread), and on both (every CPU allowed, the kernel threads
as configured), so a benchmark run can be read against the state the machine was in.

    python benchmarks/bench_cores.py [--type Q4_1] [--shape 3072,576] [--rows 8] [--duration 60] [--every 0.5]

Linux only (``os.sched_setaffinity``); the two CPUs are the first two this process may run on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--type", default="Q4_1", help="weight block type (default Q4_1, SmolLM2's)")
    ap.add_argument("--shape", default="3072,576", help="n_out,n_in (default SmolLM2's gate | up)")
    ap.add_argument("--rows", type=int, default=8, help="activation rows (default 8: a k = 8 verify)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds to sample (default 60)")
    ap.add_argument("--every", type=float, default=0.5, help="seconds between samples (default 0.5)")
    args = ap.parse_args()
    if not hasattr(os, "sched_setaffinity"):
        sys.exit("bench_cores.py pins threads with os.sched_setaffinity (Linux only)")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit(f"bench_cores.py compares two cores; this process may run on {len(cpus)}")

    import numba

    import plinth.quant as quant
    from plinth.gguf.constants import GGMLType
    from plinth.testing import quantized_rows

    if quant.compiled_i8() is None:
        sys.exit("bench_cores.py times the int8 kernels, which are off here (PLINTH_INT8=0, no AVX2, or no numba)")
    n_out, n_in = (int(v) for v in args.shape.split(","))
    w = quant.QuantWeight(quantized_rows(args.type, n_out, n_in), int(GGMLType[args.type]), (n_out, n_in))
    x = np.random.default_rng(1).standard_normal((args.rows, n_in)).astype(np.float32)
    threads = quant.threads()
    me = threading.get_native_id()

    def best(n: int = 60) -> float:
        got = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(n):
                w.matmul(x)
            got = min(got, (time.perf_counter() - t) / n)
        return got * 1e6

    w.matmul(x)  # (the first product repacks the weight)
    print(f"{args.type} {n_out} x {n_in}, {args.rows} rows; CPUs {cpus[0]} and {cpus[1]}; kernel threads {threads}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"   t (s) {f'CPU {cpus[0]} alone (us)':>18} {f'CPU {cpus[1]} alone (us)':>18} {'both (us)':>10} "
          f"{'both / faster alone':>20}")
    rows = []
    t0 = time.time()
    try:
        while time.time() - t0 < args.duration:
            numba.set_num_threads(1)
            alone = []
            for cpu in cpus[:2]:
                os.sched_setaffinity(me, {cpu})
                alone.append(best())
            os.sched_setaffinity(me, set(cpus))
            numba.set_num_threads(threads)
            best(10)
            both = best()
            rows.append((*alone, both))
            print(f"{time.time() - t0:8.1f} {alone[0]:18.1f} {alone[1]:18.1f} {both:10.1f} {both / min(alone):20.2f}",
                  flush=True)
            time.sleep(args.every)
    finally:
        os.sched_setaffinity(me, set(cpus))
        numba.set_num_threads(threads)
    if rows:
        fast = min(min(a, b) for a, b, _ in rows)
        slow_one = sum(max(a, b) > 1.15 * fast for a, b, _ in rows)
        print(f"samples {len(rows)}; fastest core-alone time {fast:.1f} us; samples where a core ran > 15% slower than "
              f"that: {slow_one}; both-cores time median {statistics.median(r[2] for r in rows):.1f} us, "
              f"best {min(r[2] for r in rows):.1f} us")


if __name__ == "__main__":
    main()

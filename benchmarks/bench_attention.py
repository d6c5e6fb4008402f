"""Decode / verify attention: the vector kernel (plinth.ops.attend_simd) against the plain per-(row,
head) loop it replaced, on the same compiled entry point (``plinth.ops.compiled.attention_groups``).

Usage::

    python benchmarks/bench_attention.py [--keys 129,513] [--rows 1,4,8,16] [--shape 9,3,64] [--runs 300]
                                         [--types f16,q8_0,q4_0] [--plain-typed]

``--shape`` is n_head, n_head_kv, head size (SmolLM2-135M: 9,3,64; Gemma-3-270M: 4,1,256). One
sequence, causal rows at the end of the keys; best of ``--runs`` calls each, interleaved; the
kernel threads are plinth's default (``PLINTH_THREADS``). ``--types``: also the vector kernel that reads a
typed cache's blocks (:mod:`plinth.ops.attend_qsimd`, the rotation on), per type, on the same rows (its
time and its ratio to the float32 vector kernel's); ``--plain-typed`` adds the typed cache's plain
loops (:mod:`plinth.ops.attend_q`, every tenth run). Every kernel's calls are interleaved in the same runs.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", default="129,513")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--shape", default="9,3,64")
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--types", default="", help="typed caches to time too, e.g. f16,q8_0,q4_0")
    ap.add_argument("--plain-typed", action="store_true",
                    help="also the typed cache's plain kernel (plinth.ops.attend_q's loops), every tenth run")
    args = ap.parse_args()
    types = [t for t in args.types.split(",") if t]

    from plinth import quant
    from plinth.kvtypes import CacheTypes
    from plinth.ops._xp import compiled_ops
    from plinth.ops.attend_q import attention_rows_q

    c = compiled_ops()
    if c is None:
        raise SystemExit("the compiled kernels are off here (numba missing or PLINTH_KERNELS=0)")
    n_head, n_head_kv, hd = (int(x) for x in args.shape.split(","))
    threads = quant.threads()
    rng = np.random.default_rng(0)
    print(f"{n_head} heads over {n_head_kv} kv heads of {hd}; {threads} threads; load average "
          f"{os.getloadavg()[0]:.2f}; best of {args.runs}, microseconds a call")
    cols = [c for t in types for c in ([t] + [f"{t} plain"] * args.plain_typed)]
    print("| keys | rows | plain loop | vector kernel | ratio |" + "".join(f" {c} |" for c in cols))
    print("|---|---|---|---|---|" + "---|" * len(cols))
    for n_kv in (int(x) for x in args.keys.split(",")):
        k = rng.standard_normal((n_kv, n_head_kv, hd)).astype(np.float32)
        v = rng.standard_normal((n_kv, n_head_kv, hd)).astype(np.float32)
        for rows in (int(x) for x in args.rows.split(",")):
            q = rng.standard_normal((rows, n_head, hd)).astype(np.float32)
            bias = np.zeros((rows, n_kv), np.float32)
            for i in range(rows):
                bias[i, n_kv - rows + i + 1:] = -np.inf
            t = np.array([[0, rows, n_kv, k.ctypes.data, v.ctypes.data, bias.ctypes.data]], dtype=np.int64)
            outs = [np.empty((rows, n_head, hd), np.float32) for _ in range(2)]
            # every kernel's calls interleaved in the same runs (a loaded machine's noise falls on all alike)
            calls = [lambda o=outs[j], p=plain: c.attention_groups(q, t, n_head_kv, hd, hd ** -0.5, 0.0, o, threads, p)
                     for j, plain in enumerate((True, False))]
            every = [1, 1]  # a call is timed on runs r % every == 0
            keep = []
            for name in types:
                ct = CacheTypes(k=name, v=name)
                kc, vc = ct.codec("k", (n_head_kv, hd)), ct.codec("v", (n_head_kv, hd))
                kq, vq = kc.encode(k), vc.encode(v)
                tq = t.copy()
                tq[0, 3], tq[0, 4] = kq.ctypes.data, vq.ctypes.data
                keep += [kq, vq, tq]
                for plain in (False, True)[:1 + args.plain_typed]:
                    calls.append(lambda tq=tq, kc=kc, vc=vc, p=plain:
                                 attention_rows_q(q, tq, n_head_kv, hd, kc, vc, hd ** -0.5, plain=p))
                    every.append(10 if plain else 1)
            best = [float("inf")] * len(calls)
            for r in range(args.runs):
                for j, call in enumerate(calls):
                    if r % every[j] == 0:
                        t0 = time.perf_counter()
                        call()
                        best[j] = min(best[j], time.perf_counter() - t0)
            err = np.abs(outs[0] - outs[1]).max() / np.abs(outs[0]).max()
            typed = "".join(f" {b * 1e6:.1f} ({b / best[1]:.{1 if e > 1 else 2}f}x) |"
                            for b, e in zip(best[2:], every[2:]))
            print(f"| {n_kv} | {rows} | {best[0] * 1e6:.1f} | {best[1] * 1e6:.1f} | {best[0] / best[1]:.2f}x |" + typed
                  + (f" (max relative difference {err:.1e})" if err > 1e-5 else ""))


if __name__ == "__main__":
    main()

"""Time plinth.ops attention and linear on SmolLM2-135M shapes (numpy backend).

n_embd 576, 9 query heads, 3 kv heads, head_dim 64, n_ff 1536, vocab 49152.
Prints milliseconds per call and the effective memory bandwidth of the weight-bound ops
(linear at decode reads its whole weight once, so GB/s against the machine's memory
roofline is the figure that matters).

    PYTHONPATH=core python benchmarks/bench_ops.py
"""

from __future__ import annotations

import time

import numpy as np

from plinth import ops

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF, N_VOCAB = 576, 9, 3, 64, 1536, 49152


def bench(fn, *args, min_time=0.3, **kw):
    fn(*args, **kw)
    n, t0 = 0, time.perf_counter()
    while True:
        fn(*args, **kw)
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_time:
            return dt / n


def main() -> None:
    rng = np.random.default_rng(0)
    f32 = np.float32
    print(f"numpy {np.__version__}")
    print("linear  (x @ W.T, W in GGUF layout [n_out, n_in])")
    for n_tok in (1, 16, 128):
        for n_out, n_in, name in ((N_FF, N_EMBD, "ffn_up"), (N_EMBD, N_FF, "ffn_down"), (N_VOCAB, N_EMBD, "lm_head")):
            x = rng.standard_normal((n_tok, n_in)).astype(f32)
            w = rng.standard_normal((n_out, n_in)).astype(f32)
            t = bench(ops.linear, x, w)
            gbs = w.nbytes / t / 1e9
            gflops = 2 * n_tok * n_out * n_in / t / 1e9
            print(f"  n_tok {n_tok:4d} {name:8s} [{n_out}x{n_in}]: {t * 1e3:8.3f} ms  {gbs:6.1f} GB/s  {gflops:7.1f} GFLOP/s")

    print("attention  (9 q heads, 3 kv heads, head_dim 64)")
    for n_q, n_kv in ((1, 128), (1, 1024), (1, 4096), (128, 128), (512, 512)):
        q = rng.standard_normal((n_q, N_HEAD, HEAD_DIM)).astype(f32)
        k = rng.standard_normal((n_kv, N_HEAD_KV, HEAD_DIM)).astype(f32)
        v = rng.standard_normal((n_kv, N_HEAD_KV, HEAD_DIM)).astype(f32)
        kp = np.arange(n_kv)
        qp = kp[-n_q:]
        t = bench(ops.attention, q, k, v, qp, kp)
        gbs = (k.nbytes + v.nbytes) / t / 1e9
        print(f"  n_q {n_q:4d} n_kv {n_kv:5d}: {t * 1e3:8.3f} ms  (KV read {gbs:6.1f} GB/s)")
        if n_q == 1:
            tw = bench(ops.attention, q, k, v, qp, kp, sliding_window=256)
            print(f"  n_q {n_q:4d} n_kv {n_kv:5d} swa 256: {tw * 1e3:8.3f} ms")

    x = rng.standard_normal((1, N_EMBD)).astype(f32)
    w = rng.standard_normal(N_EMBD).astype(f32)
    print(f"rms_norm [1, {N_EMBD}]: {bench(ops.rms_norm, x, w, 1e-5) * 1e6:.1f} us")
    qh = rng.standard_normal((1, N_HEAD, HEAD_DIM)).astype(f32)
    cache = ops.RopeCache(ops.rope_freqs(HEAD_DIM, 100000.0), 8192)
    pos = np.array([1000])
    print(f"apply_rope [1, {N_HEAD}, {HEAD_DIM}] cached: {bench(lambda: ops.apply_rope(qh, cos_sin=cache(pos), mode='normal')) * 1e6:.1f} us")


if __name__ == "__main__":
    main()

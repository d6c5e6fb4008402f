"""Load time and resident set against parameter count: synthetic llama models at Q4_0.

Usage: python benchmarks/bench_memory.py [--sizes 0.25 0.5 1.0] [--dir /tmp/plinth-mem] [--f32]

Writes llama-architecture GGUF files of about the given sizes (billions of parameters)
whose matrices are random Q4_0 blocks (scales O(0.01), written block by block, so the
writer never holds an f32 copy), then loads each in a fresh process and prints the load
time, the resident set after load, the file size, one decode step's time and the ratio.
``--f32`` also loads with ``PLINTH_DEQUANTIZE=1`` (the old all-f32 path) for comparison.
Files are kept in ``--dir`` between runs (delete them after).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# (n_embd, n_ff, n_head, n_head_kv) per size class; n_vocab 32000; layers chosen for the size
SHAPE = (2048, 5632, 32, 4)
N_VOCAB = 32000


def _n_params(n_layer: int) -> int:
    e, f, h, kv = SHAPE
    hd = e // h
    per_layer = e * e * 2 + 2 * e * kv * hd + 3 * e * f + 2 * e
    return n_layer * per_layer + 2 * N_VOCAB * e + e


def write_model(path: Path, billions: float) -> tuple[Path, int]:
    import gguf
    import numpy as np

    e, f, h, kv = SHAPE
    n_layer = max(1, round((billions * 1e9 - _n_params(0)) / (_n_params(1) - _n_params(0))))
    if path.exists():
        return path, _n_params(n_layer)
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.vocab_size", N_VOCAB)
    w.add_uint32("llama.embedding_length", e)
    w.add_uint32("llama.block_count", n_layer)
    w.add_uint32("llama.feed_forward_length", f)
    w.add_uint32("llama.attention.head_count", h)
    w.add_uint32("llama.attention.head_count_kv", kv)
    w.add_uint32("llama.context_length", 2048)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    scale = np.float16(0.01).view(np.uint16)

    def q4_0(rows: int, cols: int) -> np.ndarray:
        raw = rng.integers(0, 256, (rows, cols // 32 * 18), dtype=np.uint8)
        raw.reshape(rows, -1, 18)[:, :, 0:2] = np.frombuffer(scale.tobytes(), np.uint8)
        return raw

    hd = e // h
    q = gguf.GGMLQuantizationType.Q4_0
    w.add_tensor("token_embd.weight", q4_0(N_VOCAB, e), raw_dtype=q)
    w.add_tensor("output.weight", q4_0(N_VOCAB, e), raw_dtype=q)
    w.add_tensor("output_norm.weight", np.ones(e, np.float32))
    for il in range(n_layer):
        b = f"blk.{il}."
        w.add_tensor(b + "attn_norm.weight", np.ones(e, np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(e, np.float32))
        for name, rows, cols in (("attn_q", e, e), ("attn_k", kv * hd, e), ("attn_v", kv * hd, e),
                                 ("attn_output", e, e), ("ffn_gate", f, e), ("ffn_up", f, e), ("ffn_down", e, f)):
            w.add_tensor(b + name + ".weight", q4_0(rows, cols), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, _n_params(n_layer)


CHILD = r"""
import json, sys, time
import plinth, plinth.ops, plinth.quant
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
plinth.ops.warm_up()  # the interpreter, numpy and the compiled kernels: the baseline
base = rss()
t0 = time.perf_counter()
model = plinth.load_model(sys.argv[1])
load_s = time.perf_counter() - t0
after = rss()
ctx = model.new_context()
ctx.decode([1, 2, 3, 4, 5])
best = 1e9
for i in range(3):  # 5 + 3 = 8 tokens decoded in all
    t = time.perf_counter(); ctx.decode([5 + i]); best = min(best, time.perf_counter() - t)
print(json.dumps({"load_s": load_s, "rss_mb": after, "step_s": best, "rss_end_mb": rss(), "base_mb": base}))
"""


def measure(path: Path, dequantize: bool) -> dict:
    env = dict(os.environ, PLINTH_DEQUANTIZE="1" if dequantize else "0")
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], env=env, capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"loading {path} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--dir", default="/tmp/plinth-mem")
    parser.add_argument("--f32", action="store_true", help="also load with PLINTH_DEQUANTIZE=1")
    args = parser.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| params | file | mode | load | RSS after load | RSS / file | RSS after 8 decode steps | added by the model "
          "(after 8 steps, over the baseline with kernels loaded) / file | one decode step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in args.sizes:
        t = time.perf_counter()
        path, n = write_model(d / f"synthetic-llama-{b:g}b-q4_0.gguf", b)
        size = path.stat().st_size / 2**20
        modes = [False, True] if args.f32 else [False]
        for deq in modes:
            r = measure(path, deq)
            print(f"| {n / 1e9:.2f} B | {size:.0f} MiB | {'f32 (PLINTH_DEQUANTIZE=1)' if deq else 'Q4_0 kept'} | "
                  f"{r['load_s']:.2f} s | {r['rss_mb']:.0f} MiB | {r['rss_mb'] / size:.2f} | "
                  f"{r['rss_end_mb']:.0f} MiB ({r['rss_end_mb'] / size:.2f}) | "
                  f"{(r['rss_end_mb'] - r['base_mb']) / size:.2f} | {r['step_s'] * 1e3:.0f} ms |",
                  flush=True)
        del t
    print(f"load average at end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

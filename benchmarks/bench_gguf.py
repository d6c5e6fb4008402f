"""GGUF open time and dequantize throughput: plinth against gguf-py in the same process.

    PYTHONPATH=core python benchmarks/bench_gguf.py [model.gguf ...]

Prints open time per file (plinth.gguf.GGUFFile vs gguf.GGUFReader), then, per tensor
type, dequantize throughput in million elements per second (single thread) and the ratio.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import gguf

from plinth.gguf import GGMLType, GGUFFile, dequantize
from plinth.gguf.constants import BLOCK_SIZES

Q = gguf.GGMLQuantizationType
N_ELEMENTS = 1 << 22


def _best(fn, repeat=5):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_open(paths):
    print(f"{'file':42} {'plinth s':>9} {'gguf-py s':>10} {'ratio':>7}")
    for p in paths:
        def ours():
            with GGUFFile(p) as f:
                len(f.metadata)

        t_ours = _best(ours)
        t_ref = _best(lambda: gguf.GGUFReader(str(p)), repeat=2)
        print(f"{Path(p).name[:42]:42} {t_ours:9.3f} {t_ref:10.3f} {t_ref / t_ours:6.1f}x")


def _data(name):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N_ELEMENTS // 256, 256)).astype(np.float32)
    try:
        return gguf.quants.quantize(x, Q[name])
    except NotImplementedError:
        block, type_size = BLOCK_SIZES[GGMLType[name]]
        raw = rng.integers(0, 256, size=(N_ELEMENTS // block, type_size), dtype=np.uint8)
        scale_at = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
        for off in scale_at.get(name, ()):
            raw[:, off:off + 2] = np.full(len(raw), 0.01, "<f2").view(np.uint8).reshape(-1, 2)
        return raw.reshape(N_ELEMENTS // 256, -1)


def bench_dequant():
    print(f"\n{'type':7} {'plinth Melem/s':>15} {'gguf-py Melem/s':>16} {'ratio':>7}")
    for name in ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                 "Q6_K", "MXFP4", "NVFP4"]:
        stored = _data(name)
        raw = stored.view("<f2") if name == "F16" else stored.view("<u2") if name == "BF16" else stored
        shape = (N_ELEMENTS // 256, 256)
        t_ours = _best(lambda: dequantize(raw, GGMLType[name], shape), repeat=3)
        t_ref = _best(lambda: gguf.quants.dequantize(stored, Q[name]), repeat=1)
        print(f"{name:7} {N_ELEMENTS / t_ours / 1e6:15.0f} {N_ELEMENTS / t_ref / 1e6:16.0f} "
              f"{t_ref / t_ours:6.1f}x")


if __name__ == "__main__":
    files = sys.argv[1:] or [str(p) for p in sorted((Path.home() / ".cache" / "plinth").glob("*.gguf"))]
    if files:
        bench_open(files)
    bench_dequant()

"""Opt-in (``make test-kv-accuracy``, or ``pytest -m peer``): the accuracy of a quantized K/V cache against
llama.cpp's on the same GGUF (benchmarks/bench_kv_accuracy.py at a smaller size: SmolLM2, WINDOWS windows
of 1024 tokens of real text, the last POSITIONS of each teacher-forced).

plinth's q4_0 cache against its own f32 cache must be at least as good as llama.cpp's q4_0 cache against its
own f16 cache, judged per window (paired): its mean KL divergence of the next-token distributions no
larger, and its top-1 agreement not below by more than one standard error of the paired difference (a
q4_0 cache's figures move by several percent with rounding alone: a relative 1e-6 on the stored K / V
changes which values round up, and over 512 positions top-1 agreement then spreads by about a point, the
KLD by ~5%, so a single window of a hundred positions cannot tell the engines apart). And the rotation
must help plinth (the reason for it). Measured: benchmarks/README.md, "Fitted q4_0 / q5_0 scales"."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

SMOLLM2 = Path.home() / ".cache" / "plinth" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CTX, POSITIONS, WINDOWS = 1024, 128, 8


@pytest.mark.peer
@pytest.mark.slow
def test_q4_0_cache_no_worse_than_llama_cpp(request):
    if not ({"peer", "slow"} & set((request.config.getoption("markexpr") or "").replace("(", " ").split())):
        pytest.skip("opt-in: make test-kv-accuracy (pytest -m peer)")
    pytest.importorskip("llama_cpp")
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2} not available")
    import plinth
    from plinth.testing import load_module

    bench = load_module(Path(__file__).parents[1] / "benchmarks" / "bench_kv_accuracy.py", "bench_kv_accuracy")
    model = plinth.load_model(SMOLLM2, tokenizer=True)
    samples = bench.windows(model.tokenizer, bench.default_corpus(), CTX, WINDOWS, POSITIONS)
    ours, off, theirs = [], [], []
    try:
        for ids in samples:
            ref = bench.plinth_logprobs(model, ids, POSITIONS, "f32", True, 128)
            ours.append(bench.compare(ref, bench.plinth_logprobs(model, ids, POSITIONS, "q4_0", True, 128)))
            off.append(bench.compare(ref, bench.plinth_logprobs(model, ids, POSITIONS, "q4_0", False, 128)))
            lref = bench.llama_logprobs(SMOLLM2, ids, POSITIONS, "f16", True, 2)
            theirs.append(bench.compare(lref, bench.llama_logprobs(SMOLLM2, ids, POSITIONS, "q4_0", True, 2)))
    finally:
        os.environ.pop("PLINTH_ATTN_ROT_DISABLE", None)
        os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
    ours, off, theirs = np.array(ours), np.array(off), np.array(theirs)
    diff = ours - theirs  # per window: [top-1, KLD]
    se = diff.std(0, ddof=1) / np.sqrt(len(diff))
    print(f"q4_0 cache, {WINDOWS} windows x {POSITIONS} positions at {CTX}: plinth top-1 {ours[:, 0].mean():.2%} "
          f"KLD {ours[:, 1].mean():.5f} (rotation off {off[:, 0].mean():.2%}, {off[:, 1].mean():.5f}); llama.cpp "
          f"top-1 {theirs[:, 0].mean():.2%} KLD {theirs[:, 1].mean():.5f}; paired difference top-1 "
          f"{diff[:, 0].mean():+.2%} +- {se[0]:.2%}, KLD {diff[:, 1].mean():+.5f} +- {se[1]:.5f}")
    assert diff[:, 1].mean() <= 0, "plinth's q4_0 cache moves the distribution more than llama.cpp's"
    assert diff[:, 0].mean() >= -se[0], "plinth's q4_0 cache keeps fewer top-1 tokens than llama.cpp's"
    assert off[:, 1].mean() > 1.5 * ours[:, 1].mean() and off[:, 0].mean() < ours[:, 0].mean()

"""Opt-in (``make test-kv-accuracy``, or ``pytest -m peer``): the accuracy of a quantized K/V cache against
llama.cpp's on the same GGUF (benchmarks/bench_kv_accuracy.py at a smaller size: SmolLM2, 1024 tokens of
real text, the last 128 positions teacher-forced). plinth's top-1 agreement with its own f32 cache must be
llama.cpp's with its own f16 cache or better, within SPREAD (a few near-tie positions of 128 move with any
rounding), and the rotation must help on q4_0 (the reason for it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SMOLLM2 = Path.home() / ".cache" / "plinth" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CTX, POSITIONS = 1024, 128
#: 5 positions of 128
SPREAD = 0.04


@pytest.mark.peer
@pytest.mark.slow
def test_q4_0_cache_agreement_at_least_llama_cpp(request):
    if not ({"peer", "slow"} & set((request.config.getoption("markexpr") or "").replace("(", " ").split())):
        pytest.skip("opt-in: make test-kv-accuracy (pytest -m peer)")
    pytest.importorskip("llama_cpp")
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2} not available")
    import plinth
    from plinth.testing import load_module

    bench = load_module(Path(__file__).parents[1] / "benchmarks" / "bench_kv_accuracy.py", "bench_kv_accuracy")
    model = plinth.load_model(SMOLLM2, tokenizer=True)
    ids = model.tokenizer.encode(bench.default_text(), add_special=True)[:CTX]
    ref = bench.plinth_top1(model, ids, POSITIONS, "f32", True, 128)
    ours = {rot: float((bench.plinth_top1(model, ids, POSITIONS, "q4_0", rot, 128) == ref).mean())
            for rot in (True, False)}
    lref = bench.llama_top1(SMOLLM2, ids, POSITIONS, "f16", True, 2)
    theirs = {rot: float((bench.llama_top1(SMOLLM2, ids, POSITIONS, "q4_0", rot, 2) == lref).mean())
              for rot in (True, False)}
    os.environ.pop("PLINTH_ATTN_ROT_DISABLE", None)
    os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
    print(f"q4_0 cache, top-1 agreement over {POSITIONS} positions at {CTX}: plinth rotation on {ours[True]:.2%}, "
          f"off {ours[False]:.2%}; llama.cpp on {theirs[True]:.2%}, off {theirs[False]:.2%}")
    assert ours[True] >= theirs[True] - SPREAD
    assert ours[True] > ours[False]

"""A sliding-window layer's few-rows attention reads only (about) its window of keys: the keys before
the earliest row's window are left out in whole runs of ``WINDOW_SKIP``, which must not change a bit
of the result (Gemma-3-270M: window 512; decode and verify rows past it, float32 and q8_0 caches)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import plinth
import plinth.graph as graph

GEMMA = Path.home() / ".cache" / "plinth" / "gemma-3-270m-q4_k_m.gguf"


@pytest.fixture(scope="module")
def gemma():
    if not GEMMA.is_file():
        pytest.skip(f"{GEMMA} not available")
    return plinth.load_model(GEMMA)


def _run(model, ids, types):
    ctx = model.new_context(cache_type_k=types, cache_type_v=types)
    ctx.decode(ids[:600], output="last")
    one = np.asarray(ctx.decode(ids[600:601]).logits[-1])
    ver = np.asarray(ctx.decode(ids[601:606], output="all").logits)
    return one, ver


@pytest.mark.parametrize("types", ["f32", pytest.param("q8_0", marks=pytest.mark.slow)])
def test_window_skip_changes_no_bit(gemma, monkeypatch, types, request):
    if types != "f32" and "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in: pytest -m slow (the q8_0 cache's 600-token prefill)")
    ids = [int(i) for i in np.random.default_rng(0).integers(10, 20000, 606)]
    called = []
    real = graph._window_columns

    def spy(step, kv, n_kv, window):
        lo, col = real(step, kv, n_kv, window)
        called.append(int(lo.max()))
        return lo, col

    monkeypatch.setattr(graph, "_window_columns", spy)
    a = _run(gemma, ids, types)
    assert max(called) >= 64  # keys were skipped
    monkeypatch.setattr(graph, "WINDOW_SKIP", 1 << 40)  # nothing skipped
    b = _run(gemma, ids, types)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32))

"""Accuracy of the dense architectures against an independent reference implementation.

``golden/<case>.npz`` holds, for a tiny random model of each architecture, the
reference's all-position logits for five prompts and its 64-token greedy
continuation of each (written by ``golden/make_golden.py`` with Hugging Face
transformers). The weights are not stored: plinth's test kit redraws them from
the recorded seed. The default run needs no torch; the ``ref``-marked test
recomputes the reference live to show the files are reproducible.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from plinth.graph import Batch
from plinth.testing import load_golden, load_module, new_cache
from plinth.testing.reference import assert_greedy_matches, assert_logits_close, assert_record_reproduces

GOLDEN = Path(__file__).resolve().parent / "golden"
LOGIT_ATOL = 1e-4


golden = load_module(GOLDEN / "make_golden.py")
CASES = sorted(golden.CASES)


def load(case):
    return load_golden(GOLDEN / f"{case}.npz")



@pytest.fixture(scope="module")
def models():
    reg = golden.registry()
    return {case: golden.plinth_model(case, reg) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_golden_file_matches_this_case(case):
    info, runs = load(case)
    c = golden.CASES[case]
    assert (info["arch"], info["seed"], info["prompt_seed"], info["tied"]) == (c["arch"], c["seed"],
                                                                               c["prompt_seed"], c["tied"])
    assert info["metadata"] == json.loads(json.dumps(golden.metadata(case)))
    assert [len(p) for p, _, _ in runs] == list(golden.PROMPT_LENGTHS)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_reference(models, case):
    hp, weights, graph = models[case]
    assert ("output.weight" not in weights) == golden.CASES[case]["tied"]
    _, runs = load(case)
    assert [p for p, _, _ in runs] == golden.prompts(case, hp.n_vocab)
    for prompt, ref, _ in runs:
        got = graph.forward(Batch.from_tokens(prompt, output="all"), new_cache(graph, hp.n_layer)).logits
        assert_logits_close(got, ref, LOGIT_ATOL, f"{case}, prompt of {len(prompt)}", oracle="reference")


@pytest.mark.parametrize("case", CASES)
def test_greedy_continuation_matches_reference(models, case):
    hp, _, graph = models[case]
    _, runs = load(case)
    for prompt, _, ref in runs:
        assert_greedy_matches(graph, hp.n_layer, prompt, ref, f"{case}, prompt of {len(prompt)}")


def test_llama_rope_row_order_mapping():
    """The GGUF -> reference q/k row mapping turns interleaved-pair RoPE into half-split RoPE."""
    from plinth import ops

    rng = np.random.default_rng(0)
    n_head, hd, n_in, n = 3, 8, 5, 4
    w = rng.standard_normal((n_head * hd, n_in)).astype(np.float32)
    x = rng.standard_normal((n, n_in)).astype(np.float32)
    cs = ops.RopeCache(ops.rope_freqs(hd))(np.arange(n))
    inter = ops.apply_rope((x @ w.T).reshape(n, n_head, hd), mode="normal", cos_sin=cs)
    halves = ops.apply_rope((x @ golden.unpermute_rope_rows(w, n_head).T).reshape(n, n_head, hd), mode="neox",
                            cos_sin=cs)
    # same rotated vectors, dims reordered: interleaved (2i + j) <-> halves (j * hd/2 + i)
    order = np.arange(hd).reshape(hd // 2, 2).T.reshape(-1)
    np.testing.assert_allclose(inter[..., order], halves, atol=1e-6, rtol=0)


@pytest.mark.ref
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_golden_files_are_reproducible(case):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    rec = golden.reference(case)
    info, runs = load(case)
    assert_record_reproduces(rec, runs, atol=1e-5)
    assert [rec[f"greedy_{i}"].tolist() for i in range(len(runs))] == [greedy for _, _, greedy in runs]

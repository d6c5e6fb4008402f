"""Accuracy of Mistral Large 4 against Hugging Face transformers' MistralLarge4ForConditionalGeneration.

``golden/<case>.npz`` holds, for a tiny random model of each case (the issue's store / reuse /
reuse_but_indexer / own pattern; no sharing with top-k above every prompt; NoPE layers sharing
with NoPE layers; six layers with two shared-indexer runs), the reference's all-position logits
for prompts of 1, 7, 24 and 200 tokens and its 16-token greedy continuation of each
(``golden/make_golden.py``). Here the same weights are written as an HF folder, converted by
plinth's converter, loaded through the plugin, and compared. The default run needs no torch;
the ``ref`` tests recompute the reference live, and convert a folder written by transformers'
own ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.graph import Batch
from plinth.testing import load_golden, load_module, new_cache
from plinth.testing.golden import assert_record_is_case
from plinth.testing.reference import (assert_converted_matches, assert_greedy_matches, assert_logits_close,
                                      assert_record_reproduces, greedy_full)

GOLDEN = Path(__file__).resolve().parent / "golden"
LOGIT_ATOL = 1e-4
# a gap between the k-th and (k+1)-th index score smaller than this (relative to the row's largest
# score) counts as a tie: ~100 float32 ulps, far above the rounding difference between two implementations
TIE_GAP = 1e-5

golden = load_module(GOLDEN / "make_golden.py")
CASES = sorted(golden.CASES)


def load(case):
    return load_golden(GOLDEN / f"{case}.npz")


@pytest.mark.parametrize("case", CASES)
def test_golden_file_matches_this_case(case):
    info, runs = load(case)
    assert_record_is_case(info, runs, golden, case, config=golden.config(case))


def test_cases_cover_the_patterns(mistral_models):
    """Between them the cases have every sharing mode, both indexer types, NoPE layers, top-k below
    and above the prompt lengths."""
    modes, types, rope, topk = set(), set(), set(), set()
    for case in CASES:
        hp = mistral_models(case).hparams
        modes |= set(hp.kv_sharing)
        types |= set(hp.indexer_types)
        rope |= set(hp.rope_layers)
        topk.add(hp.idx_top_k)
    assert modes == {"own", "store", "reuse", "reuse_but_indexer"}
    assert types == {"full", "shared"} and rope == {0, 1}
    assert min(topk) < 7 and max(topk) > max(golden.PROMPT_LENGTHS)
    assert any(24 < k < 200 for k in topk)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_reference(mistral_models, case):
    model = mistral_models(case)
    _, runs = load(case)
    for prompt, ref, _ in runs:
        assert_logits_close(model.logits(prompt), ref, LOGIT_ATOL, f"{case}, prompt of {len(prompt)}")


@pytest.mark.parametrize("case", CASES)
def test_no_topk_boundary_ties_in_the_test_data(mistral_models, case):
    """Where the indexer keeps fewer keys than a query sees, the k-th and (k+1)-th scores are well apart,
    so the comparison with the reference cannot hinge on rounding."""
    graph = mistral_models(case).graph
    graph.index_margins = []
    try:
        for prompt in golden.prompts(case):
            graph.forward(Batch.from_tokens(prompt, output="all"), new_cache(graph, graph.hp.n_layer))
        margins = np.asarray(graph.index_margins)
    finally:
        graph.index_margins = None
    n_ties = int((margins < TIE_GAP).sum())
    print(f"{case}: {margins.size} top-k boundaries, {n_ties} closer than {TIE_GAP}"
          + (f", smallest gap {margins.min():.3g}" if margins.size else ""))
    if graph.hp.idx_top_k < max(golden.PROMPT_LENGTHS):
        assert margins.size > 0
    assert n_ties == 0


@pytest.mark.parametrize("case", CASES)
def test_greedy_continuation_matches_reference(mistral_models, case):
    model = mistral_models(case)
    _, runs = load(case)
    for prompt, _, ref in runs:
        assert_greedy_matches(model.graph, model.hparams.n_layer, prompt, ref, f"{case}, prompt of {len(prompt)}")


@pytest.mark.ref
@pytest.mark.parametrize("case", CASES)
def test_golden_logits_are_reproducible(case, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _, runs = load(case)
    assert_record_reproduces(golden.reference(case, tmp_path, with_greedy=False), runs, atol=1e-5)


@pytest.mark.ref
def test_golden_greedy_is_reproducible(tmp_path):
    """The 7-token prompt's greedy continuation of the issue case, recomputed live."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    ref = golden.hf_reference(golden.write_hf_folder("issue", tmp_path / "hf"))
    _, runs = load("issue")
    prompt, _, greedy_ref = runs[1]
    assert greedy_full(ref, prompt, len(greedy_ref)) == greedy_ref


@pytest.mark.ref
def test_folder_saved_by_transformers_converts_and_matches(tmp_path):
    """transformers' own save_pretrained output (its names, its handling of every tensor) goes through
    plinth convert and gives the reference's logits."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")

    ref = golden.hf_reference(golden.write_hf_folder("issue", tmp_path / "numpy-hf"))
    saved = tmp_path / "saved-by-transformers"
    ref.model.save_pretrained(saved)
    assert_converted_matches(saved, ref, golden.prompts("issue"), golden.registry(), tmp_path / "m.gguf", LOGIT_ATOL)

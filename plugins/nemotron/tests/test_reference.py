"""Accuracy of Nemotron-H against Hugging Face transformers' NemotronH.

``golden/<case>.npz`` holds, for a tiny random model of each case (Mamba-2 only; Mamba-2 +
attention + MLP; MoE; LatentMoE mixed with MLP; Puzzle per-layer experts), the reference's
all-position logits for prompts of 1, 7 and 64 tokens and its 32-token greedy continuation
of each (``golden/make_golden.py``). Here the same weights are written as an HF folder,
converted by plinth's converter, loaded through the plugin, and compared. The default run
needs no torch; the ``ref`` tests recompute the reference live, and convert a folder written
by transformers' own ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.testing import load_golden, load_module
from plinth.testing.golden import assert_record_is_case, plinth_models
from plinth.testing.reference import (assert_converted_matches, assert_greedy_matches, assert_logits_close,
                                      assert_record_reproduces, greedy_full)

GOLDEN = Path(__file__).resolve().parent / "golden"
LOGIT_ATOL = 1e-4


golden = load_module(GOLDEN / "make_golden.py")
CASES = sorted(golden.CASES)


def load(case):
    return load_golden(GOLDEN / f"{case}.npz")



@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return plinth_models(golden, tmp_path_factory.mktemp("nemotron-golden"))


@pytest.mark.parametrize("case", CASES)
def test_golden_file_matches_this_case(case):
    info, runs = load(case)
    assert_record_is_case(info, runs, golden, case, keys=("seed", "prompt_seed", "arch"))


@pytest.mark.parametrize("case", CASES)
def test_converted_model_has_the_configured_pattern(models, case):
    model = models[case]
    assert model.arch == golden.CASES[case]["arch"]
    kinds = golden.layer_kinds(golden.CASES[case]["config"])
    assert [model.hparams.mixer(i) for i in range(model.hparams.n_layer)] == kinds


@pytest.mark.parametrize("case", CASES)
def test_logits_match_reference(models, case):
    model = models[case]
    _, runs = load(case)
    for prompt, ref, _ in runs:
        assert_logits_close(model.logits(prompt), ref, LOGIT_ATOL, f"{case}, prompt of {len(prompt)}")


@pytest.mark.parametrize("case", CASES)
def test_greedy_continuation_matches_reference(models, case):
    model = models[case]
    _, runs = load(case)
    for prompt, _, ref in runs:
        assert_greedy_matches(model.graph, model.hparams.n_layer, prompt, ref, f"{case}, prompt of {len(prompt)}")


def test_puzzle_case_is_heterogeneous(models):
    """The Puzzle file really has per-layer expert widths and top-k (not a uniform model in disguise)."""
    hp = models["puzzle"].hparams
    moe = [il for il in range(hp.n_layer) if hp.mixer(il) == "moe"]
    assert [hp.n_expert_used(il) for il in moe] == [2, 4, 1]
    assert [hp.n_ff_exp(il) for il in moe] == [24, 40, 16]
    assert [hp.n_ff_shexp[il] for il in moe] == [48, 32, 48]
    assert hp.n_head_kv[2] == 1
    md = models["puzzle"].metadata
    assert isinstance(md["nemotron_h_moe.expert_used_count"], (list, np.ndarray))


@pytest.mark.ref
@pytest.mark.parametrize("case", CASES)
def test_golden_logits_are_reproducible(case, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _, runs = load(case)
    assert_record_reproduces(golden.reference(case, tmp_path, with_greedy=False), runs, atol=1e-5)


@pytest.mark.ref
@pytest.mark.slow
@pytest.mark.parametrize("case", ["hybrid"])
def test_golden_greedy_is_reproducible(case, tmp_path):
    """The shortest prompt's greedy continuation, recomputed live (the others only by make_golden.py)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    ref = golden.reference_model(case, golden.write_hf_folder(case, tmp_path / "hf"))
    _, runs = load(case)
    prompt, _, greedy_ref = runs[0]
    assert greedy_full(ref, prompt, len(greedy_ref)) == greedy_ref


@pytest.mark.ref
@pytest.mark.parametrize("case", ["hybrid", "latent"])
def test_folder_saved_by_transformers_converts_and_matches(case, tmp_path):
    """transformers' own save_pretrained output (its names, its dtype handling) goes through plinth convert."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")

    ref = golden.hf_reference(golden.write_hf_folder(case, tmp_path / "numpy-hf"))
    saved = tmp_path / "saved-by-transformers"
    ref.model.save_pretrained(saved)
    assert_converted_matches(saved, ref, golden.prompts(case), golden.registry(), tmp_path / "m.gguf", LOGIT_ATOL,
                             case)
    assert torch is not None


def test_bolt_case_is_heterogeneous_and_info_shows_it(models, capsys):
    """The Bolt-style file: per-layer top-k, widths, latent sizes, shared widths and KV heads, and an MTP head."""
    from plinth.cli import main

    hp = models["bolt"].hparams
    moe = [il for il in range(hp.n_layer) if hp.mixer(il) == "moe"]
    assert [hp.n_expert_used(il) for il in moe] == [3, 1, 5]
    assert [hp.n_ff_exp(il) for il in moe] == [24, 40, 16]
    assert [hp.moe_latent[il] for il in moe] == [24, 32, 0]
    assert [hp.n_head_kv[il] for il in (2, 6)] == [4, 1]
    assert hp.pattern == "ME*-EM*E" and hp.mtp_pattern == "*E" and hp.n_expert_used(hp.n_layer) == 2
    capsys.readouterr()
    assert main(["--plugins", "nemotron", "info", "-m", str(models["bolt"].path)]) == 0
    out = capsys.readouterr().out
    assert "mtp_pattern      *E" in out and "n_expert_used_arr (0, 3, 0, 0, 1, 0, 0, 5, 2)" in out

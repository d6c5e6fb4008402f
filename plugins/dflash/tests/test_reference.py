"""Draft logits and drafted tokens against the authors' torch reference (PyPI ``dflash``, z-lab).

The golden files come from ``scripts/make_golden.py``: the reference's DFlashDraftModel /
DFlash2DraftModel on tiny random weights, 5 prompts x block sizes 4, 8, 16 x 3 draft/verify
rounds. plinth replays the same rounds through its drafter contract on the GGUF that
``plinth convert`` makes of the same HF folder. The ``ref`` test runs the reference live.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).parent / "golden"
VARIANTS = ("dflash", "dflash2")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    from plinth_dflash.testkit import reference_case

    tmp = tmp_path_factory.mktemp("ref")
    return {variant: reference_case(tmp, variant) for variant in VARIANTS}


def _plinth(case):
    import plinth
    from plinth.testing import make_registry
    from plinth_dflash.drafter import make_dflash

    tgt = plinth.load_model(case["target"], registry=make_registry("llama"))
    return tgt, make_dflash(tgt, {"draft": str(case["draft"])})


def _compare(ours, theirs, where):
    assert len(ours) == len(theirs), where
    worst = 0.0
    for ri, (a, b) in enumerate(zip(ours, theirs)):
        assert a["start"] == b["start"], f"{where} round {ri}: start {a['start']} vs {b['start']}"
        d = float(np.abs(a["logits"] - b["logits"]).max())
        worst = max(worst, d)
        assert d < 1e-4, f"{where} round {ri}: draft logits differ by {d:.3g}"
        assert list(a["tokens"]) == list(b["tokens"]), f"{where} round {ri}: drafted tokens differ"
        assert a["accepted"] == b["accepted"], f"{where} round {ri}"
    return worst


@pytest.mark.parametrize("variant", VARIANTS)
def test_golden_reference_logits_and_tokens(cases, variant):
    from plinth_dflash.reference import plinth_rounds
    from plinth_dflash.testkit import REF_BLOCKS, REF_ROUNDS, reference_prompts

    g = np.load(GOLDEN / f"reference_{variant}.npz")
    tgt, dr = _plinth(cases[variant])
    prompts = reference_prompts()
    assert len(prompts) >= 5 and len(REF_BLOCKS) >= 3
    for pi, prompt in enumerate(prompts):
        assert g[f"p{pi}.prompt"].tolist() == prompt
        for b in REF_BLOCKS:
            theirs = []
            for ri in range(REF_ROUNDS):
                k = f"p{pi}.b{b}.r{ri}"
                acc, start = g[k + ".meta"].tolist()
                theirs.append({"logits": g[k + ".logits"], "tokens": g[k + ".tokens"], "accepted": acc,
                               "start": start})
            _compare(plinth_rounds(tgt, dr, prompt, b, REF_ROUNDS), theirs, f"{variant} prompt {pi} block {b}")


@pytest.mark.ref
@pytest.mark.parametrize("variant", VARIANTS)
def test_live_reference(cases, variant):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("dflash.model")
    from plinth_dflash.reference import hf_draft, hf_target, plinth_rounds, reference_rounds
    from plinth_dflash.testkit import REF_BLOCKS, reference_prompts

    tgt, dr = _plinth(cases[variant])
    ht, hd = hf_target(tgt), hf_draft(cases[variant]["hf"])
    for pi, prompt in enumerate(reference_prompts()):
        for b in REF_BLOCKS:
            _compare(plinth_rounds(tgt, dr, prompt, b, 4), reference_rounds(ht, hd, prompt, b, 4),
                     f"{variant} prompt {pi} block {b}")

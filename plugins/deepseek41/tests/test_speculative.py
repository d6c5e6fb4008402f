"""Speculative decoding on a deepseek4 target is lossless.

Compressed entries, indexer keys and the rows of unfinished blocks are recurrent state, so a
partly rejected verify batch is undone by the engine's snapshot / restore plus a replay of the
kept rows. Greedy output with the ``ngram`` drafter and the test kit's oracle and random
drafters (with and without a sampled q, verified greedily and by rejection sampling) equals
plain greedy decoding, and the target's cache afterwards (raw window keys, compressed streams,
indexer keys, partial blocks) equals plain decoding's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plinth.speculative.ngram import NgramDrafter
from plinth.testing import load_module
from plinth.testing.drafters import OracleDrafter, RandomDrafter, check_drafter_contract

golden = load_module(Path(__file__).resolve().parent / "golden" / "make_golden.py")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return golden.plinth_model("flash", tmp_path_factory.mktemp("ds4-spec"), vocab=True)


def prompts():
    p = golden.prompts("flash")
    repeat = (p[1] * 5)[:30]  # repetitive text: the ngram drafter finds matches
    return [p[2][:13], repeat]


@pytest.mark.parametrize("which", ["ngram", "oracle", "random", "random-q-rejection"])
def test_drafter_contract_on_deepseek4(target, which):
    verifier = "rejection" if which.endswith("rejection") else "greedy"
    make = {
        "ngram": lambda: NgramDrafter(n_match_min=1),
        "oracle": lambda: OracleDrafter(target, horizon=40, n_draft=6),
        "random": lambda: RandomDrafter(target.n_vocab, length=4, seed=1),
        "random-q-rejection": lambda: RandomDrafter(target.n_vocab, length=3, seed=2, with_probs=True),
    }[which]
    stats = check_drafter_contract(target, make, prompts(), max_tokens=24, n_max=5, atol=2e-5, rtol=2e-5,
                                   verifier=verifier)
    assert sum(s.n_drafts for s in stats) > 0
    if which == "oracle":
        assert all(s.n_accepted == s.n_drafted for s in stats)

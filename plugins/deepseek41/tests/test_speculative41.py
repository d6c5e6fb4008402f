"""Speculative decoding on a deepseek41 target is lossless, Engram look-back included.

The target (``engram_hc2``: Engram trigrams at layers 0 and 2, CSA layers, a hash layer) keeps
each sequence's last N-1 token ids in an ``engram_tokens`` cache kind; a partly rejected verify
batch is undone by snapshot / restore plus a replay of the kept rows. Greedy output with the
``ngram`` drafter and the test kit's oracle and random drafters (with and without a sampled q,
verified greedily and by rejection sampling) equals plain greedy decoding, and the target's cache
afterwards (Engram history, raw keys, compressed streams) equals plain decoding's. The ``faulty``
drafter is the target's own continuation with one wrong token at a moving position, so rounds
roll back rows (every accept length) whose Engram look-back the next round must not see.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plinth.speculative.ngram import NgramDrafter
from plinth.testing import load_module
from plinth.testing.drafters import FaultyOracleDrafter, OracleDrafter, RandomDrafter, check_drafter_contract

g41 = load_module(Path(__file__).resolve().parent / "golden" / "make_golden41.py")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return g41.plinth_model("engram_hc2", tmp_path_factory.mktemp("ds41-spec"), vocab=True)


def prompts():
    p = g41.prompts("engram_hc2")
    return [p[2][:13], (p[1] * 5)[:30]]  # the second repeats: the ngram drafter finds matches


@pytest.mark.parametrize("which", ["ngram", "oracle", "faulty", "random", "random-q-rejection"])
def test_drafter_contract_on_deepseek41(target, which):
    verifier = "rejection" if which.endswith("rejection") else "greedy"
    make = {
        "ngram": lambda: NgramDrafter(n_match_min=1),
        "oracle": lambda: OracleDrafter(target, horizon=40, n_draft=6),
        "faulty": lambda: FaultyOracleDrafter(target, horizon=40, n_draft=6),
        "random": lambda: RandomDrafter(target.n_vocab, length=4, seed=1),
        "random-q-rejection": lambda: RandomDrafter(target.n_vocab, length=3, seed=2, with_probs=True),
    }[which]
    stats = check_drafter_contract(target, make, prompts(), max_tokens=24, n_max=5, atol=2e-5, rtol=2e-5,
                                   verifier=verifier)
    assert sum(s.n_drafts for s in stats) > 0
    if which == "oracle":
        assert all(s.n_accepted == s.n_drafted for s in stats)
    if which == "faulty":
        assert all(0 < s.n_accepted < s.n_drafted for s in stats)

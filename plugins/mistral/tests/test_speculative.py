"""Speculative decoding on a Mistral Large 4 target is lossless.

Rejected draft rows are cut from every cache layer (latent rows, indexer keys) at once, so the
cache after speculation equals plain decoding's. Greedy output with the ``ngram`` drafter, the
test kit's oracle drafter, an oracle that errs at a moving position (every accept length occurs)
and random drafters (greedy and rejection verification) is identical to plain greedy decoding
(:func:`plinth.testing.drafters.check_drafter_contract`). The indexer's top-k (5) is below the
verify batches' key counts, so the sparse selection is exercised on every verify step.
"""

from __future__ import annotations

import numpy as np
import pytest

from plinth.speculative.ngram import NgramDrafter
from plinth.testing.drafters import (FaultyOracleDrafter, OracleDrafter, RandomDrafter, RecordedDrafter,
                                     check_drafter_contract)

N_MAX = 5
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def target(mistral_models, with_byte_vocab, tmp_path_factory):
    """The issue case with a byte-level vocabulary added (the generation loop needs a tokenizer)."""
    from plinth.model import load_model

    path = with_byte_vocab(mistral_models("issue").path, tmp_path_factory.mktemp("spec") / "issue-vocab.gguf")
    return load_model(path, registry=src_registry())


def src_registry():
    from plinth.testing import make_registry
    from plinth_mistral.plugin import plugin

    return make_registry(plugin)


def prompts():
    rng = np.random.default_rng(17)
    motif = rng.permutation(256)[:5].tolist()
    return [motif * 4 + [motif[0]], rng.permutation(256)[:11].tolist()]


def run_contract(target, factory, verifier="greedy"):
    made = []

    def make():
        made.append(RecordedDrafter(factory()))
        return made[-1]

    stats = check_drafter_contract(target, make, prompts(), max_tokens=MAX_TOKENS, n_max=N_MAX, verifier=verifier,
                                   atol=2e-5)
    return stats, [s for d in made for s in d.steps]


def test_ngram_drafter_is_lossless(target):
    stats, steps = run_contract(target, lambda: NgramDrafter(n_match_max=3, n_match_min=1, n_draft=N_MAX))
    assert sum(s.n_drafts for s in stats) > 0 and steps


def test_oracle_drafter_is_lossless_and_fully_accepted(target):
    stats, steps = run_contract(target, lambda: OracleDrafter(target, horizon=MAX_TOKENS + 8, n_draft=N_MAX))
    assert steps and all(a == k for k, a in steps)


def test_faulty_oracle_exercises_every_accept_length(target):
    _, steps = run_contract(target, lambda: FaultyOracleDrafter(target, horizon=MAX_TOKENS + 8, n_draft=N_MAX))
    assert {0, 1, 2, 3, 4, N_MAX} <= {a for k, a in steps if k == N_MAX}, steps


@pytest.mark.parametrize("verifier", ["greedy", "rejection"])
def test_random_drafter_rejections_are_lossless(target, verifier):
    _, steps = run_contract(target, lambda: RandomDrafter(target.n_vocab, length=3, seed=1,
                                                          with_probs=verifier == "rejection"), verifier)
    assert steps and sum(a for _, a in steps) < sum(k for k, _ in steps)

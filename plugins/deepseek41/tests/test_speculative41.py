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


def test_mtp_drafter_is_lossless_on_deepseek41(tmp_path):
    """A deepseek41 file with a random MTP block (run as V4's block: an assumption, see the README):
    the ``mtp`` drafter's greedy output equals plain decoding and the target's cache matches."""
    import plinth
    from plinth.testing import byte_vocab, random_tensors
    from plinth_deepseek41.deepseek41 import load_hparams, tensor_specs
    from plinth_deepseek41.mtp import MtpDrafter

    reg = g41.v4.registry()
    md, tensors, forced = g41.deepseek41_parts("engram_hc2", tmp_path, reg)
    md.update(byte_vocab())
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"][:256]
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"][:256]
    del md["tokenizer.ggml.eos_token_id"]
    md["deepseek41.nextn_predict_layers"] = 1
    # plinth's combined layout: the ratios cover the MTP layer (block_count stays the trunk)
    md["deepseek41.attention.compress_ratios"] = [int(r) for r in md["deepseek41.attention.compress_ratios"]] + [0]
    hp = load_hparams(md, "mtp.gguf")
    extra = random_tensors([s for s in tensor_specs(hp) if s.name.startswith(f"blk.{hp.n_layer}.")], seed=9,
                           scale=0.3)
    target = plinth.load_model(g41.write_file(tmp_path / "mtp.gguf", md, {**tensors, **extra}, forced), registry=reg)
    assert target.graph.n_mtp == 1
    stats = check_drafter_contract(target, lambda: MtpDrafter(target, n_draft=3), prompts(), max_tokens=20, n_max=3,
                                   atol=2e-5, rtol=2e-5)
    assert sum(s.n_drafts for s in stats) > 0

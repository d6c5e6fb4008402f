"""DFlash feature extraction from mimo2's layers: the taps (input of layer k, k = n_layer the residual before
the final norm) feed random block drafts (DFlash, DFlash2, LiLiCorr, DSpark) whose greedy output equals
plain greedy decoding, on the numpy and strict backends (the drafter test kit's contract: output and the
target's cache after rollback)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.testing import CONTRACT_BACKENDS, byte_vocab, load_module, make_registry, write_synthetic_gguf
from plinth_mimo.convert import gguf_metadata

cases = load_module(Path(__file__).resolve().parent / "mimo_cases.py")
PROMPTS = [[3, 17, 42, 8, 23, 3, 17, 42, 8], [60, 2, 2, 2, 9, 31, 77, 4, 50, 12, 1]]


@pytest.fixture(scope="module")
def target_file(tmp_path_factory):
    md = gguf_metadata(dict(cases.CASES["release"]["config"], vocab_size=257), "release") | byte_vocab()
    path = tmp_path_factory.mktemp("mimo") / "mimo2.gguf"
    return write_synthetic_gguf(path, "mimo2", md, make_registry("mimo"), seed=4, scale=0.2)


def test_taps_are_the_layer_inputs(target_file):
    import plinth

    model = plinth.load_model(target_file, registry=make_registry("mimo"))
    n = model.hparams.n_layer
    ctx = model.new_context(taps=(1, 3, n))
    out = ctx.decode(PROMPTS[0], output="all")
    assert sorted(out.features) == [1, 3, n]
    # a model cut after layer 3 (a pipeline stage) returns the residual that tap 3 holds
    stage = model.graph.forward_stage(plinth.graph.Batch.from_tokens(PROMPTS[0], output="all"),
                                      model.new_context().cache, None, 0, 3)
    np.testing.assert_array_equal(stage, out.features[3])


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
def test_random_dflash_draft_is_lossless(target_file, tmp_path, backend):
    import plinth
    from plinth.testing.drafters import check_drafter_contract
    from plinth_dflash.drafter import make_dflash
    from plinth_dflash.testkit import write_tiny_draft

    model = plinth.load_model(target_file, registry=make_registry("mimo", "dflash"), backend=backend)
    draft = str(write_tiny_draft(tmp_path / "draft.gguf", "dflash", n_embd=64, n_vocab=257, taps=(1, 3, 4),
                                 block_size=6))
    stats = check_drafter_contract(model, lambda: make_dflash(model, {"draft": draft}), PROMPTS, max_tokens=20,
                                   n_max=5)
    assert all(s.n_drafts > 0 for s in stats)


@pytest.mark.parametrize("variant", ["dflash2", "lilicorr", "dspark"])
def test_every_block_drafter_is_lossless(target_file, tmp_path, variant):
    import plinth
    from plinth.testing.drafters import check_drafter_contract

    model = plinth.load_model(target_file, registry=make_registry("mimo", "dflash", "dspark"))
    if variant == "dspark":
        from plinth_dspark.drafter import make_dspark as make
        from plinth_dspark.testkit import write_tiny_dspark

        draft = write_tiny_dspark(tmp_path / "d.gguf", n_embd=64, n_vocab=257, mask_token=255, taps=(2, 4),
                                  block_size=6)
    else:
        from plinth_dflash.drafter import make_dflash as make
        from plinth_dflash.testkit import write_tiny_draft

        draft = write_tiny_draft(tmp_path / "d.gguf", variant, n_embd=64, n_vocab=257, taps=(2, 4), block_size=6,
                                 causal=variant == "lilicorr" or None)
    stats = check_drafter_contract(model, lambda: make(model, {"draft": str(draft)}), PROMPTS, max_tokens=16,
                                   n_max=5)
    assert all(s.n_drafts > 0 for s in stats)

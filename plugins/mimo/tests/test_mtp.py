"""MiMo's MTP blocks as the ``mtp`` drafter (no torch): a tiny random target whose file carries one MTP block
drafts losslessly on the numpy and strict backends (the drafter contract: greedy output equal to plain
decoding, the target's cache after rollback equal to plain decoding's); a target without MTP blocks is
refused in one line before any compute; half an MTP block is refused by name. (The block's numbers
against transformers' own decoder layer: test_reference.py, ``ref``.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import plinth
from plinth.testing import CONTRACT_BACKENDS, byte_vocab, load_module, make_registry, write_gguf, write_synthetic_gguf
from plinth_mimo.convert import gguf_metadata
from plinth_mimo.mimo2 import MiMo2

cases = load_module(Path(__file__).resolve().parent / "mimo_cases.py")
PROMPTS = [[3, 17, 42, 8, 23, 3, 17, 42, 8], [60, 2, 2, 2, 9, 31, 77, 4, 50, 12, 1]]


def metadata(n_mtp: int) -> dict:
    return gguf_metadata(dict(cases.CASES["release"]["config"], vocab_size=257), "release", n_mtp) | byte_vocab()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mimo-mtp")
    reg = make_registry("mimo")
    return {n: write_synthetic_gguf(tmp / f"mtp{n}.gguf", "mimo2", metadata(n), reg, seed=5, scale=0.3) for n in (0, 2)}


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
def test_mtp_drafter_is_lossless(files, backend):
    from plinth.testing.drafters import check_drafter_contract

    reg = make_registry("mimo")
    model = plinth.load_model(files[2], registry=reg, backend=backend)
    assert sorted(model.graph.draft_heads()) == ["mtp", "mtp.1"] and model.hparams.n_nextn == 2
    stats = check_drafter_contract(model, lambda: reg.make_drafter("mtp", model, {"n_max": 3}), PROMPTS,
                                   max_tokens=16, n_max=3)
    assert all(s.n_drafts > 0 for s in stats)


def test_target_without_mtp_blocks_is_refused(files):
    from plinth.errors import UserError

    reg = make_registry("mimo")
    model = plinth.load_model(files[0], registry=reg)
    with pytest.raises(UserError, match="drafter 'mtp': .* carries no MTP block"):
        reg.make_drafter("mtp", model, {"n_max": 3})


def test_half_an_mtp_block_is_refused(tmp_path):
    from plinth.errors import UserError

    arch = MiMo2()
    md = metadata(1)
    hp = arch.load_hparams(md, "x")
    rng = np.random.default_rng(0)
    tensors = {s.name: (0.2 * rng.standard_normal(s.shape)).astype(np.float32) for s in arch.synthetic_tensors(hp)}
    del tensors["blk.4.nextn.hnorm.weight"]
    with pytest.raises(UserError, match="missing tensor 'blk.4.nextn.hnorm.weight' \\(MTP block 4 is incomplete\\)"):
        plinth.load_model(write_gguf(tmp_path / "half.gguf", md, tensors), registry=make_registry("mimo"))

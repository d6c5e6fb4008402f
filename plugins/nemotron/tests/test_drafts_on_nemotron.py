"""DFlash / DFlash2 / LiLiCorr / DSpark drafts on Nemotron-H hybrid targets (Nemotron 3.5 style).

The drafts are plinth-dflash's and plinth-dspark's tiny random files, with Nemotron-3.5-style
per-head attention sinks (and a sliding window) in the draft backbone; the target is a hybrid
Mamba-2 + attention + MoE Nemotron-H whose recurrent state the engine snapshots and replays. Greedy
output with each draft equals plain greedy decoding and the target's cache equals plain
decoding's (the drafter contract). Skipped when those plugins are not installed. The LiLiCorr
head-id clash and the n_tokens (whole-block) condition are plinth-dflash's own tests
(``test_convert::test_lilicorr_head_ids_do_not_clash_with_backbone_blocks``,
``test_selectors`` for ``whole_blocks``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.testing import load_module

tiny = load_module(Path(__file__).resolve().parent / "tiny.py")
PROMPTS = [[3, 17, 42, 8, 23], [60, 2, 2, 2, 9, 31, 77, 4, 50, 12, 1]]
SINKS = {f"blk.{i}.attn_sinks.weight": np.full(4, 0.5 - i, dtype=np.float32) for i in range(2)}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    pytest.importorskip("plinth_dflash")
    from plinth.model import load_model
    from plinth.testing import make_registry

    reg = make_registry("nemotron")
    md = tiny.metadata("M*EM*E", vocab=True, n_embd=64, top_k=[0, 0, 2, 0, 0, 3], n_ff_exp=[0, 0, 16, 0, 0, 24])
    path = tiny.write(tmp_path_factory.mktemp("nemotron-target") / "hybrid.gguf", reg, md, seed=21)
    model = load_model(path, registry=reg)
    assert model.new_context().recurrent
    return model


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "lilicorr"])
def test_dflash_family_with_sinks_is_lossless_on_a_nemotron_target(target, tmp_path, kind):
    from plinth.testing.drafters import check_drafter_contract
    from plinth_dflash.drafter import make_dflash
    from plinth_dflash.testkit import write_tiny_draft

    path = str(write_tiny_draft(tmp_path / f"{kind}.gguf", kind, n_vocab=257, mask_token=255, taps=(1, 3, 6),
                                block_size=6, sliding_window=3, swa_pattern=[True, False], extra_tensors=SINKS))
    stats = check_drafter_contract(target, lambda: make_dflash(target, {"draft": path}), PROMPTS, max_tokens=20,
                                   n_max=5)
    assert all(s.n_drafts > 0 for s in stats)


def test_dspark_with_sinks_is_lossless_on_a_nemotron_target(target, tmp_path):
    pytest.importorskip("plinth_dspark")
    from plinth.testing.drafters import check_drafter_contract
    from plinth_dspark.drafter import make_dspark
    from plinth_dspark.testkit import write_tiny_dspark

    path = str(write_tiny_dspark(tmp_path / "dspark.gguf", n_vocab=257, mask_token=255, taps=(1, 6), block_size=6,
                                 sliding_window=3, swa_pattern=[True, False], extra_tensors=SINKS))
    stats = check_drafter_contract(target, lambda: make_dspark(target, {"draft": path}), PROMPTS, max_tokens=20,
                                   n_max=6)
    assert all(s.n_drafts > 0 for s in stats)

"""Block drafters on DeepSeek V4 / V4.1 targets, and the targets split into pipeline stages.

* Feature taps are what the seed's drafters read of a hyper-connection target: the hc-mean of the
  streams entering a layer, [n, E] (tap n_layer: the streams before the hc head); the extra tap
  ``n_layer + 1`` is the whole final streams [n, hc·E] that the MTP block reads.
* A random DFlash and a random DSpark draft (the drafters' test kits) whose backbone reads those
  taps are lossless on a tiny V4 target and a tiny V4.1 (Engram) target: greedy output identical to
  plain decoding, and the target's cache afterwards equal to plain decoding's.
* ``forward_stage`` chains (each stage its own cache, as on separate Ray actors) give the logits
  of one forward, and the in-process pipeline of tests/test_pipeline.py decodes as one process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.graph import Batch
from plinth.testing import load_module
from plinth.testing.drafters import check_drafter_contract

HERE = Path(__file__).resolve().parent
golden = load_module(HERE / "golden" / "make_golden.py")
g41 = load_module(HERE / "golden" / "make_golden41.py")


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return golden.plinth_model("flash", tmp_path_factory.mktemp("ds4-drafters"), vocab=True)


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    return g41.plinth_model("engram_hc2", tmp_path_factory.mktemp("ds41-drafters"), vocab=True)


def prompts(case="flash"):
    p = (golden if case == "flash" else g41).prompts(case)
    return [p[2][:13], (p[1] * 5)[:30]]


@pytest.mark.parametrize("which", ["v4", "v41"])
def test_taps_are_the_hc_mean_and_the_wide_tap_the_whole_streams(which, request):
    m = request.getfixturevalue(which)
    hp, g = m.hparams, m.graph
    ctx = m.new_context(taps=(0, 1, hp.n_layer, g.wide_tap))
    out = ctx.forward(Batch.from_tokens(prompts()[0], output="all"))
    n = len(prompts()[0])
    for k in (0, 1, hp.n_layer):
        assert out.features[k].shape == (n, hp.n_embd)
    wide = out.features[g.wide_tap]
    assert wide.shape == (n, hp.hc * hp.n_embd)
    np.testing.assert_array_equal(out.features[hp.n_layer], wide.reshape(n, hp.hc, hp.n_embd).mean(axis=1))
    # tap 0: every copy is the token's embedding, so the mean is the embedding itself
    np.testing.assert_allclose(out.features[0], m.weights["token_embd.weight"][prompts()[0]], atol=1e-6)


def _dflash(tmp, m, **kw):
    from plinth_dflash.testkit import write_tiny_draft

    hp = m.hparams
    return str(write_tiny_draft(tmp / "dflash.gguf", "dflash", n_vocab=hp.n_vocab, mask_token=hp.n_vocab - 1,
                                n_embd=hp.n_embd, n_head=4, n_head_kv=2, taps=(1, hp.n_layer), block_size=6, **kw))


def _dspark(tmp, m):
    from plinth_dspark.testkit import write_tiny_dspark

    hp = m.hparams
    return str(write_tiny_dspark(tmp / "dspark.gguf", n_vocab=hp.n_vocab, mask_token=hp.n_vocab - 1,
                                 n_embd=hp.n_embd, n_head=4, n_head_kv=2, taps=(1, hp.n_layer), block_size=6))


@pytest.mark.parametrize("which", ["v4", "v41"])
@pytest.mark.parametrize("drafter", ["dflash", "dspark"])
def test_block_drafters_are_lossless(which, drafter, request, tmp_path):
    from plinth_dflash.drafter import make_dflash
    from plinth_dspark.drafter import make_dspark

    m = request.getfixturevalue(which)
    path = (_dflash if drafter == "dflash" else _dspark)(tmp_path, m)
    make = make_dflash if drafter == "dflash" else make_dspark
    stats = check_drafter_contract(m, lambda: make(m, {"draft": path}), prompts("flash" if which == "v4" else
                                                                                 "engram_hc2"),
                                   max_tokens=20, n_max=5, atol=2e-5, rtol=2e-5)
    assert sum(s.n_drafts for s in stats) > 0


def test_a_draft_for_another_width_is_refused_in_one_line(v4, tmp_path):
    from plinth.testing.drafters import check_one_line_refusal
    from plinth_dflash.drafter import make_dflash
    from plinth_dflash.testkit import write_tiny_draft

    hp = v4.hparams
    path = str(write_tiny_draft(tmp_path / "wide.gguf", "dflash", n_vocab=hp.n_vocab, mask_token=hp.n_vocab - 1,
                                n_embd=hp.hc * hp.n_embd, n_head=4, n_head_kv=2, taps=(1, 2)))
    check_one_line_refusal(lambda: make_dflash(v4, {"draft": path}), "n_embd = 64", "wide.gguf")


@pytest.mark.parametrize("which", ["v4", "v41"])
def test_forward_stage_chain_equals_forward(which, request):
    m = request.getfixturevalue(which)
    g, n_layer = m.graph, m.hparams.n_layer
    ids = prompts()[1][:19]
    want = m.new_context().forward(Batch.from_tokens(ids, output="all")).logits
    for bounds in ([0, n_layer], [0, 2, n_layer], [0, 1, 2, n_layer]):
        caches = [m.new_context().cache for _ in bounds[1:]]  # each stage its own cache
        for step in (ids[:11], ids[11:14], ids[14:15], ids[15:]):  # a prompt, then decode and verify batches
            start = caches[0].next_position(0)
            x = None
            for cache, a, b in zip(caches, bounds, bounds[1:]):
                x = g.forward_stage(Batch.from_tokens(step, start=start, output="all"), cache, x, a, b)
            np.testing.assert_allclose(x.logits, want[start:start + len(step)], atol=2e-5, rtol=0)


def test_in_process_pipeline_decodes_as_one_process(v4, monkeypatch):
    from plinth.testing.pipeline import in_process_pipeline

    pm = in_process_pipeline(monkeypatch, v4.path, 2, n_layer=v4.hparams.n_layer, plugins="deepseek41")
    ids = prompts()[1][:12]
    ctx, one = pm.new_context(), v4.new_context()
    np.testing.assert_allclose(ctx.decode(ids).logits, one.decode(ids).logits, atol=2e-5, rtol=0)
    for t in (8, 120, 3):
        np.testing.assert_allclose(ctx.decode([t]).logits, one.decode([t]).logits, atol=2e-5, rtol=0)

"""The DSpark format: detection, keys, tensors, and the one-line named errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest


def test_detection_and_defaults(targets, dspark_file):
    from plinth_dspark.drafter import make_dspark

    dr = make_dspark(targets["qwen3"], {"draft": str(dspark_file(block_size=6))})
    assert dr.name == "dspark"
    assert dr.ds.sample_from_anchor and dr.ds.has_confidence_head  # missing keys mean true
    assert dr.ds.rank == 16 and dr.max_block == 6 and dr.requirements().max_draft == 6
    dr = make_dspark(targets["qwen3"], {"draft": str(dspark_file(block_size=6, sample_from_anchor=False))})
    assert dr.max_block == 5 and dr.n_max == 5


def test_plain_dflash_refers_dspark_files_here(targets, dspark_file):
    from plinth.errors import UserError
    from plinth_dflash.drafter import make_dflash

    with pytest.raises(UserError, match="plinth-dspark"):
        make_dflash(targets["qwen3"], {"draft": str(dspark_file())})


def test_dspark_refuses_plain_dflash(targets, tmp_path):
    from plinth_dflash.testkit import write_tiny_draft
    from plinth_dspark.drafter import make_dspark
    from plinth_dspark.format import DSparkFormatError

    p = write_tiny_draft(tmp_path / "d.gguf", "dflash", n_vocab=257, mask_token=255, taps=(1, 3))
    with pytest.raises(DSparkFormatError, match="not a DSpark draft"):
        make_dspark(targets["qwen3"], {"draft": str(p)})


def one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_markov_w1_rows_must_be_the_target_vocabulary(targets, dspark_file):
    from plinth_dspark.drafter import make_dspark
    from plinth_dspark.format import DSparkFormatError

    bad = np.zeros((200, 16), dtype=np.float32)
    with pytest.raises(DSparkFormatError) as exc:
        make_dspark(targets["qwen3"], {"draft": str(dspark_file(extra_tensors={"markov_w1.weight": bad}))})
    assert "'markov_w1.weight' has 200 rows, the target's vocabulary 257" in one_line(exc)


def test_d2t_out_of_range(targets, dspark_file):
    from plinth_dspark.drafter import make_dspark
    from plinth_dspark.format import DSparkFormatError

    d2t = np.arange(64, dtype=np.int64)
    d2t[5] = 999
    with pytest.raises(DSparkFormatError) as exc:
        make_dspark(targets["qwen3"], {"draft": str(dspark_file(draft_vocab=64, extra_tensors={"d2t": d2t}))})
    assert "'d2t' maps draft id 5 to 999, outside the target's vocabulary 0..256" in one_line(exc)


def test_unequal_blocks_are_refused_and_long_blocks_skip_the_head():
    from plinth_dspark.heads import BlockShapeError, markov_chain

    rng = np.random.default_rng(0)
    z, h = rng.standard_normal((7, 10)).astype(np.float32), rng.standard_normal((7, 4)).astype(np.float32)
    w1, w2 = rng.standard_normal((10, 3)), rng.standard_normal((10, 3))
    with pytest.raises(BlockShapeError) as exc:
        markov_chain(z, h, [1, 2], 2, w1=w1, w2=w2, xp=np)
    assert "7 rows do not split into 2 equal blocks" in one_line(exc)
    out = markov_chain(z, h, [1], 1, w1=w1, w2=w2, max_block=4, xp=np)  # 7 > trained block 4: no bias
    np.testing.assert_array_equal(out.logits[0], z)


def test_markov_chain_vectorised_over_blocks_matches_the_formula():
    """Two blocks at once equal two single-block chains, and each row is Z + w2 . w1[prev] with the greedy prev."""
    from plinth_dspark.heads import markov_chain

    rng = np.random.default_rng(1)
    v, vd, r, e, b = 30, 12, 4, 6, 5
    d2t = np.sort(rng.choice(v, vd, replace=False))
    w1, w2 = rng.standard_normal((v, r)), rng.standard_normal((vd, r))
    cw, cb = rng.standard_normal((1, e + r)), np.array([0.3])
    z, h = rng.standard_normal((2 * b, vd)), rng.standard_normal((2 * b, e))
    both = markov_chain(z, h, [3, 7], 2, w1=w1, w2=w2, d2t=d2t, conf_w=cw, conf_b=cb, first_row=1, xp=np)
    for j, anchor in enumerate((3, 7)):
        one = markov_chain(z[j * b:(j + 1) * b], h[j * b:(j + 1) * b], [anchor], 1, w1=w1, w2=w2, d2t=d2t,
                           conf_w=cw, conf_b=cb, first_row=1, xp=np)
        np.testing.assert_allclose(both.logits[j], one.logits[0])
        np.testing.assert_array_equal(both.tokens[j], one.tokens[0])
        prev = anchor
        for i in range(b - 1):
            row = z[j * b + 1 + i] + w2 @ w1[prev]
            np.testing.assert_allclose(one.logits[0, i], row, rtol=1e-12)
            c = 1 / (1 + np.exp(-(cw[0] @ np.concatenate([h[j * b + 1 + i], w1[prev]]) + cb[0])))
            np.testing.assert_allclose(one.conf[0, i], c, rtol=1e-12)
            prev = int(d2t[np.argmax(row)])
            assert one.tokens[0, i] == prev


@pytest.mark.parametrize("bias", [0.1, 3.0, 30.0])
def test_host_chain_equals_the_fixed_point_rounds(monkeypatch, bias):
    """The compiled row-after-row chain (numpy, float32) and the fixed-point rounds a device runs give the same
    tokens and (to float32 rounding) the same logits; a larger bias makes the Markov term flip more guesses."""
    import plinth_dspark.heads as heads

    rng = np.random.default_rng(int(bias * 10))
    v, vd, r, e, b, nb = 300, 120, 16, 24, 8, 3
    d2t = rng.choice(v, vd, replace=False)
    w1 = rng.standard_normal((v, r)).astype(np.float32)
    w2 = (bias * rng.standard_normal((vd, r))).astype(np.float32)
    cw, cb = rng.standard_normal((1, e + r)).astype(np.float32), np.array([0.3], np.float32)
    z, h = rng.standard_normal((nb * b, vd)).astype(np.float32), rng.standard_normal((nb * b, e)).astype(np.float32)
    z[2, 7] = z[2, 9] = 50.0  # a tie: the first index wins on both paths

    def run(anchors, d2t, w2t=None):
        return heads.markov_chain(z, h, anchors, nb, w1=w1, w2=w2, d2t=d2t, conf_w=cw, conf_b=cb, first_row=1,
                                  xp=np, w2t=w2t)

    assert heads._host(np, z, w1, w2)
    host = [run([3, 7, 11], d2t), run([3, 7, 11], d2t, heads.transposed_w2(w2, np)), run([1, 2, 3], None)]
    monkeypatch.setattr(heads, "_host", lambda *a: False)
    rounds = [run([3, 7, 11], d2t), run([3, 7, 11], d2t), run([1, 2, 3], None)]
    for a, c in zip(host, rounds):
        np.testing.assert_array_equal(a.tokens, c.tokens)
        np.testing.assert_allclose(a.logits, c.logits, rtol=1e-5, atol=1e-6 * float(np.abs(c.logits).max()))
        np.testing.assert_allclose(a.conf, c.conf, rtol=1e-5)
        np.testing.assert_array_equal(a.prev_emb, c.prev_emb)


def test_host_chain_argmax_is_numpys():
    """Ties go to the first index and a NaN wins, as numpy's argmax decides (the chain's next prev too)."""
    from plinth_dspark.heads import markov_chain

    w1 = np.zeros((6, 2), np.float32)
    w2 = np.zeros((6, 2), np.float32)
    z = np.array([[0, 2, 2, 1, 0, 0], [0, 1, np.nan, 3, np.nan, 0], [5, 0, 0, 0, 0, 0]], np.float32)
    w1[2] = [1, 0]  # prev 2 (row 0's tied second maximum) would add 4 to column 5 of row 1; prev 1 adds nothing
    w2[5] = [4, 0]
    out = markov_chain(z, np.zeros((3, 1), np.float32), [0], 1, w1=w1, w2=w2, xp=np)
    assert out.tokens[0].tolist() == [1, 2, 0]
    assert out.logits[0, 1, 5] == 0.0  # prev of row 1 is row 0's first maximum (1), not the tied 2


def test_no_confidence_head_with_p_min_is_refused(targets, dspark_file):
    from plinth_dspark.drafter import make_dspark
    from plinth_dspark.format import DSparkFormatError

    path = str(dspark_file(conf=False, has_confidence_head=False))
    make_dspark(targets["qwen3"], {"draft": path})
    with pytest.raises(DSparkFormatError) as exc:
        make_dspark(targets["qwen3"], {"draft": path, "p_min": 0.5})
    assert "set --spec-p-min 0" in one_line(exc)
    # a declared head that the file lacks is a named error too
    with pytest.raises(DSparkFormatError, match="has_confidence_head"):
        make_dspark(targets["qwen3"], {"draft": str(dspark_file(conf=False))})


def test_w2_scale_is_folded_in(targets, dspark_file):
    """markov_w2 stored as w2 / s with markov_w2.scale = s drafts exactly like the unscaled file."""
    from plinth_dspark.drafter import make_dspark
    from plinth.speculative.base import TargetOutput

    outs = []
    for scale in (None, 3.0):
        dr = make_dspark(targets["qwen3"], {"draft": str(dspark_file(w2_scale=scale, seed=4))})
        f = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
        dr.process(TargetOutput(seq=0, phase="prefill", tokens=np.arange(5), positions=np.arange(5),
                                features={1: f, 3: f}))
        outs.append(dr.block_outputs(0, 7, 5, 6))
    np.testing.assert_allclose(outs[0]["logits"], outs[1]["logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(outs[0]["tokens"], outs[1]["tokens"])


def test_anchor_first_row_zero_predicts(targets, dspark_file):
    """Anchor-first: n drafts from a block of n rows (row 0 is a prediction); 1+N: n + 1 rows, row 0 skipped."""
    from plinth_dspark.drafter import make_dspark

    calls = []
    for anchor_first in (True, False):
        dr = make_dspark(targets["qwen3"], {"draft": str(dspark_file(sample_from_anchor=anchor_first))})
        real = dr.block_hidden

        def spy(seq, anchor, pos, n, real=real):
            calls.append(n + 1)
            return real(seq, anchor, pos, n)

        dr.block_hidden = spy
        d = dr.draft(0, 5, history=[1, 2, 3], pos=3)
        assert len(d) == 5
    assert calls == [5, 6]


def test_backbone_sinks_and_sliding_layers_change_the_draft(targets, dspark_file):
    """The DSpark draft runs plinth-dflash's backbone as is: per-head sinks and sliding-window layers are read
    and used (the logits move when they are present)."""
    from plinth.speculative.base import TargetOutput
    from plinth_dspark.drafter import make_dspark

    f = np.random.default_rng(0).standard_normal((9, 64)).astype(np.float32)
    sinks = {f"blk.{i}.attn_sinks.weight": np.full(4, 1.5, dtype=np.float32) for i in range(2)}
    outs = []
    for kw in ({}, {"extra_tensors": sinks}, {"sliding_window": 3, "swa_pattern": [True, False]}):
        dr = make_dspark(targets["qwen3"], {"draft": str(dspark_file(seed=2, **kw))})
        dr.process(TargetOutput(seq=0, phase="prefill", tokens=np.arange(9), positions=np.arange(9),
                                features={1: f, 3: f}))
        outs.append(dr.block_outputs(0, 7, 9, 5)["logits"])
    assert not np.allclose(outs[0], outs[1]) and not np.allclose(outs[0], outs[2])


def test_plinth_info_says_dflash_draft_with_dspark_heads(dspark_file):
    """`plinth info` in a subprocess: the DSpark heads are found by 'markov_w1.weight' and described by plinth-dspark."""
    import subprocess
    import sys

    path = dspark_file(rank=8, draft_vocab=100, sample_from_anchor=False)
    cmd = [sys.executable, "-m", "plinth", "info", "-m", str(path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "drafter          dflash draft with DSpark heads\n" in out
    assert "described by plugin 'dspark'" in out
    assert "markov_rank      8\n" in out
    assert "confidence_head  yes, sees the hidden state and the Markov embedding" in out
    assert "reduced_vocab    yes, d2t: 100 draft ids of 257 target ids" in out
    assert "sample_from_anchor false" in out and "target_layers    [1, 3]" in out


def test_plinth_info_dspark_without_confidence_head_full_vocab(dspark_file, capsys):
    from plinth.cli import main

    path = dspark_file(conf=False, has_confidence_head=False)
    assert main(["--plugins", "dflash,dspark", "info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "dflash draft with DSpark heads" in out
    assert "confidence_head  no\n" in out and "reduced_vocab    no (full vocabulary, 257)" in out
    assert "sample_from_anchor true" in out


def test_every_misfit_is_one_named_line(tmp_path, targets, dspark_file):
    """DSpark drafts on targets they do not fit: one line naming the draft file, before any draft compute."""
    from plinth.speculative.base import TargetOutput
    from plinth.testing.drafters import check_one_line_refusal
    from plinth_dflash.testkit import tiny_target
    from plinth_dspark.drafter import make_dspark

    t = targets["qwen3"]
    t48 = tiny_target(tmp_path / "t48.gguf", "qwen3", n_embd=48, n_layer=3)
    for target, kw, match in ((t48, {}, "n_embd = 48"),
                              (t, dict(taps=(2, 7)), r"taps \[7\] outside"),
                              (t, dict(n_vocab=300, mask_token=5), "'markov_w1.weight' has 300 rows"),
                              (t, dict(mask_token=300, n_vocab=257), "mask token 300 is outside")):
        path = dspark_file(**kw)
        check_one_line_refusal(lambda: make_dspark(target, {"draft": str(path)}), match, path.name)
    dr = make_dspark(t, {"draft": str(dspark_file())})
    wide = TargetOutput(seq=0, phase="prefill", tokens=np.arange(3), positions=np.arange(3),
                        features={1: np.zeros((3, 64), np.float32), 3: np.zeros((3, 256), np.float32)})
    check_one_line_refusal(lambda: dr.process(wide), r"tap 3 as rows of shape \[3, 256\]", "dspark")

"""DFlash2 convolution, lattice and walk; LiLiCorr candidates, features, biases, scores and walk (checklist 23-31)."""

from __future__ import annotations

import numpy as np
import pytest

from plinth_dflash.graph import block_conv
from plinth_dflash.selector import (candidate_features, dflash2_lattice, lattice_walk, lilicorr_candidates,
                                    lilicorr_scores, lilicorr_walk, slot_bias, whole_blocks)

rng = np.random.default_rng(0)


def naive_conv(x, dyn, base, side, b, gs):
    n, e = x.shape
    kc = base.shape[1]
    g = e // gs
    d = dyn.reshape(n, 2, kc, g)
    y = np.zeros_like(x)
    for t in range(n):
        for k in range(kc):
            if t % b < k:  # zero left padding inside the block
                continue
            for c in range(e):
                y[t, c] += (d[t, side, k, c // gs] + base[side, k, c]) * x[t - k, c]
    return y


# 23. coefficient indexing (side, tap, group); zero left padding; taps >= b skipped
@pytest.mark.parametrize("b, kc", [(4, 2), (3, 3), (2, 5), (1, 3)])
def test_block_conv_matches_the_formula(b, kc):
    e, gs, n_blocks = 16, 4, 2
    x = rng.standard_normal((b * n_blocks, e)).astype(np.float32)
    dyn = rng.standard_normal((b * n_blocks, 2 * kc * (e // gs))).astype(np.float32)
    base = rng.standard_normal((2, kc, e)).astype(np.float32)
    for side in (0, 1):
        np.testing.assert_allclose(block_conv(x, dyn, base, side, b, gs), naive_conv(x, dyn, base, side, b, gs),
                                   atol=1e-5)
    if b == 1:  # a single-row block: only tap 0 contributes
        d = dyn.reshape(n_blocks, 2, kc, e // gs)
        np.testing.assert_allclose(block_conv(x, dyn, base, 0, 1, gs),
                                   (np.repeat(d[:, 0, 0], gs, 1) + base[0, 0]) * x, atol=1e-6)


# 24. the dynamic coefficients of the normed input serve the output side too
def test_dynamic_coefficients_are_shared_by_both_sides(drafter, targets, monkeypatch):
    import plinth_dflash.graph as graph

    from .test_drafter import prefill

    dr = drafter("dflash2")
    prefill(dr, targets["qwen3"])
    seen = []
    real = graph.block_conv

    def spy(x, dyn, base, side, b, gs):
        seen.append((id(dyn), id(base), side))
        return real(x, dyn, base, side, b, gs)

    monkeypatch.setattr(graph, "block_conv", spy)
    dr.draft_logits(0, 9, 8, 4)
    assert len(seen) == 4 * dr.hp.n_layer
    for i in range(0, len(seen), 2):
        assert seen[i][0] == seen[i + 1][0] and seen[i][1] == seen[i + 1][1]
        assert (seen[i][2], seen[i + 1][2]) == (0, 1)


# 25. logit scale and soft-cap only for DFlash2
def test_logit_scale_and_softcap_only_for_dflash2(drafter, targets):
    from .test_drafter import prefill

    for variant in ("dflash", "dflash2"):
        a = drafter(variant, seed=8)
        b = drafter(variant, seed=8, logit_scale=2.0, softcap=3.0)
        for d in (a, b):
            prefill(d, targets["qwen3"])
        la, lb = a.draft_logits(0, 9, 8, 4), b.draft_logits(0, 9, 8, 4)
        if variant == "dflash":
            np.testing.assert_allclose(lb, la, atol=1e-6)
        else:
            np.testing.assert_allclose(lb, 3.0 * np.tanh(2.0 * la / 3.0), atol=1e-5)


def _selector_weights(v=20, r=3, e=24):
    return {"selector_predecessor.weight": rng.standard_normal((v, r)).astype(np.float32),
            "selector_successor.weight": rng.standard_normal((v, r)).astype(np.float32),
            "selector_hidden.weight": rng.standard_normal((r, e)).astype(np.float32)}


# 26. lattice packing [K ids | K*K scores q-major | pad]; row 0 zero; position 1 has the anchor as sole predecessor
def test_lattice_packing():
    k, b, e, v = 3, 5, 24, 20
    w = _selector_weights(v, 3, e)
    hidden = rng.standard_normal((b, e)).astype(np.float32)
    logits = rng.standard_normal((b, v)).astype(np.float32)
    anchor = 7
    lat = dflash2_lattice(hidden, logits, [anchor], w, k)
    assert lat.shape == (b, e) and not lat[0].any() and not lat[1:, k + k * k:].any()
    gate = hidden @ w["selector_hidden.weight"].T
    prev = None
    for p in range(1, b):
        cand = np.argsort(-logits[p], kind="stable")[:k]
        assert lat[p, :k].tolist() == cand.astype(np.float32).tolist()
        preds = [anchor] * k if p == 1 else prev
        s = lat[p, k:k + k * k].reshape(k, k)
        for q in range(k):
            for c in range(k):
                want = np.sum(w["selector_successor.weight"][cand[c]] * w["selector_predecessor.weight"][preds[q]]
                              * gate[p]) + logits[p, cand[c]]
                assert abs(s[q, c] - want) < 1e-4
        if p == 1:
            assert np.all(s == s[0])
        prev = cand
    with pytest.raises(ValueError, match="cannot hold"):
        dflash2_lattice(hidden[:, :10], logits, [anchor], {**w, "selector_hidden.weight": w["selector_hidden.weight"][:, :10]}, 3)


# 27. walk: first maximum (lower index on ties), indexed by the previous candidate index; p_min on the row softmax
def test_lattice_walk_by_hand():
    k, e = 2, 8
    lat = np.zeros((4, e), np.float32)
    lat[1, :2] = [10, 11]
    lat[1, 2:6] = [1.0, 1.0, 1.0, 1.0]  # tie: index 0 (token 10)
    lat[2, :2] = [20, 21]
    lat[2, 2:6] = [5.0, 0.0, 0.0, 9.0]  # q=0 row -> [5, 0] picks index 0
    lat[3, :2] = [30, 31]
    lat[3, 2:6] = [0.0, 2.0, 7.0, 7.0]  # q=0 row -> [0, 2] picks index 1
    toks, conf = lattice_walk(lat, k, 4)
    assert toks == [10, 20, 31]
    assert conf[0] == pytest.approx(0.5) and conf[1] == pytest.approx(1 / (1 + np.exp(-5.0)))
    assert lattice_walk(lat, k, 4, p_min=0.6)[0] == []
    assert lattice_walk(lat, k, 4, p_min=0.5)[0] == [10, 20, 31]


# 28. candidate log-probs normalised over the full vocabulary
def test_lilicorr_candidates_use_the_full_vocabulary():
    hidden = rng.standard_normal((3, 8)).astype(np.float32)
    head = rng.standard_normal((50, 8)).astype(np.float32)
    ids, logp = lilicorr_candidates(hidden, head, 4)
    z = hidden @ head.T
    full = z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
    np.testing.assert_allclose(logp, np.take_along_axis(full, ids, 1), atol=1e-5)
    assert np.all(np.exp(logp).sum(-1) < 1.0)  # not renormalised over the K candidates


# 29. feature order, relative-slot bias clamp, cosine scores times lambda
def test_lilicorr_features_and_bias():
    logp = np.log(np.array([[0.5, 0.2, 0.1, 0.05]], np.float32))
    f = candidate_features(logp)
    np.testing.assert_allclose(f[0, :, 0], logp[0], atol=1e-7)
    np.testing.assert_allclose(f[0, :, 1], [0.5, 0.2, 0.1, 0.05], atol=1e-6)
    np.testing.assert_allclose(f[0, :, 2], logp[0] - logp[0, 0], atol=1e-6)
    np.testing.assert_allclose(f[0, :, 3], [0, 1 / 3, 2 / 3, 1], atol=1e-6)
    assert f[0, :, 4].tolist() == [1, 0, 0, 0]
    assert candidate_features(logp[:, :1])[0, 0, 3] == 0.0  # K = 1: rank fraction 0
    bsz = 3
    rel = np.arange(2 * (2 * bsz - 1), dtype=np.float32).reshape(2, 2 * bsz - 1)
    same = np.array([100.0, 200.0], np.float32)
    slots = np.array([0, 0, 1, 5])
    bias = slot_bias(rel, same, slots, bsz)
    assert bias[0, 0, 1] == rel[0, 2] + 100  # same slot
    assert bias[0, 2, 0] == rel[0, 3]  # diff +1
    assert bias[1, 3, 0] == rel[1, 4]  # diff +5 clamped to B-1 = 2
    assert bias[1, 0, 3] == rel[1, 0]  # diff -5 clamped to -(B-1)


def test_lilicorr_scores_are_scaled_cosines(drafter, targets):
    import attrs

    from .test_drafter import prefill

    dr = drafter("lilicorr")
    prefill(dr, targets["qwen3"])
    hidden = dr.block_hidden(0, 9, 8, 7)[1:]
    anchor = dr._anchor[0][1][-1]
    lh = dr.hp.lilicorr
    args = (hidden, dr.graph.head, dr.target_embed, anchor, True, dr.graph.w)
    ids, start, pair = lilicorr_scores(*args, lh, dr.hp.block_size, dr.hp.norm_eps)
    assert ids.shape == (7, lh.top_k) and start.shape == (lh.top_k,) and pair.shape == (6, lh.top_k, lh.top_k)
    assert np.abs(start).max() <= lh.logit_scale + 1e-4 and np.abs(pair).max() <= lh.logit_scale + 1e-4
    _, s2, p2 = lilicorr_scores(*args, attrs.evolve(lh, logit_scale=2 * lh.logit_scale), dr.hp.block_size,
                                dr.hp.norm_eps)
    np.testing.assert_allclose(s2, 2 * start, atol=1e-5)
    np.testing.assert_allclose(p2, 2 * pair, atol=1e-5)
    # an invalid anchor is zeroed: the start scores no longer depend on the anchor row
    _, z1, _ = lilicorr_scores(hidden, dr.graph.head, dr.target_embed, anchor, False, dr.graph.w, lh,
                               dr.hp.block_size, dr.hp.norm_eps)
    _, z2, _ = lilicorr_scores(hidden, dr.graph.head, dr.target_embed, anchor * 3 + 1, False, dr.graph.w, lh,
                               dr.hp.block_size, dr.hp.norm_eps)
    np.testing.assert_allclose(z1, z2, atol=1e-6)


# 30. walk start -> pairs, by candidate index, lower index on ties; whole-block batches
def test_lilicorr_walk_by_hand():
    ids = np.array([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    start = np.array([0.0, 3.0, 3.0])  # tie -> index 1
    pair = np.zeros((2, 3, 3))
    pair[0, 1] = [0.0, 0.0, 5.0]  # from candidate index 1 -> index 2
    pair[0, 0] = [9.0, 0.0, 0.0]  # (a token-id-indexed walk would land elsewhere)
    pair[1, 2] = [1.0, 1.0, 0.0]  # tie -> index 0
    toks, conf = lilicorr_walk(ids, start, pair)
    assert toks == [11, 22, 30]
    assert lilicorr_walk(ids, start, pair, p_min=0.5)[0] == []
    assert lilicorr_walk(ids, start, pair, p_min=0.45)[0] == [11, 22]  # last row: e / (2e + 1) = 0.42
    assert lilicorr_walk(ids, start, pair, p_min=0.4)[0] == [11, 22, 30]


def test_whole_blocks():
    assert whole_blocks(16, 2, 8) == 8
    with pytest.raises(ValueError, match="whole"):
        whole_blocks(15, 2, 8)
    with pytest.raises(ValueError, match="exceed"):
        whole_blocks(18, 2, 8)
    with pytest.raises(ValueError, match="equal blocks"):
        dflash2_lattice(np.zeros((5, 24), np.float32), np.zeros((5, 20), np.float32), [1, 2], _selector_weights(), 3,
                        n_blocks=2)

"""The runtime drafter: taps, injection, masks, cache hygiene, controls, scales, heads (checklist 1-15)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from plinth import ops
from plinth.graph import Batch
from plinth.errors import UserError
from plinth.speculative.base import TargetOutput, check_compatible

PROMPT = [3, 17, 42, 8, 23, 61, 5, 11]


def prefill(dr, target, prompt=PROMPT, seq=0):
    ctx = target.new_context(taps=dr.requirements().taps)
    out = ctx.forward(Batch.from_tokens(prompt, seq=seq, output="last"))
    dr.begin(seq, prompt)
    dr.process(TargetOutput(seq=seq, phase="prefill", tokens=np.asarray(prompt), positions=np.arange(len(prompt)),
                            features=out.features))
    return ctx, out


# 1. taps: the +1 rule (converter: test_convert), tap L_t = the pre-final-norm residual
def test_requirements_and_tap_n_layer(drafter, targets):
    dr = drafter(taps=(3, 1))
    req = dr.requirements()
    assert req.taps == (1, 3) and req.max_draft == 7 and req.n_embd == 64
    assert req.shares_embedding and req.shares_head
    check_compatible(targets["qwen3"], dr)
    ctx, out = prefill(dr, targets["qwen3"])
    t = targets["qwen3"]
    # tap 3 == n_layer: the residual before output_norm (the target's logits are head(norm(tap 3)))
    h = ops.rms_norm(out.features[3][-1:], t.weights["output_norm.weight"], t.hparams.norm_eps)
    np.testing.assert_allclose(ops.linear(h, t.target_view().head_weight), out.logits, atol=1e-4)


def test_taps_outside_target_are_refused(drafter):
    with pytest.raises(UserError, match="outside the target"):
        drafter(taps=(1, 4))


# 2. concat in tap order; E_t must equal E
def test_features_concatenate_in_file_tap_order(drafter, targets, tmp_path):
    from plinth_dflash.drafter import make_dflash
    from plinth_dflash.testkit import random_draft_tensors, tiny_draft_metadata

    a = drafter(taps=(1, 3), seed=4)
    prefill(a, targets["qwen3"])
    md = tiny_draft_metadata(taps=(3, 1), n_vocab=257, mask_token=255)
    t = random_draft_tensors(tiny_draft_metadata(taps=(1, 3), n_vocab=257, mask_token=255), "dflash", seed=4)
    t["fc.weight"] = np.concatenate([t["fc.weight"][:, 64:], t["fc.weight"][:, :64]], axis=1)
    from plinth.convert import write_gguf

    p = write_gguf(tmp_path / "swapped.gguf", md, t)
    b = make_dflash(targets["qwen3"], {"draft": str(p)})
    prefill(b, targets["qwen3"])
    np.testing.assert_allclose(a.draft_logits(0, 7, 8, 5), b.draft_logits(0, 7, 8, 5), atol=1e-5)


def test_hidden_size_mismatch_is_detected(tmp_path, draft_file):
    from plinth_dflash.drafter import make_dflash
    from plinth_dflash.testkit import tiny_target

    t48 = tiny_target(tmp_path / "t48.gguf", "qwen3", n_embd=48, n_layer=3)
    with pytest.raises(UserError, match="n_embd = 48"):
        make_dflash(t48, {"draft": str(draft_file(taps=(1, 3)))})


# 3. sanitisation, warned once
def test_feature_sanitisation(drafter, targets):
    from plinth_dflash.drafter import FeatureWarning, sanitize_features

    f = np.array([[np.nan, np.inf, -np.inf, 1e6, -7e4, 3.0]], dtype=np.float32)
    clean, changed = sanitize_features(f, np)
    assert changed and clean.tolist() == [[0.0, 65504.0, -65504.0, 65504.0, -65504.0, 3.0]]
    dr, ref = drafter(seed=2), drafter(seed=2)
    ctx, out = prefill(ref, targets["qwen3"])
    feats = {k: v.copy() for k, v in out.features.items()}
    feats[1][2, 5] = np.nan
    feats[3][4, 7] = 1e9
    clean_feats = {k: v.copy() for k, v in feats.items()}
    clean_feats[1][2, 5] = 0.0
    clean_feats[3][4, 7] = 65504.0
    mk = lambda fs: TargetOutput(seq=0, phase="prefill", tokens=np.asarray(PROMPT), positions=np.arange(8), features=fs)
    ref.begin(0, PROMPT)
    ref.process(mk(clean_feats))
    with pytest.warns(FeatureWarning):
        dr.process(mk(feats))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dr.process(mk(feats))  # the second time is silent
    np.testing.assert_array_equal(dr.draft_logits(0, 9, 8, 4), ref.draft_logits(0, 9, 8, 4))
    assert np.isfinite(dr.draft_logits(0, 9, 8, 4)).all()


# 4 + 5. fused injection == separate encoder then injection; K = RoPE(k_norm(Wk g)) at target positions, V = Wv g
def test_injected_kv_matches_separate_encoder_and_formula(drafter, targets):
    dr = drafter()
    ctx, out = prefill(dr, targets["qwen3"])
    w, hp = dr.graph.w, dr.hp
    f = np.concatenate([out.features[1], out.features[3]], axis=1)  # raw features, n_taps * E wide
    assert f.shape[1] == 2 * 64
    # separate "encoder" pass (fc then enc.output_norm), written out longhand
    y = f @ w["fc.weight"].T
    g = y / np.sqrt((y * y).mean(-1, keepdims=True) + hp.norm_eps) * w["enc.output_norm.weight"]
    pos = np.arange(8)
    for il in range(hp.n_layer):
        k = (g @ w[f"blk.{il}.attn_k.weight"].T).reshape(8, hp.n_head_kv, hp.head_dim)
        k = k / np.sqrt((k * k).mean(-1, keepdims=True) + hp.norm_eps) * w[f"blk.{il}.attn_k_norm.weight"]
        inv = 10000.0 ** (-np.arange(0, hp.head_dim, 2) / hp.head_dim)
        ang = pos[:, None] * inv[None]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        half = hp.head_dim // 2
        k = np.concatenate([k[..., :half] * c - k[..., half:] * s, k[..., :half] * s + k[..., half:] * c], -1)
        v = (g @ w[f"blk.{il}.attn_v.weight"].T).reshape(8, hp.n_head_kv, hp.head_dim)
        kc, vc, _ = dr.cache.kv(il).get(0)
        np.testing.assert_allclose(kc, k, atol=1e-5)
        np.testing.assert_allclose(vc, v, atol=1e-5)
    assert dr.cache.positions(0).tolist() == list(range(8))


# 7. SWA routing: only pattern layers get the window, together with non-causal attention
def test_sliding_window_routing(drafter, targets, monkeypatch):
    import plinth_dflash.graph as graph

    dr = drafter(sliding_window=3, swa_pattern=[True, False])
    prefill(dr, targets["qwen3"])
    calls = []
    real = graph.ops.attention

    def spy(*a, **kw):
        calls.append((kw["causal"], kw["sliding_window"]))
        return real(*a, **kw)

    monkeypatch.setattr(graph.ops, "attention", spy)
    dr.draft_logits(0, 9, 8, 4)
    monkeypatch.undo()
    assert calls == [(False, 3), (False, None)]
    # the window bites: a draft with a huge window equals the full-attention draft, the small one does not
    big = drafter(sliding_window=1000, swa_pattern=[True, False])
    full = drafter()
    for d in (big, full):
        prefill(d, targets["qwen3"])
    # (1e-5: with no window the block's few query rows take the compiled attention kernel, with one
    # the numpy path; the two round differently)
    np.testing.assert_allclose(big.draft_logits(0, 9, 8, 4), full.draft_logits(0, 9, 8, 4), atol=1e-5)
    assert np.abs(dr.draft_logits(0, 9, 8, 4) - full.draft_logits(0, 9, 8, 4)).max() > 1e-4


# 8. non-causal inside the block; causal only when the file says so
def test_block_is_non_causal_unless_flagged(drafter, targets):
    nc, ca = drafter(seed=3), drafter(seed=3, causal=True)
    for d in (nc, ca):
        prefill(d, targets["qwen3"])
    # row 1 of a non-causal block sees the MASK rows after it: the block length changes it
    assert np.abs(nc.draft_logits(0, 9, 8, 2)[0] - nc.draft_logits(0, 9, 8, 6)[0]).max() > 1e-4
    np.testing.assert_allclose(ca.draft_logits(0, 9, 8, 2)[0], ca.draft_logits(0, 9, 8, 6)[0], atol=1e-5)


# 9. noise K/V and rejected injected rows never stay in the cache
def test_noise_and_rejected_rows_do_not_persist(drafter, targets):
    dr = drafter()
    ctx, _ = prefill(dr, targets["qwen3"])
    before = [np.array(dr.cache.kv(il).get(0)[0]) for il in range(2)]
    d1 = dr.draft(0, 7, history=PROMPT + [9], pos=8)
    assert dr.cache.positions(0).tolist() == list(range(8))
    for il in range(2):
        np.testing.assert_array_equal(dr.cache.kv(il).get(0)[0], before[il])
    assert dr.draft(0, 7, history=PROMPT + [9], pos=8).tokens == d1.tokens  # no leftovers change the next draft
    verify = [9, *d1.tokens[:5]]
    vo = ctx.forward(Batch.from_tokens(verify, start=8, output="all"))
    dr.process(TargetOutput(seq=0, phase="verify", tokens=np.asarray(verify), positions=np.arange(8, 14),
                            features=vo.features))
    assert dr.cache.positions(0).tolist() == list(range(14))
    dr.accept(0, 2)  # rows 8 (anchor), 9, 10 kept
    assert dr.cache.positions(0).tolist() == list(range(11))
    # draft() also drops anything at or after its anchor position, should an engine skip accept()
    dr.process(TargetOutput(seq=0, phase="verify", tokens=np.asarray(verify), positions=np.arange(8, 14),
                            features=vo.features))
    dr.draft(0, 3, history=PROMPT + [9, 1, 2], pos=10)
    assert dr.cache.positions(0).tolist() == list(range(10))


# 10. the draft positions are the engine's pos (the target's next position), not a token count
def test_positions_follow_pos_not_token_count(drafter, targets):
    dr = drafter()
    prefill(dr, targets["qwen3"])
    a = dr.draft_logits(0, 9, 8, 4)
    b = dr.draft_logits(0, 9, 12, 4)  # a position gap (e.g. image rows in the target) shifts the RoPE
    assert np.abs(a - b).max() > 1e-4


# 11. n_max clamp to B - 1
def test_n_max_is_clamped_to_the_block(drafter, targets):
    dr = drafter(block_size=6)
    prefill(dr, targets["qwen3"])
    assert len(dr.draft(0, 100, history=PROMPT + [9], pos=8)) == 5
    assert dr.requirements().max_draft == 5
    small = drafter(block_size=6, options={"n_max": 3})
    prefill(small, targets["qwen3"])
    assert len(small.draft(0, 100, history=PROMPT + [9], pos=8)) == 3


# 12. p_min stops at the first low-confidence token; n_min drops short drafts
@pytest.mark.parametrize("variant", ["dflash", "dflash2", "lilicorr"])
def test_p_min_and_n_min(drafter, targets, variant):
    full = drafter(variant)
    prefill(full, targets["qwen3"])
    d = full.draft(0, 7, history=PROMPT + [9], pos=8)
    assert len(d) == 7 and np.all((d.confidences > 0) & (d.confidences <= 1))
    conf = np.asarray(d.confidences)
    p = float(np.sort(conf)[3])  # cut somewhere inside the block
    cut = int(np.nonzero(conf < p)[0][0])
    pm = drafter(variant, options={"p_min": p})
    prefill(pm, targets["qwen3"])
    got = pm.draft(0, 7, history=PROMPT + [9], pos=8)
    assert got.tokens == d.tokens[:cut]
    nm = drafter(variant, options={"p_min": p, "n_min": cut + 1})
    prefill(nm, targets["qwen3"])
    assert len(nm.draft(0, 7, history=PROMPT + [9], pos=8)) == 0


# 13. target batches with embedding rows are skipped
def test_embedding_batches_are_skipped(drafter, targets):
    dr = drafter()
    ctx, out = prefill(dr, targets["qwen3"])
    dr.process(TargetOutput(seq=0, phase="prefill", tokens=np.zeros(2, int), positions=np.arange(8, 10),
                            features={1: np.ones((2, 64), np.float32), 3: np.ones((2, 64), np.float32)},
                            has_embeddings=True))
    assert dr.cache.positions(0).tolist() == list(range(8)) and dr.stats["skipped_batches"] == 1


# 14. every per-tensor scale is applied (injection and drafting paths); fc.input_scale loads
@pytest.mark.parametrize("variant", ["dflash", "dflash2", "lilicorr"])
def test_per_tensor_scales(drafter, targets, variant):
    plain = drafter(variant, seed=6, own_head=True)
    scaled = drafter(variant, seed=6, own_head=True, scales=True)
    assert any(n.endswith(".scale") for n in scaled.draft_file.tensor_types)
    assert scaled.draft_file.fc_input_scale == 0.5
    for d in (plain, scaled):
        prefill(d, targets["qwen3"])
    for il in range(2):
        np.testing.assert_allclose(scaled.cache.kv(il).get(0)[0], plain.cache.kv(il).get(0)[0], atol=1e-4)
        np.testing.assert_allclose(scaled.cache.kv(il).get(0)[1], plain.cache.kv(il).get(0)[1], atol=1e-4)
    np.testing.assert_allclose(scaled.draft_logits(0, 9, 8, 7), plain.draft_logits(0, 9, 8, 7), atol=1e-3)
    assert scaled.draft(0, 7, history=PROMPT + [9], pos=8).tokens == plain.draft(0, 7, history=PROMPT + [9],
                                                                                 pos=8).tokens


# 15. head from metadata: own, tied to the own embedding, or the target's; no silent fallback
def test_head_selection(drafter, targets, draft_file, tmp_path):
    from plinth_dflash.drafter import make_dflash
    from plinth_dflash.format import DFlashFormatError
    from plinth_dflash.testkit import random_draft_tensors, tiny_draft_metadata

    t = targets["qwen3"]
    own = drafter(own_head=True)
    assert own.head_source == "own" and own.graph.head is own.draft_file.weights["output.weight"]
    tied = drafter(tied=True)
    assert tied.head_source == "tied" and tied.graph.head is tied.draft_file.weights["token_embd.weight"]
    assert not tied.requirements().shares_embedding and not tied.requirements().shares_head
    shared = drafter()
    assert shared.head_source == "target" and shared.graph.head is t.target_view().head_weight
    # an own embedding with the tied flag false does not become the head ...
    untied = drafter(own_embd=True, tied=False)
    assert untied.head_source == "target" and untied.graph.embed_table is untied.draft_file.weights[
        "token_embd.weight"]
    # ... and without the flag it does (llama.cpp's loader: no output.weight, token_embd present -> tied)
    implicit = drafter(own_embd=True)
    assert implicit.head_source == "tied" and implicit.graph.head is implicit.draft_file.weights["token_embd.weight"]
    md = tiny_draft_metadata(taps=(1, 3), tied=True, n_vocab=257)
    tens = random_draft_tensors(tiny_draft_metadata(taps=(1, 3), n_vocab=257), "dflash")
    from plinth.convert import write_gguf

    p = write_gguf(tmp_path / "tied-noembd.gguf", md, tens)
    with pytest.raises(DFlashFormatError, match="no 'token_embd.weight'"):
        make_dflash(t, {"draft": str(p)})
    for d in (own, tied, shared):
        prefill(d, t)
        hidden = d.block_hidden(0, 9, 8, 3)
        np.testing.assert_allclose(d.draft_logits(0, 9, 8, 3), hidden[1:] @ np.asarray(d.graph.head).T, atol=1e-5)


def test_reduced_vocabulary_is_refused(draft_file, targets):
    from plinth_dflash.drafter import make_dflash

    p = draft_file(taps=(1, 3), extra_tensors={"d2t": np.arange(257, dtype=np.int64)})
    with pytest.raises(UserError, match="d2t"):
        make_dflash(targets["qwen3"], {"draft": str(p)})


def test_variant_specific_factories(draft_file, targets):
    from plinth_dflash.drafter import make_dflash2, make_lilicorr

    with pytest.raises(UserError, match="not dflash2"):
        make_dflash2(targets["qwen3"], {"draft": str(draft_file("dflash", taps=(1, 3)))})
    assert make_lilicorr(targets["qwen3"], {"draft": str(draft_file("lilicorr", taps=(1, 3)))}).name == "lilicorr"
    with pytest.raises(UserError, match="--draft"):
        make_dflash2(targets["qwen3"], {})


def test_drafter_registered_through_the_plugin(plinth_registry, targets, draft_file):
    from plinth_dflash.plugin import plugin

    reg = plinth_registry(plugin)
    for name in ("dflash", "dflash2", "lilicorr"):
        assert reg.owner("drafters", name) == "dflash"
    dr = reg.make_drafter("dflash", targets["llama"], {"draft": str(draft_file("dflash2", taps=(1, 3)))})
    assert dr.name == "dflash2"


def test_every_misfit_is_one_named_line(tmp_path, targets, draft_file):
    """A draft that cannot run on a target says so in one line naming the draft and the mismatch, before any
    draft compute: hidden size, tap range, vocabulary (own tensors or the vocab_size key), mask token, and a
    target whose tap rows are not n_embd wide (e.g. hyper-connection streams handed over flattened)."""
    from plinth.testing.drafters import check_one_line_refusal
    from plinth_dflash.drafter import make_dflash
    from plinth_dflash.testkit import tiny_target

    t = targets["qwen3"]
    t48 = tiny_target(tmp_path / "t48.gguf", "qwen3", n_embd=48, n_layer=3)
    cases = [
        (t48, dict(taps=(1, 3)), "n_embd = 48"),
        (t, dict(taps=(1, 4)), r"taps \[4\] outside the target's 0..3"),
        (t, dict(taps=(1, 3), n_vocab=300, mask_token=5, own_head=True), "output head has 300 rows"),
        (t, dict(taps=(1, 3), n_vocab=300, mask_token=5), "made for a vocabulary of 300 tokens"),
        (t, dict(taps=(1, 3), mask_token=400), "mask token 400 is outside"),
    ]
    for target, kw, match in cases:
        path = draft_file(**kw)
        check_one_line_refusal(lambda: make_dflash(target, {"draft": str(path)}), match, path.name)
    dr = make_dflash(t, {"draft": str(draft_file(taps=(1, 3)))})
    wide = TargetOutput(seq=0, phase="prefill", tokens=np.arange(4), positions=np.arange(4),
                        features={1: np.zeros((4, 128), np.float32), 3: np.zeros((4, 128), np.float32)})
    check_one_line_refusal(lambda: dr.process(wide), r"tap 1 as rows of shape \[4, 128\].*width E = 64", "dflash")
    assert dr.stats["injected_rows"] == 0 and not dr.cache.positions(0).size

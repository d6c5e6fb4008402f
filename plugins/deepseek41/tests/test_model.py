"""deepseek4 contract, pieces and refusals: cache consistency, mHC maps, compressed streams, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.graph import Batch
from plinth.errors import UserError
from plinth.hparams import HParamsError
from plinth.testing import check_prefill_then_decode, load_module, new_cache
from plinth_deepseek41 import deepseek4 as ds4
from plinth_deepseek41.convert import gguf_metadata

golden = load_module(Path(__file__).resolve().parent / "golden" / "make_golden.py")


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    return golden.plinth_model("flash", tmp_path_factory.mktemp("ds4-flash"))


def prompt(n, seed=7, v=256):
    return np.random.default_rng(seed).integers(0, v, n).tolist()


# ---------------------------------------------------------------- cache consistency


def test_prefill_then_decode_equals_full_forward(flash):
    check_prefill_then_decode(flash.graph, flash.hparams.n_layer, prompt(60), 21, atol=2e-5)


def test_chunked_prefill_equals_token_by_token_and_full(flash):
    toks = prompt(131, seed=3)
    g, n_layer = flash.graph, flash.hparams.n_layer
    full = g.forward(Batch.from_tokens(toks, output="all"), new_cache(g, n_layer)).logits
    for chunk in (1, 3, 8, 37):
        cache = new_cache(g, n_layer)
        parts = [g.forward(Batch.from_tokens(toks[i:i + chunk], start=i, output="all"), cache).logits
                 for i in range(0, len(toks), chunk)]
        np.testing.assert_allclose(np.concatenate(parts), full, atol=2e-5, rtol=0, err_msg=f"chunk {chunk}")


def test_two_sequences_in_one_batch_equal_separate_runs(flash):
    g, n_layer = flash.graph, flash.hparams.n_layer
    a, b = prompt(23, 1), prompt(17, 2)
    sep_a = g.forward(Batch.from_tokens(a, output="all"), new_cache(g, n_layer)).logits
    sep_b = g.forward(Batch.from_tokens(b, seq=1, output="all"), new_cache(g, n_layer)).logits
    both = g.forward(Batch.concat([Batch.from_tokens(a, output="all"), Batch.from_tokens(b, seq=1, output="all")]),
                     new_cache(g, n_layer)).logits
    np.testing.assert_allclose(both, np.concatenate([sep_a, sep_b]), atol=2e-5, rtol=0)


def test_deterministic_and_finite(flash):
    toks = prompt(50)
    a, b = flash.logits(toks), flash.logits(toks)
    assert np.isfinite(a).all() and np.array_equal(a, b)


def test_cache_keeps_the_window_and_the_compressed_streams(flash):
    hp, g = flash.hparams, flash.graph
    n = 30
    cache = new_cache(g, hp.n_layer)
    g.forward(Batch.from_tokens(prompt(n)), cache)
    keep = ds4.ROLLBACK_ROWS
    for il in range(hp.n_layer):
        blocks, bpos, keys, kpos = cache.find(il, ds4.WindowKeys).get(0)
        assert blocks is None and keys.shape[1:] == (hp.head_dim,)  # K = V: keys only, no blocks
        assert kpos[0] == max(0, n - hp.n_swa - keep) and kpos[-1] == n - 1  # the window (+ spare rows) only
        atype = hp.attention_type(il)
        if atype == "window":
            continue
        r = hp.ratio(il)
        entries, epos, rows, rpos = cache.find(il, ds4.CompressedStream).get(0)
        assert entries.shape == (n // r, hp.head_dim) and list(epos) == list(range(0, n // r * r, r))
        coff = 2 if atype == "csa" else 1
        assert rows.shape[1] == 2 * coff * hp.head_dim  # kv | score
        # the filling block (+ the last complete one for CSA) are what the next position needs
        live = cache.find(il, ds4.CompressedStream).contents(0)[3]
        assert live[0] == n // r * r - (r if atype == "csa" else 0) and live[-1] == n - 1
        if atype == "csa":
            assert cache.find(il, ds4.IndexerStream).get(0)[0].shape == (n // r, hp.idx_head_dim)
    layout = g.cache_layout()
    want = {"window": ["WindowKeys"], "hca": ["WindowKeys", "CompressedStream"],
            "csa": ["WindowKeys", "CompressedStream", "IndexerStream"]}
    assert [[type(k).__name__ for k in kinds] for kinds in layout] == [want[hp.attention_type(il)]
                                                                       for il in range(hp.n_layer)]
    ctx = flash.new_context()
    ctx.forward(Batch.from_tokens(prompt(n)))
    assert not ctx.recurrent
    by_kind = ctx.cache.nbytes_by_kind()
    assert set(by_kind) == {"window", "compressed", "indexer"}


def test_positions_must_continue_the_cache(flash):
    cache = new_cache(flash.graph, flash.hparams.n_layer)
    flash.graph.forward(Batch.from_tokens(prompt(5)), cache)
    with pytest.raises(UserError, match="continues at position 7"):
        flash.graph.forward(Batch.from_tokens([1], start=7), cache)


# ---------------------------------------------------------------- hyper-connections


def test_sinkhorn_is_doubly_stochastic():
    """V4's setting (hc 4, 20 iterations, unit-scale mixes): rows and columns sum to 1 within 1e-4;
    the columns (normalised last) to float32 precision; more iterations for harder inputs converge too.
    The result equals a float64 evaluation of the same steps."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((500, 4, 4)).astype(np.float32)
    c = ds4.sinkhorn(logits, 20, 1e-6)
    assert (c >= 0).all()
    np.testing.assert_allclose(c.sum(axis=-2), 1.0, atol=1e-5)
    np.testing.assert_allclose(c.sum(axis=-1), 1.0, atol=1e-4)
    hard = (2 * rng.standard_normal((100, 3, 3))).astype(np.float32)
    np.testing.assert_allclose(ds4.sinkhorn(hard, 400, 1e-6).sum(axis=-1), 1.0, atol=1e-3)
    ref = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
    ref = ref / ref.sum(-1, keepdims=True) + 1e-6
    ref = ref / (ref.sum(-2, keepdims=True) + 1e-6)
    for _ in range(19):
        ref = ref / (ref.sum(-1, keepdims=True) + 1e-6)
        ref = ref / (ref.sum(-2, keepdims=True) + 1e-6)
    np.testing.assert_allclose(c, ref, atol=1e-6)


def test_hc_fused_equals_unfused():
    """The model's mixes (one GEMV over the raw stream, the RMS scale after it) equal the textbook
    order (normalise the flattened stream, then project); collapse/expand equal explicit loops."""
    rng = np.random.default_rng(1)
    n, hc, e = 5, 4, 16
    X = rng.standard_normal((n, hc, e)).astype(np.float32)
    fn = rng.standard_normal(((2 + hc) * hc, hc * e)).astype(np.float32) / 8
    flat = X.reshape(n, -1)
    unfused = (flat / np.sqrt((flat ** 2).mean(-1, keepdims=True) + 1e-6)) @ fn.T
    np.testing.assert_allclose(ds4.hc_mixes(X, fn, 1e-6), unfused, atol=1e-5, rtol=1e-5)
    hp = type("HP", (), dict(hc=hc, norm_eps=1e-6, hc_eps=1e-6, hc_sinkhorn_iters=20))()
    base = rng.standard_normal((2 + hc) * hc).astype(np.float32)
    mix = ds4.hc_mix(X, fn, base, np.array([0.7, 1.2, 0.9], np.float32), hp)
    y = rng.standard_normal((n, e)).astype(np.float32)
    out = ds4.hc_expand(X, y, mix)
    for t in range(n):
        np.testing.assert_allclose(ds4.hc_collapse(X, mix.pre)[t], sum(mix.pre[t, h] * X[t, h] for h in range(hc)),
                                   atol=1e-5)
        for dst in range(hc):
            want = mix.post[t, dst] * y[t] + sum(mix.comb[t, src, dst] * X[t, src] for src in range(hc))
            np.testing.assert_allclose(out[t, dst], want, atol=1e-5)
    assert (mix.pre > 0).all() and (mix.post > 0).all() and (mix.post < 2).all()


# ---------------------------------------------------------------- compressed streams and the indexer


def _compressor(rng, r, w, overlap, e=8):
    coff = 2 if overlap else 1
    return ds4.Compressor(rng.standard_normal((coff * w, e)).astype(np.float32),
                          rng.standard_normal((coff * w, e)).astype(np.float32),
                          rng.standard_normal((r, coff * w)).astype(np.float32), np.ones(w, np.float32), r, overlap)


def _rope(w):
    from plinth import ops

    return ops.RopeCache(ops.rope_freqs(w // 2, 10000.0))


def _stream(r, overlap):
    from plinth.graph import Cache

    return Cache(1, layout=[(ds4.CompressedStream(r, overlap),)]).find(0, ds4.CompressedStream)


def _compress(stream, comp, x, pos):
    entries = ds4.compress(stream, 0, comp, x, pos, _rope(8), 4, 1e-6)
    stream.commit()
    return entries


def test_csa_with_fewer_tokens_than_one_block():
    rng = np.random.default_rng(2)
    comp = _compressor(rng, 4, 8, True)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    s = _stream(4, True)
    entries = _compress(s, comp, x, np.arange(3))
    assert entries.shape == (0, 8) and s.get(0)[2].shape == (3, 32)  # no entry, rows (kv | score) kept
    # the 4th token completes block 0: its entry pools the padding rows (score -inf) and block 0's second half
    x4 = rng.standard_normal((1, 8)).astype(np.float32)
    entries = _compress(s, comp, x4, np.arange(3, 4))
    rows = np.concatenate([x, x4])
    kv, sc = rows @ comp.w_kv.T, rows @ comp.w_gate.T + comp.ape
    p = np.exp(sc[:, 8:] - sc[:, 8:].max(0))
    pooled = (p / p.sum(0) * kv[:, 8:]).sum(0)
    pooled = pooled / np.sqrt((pooled ** 2).mean() + 1e-6)  # norm weight 1; rope at position 0 is the identity
    np.testing.assert_allclose(entries[0], pooled, atol=1e-5)
    assert list(s.contents(0)[3]) == [0, 1, 2, 3]  # block 0 stays: its first half feeds entry 1


def test_csa_entries_pool_the_block_before():
    from plinth import ops

    rng = np.random.default_rng(5)
    comp = _compressor(rng, 4, 8, True)
    x = rng.standard_normal((13, 8)).astype(np.float32)
    s = _stream(4, True)
    entries = _compress(s, comp, x, np.arange(13))
    kv, sc = x @ comp.w_kv.T, x @ comp.w_gate.T + comp.ape[np.arange(13) % 4]
    for j in (1, 2):  # block j-1's first half, block j's second half
        slot_kv = np.concatenate([kv[4 * j - 4:4 * j, :8], kv[4 * j:4 * j + 4, 8:]])
        slot_sc = np.concatenate([sc[4 * j - 4:4 * j, :8], sc[4 * j:4 * j + 4, 8:]])
        p = np.exp(slot_sc - slot_sc.max(0))
        pooled = (p / p.sum(0) * slot_kv).sum(0)
        pooled = pooled / np.sqrt((pooled ** 2).mean() + 1e-6)
        got = ops.apply_rope(pooled[None, None, :], cos_sin=_rope(8)(np.array([4 * j])), offset=4)[0, 0]
        np.testing.assert_allclose(entries[j], got, atol=1e-5)


def test_hca_partial_block_gives_no_entry_until_complete():
    rng = np.random.default_rng(3)
    comp = _compressor(rng, 8, 8, False)
    s = _stream(8, False)
    x = rng.standard_normal((13, 8)).astype(np.float32)
    assert _compress(s, comp, x[:7], np.arange(7)).shape[0] == 0
    entries = _compress(s, comp, x[7:13], np.arange(7, 13))
    assert entries.shape[0] == 1 and list(s.contents(0)[3]) == list(range(8, 13))  # one block + 5 rows of the next
    one = _compress(_stream(8, False), comp, x, np.arange(13))
    np.testing.assert_allclose(one, entries, atol=1e-6)


def test_topk_larger_than_entries_is_clamped():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((6, 16, 8)).astype(np.float32)
    w = rng.standard_normal((6, 16)).astype(np.float32)
    keys = rng.standard_normal((3, 8)).astype(np.float32)
    pos = np.array([2, 3, 7, 8, 11, 12])
    sel = ds4.indexer_topk(q, w, keys, pos, 4, top_k=10)
    assert sel.indices.shape == (6, 3)  # min(top_k, entries)
    visible = (pos + 1) // 4
    for t in range(6):
        chosen = sorted(i for i in sel.indices[t] if i >= 0)
        assert chosen == list(range(min(visible[t], 3)))  # every visible entry, nothing from the future
    none = ds4.indexer_topk(q, w, keys[:0], pos, 4, top_k=10)
    assert none.indices.shape == (6, 0)


def test_indexer_picks_the_best_scores():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 16, 8)).astype(np.float32)
    w = np.abs(rng.standard_normal((1, 16))).astype(np.float32)
    keys = rng.standard_normal((9, 8)).astype(np.float32)
    sel = ds4.indexer_topk(q, w, keys, np.array([40]), 4, top_k=3)
    score = (np.maximum(q[0] @ keys.T, 0) * w[0][:, None]).sum(0)
    assert sorted(sel.indices[0].tolist()) == sorted(np.argsort(-score)[:3].tolist()) and sel.ties == 0


# ---------------------------------------------------------------- refusals


def _metadata(case="flash"):
    return gguf_metadata(golden.CASES[case]["config"], "tiny/config.json", "tiny")


def test_compress_ratios_length_is_checked():
    md = _metadata()
    md["deepseek4.attention.compress_ratios"] = md["deepseek4.attention.compress_ratios"][:-1]
    with pytest.raises(HParamsError, match="compress_ratios' has 3 entries, expected n_layer = 4"):
        ds4.load_hparams(md, "tiny.gguf")
    md["deepseek4.attention.compress_ratios"] += [0, 0]
    # llama.cpp's trunk file keeps the release list, which also covers the MTP layer it leaves out
    assert list(ds4.load_hparams(md, "tiny.gguf").compress_ratios) == md["deepseek4.attention.compress_ratios"][:4]
    md["deepseek4.nextn_predict_layers"] = 1  # n_layer + MTP layers (plinth's combined file) is accepted
    assert ds4.load_hparams(md, "tiny.gguf").n_layer == 4


def test_unknown_ratio_is_refused():
    md = _metadata()
    md["deepseek4.attention.compress_ratios"] = [0, 4, 16, 4]
    with pytest.raises(HParamsError, match=r"ratio\(s\) \[16\]; deepseek4 defines 0 \(window only\), 4 \(CSA\) and 8"):
        ds4.load_hparams(md, "tiny.gguf")


def test_gating_other_than_sqrt_softplus_is_refused():
    md = _metadata()
    md["deepseek4.expert_gating_func"] = 2  # sigmoid
    with pytest.raises(HParamsError, match="expert_gating_func' = 2; deepseek4 routes experts with sqrt-softplus"):
        ds4.load_hparams(md, "tiny.gguf")
    cfg = dict(golden.CASES["flash"]["config"], scoring_func="sigmoid")
    with pytest.raises(UserError, match="scoring_func is 'sigmoid'"):
        gguf_metadata(cfg, "tiny/config.json", "tiny")


def test_missing_indexer_tensor_on_a_csa_layer_is_named(tmp_path):
    import plinth
    from plinth.convert import convert
    from plinth.tensors import TensorCheckError

    reg = golden.registry()
    out = convert(golden.write_hf_folder("flash", tmp_path / "hf"), tmp_path / "full.gguf", registry=reg)
    from plinth.gguf import GGUFFile
    from plinth.testing import write_gguf

    gf = GGUFFile(out)
    tensors = {n: np.asarray(gf.raw(n)) for n in gf.tensors if n != "blk.1.indexer.attn_q_b.weight"}
    path = write_gguf(tmp_path / "broken.gguf", dict(gf.metadata), tensors)
    with pytest.raises(TensorCheckError, match="missing tensor 'blk.1.indexer.attn_q_b.weight'"):
        plinth.load_model(path, registry=reg)


def test_embedding_rows_are_refused(flash):
    with pytest.raises(UserError, match="embedding rows are not supported"):
        flash.graph.forward(Batch.from_embeddings(np.zeros((2, 64), np.float32)), new_cache(flash.graph, 4))


def test_strict_device_stand_in_gives_the_same_logits(flash):
    """Device discipline (no host arrays inside device ops) on the test kit's strict stand-in."""
    import plinth

    strict = plinth.load_model(flash.path, registry=golden.registry(), backend="strict")
    toks = prompt(23, seed=11)
    ctx = strict.new_context()
    a = strict.backend.to_numpy(ctx.forward(Batch.from_tokens(toks[:20], output="all")).logits)
    b = strict.backend.to_numpy(ctx.forward(Batch.from_tokens(toks[20:], start=20, output="all")).logits)
    np.testing.assert_allclose(np.concatenate([a, b]), flash.logits(toks), atol=2e-5, rtol=0)


def test_test_kit_architecture_contract(tmp_path):
    """plinth.testing.check_architecture on a random deepseek4 (load, prefill/decode, batches, rollback,
    speculative decoding with the ngram and random drafters)."""
    from plinth.testing.arch import check_architecture

    md = _metadata()
    md["deepseek4.vocab_size"] = 257
    # the kit draws every tensor as random floats, and a hash layer's token -> experts table must hold expert ids
    # (refused otherwise); hash routing is covered by the goldens (csa2_hash, flash) and test_speculative
    md["deepseek4.hash_layer_count"] = 0
    check_architecture(golden.registry(), "deepseek4", md, tmp_path, max_tokens=12, atol=2e-4)


def test_tid2eid_is_written_as_i32_and_loads_as_integers_or_from_old_f32_files(flash, tmp_path):
    """llama.cpp writes the hash layers' token -> experts table as I32; plinth's converter now does too and the
    loader uses it as integers. Files plinth wrote before (F32 ids) give the same logits; a table with ids that
    are not experts (or not whole numbers) is refused by name."""
    import plinth
    from plinth.gguf import GGUFFile
    from plinth.testing import write_gguf

    reg = golden.registry()
    gf = GGUFFile(flash.path)
    name = "blk.0.ffn_gate_tid2eid.weight"
    assert gf.tensors[name].type_name == "I32"
    assert flash.graph.tid2eid[0].dtype == np.int64
    toks = prompt(30)
    want = flash.logits(toks)
    tensors = {n: np.asarray(gf.raw(n)) for n in gf.tensors}
    assert tensors[name].dtype == np.int32
    md = dict(gf.metadata)
    old = write_gguf(tmp_path / "f32.gguf", md, dict(tensors, **{name: tensors[name].astype(np.float32)}))
    assert GGUFFile(old).tensors[name].type_name == "F32"
    np.testing.assert_array_equal(plinth.load_model(old, registry=reg).logits(toks), want)
    bad = tensors[name].copy()
    bad[3, 0] = flash.hparams.n_expert
    with pytest.raises(UserError, match=f"{name}: expert ids must lie in 0..{flash.hparams.n_expert - 1}"):
        plinth.load_model(write_gguf(tmp_path / "bad.gguf", md, dict(tensors, **{name: bad})), registry=reg)
    half = tensors[name].astype(np.float32)
    half[0, 0] += 0.5
    with pytest.raises(UserError, match="whole numbers"):
        plinth.load_model(write_gguf(tmp_path / "half.gguf", md, dict(tensors, **{name: half})), registry=reg)


def test_info_reports_the_cache_bytes_a_token_at_a_length(flash, capsys):
    """``plinth info --cache --cache-tokens N``: the layout and the bytes a token once N tokens are cached (the
    window and the compressor rows stop growing, so the figure falls with N)."""
    from plinth.cli import main

    def per_token(n):
        assert main(["info", str(flash.path), "--cache", "--cache-tokens", str(n)]) == 0
        out = capsys.readouterr().out
        assert "x window+compressed+indexer" in out and "x window+compressed" in out
        line = next(s for s in out.splitlines() if "per token at" in s)
        return float(line.split("(total ")[1].split()[0])

    short, long = per_token(40), per_token(600)
    cache = new_cache(flash.graph, flash.hparams.n_layer)
    rng = np.random.default_rng(0)
    for s in range(0, 600, 512):  # the same fill, checked against the cache's own count
        flash.graph.forward(Batch.from_tokens(rng.integers(0, 256, min(512, 600 - s)).tolist(), start=s,
                                              output="none"), cache)
    assert long < short and abs(long - cache.nbytes() / 600) < 0.06  # (printed to 0.1)

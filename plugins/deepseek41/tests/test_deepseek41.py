"""deepseek41 (DeepSeek V4.1 Flash): reference goldens, cache contract, the lag's wiring, refusals.

``golden/<case>.npz`` (``golden/make_golden41.py``) holds the logits and greedy continuations of
transformers' DeepseekV4 modules re-wired for the lag, with Engram evaluated in torch from the
spec's formula, for three tiny models: V4's "flash" weights with the lag and no Engram, and two
Engram models (trigrams with wrapping multipliers and a folded token map on two streams; bigrams
with three heads on three streams). The default run needs no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from plinth.graph import Batch
from plinth.errors import UserError
from plinth.testing.golden import load_golden_rows
from plinth.testing import check_prefill_then_decode, greedy_through_cache, load_module, new_cache

GOLDEN = Path(__file__).resolve().parent / "golden"
LOGIT_ATOL = 1e-4
g41 = load_module(GOLDEN / "make_golden41.py")
CASES = sorted(g41.CASES)


def load(case):
    return load_golden_rows(GOLDEN / f"{case}.npz")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepseek41")
    reg = g41.v4.registry()
    return {case: g41.plinth_model(case, tmp, reg) for case in CASES}


def prompt(n, seed=7, v=256):
    return np.random.default_rng(seed).integers(0, v, n).tolist()


# ---------------------------------------------------------------- against the reference


@pytest.mark.parametrize("case", CASES)
def test_golden_file_matches_this_case(case):
    info, runs = load(case)
    assert info == json.loads(json.dumps(g41.info(case)))
    assert [p for p, *_ in runs] == g41.prompts(case)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_reference(models, case):
    model = models[case]
    model.graph.topk_ties = 0
    for p, rows, ref, _ in load(case)[1]:
        err = float(np.abs(model.logits(p)[rows] - ref).max())
        assert err < LOGIT_ATOL, f"{case}, {len(p)} tokens: max |plinth - reference| = {err:.3g}"
    assert model.graph.topk_ties == 0


@pytest.mark.parametrize("case", CASES)
def test_greedy_continuations_match_reference(models, case):
    model = models[case]
    for p, _, _, ref in load(case)[1]:
        assert greedy_through_cache(model.graph, model.hparams.n_layer, p, len(ref)) == ref, f"{case}, {len(p)}"


def test_cases_cover_the_features(models):
    hps = {c: models[c].hparams for c in CASES}
    assert {hp.hc for hp in hps.values()} == {2, 3, 4}
    assert {hp.attention_type(il) for hp in hps.values() for il in range(hp.n_layer)} == {"window", "csa", "hca"}
    eng = [hp.engram for hp in hps.values() if hp.engram is not None]
    assert {e.max_ngram for e in eng} == {2, 3} and {e.n_head for e in eng} == {2, 3}
    assert any(int(e.multipliers.max()) >= 1 << 60 for e in eng)  # products wrap around 2^64
    assert any(not np.array_equal(e.token_map, np.arange(len(e.token_map))) for e in eng)
    assert any(0 in e.layer_ids for e in eng)  # Engram before the first block (after the one-hot mix's input)
    for case in ("engram_hc2", "engram_hca"):
        w = models[case].weights
        assert all(type(w[f"blk.{il}.engram_embd.weight"]).__name__ == "QuantWeight"
                   for il in hps[case].engram.layer_ids)  # BF16 tables, read row by row


def test_lag_and_engram_change_the_output(models, tmp_path):
    """The goldens would not see a lag or an Engram that did nothing: both move the logits by O(1)."""
    import plinth

    reg = g41.v4.registry()
    v4 = g41.v4.plinth_model("flash", tmp_path, reg)
    p = prompt(40)
    assert np.abs(v4.logits(p) - models["lag_flash"].logits(p)).max() > 0.5
    md, tensors, forced = g41.deepseek41_parts("engram_hc2", tmp_path, reg)
    plain = plinth.load_model(g41.write_file(tmp_path / "no-engram.gguf",
                                             {k: v for k, v in md.items() if ".engram." not in k},
                                             {k: v for k, v in tensors.items() if "engram" not in k}, {}),
                              registry=reg)
    assert np.abs(plain.logits(p) - models["engram_hc2"].logits(p)).max() > 0.5


def test_shared_source_roles(models, tmp_path):
    """shared_hca: layers 0 and 2 compress (KV sources), layer 3 has no compressor and reads layer 2's
    stream (the latest earlier source; it keeps no stream of its own). Reading its own compressor's
    stream instead would change the logits."""
    import plinth

    m = models["shared_hca"]
    assert m.graph.stream_source == {0: 0, 2: 2, 3: 2}
    assert [[type(k).__name__ for k in kinds] for kinds in m.graph.cache_layout()] == [
        ["WindowKeys", "CompressedStream", "EngramTokens"], ["WindowKeys"], ["WindowKeys", "CompressedStream"],
        ["WindowKeys"]]
    reg = g41.v4.registry()
    md, tensors, forced = g41.deepseek41_parts("shared_hca", tmp_path, reg)
    folder = g41.write_hf_folder("shared_hca", tmp_path / "own")
    from plinth.convert import convert
    from plinth.gguf import GGUFFile

    gf = GGUFFile(convert(folder, tmp_path / "own-v4.gguf", registry=reg))
    tensors.update({n: np.array(gf.raw(n)) for n in gf.tensors if n.startswith("blk.3.attn_compressor_")})
    own = plinth.load_model(g41.write_file(tmp_path / "own.gguf", md, tensors, forced), registry=reg)
    assert own.graph.stream_source[3] == 3
    p = prompt(40)
    assert np.abs(own.logits(p) - m.logits(p)).max() > 0.05


def test_a_compressor_without_a_gate_at_ratio_1(models):
    """gateless_r1: HCA layers at ratio 1 whose file has no attn_compressor_gate (one row an entry);
    its golden (transformers' compressor, gate and all) is matched by test_logits_match_reference."""
    m = models["gateless_r1"]
    assert [m.hparams.ratio(il) for il in range(3)] == [1, 0, 1]
    assert not any("attn_compressor_gate" in n for n in m.weights)
    assert m.graph.stream_source == {0: 0, 2: 2}


@pytest.mark.parametrize("case, drop, add, message", [
    ("lag_flash", "blk.2.attn_compressor_", None,
     r"layer 2 \(compress ratio 8\) would read layer 1's compressed stream, whose ratio is 4"),
    ("lag_flash", "blk.1.attn_compressor_", None, "CSA layer 1 has no compressor of its own"),
    ("lag_flash", "blk.2.attn_compressor_gate", None, "layer 2's compressor has no gate .* allowed at ratio 1 only"),
    ("lag_flash", "blk.1.indexer_compressor_kv", None, r"layer 1 has a compressor .* lacks \['blk.1.indexer_compressor"),
    ("lag_flash", None, ("blk.1.indexer.attn_k.weight", (16, 32)), "V4.1 index-key owner"),
    ("engram_hca", "blk.0.attn_compressor_", None, "no earlier layer compresses a stream for it to read"),
])
def test_sparse_attention_roles_are_checked(tmp_path, case, drop, add, message):
    import plinth

    reg = g41.v4.registry()
    md, tensors, forced = g41.deepseek41_parts(case, tmp_path, reg)
    tensors = {k: v for k, v in tensors.items() if drop is None or not k.startswith(drop)}
    if add is not None:
        tensors[add[0]] = np.zeros(add[1], np.float32)
    with pytest.raises(UserError, match=message):
        plinth.load_model(g41.write_file(tmp_path / "roles.gguf", md, tensors, forced), registry=reg)


# ---------------------------------------------------------------- cache contract


@pytest.mark.parametrize("case", ["engram_hc2", "lag_flash", "shared_hca"])
def test_prefill_then_decode_equals_full_forward(models, case):
    m = models[case]
    check_prefill_then_decode(m.graph, m.hparams.n_layer, prompt(45), 19, atol=2e-5)


def test_chunked_prefill_equals_full(models):
    g, n_layer = models["engram_hc2"].graph, models["engram_hc2"].hparams.n_layer
    toks = prompt(70, seed=3)
    full = g.forward(Batch.from_tokens(toks, output="all"), new_cache(g, n_layer)).logits
    for chunk in (1, 2, 5, 33):
        cache = new_cache(g, n_layer)
        parts = [g.forward(Batch.from_tokens(toks[i:i + chunk], start=i, output="all"), cache).logits
                 for i in range(0, len(toks), chunk)]
        np.testing.assert_allclose(np.concatenate(parts), full, atol=2e-5, rtol=0, err_msg=f"chunk {chunk}")


def test_two_sequences_in_one_batch_equal_separate_runs(models):
    """Each sequence has its own Engram look-back (and a second batch continues each one's)."""
    g, n_layer = models["engram_hc2"].graph, models["engram_hc2"].hparams.n_layer
    a, b = prompt(23, 1), prompt(17, 2)
    sep_a = g.forward(Batch.from_tokens(a, output="all"), new_cache(g, n_layer)).logits
    sep_b = g.forward(Batch.from_tokens(b, seq=1, output="all"), new_cache(g, n_layer)).logits
    cache = new_cache(g, n_layer)
    first = g.forward(Batch.concat([Batch.from_tokens(a[:10], output="all"),
                                    Batch.from_tokens(b[:4], seq=1, output="all")]), cache).logits
    rest = g.forward(Batch.concat([Batch.from_tokens(a[10:], start=10, output="all"),
                                   Batch.from_tokens(b[4:], start=4, seq=1, output="all")]), cache).logits
    np.testing.assert_allclose(np.concatenate([first[:10], rest[:13]]), sep_a, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.concatenate([first[10:], rest[13:]]), sep_b, atol=2e-5, rtol=0)


def test_engram_history_is_kept_in_the_cache_and_rolled_back(models):
    """The last N-1 mapped ids of each sequence live in an ``engram_tokens`` kind on layer 0; a
    snapshot / restore round trip (what a rejected draft does) gives back the look-back, so the
    continuation equals a run that never saw the rejected rows."""
    m = models["engram_hc2"]
    g, n_layer, ep = m.graph, m.hparams.n_layer, m.hparams.engram
    toks = prompt(30, seed=5)
    cache = new_cache(g, n_layer)
    g.forward(Batch.from_tokens(toks[:20]), cache)
    hist = cache.layers[0][-1]
    assert hist.kind == "engram_tokens"
    np.testing.assert_array_equal(hist.get(0), ep.token_map[toks[18:20]].astype(np.uint64))
    snap = cache.snapshot(0)
    g.forward(Batch.from_tokens([1, 2, 3, 4], start=20), cache)  # rows a verifier rejects
    cache.restore(snap)
    got = g.forward(Batch.from_tokens(toks[20:], start=20, output="all"), cache).logits
    ref = g.forward(Batch.from_tokens(toks, output="all"), new_cache(g, n_layer)).logits[20:]
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=0)


def test_strict_device_stand_in_gives_the_same_logits(models):
    import plinth

    m = models["engram_hc2"]
    strict = plinth.load_model(m.path, registry=g41.v4.registry(), backend="strict")
    toks = prompt(23, seed=11)
    # deepseek4's MoE and indexer read their expert / entry ids back (5 round trips a decode step
    # here); Engram adds none: its hash runs on the host token ids and uploads the rows
    from plinth.testing.strict import count_transfers

    check_prefill_then_decode(strict.graph, strict.hparams.n_layer, toks, 20, atol=2e-5, backend=strict.backend,
                              max_decode_transfers=5)
    with count_transfers() as n:
        cache = new_cache(strict.graph, strict.hparams.n_layer)
        strict.graph.forward(Batch.from_tokens(toks), cache)
    assert not [s for s in n.sites if "engram" in s or "deepseek41" in s], n.sites
    np.testing.assert_allclose(strict.logits(toks), m.logits(toks), atol=2e-5, rtol=0)


# ---------------------------------------------------------------- the lag's wiring


def test_each_sublayer_collapses_with_the_previous_pre(models, monkeypatch):
    """Record every mix and collapse of one forward: layer 0's attention collapses with a one-hot
    pre on copy 0, every later sublayer with the pre of the mix before it, and the output with
    the last FFN's pre (2·n_layer mixes, 2·n_layer + 1 collapses; no hc head)."""
    from plinth_deepseek41 import deepseek41 as ds41

    m = models["lag_flash"]
    mixes, collapses = [], []
    real_mix, real_collapse = ds41.hc_mix, ds41.hc_collapse
    monkeypatch.setattr(ds41, "hc_mix", lambda *a: mixes.append(real_mix(*a)) or mixes[-1])
    monkeypatch.setattr(ds41, "hc_collapse", lambda X, pre: collapses.append(pre) or real_collapse(X, pre))
    m.graph.forward(Batch.from_tokens(prompt(9), output="all"), new_cache(m.graph, m.hparams.n_layer))
    n = m.hparams.n_layer
    assert len(mixes) == 2 * n and len(collapses) == 2 * n + 1
    one_hot = np.zeros((9, m.hparams.hc), np.float32)
    one_hot[:, 0] = 1
    np.testing.assert_array_equal(collapses[0], one_hot)
    for k in range(1, 2 * n + 1):
        np.testing.assert_array_equal(collapses[k], mixes[k - 1].pre, err_msg=f"collapse {k}")
        assert not np.allclose(mixes[k - 1].pre, mixes[k % (2 * n)].pre)  # a different pre would be seen


def test_a_file_with_an_hc_head_is_refused(tmp_path):
    import plinth

    reg = g41.v4.registry()
    md, tensors, forced = g41.deepseek41_parts("lag_flash", tmp_path, reg)
    hc, e = md["deepseek41.hyper_connection.count"], md["deepseek41.embedding_length"]
    tensors.update({"output_hc_fn.weight": np.zeros((hc, hc * e), np.float32),
                    "output_hc_base.weight": np.zeros(hc, np.float32),
                    "output_hc_scale.weight": np.ones(1, np.float32)})
    with pytest.raises(UserError, match="V4.1 has no learned hc head"):
        plinth.load_model(g41.write_file(tmp_path / "head.gguf", md, tensors, forced), registry=reg)


# ---------------------------------------------------------------- embedding rows and the vision routing bias


def _variant(tmp_path, name, reg, fold_to_pad=(), vision=None, bias_from_vision=False):
    """engram_hca's file with some token ids mapped to pad and/or a vision routing bias."""
    import plinth

    md, tensors, forced = g41.deepseek41_parts("engram_hca", tmp_path, reg)
    tm = list(md["deepseek41.engram.token_map"])
    for t in fold_to_pad:
        tm[t] = md["deepseek41.engram.pad_id"]
    md["deepseek41.engram.token_map"] = tm
    for il, bias in (vision or {}).items():
        tensors[f"blk.{il}.exp_probs_b_vl.bias"] = bias
        if bias_from_vision:
            tensors[f"blk.{il}.exp_probs_b.bias"] = bias
    return plinth.load_model(g41.write_file(tmp_path / f"{name}.gguf", md, tensors, forced), registry=reg)


def test_embedding_rows_hash_as_pad_and_use_the_vision_bias(tmp_path):
    """An embedding row equal to token t's embedding gives what a token row of t gives when t maps
    to pad (Engram reads pad for embedding rows, in ctx[0] and in the next rows' look-back); with
    ``exp_probs_b_vl`` present, an embedding row selects experts with it (checked against a file
    whose ordinary bias is that vision bias; the image row is the first, so no earlier row differs)."""
    reg = g41.v4.registry()
    toks = prompt(12, seed=4)
    t = toks[0]
    rng = np.random.default_rng(9)
    c = _variant(tmp_path, "c", reg, fold_to_pad=[t])
    hp = c.hparams
    vision = {il: (3 * rng.standard_normal(hp.n_expert)).astype(np.float32) for il in range(hp.n_layer)}
    a = _variant(tmp_path, "a", reg, fold_to_pad=[t], vision=vision)
    b = _variant(tmp_path, "b", reg, fold_to_pad=[t], vision=vision, bias_from_vision=True)
    emb = np.asarray(a.weights["token_embd.weight"])[t]
    rows = Batch.from_tokens(toks, output="all")
    is_embd = np.zeros(len(toks), bool)
    is_embd[0] = True
    mixed = Batch(tokens=rows.tokens, positions=rows.positions, seq_ids=rows.seq_ids, output=rows.output,
                  embeddings=np.where(is_embd[:, None], emb[None, :], 0).astype(np.float32), is_embd=is_embd)
    # without a vision bias: every row equals the token run with t folded to pad
    np.testing.assert_allclose(c.graph.forward(mixed, new_cache(c.graph, hp.n_layer)).logits, c.logits(toks),
                               atol=2e-5, rtol=0)
    # with it: the image row routes with exp_probs_b_vl
    got = a.graph.forward(mixed, new_cache(a.graph, hp.n_layer)).logits
    np.testing.assert_allclose(got[0], b.logits(toks)[0], atol=2e-5, rtol=0)
    assert np.abs(got[0] - a.logits(toks)[0]).max() > 1e-3  # the vision bias mattered


def test_embedding_rows_with_hash_layers_are_refused(models):
    m = models["engram_hc2"]  # one hash-routed layer
    with pytest.raises(UserError, match="embedding rows are not supported by a model with hash-routed layers"):
        m.graph.forward(Batch.from_embeddings(np.zeros((2, 64), np.float32)), new_cache(m.graph, m.hparams.n_layer))


def test_rows_shared_by_several_sequences_are_refused(models):
    m = models["engram_hc2"]
    b = Batch.from_tokens([1, 2])
    shared = Batch(tokens=b.tokens, positions=b.positions, seq_ids=np.array([[0, 1], [0, 1]]), output=b.output)
    with pytest.raises(UserError, match="a row shared by several sequences is not supported"):
        m.graph.forward(shared, new_cache(m.graph, m.hparams.n_layer))


# ---------------------------------------------------------------- live reference (torch)


@pytest.mark.ref
@pytest.mark.parametrize("case", CASES)
def test_live_reference_reproduces_golden(case, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = g41.write_hf_folder(case, tmp_path / case)
    for (p, rows, logits, greedy), (lp, llogits, lgreedy) in zip(load(case)[1], g41.reference(case, folder)):
        assert p == lp
        np.testing.assert_allclose(llogits[rows], logits, atol=1e-5, rtol=0)
        assert lgreedy == greedy


@pytest.mark.ref
def test_engram_block_equals_the_torch_formula():
    """plinth's Engram (numpy hash + gather + gate) against the torch evaluation of the spec's
    formula with the Python-integer hash, on the engram_hc2 constants and random streams."""
    torch = pytest.importorskip("torch")
    from plinth_deepseek41 import engram as eg

    c = g41.engram_constants("engram_hc2")
    t = g41.engram_tensors("engram_hc2")
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 256, 17).tolist()
    X = rng.standard_normal((17, 2, 64)).astype(np.float32)
    md, _ = g41.engram_metadata(c)
    from plinth.hparams import KeyReader

    ep = eg.read_engram(KeyReader(md, "t.gguf", "deepseek41"), n_layer=3, n_vocab=256)
    for k, il in enumerate(c["layer_ids"]):
        b = f"blk.{il}."
        w = eg.EngramWeights(t[b + "engram_embd.weight"], t[b + "engram_wkv.weight"], t[b + "engram_q.weight"],
                             t[b + "engram_k.weight"])
        ctx, _ = eg.engram_rows_for_batch(np.asarray(toks), None, [(0, slice(0, 17))], {}, ep)
        rows = eg.hash_rows(ctx, ep.multipliers[k], ep.primes[k], ep.offsets[k], ep.n_head)
        got = eg.engram_mix(X, eg.gather_rows(w.table, rows, np).reshape(17, -1), w, 1e-6)
        tw = {"table": torch.from_numpy(w.table), "wkv": torch.from_numpy(w.wkv), "q": torch.from_numpy(w.q_norm),
              "k": torch.from_numpy(w.k_norm)}
        want = g41.engram_torch(torch.from_numpy(X)[None], toks, 0, c, k, tw, 1e-6)[0].numpy()
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        assert np.abs(got - X).max() > 0.1

"""Contract tests of nemotron_h / nemotron_h_moe on tiny synthetic weights.

Prefill + decode == one forward (the chunked SSD prefill agrees with the one-token
recurrence); two sequences in a batch == separate runs; recurrent state kept in the KV
cache on the backend, snapshot / restore exact; named errors for missing keys and tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.graph import Batch, Recurrent
from plinth.errors import UserError
from plinth.testing.drafters import assert_caches_equal
from plinth.testing import CONTRACT_BACKENDS, check_prefill_then_decode, load_module, new_cache


tiny = load_module(Path(__file__).parent / "tiny.py")

PATTERNS = {
    "mamba": dict(pattern="MM"),
    "hybrid": dict(pattern="M*-M"),
    "moe": dict(pattern="ME*E"),
    "latent": dict(pattern="M*E-E", latent=12, top_k=[0, 0, 3, 0, 1], n_ff_exp=[0, 0, 16, 0, 8]),
}


@pytest.fixture
def registry(plinth_registry):
    from plinth_nemotron.plugin import plugin

    return plinth_registry(plugin)


def build(registry, name, seed=0, backend="numpy"):
    return tiny.build(registry, tiny.metadata(**PATTERNS[name]), seed, backend=backend)


def run(graph, hp, batch):
    return graph.forward(batch, new_cache(graph, hp.n_layer))


def host(graph, array):
    return graph.backend.to_numpy(array)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_read_from_the_per_layer_arrays(registry, name):
    hp, graph, _ = build(registry, name)
    assert hp.pattern == PATTERNS[name]["pattern"]
    kinds = {"M": ("Recurrent",), "*": ("KV",), "-": (), "E": ()}
    assert [tuple(type(k).__name__ for k in ks) for ks in graph.cache_layout()] == [kinds[c] for c in hp.pattern]


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_prefill_then_decode_equals_full_forward(registry, name, backend):
    hp, graph, _ = build(registry, name, backend=backend)
    tokens = np.random.default_rng(1).integers(0, hp.n_vocab, 80).tolist()
    check_prefill_then_decode(graph, hp.n_layer, tokens, 70, atol=1e-4)


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
@pytest.mark.parametrize("name", ["mamba", "latent"])
def test_token_by_token_decode_equals_chunked_prefill(registry, name, backend):
    hp, graph, _ = build(registry, name, backend=backend)
    tokens = np.random.default_rng(2).integers(0, hp.n_vocab, 70).tolist()  # > one SSD chunk (64)
    full_cache = new_cache(graph, hp.n_layer)
    full = host(graph, graph.forward(Batch.from_tokens(tokens, output="all"), full_cache).logits)
    cache = new_cache(graph, hp.n_layer)
    steps = [host(graph, graph.forward(Batch.from_tokens([t], start=i), cache).logits) for i, t in enumerate(tokens)]
    np.testing.assert_allclose(np.concatenate(steps), full, atol=1e-4, rtol=0)
    assert_caches_equal(cache, full_cache, atol=1e-4)  # same conv and SSM states either way


def test_uneven_prefill_chunks_and_chunk_length_do_not_matter(registry, monkeypatch):
    from plinth_nemotron import nemotron_h

    hp, graph, _ = build(registry, "hybrid")
    tokens = np.random.default_rng(3).integers(0, hp.n_vocab, 50).tolist()
    full = run(graph, hp, Batch.from_tokens(tokens, output="all")).logits
    cache = new_cache(graph, hp.n_layer)
    parts, start = [], 0
    for n in (3, 1, 17, 2, 27):
        parts.append(graph.forward(Batch.from_tokens(tokens[start:start + n], start=start, output="all"),
                                   cache).logits)
        start += n
    np.testing.assert_allclose(np.concatenate(parts), full, atol=1e-4, rtol=0)
    monkeypatch.setattr(nemotron_h, "SSM_CHUNK", 7)
    np.testing.assert_allclose(run(graph, hp, Batch.from_tokens(tokens, output="all")).logits, full,
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
@pytest.mark.parametrize("name", ["hybrid", "latent"])
def test_two_sequences_in_one_batch_equal_separate_runs(registry, name, backend):
    hp, graph, _ = build(registry, name, backend=backend)
    rng = np.random.default_rng(4)
    a, b = rng.integers(0, hp.n_vocab, 9).tolist(), rng.integers(0, hp.n_vocab, 6).tolist()
    la = host(graph, run(graph, hp, Batch.from_tokens(a, output="all")).logits)
    lb = host(graph, run(graph, hp, Batch.from_tokens(b, output="all")).logits)
    cache = new_cache(graph, hp.n_layer)
    both = Batch.concat([Batch.from_tokens(a, seq=0, output="all"), Batch.from_tokens(b, seq=1, output="all")])
    lab = host(graph, graph.forward(both, cache).logits)
    np.testing.assert_allclose(lab[:9], la, atol=5e-5, rtol=0)
    np.testing.assert_allclose(lab[9:], lb, atol=5e-5, rtol=0)
    # then one decode step of both sequences in one batch, rows interleaved
    nxt = Batch.concat([Batch.from_tokens([5], start=6, seq=1), Batch.from_tokens([7], start=9, seq=0)])
    two = host(graph, graph.forward(nxt, cache).logits)
    np.testing.assert_allclose(two[1], host(graph, run(graph, hp, Batch.from_tokens(a + [7])).logits)[0],
                               atol=5e-5, rtol=0)
    np.testing.assert_allclose(two[0], host(graph, run(graph, hp, Batch.from_tokens(b + [5])).logits)[0],
                               atol=5e-5, rtol=0)


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
def test_mixed_token_and_embedding_rows_equal_token_rows(registry, backend):
    hp, graph, w = build(registry, "latent", backend=backend)
    tokens = np.random.default_rng(5).integers(0, hp.n_vocab, 8).tolist()
    ref = host(graph, run(graph, hp, Batch.from_tokens(tokens, output="all")).logits)
    table = w["token_embd.weight"]
    mixed = Batch.concat([Batch.from_tokens(tokens[:3], output="all"),
                          Batch.from_embeddings(table[tokens[3:6]], start=3, output="all"),
                          Batch.from_tokens(tokens[6:], start=6, output="all")])
    np.testing.assert_allclose(host(graph, run(graph, hp, mixed).logits), ref, atol=1e-5, rtol=0)


def test_outputs_only_where_asked_taps_pooling_deterministic(registry):
    hp, graph, w = build(registry, "moe")
    tokens = list(range(10))
    full = run(graph, hp, Batch.from_tokens(tokens, output="all")).logits
    mask = [i % 3 == 0 for i in range(10)]
    out = run(graph, hp, Batch.from_tokens(tokens, output=mask))
    np.testing.assert_array_equal(out.rows, [0, 3, 6, 9])
    np.testing.assert_allclose(out.logits, full[mask], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(run(graph, hp, Batch.from_tokens(tokens, output="all")).logits, full)
    tapped = graph.forward(Batch.from_tokens(tokens, output="all"), new_cache(graph, hp.n_layer), taps=(0, 2, hp.n_layer))
    assert sorted(tapped.features) == [0, 2, hp.n_layer]
    np.testing.assert_array_equal(tapped.features[0], w["token_embd.weight"][tokens])
    pooled = graph.forward(Batch.from_tokens(tokens, output="all"), new_cache(graph, hp.n_layer), pooling="mean")
    assert pooled.logits is None and pooled.embeddings.shape == (1, hp.n_embd)


def test_state_lives_in_the_cache_as_new_backend_arrays(registry):
    hp, graph, _ = build(registry, "hybrid")
    cache = new_cache(graph, hp.n_layer)
    graph.forward(Batch.from_tokens([1, 2, 3]), cache)
    mamba_layers = [il for il in range(hp.n_layer) if hp.is_recurrent(il)]
    assert sorted(k.layer for k in cache.kinds() if isinstance(k, Recurrent) and k.holds(0)) == mamba_layers
    conv, ssm = cache.state(0).get(0)
    assert isinstance(conv, graph.xp.ndarray) and isinstance(ssm, graph.xp.ndarray)
    assert conv.shape == (hp.ssm_d_conv - 1, hp.ssm_conv_dim)
    assert ssm.shape == (hp.ssm_n_head, hp.ssm_head_dim, hp.ssm_d_state) and ssm.dtype == np.float32
    before = (conv.copy(), ssm.copy())
    graph.forward(Batch.from_tokens([4], start=3), cache)
    np.testing.assert_array_equal(conv, before[0])  # the old state was not written in place
    np.testing.assert_array_equal(ssm, before[1])
    assert cache.state(0).get(0)[1] is not ssm


def test_snapshot_restore_and_replay_equal_plain_decoding(registry):
    hp, graph, _ = build(registry, "latent")
    tokens = np.random.default_rng(6).integers(0, hp.n_vocab, 14).tolist()
    cache = new_cache(graph, hp.n_layer)
    graph.forward(Batch.from_tokens(tokens[:8]), cache)
    snap = cache.snapshot(0)
    graph.forward(Batch.from_tokens(tokens[8:13], start=8, output="all"), cache)  # a verify batch of 5
    cache.restore(snap)
    graph.forward(Batch.from_tokens(tokens[8:10], start=8, output="none"), cache)  # keep 2 of them
    ref = new_cache(graph, hp.n_layer)
    graph.forward(Batch.from_tokens(tokens[:10]), ref)
    assert_caches_equal(cache, ref, atol=1e-5)
    got = graph.forward(Batch.from_tokens(tokens[10:], start=10, output="all"), cache).logits
    want = run(graph, hp, Batch.from_tokens(tokens, output="all")).logits[10:]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_recurrent_state_refuses_position_gaps(registry):
    hp, graph, _ = build(registry, "hybrid")
    cache = new_cache(graph, hp.n_layer)
    graph.forward(Batch.from_tokens([1, 2, 3, 4]), cache)
    with pytest.raises(ValueError, match="holds recurrent state"):
        cache.seq_rm(0, 2)
    with pytest.raises(UserError, match="continues at position 6, but its recurrent state stands at position 4"):
        graph.forward(Batch.from_tokens([5], start=6), cache)
    with pytest.raises(UserError, match="consecutive increasing positions"):
        graph.forward(Batch(tokens=np.array([1, 2]), positions=np.array([4, 6]), seq_ids=np.array([0, 0]),
                            output=np.array([True, True])), cache)
    with pytest.raises(UserError, match="continues at position 3, but its recurrent state stands at position 0"):
        graph.forward(Batch.from_tokens([1], start=3, seq=1), new_cache(graph, hp.n_layer))
    assert cache.n_cached(0) == 4  # the failed forwards left nothing behind
    graph.forward(Batch.from_tokens([5], start=4), cache)


def test_loaded_file_generates_and_names_missing_tensors(registry, tmp_path):
    from plinth.model import load_model

    md = tiny.metadata("M*E-", vocab=True, top_k=[0, 0, 2, 0], n_ff_exp=[0, 0, 16, 0])
    path = tiny.write(tmp_path / "t.gguf", registry, md)
    model = load_model(path, registry=registry)
    assert model.arch == "nemotron_h_moe" and model.hparams.pattern == "M*E-"
    from plinth.generate import Generator

    assert len(Generator(model).generate([1, 2, 3], 6)) == 6
    bad = tiny.write(tmp_path / "bad.gguf", registry, md, drop=("blk.0.ssm_conv1d.weight",))
    with pytest.raises(Exception, match=r"missing tensor 'blk.0.ssm_conv1d.weight' \(expected shape \[64, 4\]\)"):
        load_model(bad, registry=registry)


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
def test_check_architecture(registry, tmp_path, backend):
    """The test kit's whole-architecture contract on a hybrid with every layer kind."""
    from plinth.testing import check_architecture

    md = tiny.metadata("M*EM-E", n_vocab=257, n_embd=48, top_k=[0, 0, 2, 0, 0, 3], n_ff_exp=[0, 0, 16, 0, 0, 24],
                       latent=[0, 0, 0, 0, 0, 16])
    model = check_architecture(registry, "nemotron_h_moe", md, tmp_path, scale=0.1, backend=backend)
    assert model.new_context().rollback_plan(0, 0, 4) == "snapshot"  # Mamba state: snapshot + replay


def test_check_architecture_with_an_mtp_head_and_the_mtp_drafter(registry, tmp_path):
    """A file with the MTP head passes the same contract, and the mtp drafter passes the drafter contract on it."""
    from plinth.testing import check_architecture
    from plinth.testing.drafters import check_drafter_contract
    from plinth_nemotron.mtp import make_mtp_drafter

    md = tiny.metadata("M*EM-E*E", n_vocab=257, n_embd=48, top_k=[0, 0, 2, 0, 0, 3, 0, 2],
                       n_ff_exp=[0, 0, 16, 0, 0, 24, 0, 16], nextn_predict_layers=2)
    model = check_architecture(registry, "nemotron_h_moe", md, tmp_path, scale=0.1)
    assert model.hparams.mtp_pattern == "*E" and model.target_view().draft_heads == ["mtp"]
    check_drafter_contract(model, lambda: make_mtp_drafter(model, {"n_max": 3}), [[1, 2, 3, 1, 2, 3], [40, 7]],
                           max_tokens=16, n_max=3, atol=1e-4, rtol=1e-4)

"""Contract tests every dense architecture of plinth-llama passes (synthetic tiny weights)."""

from __future__ import annotations

import numpy as np
import pytest

from plinth.graph import Batch
from plinth.testing import CONTRACT_BACKENDS, check_prefill_then_decode, new_cache, random_tensors, tiny_metadata

ARCHS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "gemma3": {"attention__sliding_window": 5, "n_layer": 7},
}


@pytest.fixture
def registry(plinth_registry):
    from plinth_llama.plugin import plugin

    return plinth_registry(plugin)


def build(registry, arch, seed=0, backend="numpy"):
    extra = dict(ARCHS[arch])
    n_layer = extra.pop("n_layer", 2)
    md = tiny_metadata(arch, n_layer=n_layer, **extra)
    hp = registry.arch_hparams(arch, md, f"tiny-{arch}.gguf")
    specs = registry.arch_tensors(arch, hp)
    be = registry.make_backend(backend)
    weights = {k: be.asarray(v) for k, v in
               random_tensors([s for s in registry.architecture(arch).synthetic_tensors(hp)
                               if s.name != "output.weight"], seed=seed).items()}
    graph = registry.arch_build(arch, hp, weights, be)
    return hp, graph


def run(graph, hp, batch):
    return graph.forward(batch, new_cache(graph, hp.n_layer))


def logits(graph, hp, batch):
    """Host logits of one forward on a fresh cache."""
    return graph.backend.to_numpy(run(graph, hp, batch).logits)


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_prefill_then_decode_equals_full_forward(registry, arch, backend):
    hp, graph = build(registry, arch, backend=backend)
    tokens = np.random.default_rng(1).integers(0, hp.n_vocab, 12).tolist()
    check_prefill_then_decode(graph, hp.n_layer, tokens, 5, atol=1e-5)


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_two_sequences_in_one_batch_equal_separate_runs(registry, arch, backend):
    hp, graph = build(registry, arch, backend=backend)
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, hp.n_vocab, 9).tolist(), rng.integers(0, hp.n_vocab, 6).tolist()
    la = logits(graph, hp, Batch.from_tokens(a, output="all"))
    lb = logits(graph, hp, Batch.from_tokens(b, output="all"))
    both = Batch.concat([Batch.from_tokens(a, seq=0, output="all"), Batch.from_tokens(b, seq=1, output="all")])
    lab = logits(graph, hp, both)
    np.testing.assert_allclose(lab[:9], la, atol=1e-5, rtol=0)
    np.testing.assert_allclose(lab[9:], lb, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_mixed_token_and_embedding_rows_equal_token_rows(registry, arch, backend):
    hp, graph = build(registry, arch, backend=backend)
    tokens = np.random.default_rng(3).integers(0, hp.n_vocab, 8).tolist()
    ref = logits(graph, hp, Batch.from_tokens(tokens, output="all"))
    table = graph.backend.to_numpy(graph.w["token_embd.weight"])
    mixed = Batch.concat([Batch.from_tokens(tokens[:3], output="all"),
                          Batch.from_embeddings(table[tokens[3:6]], start=3, output="all"),
                          Batch.from_tokens(tokens[6:], start=6, output="all")])
    np.testing.assert_allclose(logits(graph, hp, mixed), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_outputs_only_where_asked_and_deterministic(registry, arch, backend):
    hp, graph = build(registry, arch, backend=backend)
    tokens = list(range(10))
    full = logits(graph, hp, Batch.from_tokens(tokens, output="all"))
    mask = [i % 3 == 0 for i in range(10)]
    out = run(graph, hp, Batch.from_tokens(tokens, output=mask))
    assert out.logits.shape == (4, hp.n_vocab)
    np.testing.assert_array_equal(out.rows, [0, 3, 6, 9])
    np.testing.assert_allclose(graph.backend.to_numpy(out.logits), full[mask], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(logits(graph, hp, Batch.from_tokens(tokens, output="all")), full)


def test_feature_taps_and_pooling_skip_the_lm_head(registry):
    hp, graph = build(registry, "qwen3")
    tokens = list(range(7))
    out = graph.forward(Batch.from_tokens(tokens, output="all"), new_cache(graph, hp.n_layer), taps=(0, 1, hp.n_layer))
    assert sorted(out.features) == [0, 1, hp.n_layer]
    np.testing.assert_array_equal(out.features[0], graph.w["token_embd.weight"][tokens])
    pooled = graph.forward(Batch.from_tokens(tokens, output="all"), new_cache(graph, hp.n_layer), pooling="mean")
    assert pooled.logits is None and pooled.embeddings.shape == (1, hp.n_embd)


def test_kv_cache_seq_rm_and_cp(registry):
    hp, graph = build(registry, "llama")
    tokens = list(range(10))
    cache = new_cache(graph, hp.n_layer)
    graph.forward(Batch.from_tokens(tokens[:8]), cache)
    cache.seq_rm(0, 6)  # drop positions 6, 7 (a rejected draft)
    assert cache.n_cached(0) == 6 and cache.next_position(0) == 6
    again = graph.forward(Batch.from_tokens(tokens[6:], start=6, output="all"), cache).logits
    ref = run(graph, hp, Batch.from_tokens(tokens, output="all")).logits[6:]
    np.testing.assert_allclose(again, ref, atol=1e-5, rtol=0)
    cache.seq_cp(0, 3)
    assert cache.n_cached(3) == 10
    np.testing.assert_array_equal(cache.positions(3), np.arange(10))


def test_per_layer_head_counts_accessors(registry):
    md = tiny_metadata("llama")
    hp = registry.arch_hparams("llama", md, "x.gguf")
    assert hp.n_head_kv[1] == 2
    with pytest.raises(IndexError, match="layer 2 out of range"):
        hp.n_head_kv[2]


def test_missing_required_key_is_named(registry):
    md = tiny_metadata("qwen3")
    del md["qwen3.block_count"]
    with pytest.raises(KeyError, match="x.gguf: missing required key 'qwen3.block_count'"):
        registry.arch_hparams("qwen3", md, "x.gguf")


def test_gemma3_rope_scaling_on_global_layers_only_and_27b_scale(registry):
    md = tiny_metadata("gemma3", n_layer=7, attention__sliding_window=5, rope__scaling__type="linear",
                       rope__scaling__factor=8.0)
    hp = registry.arch_hparams("gemma3", md, "tiny-gemma3.gguf")
    assert [hp.sliding_window[il] == 0 for il in range(7)] == [False] * 5 + [True, False]  # scaled: global only
    specs = registry.arch_tensors("gemma3", hp)
    graph = registry.arch_build("gemma3", hp, random_tensors(specs), registry.make_backend("numpy"))
    pos = np.arange(4)
    tables = graph.rope.tables
    local, glob = tables[0](pos), tables[5](pos)
    assert tables[0] is tables[1] and tables[0] is not tables[5]
    assert tables[5] is not tables[6]  # same base as 5 would be, but not scaled
    assert not np.allclose(np.asarray(local[0]), np.asarray(glob[0]))
    assert hp.attn_scale == pytest.approx(1 / np.sqrt(hp.head_dim))
    md = tiny_metadata("gemma3", n_layer=62, n_embd=64, n_head=2, attention__key_length=16)
    big = registry.arch_hparams("gemma3", md, "27b.gguf")  # 27B: head_dim 128, n_embd / n_head 168
    assert big.head_dim == 16 and big.attn_scale == pytest.approx(1 / np.sqrt(32))


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_check_architecture(registry, arch, tmp_path, backend):
    """The test kit's whole-architecture contract: load, forward, rollback, plain and speculative generation."""
    from plinth.testing import check_architecture

    extra = dict(ARCHS[arch])
    n_layer = extra.pop("n_layer", 2)
    check_architecture(registry, arch, tiny_metadata(arch, n_vocab=257, n_layer=n_layer, **extra), tmp_path,
                       backend=backend)

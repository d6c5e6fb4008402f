"""The architecture contract on tiny Mistral Large 4 models, and what the cache holds.

Prefill then token-by-token decode, and prefill in uneven chunks, equal one full forward; two
sequences in one batch equal two separate runs; the cache keeps the MLA latent ``[c_kv ; k_rope]``
plus the indexer keys (never the expanded per-head K/V), "reuse" layers keep nothing, and the
bytes per token are printed beside an expanded K/V cache of the same model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.graph import Batch
from plinth.testing import CONTRACT_BACKENDS, check_prefill_then_decode, new_cache

from plinth.graph import IndexerKeys, Latent, SharedKV
from plinth_mistral.mistral_large4 import cache_bytes_per_token, cache_widths

CASES = ["issue", "nope_share", "deep"]


def tokens(n, seed=0, vocab=256):
    return np.random.default_rng(seed).permutation(vocab)[:n].tolist()


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_prefill_then_decode_equals_full_forward(mistral_models, case, backend):
    """On the strict device stand-in, a decode forward also makes no host round trip."""
    model = mistral_models(case, backend)
    check_prefill_then_decode(model.graph, model.hparams.n_layer, tokens(40, 1), n_prefill=9, atol=2e-5)


@pytest.mark.parametrize("case", CASES)
def test_chunked_prefill_equals_full_forward(mistral_models, case):
    """Prefill in chunks of 1, 5, 30 and 64 rows (top-k above and below each chunk's key count)."""
    model = mistral_models(case)
    g, n_layer = model.graph, model.hparams.n_layer
    toks = tokens(100, 2)
    full = g.forward(Batch.from_tokens(toks, output="all"), new_cache(g, n_layer)).logits
    cache, parts, start = new_cache(g, n_layer), [], 0
    for size in (1, 5, 30, 64):
        parts.append(g.forward(Batch.from_tokens(toks[start:start + size], start=start, output="all"), cache).logits)
        start += size
    np.testing.assert_allclose(np.concatenate(parts), full, atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
def test_two_sequences_in_one_batch_equal_two_runs(mistral_models, backend):
    model = mistral_models("issue", backend)
    g, n_layer, xp, host = model.graph, model.hparams.n_layer, model.backend.xp, model.backend.to_numpy

    def run(batch):
        return host(g.forward(batch, new_cache(g, n_layer, xp)).logits)

    a, b = tokens(30, 3), tokens(12, 4)
    ra, rb = run(Batch.from_tokens(a, output="all")), run(Batch.from_tokens(b, output="all"))
    batch = Batch.concat([Batch.from_tokens(a, seq=0, output="all"), Batch.from_tokens(b, seq=1, output="all")])
    both = run(batch)
    np.testing.assert_allclose(both[:30], ra, atol=1e-5, rtol=0)
    np.testing.assert_allclose(both[30:], rb, atol=1e-5, rtol=0)
    # the same rows interleaved (non-contiguous rows per sequence)
    order = np.argsort(np.concatenate([np.arange(30) * 2, np.arange(12) * 5 + 1]), kind="stable")
    mixed = Batch(tokens=batch.tokens[order], positions=batch.positions[order], seq_ids=batch.seq_ids[order],
                  output=batch.output[order])
    np.testing.assert_allclose(run(mixed), both[order], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_cache_holds_the_latent_and_reuse_layers_hold_nothing(mistral_models, case):
    model = mistral_models(case)
    hp = model.hparams
    ctx = model.new_context()
    n = 37
    ctx.decode(tokens(n, 5))
    held = 0
    for il, width in enumerate(cache_widths(hp)):
        kinds = ctx.cache.layers[il]
        mode = hp.kv_sharing[il]
        types = [type(k) for k in kinds]
        if mode in ("reuse", "reuse_but_indexer"):  # the source's latent, nothing of its own ...
            assert types[0] is SharedKV and kinds[0].source == hp.kv_source[il]
            assert kinds[0].nbytes() == 0
        else:  # [c_kv ; k_rope] (k_rope empty on NoPE layers)
            c, r, pos = kinds[0].get(0)
            assert types[0] is Latent and c.shape == (n, hp.kv_lora_rank) and r.shape == (n, hp.rope_width(il))
            held += (c.size + r.size) * 4
        if hp.has_indexer(il):  # ... but its own indexer keys
            (k, pos) = kinds[1].get(0)
            assert types[1] is IndexerKeys and k.shape == (n, hp.idx_head_dim)
            held += k.size * 4
        assert len(kinds) == 1 + hp.has_indexer(il)
        assert width.latent + width.index_key == sum(k.nbytes() // n - 8 for k in kinds if k.nbytes()) // 4
    latent, expanded = cache_bytes_per_token(hp)
    assert held == latent * n
    by_kind = ctx.cache.nbytes_by_kind()
    print(f"{case}: cache {latent} bytes/token (latent + indexer keys) vs {expanded} bytes/token expanded K/V "
          f"({expanded / latent:.1f}x); layers {list(hp.kv_sharing)}; held by kind {by_kind}")
    assert latent < expanded and "kv" not in by_kind


def test_cache_bytes_of_the_full_size_model():
    """Mistral Large 4's own shapes (72 layers, 64 heads, rank 512, every 4th layer NoPE, no sharing)."""
    from plinth_mistral.mistral_large4 import MistralLarge4

    a = "mistral_large4"
    n = 72
    md = {f"{a}.block_count": n, f"{a}.embedding_length": 6144, f"{a}.context_length": 1048576,
          f"{a}.attention.layer_norm_rms_epsilon": 1e-5, f"{a}.attention.head_count": 64,
          f"{a}.attention.kv_lora_rank": 512, f"{a}.attention.key_length": 128, f"{a}.attention.value_length": 128,
          f"{a}.rope.dimension_count": 64, f"{a}.rope.layers": [int((i + 1) % 4 != 0) for i in range(n)],
          f"{a}.attention.indexer.types": ["full"] * n, f"{a}.attention.indexer.head_count": 32,
          f"{a}.attention.indexer.key_length": 128, f"{a}.attention.indexer.top_k": 2048,
          f"{a}.leading_dense_block_count": 1, f"{a}.feed_forward_length": 24576, f"{a}.expert_count": 128,
          f"{a}.expert_used_count": 4, f"{a}.expert_feed_forward_length": 6144, f"{a}.vocab_size": 204800}
    hp = MistralLarge4().load_hparams(md, "full-size")
    latent, expanded = cache_bytes_per_token(hp)
    # RoPE layers: 512 + 64 latent floats, NoPE: 512; plus 128 indexer floats each
    assert latent == 4 * (54 * (576 + 128) + 18 * (512 + 128))
    assert expanded == 4 * 72 * (64 * 256 + 128)
    print(f"Mistral Large 4 shapes: {latent / 1024:.0f} KiB/token latent vs {expanded / 1024:.0f} KiB/token expanded")


def test_feature_taps_for_a_drafter(mistral_models):
    """Taps k = input of layer k, k = n_layer the residual before the final norm (what a DSpark head reads)."""
    model = mistral_models("issue")
    n = model.hparams.n_layer
    ctx = model.new_context(taps=(1, n))
    out = ctx.decode(tokens(9, 6), output="all")
    assert sorted(out.features) == [1, n]
    assert all(f.shape == (9, model.hparams.n_embd) for f in out.features.values())
    again = model.new_context(taps=(1, n)).decode(tokens(9, 6), output="all")
    np.testing.assert_array_equal(out.logits, again.logits)  # deterministic


@pytest.mark.parametrize("case", CASES)
def test_absorbed_and_expanded_mla_agree(mistral_models, case, monkeypatch):
    """Both MLA forms (W_kv_b absorbed into q and o, or K/V expanded per head) on the same 60 rows."""
    import plinth_mistral.mistral_large4 as ml

    model = mistral_models(case)
    toks = tokens(60, 8)
    runs = []
    for limit in (0, 10**6):
        monkeypatch.setattr(ml, "ABSORB_MAX_ROWS", limit)
        runs.append(model.graph.forward(Batch.from_tokens(toks, output="all"), new_cache(model.graph, model.hparams.n_layer)).logits)
    np.testing.assert_allclose(runs[0], runs[1], atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
def test_mixed_token_and_embedding_rows_equal_token_rows(mistral_models, backend):
    model = mistral_models("issue", backend)
    g, n_layer, be = model.graph, model.hparams.n_layer, model.backend
    toks = tokens(12, 7)
    table = be.to_numpy(model.weights["token_embd.weight"])
    ref = be.to_numpy(g.forward(Batch.from_tokens(toks, output="all"), new_cache(g, n_layer, be.xp)).logits)
    mixed = Batch.concat([Batch.from_tokens(toks[:4], output="all"),
                          Batch.from_embeddings(table[toks[4:9]], start=4, output="all"),
                          Batch.from_tokens(toks[9:], start=9, output="all")])
    got = be.to_numpy(g.forward(mixed, new_cache(g, n_layer, be.xp)).logits)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
def test_core_architecture_contract(tmp_path, backend):
    """The test kit's whole-architecture contract (load, prefill/decode, two sequences, rollback,
    generation, speculative decoding with ngram and random drafters) on the issue's layer pattern."""
    from plinth.testing import check_architecture, load_module
    from plinth_mistral.convert import metadata, text_config

    golden = load_module(Path(__file__).resolve().parent / "golden" / "make_golden.py")
    cfg = golden.config("issue")
    cfg["text_config"]["vocab_size"] = 257
    md = metadata(text_config(cfg), "contract")
    check_architecture(golden.registry(), "mistral_large4", md, tmp_path, backend=backend)

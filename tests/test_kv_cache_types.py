"""Typed K/V caches (``cache_type_k`` / ``cache_type_v``) on a tiny llama: logits near the float32
cache's, rows stored in the type's bytes, the bits of a row independent of its batch (a verify batch's
row against its decode step, several sequences in one step against each alone), rollback / snapshot /
seq_cp on typed rows, the rotation's switch, and speculative decoding with a random DFlash draft equal
to plain greedy decoding on a q8_0 cache."""

from __future__ import annotations

import numpy as np
import pytest

import plinth
from plinth.graph import Batch
from plinth.testing import byte_vocab, tiny_metadata, write_synthetic_gguf
from plinth.testing.scheduling import run_requests

N_EMBD, N_HEAD, N_HEAD_KV, N_LAYER = 256, 4, 2, 2  # head size 64: the rotation applies
HD = N_EMBD // N_HEAD


@pytest.fixture(scope="module")
def registry():
    from plinth.testing import make_registry
    from plinth_llama.plugin import plugin

    return make_registry(plugin)


@pytest.fixture(scope="module")
def path(registry, tmp_path_factory):
    md = tiny_metadata("llama", n_vocab=257, n_embd=N_EMBD, n_head=N_HEAD, n_head_kv=N_HEAD_KV, n_layer=N_LAYER,
                       n_ff=128, n_ctx=512) | byte_vocab()
    return write_synthetic_gguf(tmp_path_factory.mktemp("kvt") / "tiny.gguf", "llama", md, registry, seed=5)


def _load(path, registry, k="f32", v="f32"):
    return plinth.load_model(path, registry=registry, cache_type_k=k, cache_type_v=v)


PROMPT = list(np.random.default_rng(0).integers(1, 257, 40))


def _decode_logits(model, tokens, **types):
    ctx = model.new_context(**types)
    out = [np.asarray(ctx.decode(tokens[:8], output="last").logits[-1])]
    for t in tokens[8:]:
        out.append(np.asarray(ctx.decode([t]).logits[-1]))
    return np.stack(out), ctx


# (a random tiny model's attention is sharp: rounding K/V moves its logits far more than a trained model's)
@pytest.mark.parametrize("k,v,tol", [("f16", "f16", 1e-2), ("bf16", "bf16", 0.15), ("q8_0", "q8_0", 0.15),
                                     ("q4_0", "q4_0", None), ("q5_1", "q8_0", 0.6), ("q8_0", "f32", 0.15)])
def test_logits_near_f32_and_bytes(path, registry, k, v, tol):
    model = _load(path, registry)
    ref, _ = _decode_logits(model, PROMPT)
    got, ctx = _decode_logits(model, PROMPT, cache_type_k=k, cache_type_v=v)
    if tol is not None:
        assert np.abs(got - ref).max() <= tol * np.abs(ref).max()
    from plinth.kvtypes import cache_type

    kt, vt = cache_type(k), cache_type(v)
    per_layer = N_HEAD_KV * (kt.row_bytes(HD) + vt.row_bytes(HD)) + 8  # (+ the position)
    assert ctx.cache.nbytes_by_kind() == {"kv": N_LAYER * per_layer * len(PROMPT)}


def test_model_default_and_refusals(path, registry):
    model = _load(path, registry, "q8_0", "q4_0")
    ctx = model.new_context()
    ctx.decode(PROMPT[:5])
    kv = ctx.cache.kv(0)
    assert kv.typed and [c.type.name for c in kv.codecs] == ["q8_0", "q4_0"]
    assert [c.rot for c in kv.codecs] == [64, 64]
    assert ctx.cache.kv(0).buffers(0)[0].dtype == np.uint8
    with pytest.raises(plinth.UserError, match="unknown cache type 'q3_k'"):
        _load(path, registry, "q3_k")


def test_rotation_switch(path, registry, monkeypatch):
    model = _load(path, registry, "q4_0", "q4_0")
    monkeypatch.setenv("PLINTH_ATTN_ROT_DISABLE", "1")
    ctx = model.new_context()
    ctx.decode(PROMPT[:5])
    assert [c.rot for c in ctx.cache.kv(0).codecs] == [0, 0]


@pytest.mark.parametrize("k", ["q8_0", "q4_0", "f16"])
def test_verify_rows_and_server_rows_give_the_decode_bits(path, registry, k):
    """Row 0 of a verify batch (1 + m rows) against the lone decode step; a step of three sequences
    against each alone: the logits' bits."""
    model = _load(path, registry, k, k)
    base = model.new_context()
    base.decode(PROMPT[:20])
    lone = np.asarray(base.decode([PROMPT[20]]).logits[-1])
    for m in (1, 3, 8):
        ctx = model.new_context()
        ctx.decode(PROMPT[:20])
        out = ctx.decode(PROMPT[20:21] + PROMPT[21:21 + m], output="all")
        np.testing.assert_array_equal(np.asarray(out.logits[0]).view(np.uint32), lone.view(np.uint32))
    # three sequences with other histories in one step
    ctx = model.new_context()
    for s, n in ((0, 20), (1, 7), (2, 31)):
        ctx.decode(PROMPT[:n] if s == 0 else PROMPT[s:s + n], seq=s)
    toks = [PROMPT[20], PROMPT[9], PROMPT[33]]
    pos = [20, 7, 31]
    b = Batch(tokens=np.array(toks), positions=np.array(pos), seq_ids=np.arange(3), output=np.ones(3, bool))
    out = ctx.forward(b)
    np.testing.assert_array_equal(np.asarray(out.logits[0]).view(np.uint32), lone.view(np.uint32))


def test_rollback_snapshot_copy(path, registry):
    model = _load(path, registry, "q8_0", "q4_1")
    ctx = model.new_context()
    ctx.decode(PROMPT[:12])
    want = np.asarray(ctx.decode(PROMPT[12:14], output="all").logits)
    snap = ctx.cache.snapshot(0)
    ctx.cache.seq_cp(0, 3)
    ctx.decode(PROMPT[14:20])
    ctx.cache.seq_rm(0, 12)  # cut the last 8
    again = np.asarray(ctx.decode(PROMPT[12:14], output="all").logits)
    np.testing.assert_array_equal(again, want)
    ctx.decode(PROMPT[14:18])
    ctx.cache.restore(snap)
    assert ctx.cache.n_cached(0) == 14
    nxt = np.asarray(ctx.decode([PROMPT[14]]).logits[-1])
    other = np.asarray(ctx.decode([PROMPT[14]], seq=3).logits[-1])  # the copy made at the snapshot
    np.testing.assert_array_equal(nxt, other)


def test_long_prompt_path_reads_the_same_rows(path, registry, monkeypatch):
    """A prompt past the kernels' row bound takes the general path (unpacked rows, BLAS): its logits stay
    near the rows path's (the same stored blocks)."""
    import sys

    att = sys.modules["plinth.ops.attention"]

    model = _load(path, registry, "q8_0", "q8_0")
    a = np.asarray(model.new_context().decode(PROMPT, output="all").logits)
    monkeypatch.setattr(att, "KERNEL_MAX_Q", 4)
    import plinth.graph as g

    monkeypatch.setattr(g, "_rows_path", lambda kv, shared, step: False)
    b = np.asarray(model.new_context().decode(PROMPT, output="all").logits)
    # the two paths round differently (kernel vs BLAS), and this random model's sharp attention can
    # magnify that in a row (0.013 of 12.9 at one position); reading other rows, or the rows unrotated,
    # would move every row by the cache type's own error (~0.5 here, f32 cache against q8_0)
    np.testing.assert_allclose(a, b, atol=2e-3 * np.abs(a).max())
    assert np.median(np.abs(a - b).max(axis=1)) < 1e-4 * np.abs(a).max()


def test_dflash_random_draft_lossless_on_q8_0(path, registry, tmp_path):
    pytest.importorskip("plinth_dflash")
    from plinth_dflash.drafter import make_dflash
    from plinth_dflash.testkit import write_tiny_draft

    from plinth.generate import Generator
    from plinth.sampling import Sampler, SamplerConfig
    from plinth.speculative.engine import SpecConfig, SpeculativeGenerator

    model = _load(path, registry, "q8_0", "q8_0")
    draft = write_tiny_draft(tmp_path / "d.gguf", "dflash", n_embd=N_EMBD, n_vocab=model.n_vocab, n_layer=1, n_head=4,
                             n_head_kv=2, head_dim=64, n_ff=128, taps=[0, 1], block_size=5, mask_token=0, scale=0.05)
    greedy = SamplerConfig(temperature=0.0)
    prompt = [int(t) for t in PROMPT[:10]]
    want = Generator(model, Sampler(greedy)).generate(prompt, 30)
    for n_max in (2, 4):
        gen = SpeculativeGenerator(model, [make_dflash(model, {"draft": str(draft)})],
                                   config=SpecConfig(n_max=n_max, verifier="greedy"), sampler=greedy)
        assert gen.generate(prompt, 30) == want


def test_cli_flags(path, capsys):
    """-ctk / -ctv on info --cache (bytes of the rows a token), generate and bench; an unknown type is
    refused by argparse before anything loads."""
    from plinth.cli import main

    assert main(["--plugins", "llama", "info", str(path), "--cache", "-ctk", "q8_0", "-ctv", "q4_0"]) == 0
    out = capsys.readouterr().out
    k, v = N_LAYER * N_HEAD_KV * HD // 32 * 34, N_LAYER * N_HEAD_KV * HD // 32 * 18
    assert f"k q8_0, v q4_0: K {k} bytes, V {v} bytes a token" in out
    assert main(["--plugins", "llama", "generate", "-m", str(path), "-n", "4", "--temperature", "0",
                 "--cache-type-k", "q5_0", "--cache-type-v", "bf16", "hi"]) == 0
    assert main(["--plugins", "llama", "bench", "-m", str(path), "--prompt-tokens", "8", "--decode-tokens", "2",
                 "--runs", "1", "-ctk", "f16", "-ctv", "q8_0"]) == 0
    with pytest.raises(SystemExit):
        main(["--plugins", "llama", "generate", "-m", str(path), "-ctk", "q2_k", "hi"])
    assert "'q2_k' is not a cache type" in capsys.readouterr().err


def test_dflash_draft_over_a_typed_cache(path, registry, tmp_path):
    """A DFlash draft whose own cache is q8_0: its injected K/V (written by cache.update, outside
    graph.attend) are turned into the cache's space on the way in and back on the way out, so its
    block's hidden states stay near the float32 cache's, and verification stays lossless."""
    pytest.importorskip("plinth_dflash")
    from plinth_dflash.drafter import make_dflash
    from plinth_dflash.testkit import write_tiny_draft

    from plinth.generate import Generator
    from plinth.kvtypes import CacheTypes
    from plinth.sampling import Sampler, SamplerConfig
    from plinth.speculative.engine import SpecConfig, SpeculativeGenerator

    model = _load(path, registry)
    draft = write_tiny_draft(tmp_path / "d.gguf", "dflash", n_embd=N_EMBD, n_vocab=model.n_vocab, n_layer=2, n_head=4,
                             n_head_kv=2, head_dim=64, n_ff=128, taps=[0, 1], block_size=5, mask_token=0, scale=0.05)
    hidden = {}
    for kind in ("f32", "q8_0"):
        d = make_dflash(model, {"draft": str(draft)})
        d.cache = d.graph.new_cache(types=CacheTypes(k=kind, v=kind))
        rng = np.random.default_rng(3)
        g = rng.standard_normal((12, N_EMBD)).astype(np.float32)
        d.graph.inject(d.cache, 0, np.arange(12), g)
        hidden[kind] = np.asarray(d.graph.forward_block(d.cache, 0, [5, 0, 0, 0], np.arange(12, 16)))
        if kind == "q8_0":
            assert [c.rot for c in d.cache.kv(0).codecs] == [64, 64]
    assert np.abs(hidden["q8_0"] - hidden["f32"]).max() <= 0.05 * np.abs(hidden["f32"]).max()
    greedy = SamplerConfig(temperature=0.0)
    prompt = [int(t) for t in PROMPT[:10]]
    want = Generator(model, Sampler(greedy)).generate(prompt, 20)
    d = make_dflash(model, {"draft": str(draft)})
    d.cache = d.graph.new_cache(types=CacheTypes(k="q4_0", v="q8_0"))
    gen = SpeculativeGenerator(model, [d], config=SpecConfig(n_max=4, verifier="greedy"), sampler=greedy)
    assert gen.generate(prompt, 20) == want


def test_latent_and_indexer_keys_take_the_key_type(monkeypatch):
    """An MLA latent and DeepSeek's indexer keys are stored in the key type (turned: the latent as the
    switch says, the indexer keys always); get() returns them unpacked, near what was written."""
    from types import SimpleNamespace

    from plinth.cache import Cache, IndexerKeys, Latent
    from plinth.kvtypes import CacheTypes

    monkeypatch.setenv("PLINTH_ATTN_ROT_DISABLE", "1")
    rng = np.random.default_rng(2)
    cache = Cache(1, layout=[(Latent(), IndexerKeys())], types=CacheTypes(k="q8_0", v="q4_0"))
    c_kv, k_rope, idx = (rng.standard_normal((6, n)).astype(np.float32) for n in (512, 64, 128))
    pos = np.arange(6)
    with cache.forward(SimpleNamespace(positions=pos, seq_ids=np.zeros(6, np.int64))):
        cache.find(0, Latent).update(0, pos, c_kv, k_rope)
        cache.find(0, IndexerKeys).update(0, pos, idx)
    lat, ind = cache.find(0, Latent), cache.find(0, IndexerKeys)
    assert [c.type.name for c in lat.codecs] == ["q8_0", "q8_0"] and [c.rot for c in lat.codecs] == [0, 0]
    assert ind.codecs[0].type.name == "q8_0" and ind.codecs[0].rot == 128  # whatever the switch
    a, b, p = lat.get(0)
    np.testing.assert_allclose(a, c_kv, atol=0.02)
    np.testing.assert_allclose(b, k_rope, atol=0.02)
    np.testing.assert_allclose(ind.get(0)[0], idx, atol=0.05)
    assert cache.nbytes_by_role() == {"k": 6 * (512 + 64 + 128) // 32 * 34}


def test_quantized_draft_keeps_its_blocks(path, registry, tmp_path):
    """A DFlash draft GGUF with Q8_0 projections keeps them as quantized weights (as a target does), drafts
    near its dequantized load, and verification stays lossless."""
    pytest.importorskip("plinth_dflash")
    from plinth_dflash.drafter import make_dflash
    from plinth_dflash.testkit import random_draft_tensors, tiny_draft_metadata

    from plinth.convert import write_gguf
    from plinth.generate import Generator
    from plinth.quant import QuantWeight
    from plinth.sampling import Sampler, SamplerConfig
    from plinth.speculative.engine import SpecConfig, SpeculativeGenerator

    gguf = pytest.importorskip("gguf")
    model = _load(path, registry)
    md = tiny_draft_metadata("dflash", n_embd=N_EMBD, n_vocab=model.n_vocab, n_layer=1, n_head=4, n_head_kv=2,
                             head_dim=64, n_ff=128, taps=[0, 1], block_size=5, mask_token=0)
    tensors = random_draft_tensors(md, "dflash", seed=2, scale=0.05)
    q8 = {n: gguf.GGMLQuantizationType.Q8_0 for n, t in tensors.items()
          if t.ndim == 2 and (n.startswith("blk.") or n == "fc.weight")}
    draft = write_gguf(tmp_path / "q8.gguf", md, tensors, q8)
    d = make_dflash(model, {"draft": str(draft)})
    kept = {n for n, w in d.graph.w.items() if isinstance(w, QuantWeight)}
    assert kept == set(q8)
    greedy = SamplerConfig(temperature=0.0)
    prompt = [int(t) for t in PROMPT[:10]]
    want = Generator(model, Sampler(greedy)).generate(prompt, 20)
    gen = SpeculativeGenerator(model, [d], config=SpecConfig(n_max=4, verifier="greedy"), sampler=greedy)
    assert gen.generate(prompt, 20) == want


def test_server_steps_and_prompt_cache_on_a_typed_cache(path, registry):
    """plinth serve's scheduler on a q8_0 / q4_0 cache: requests decoding together (prompts in chunks) and
    a request served from the prompt cache (seq_cp of typed rows) each give a lone run's tokens."""
    from plinth.generate import Generator
    from plinth.serve.scheduler import Scheduler

    model = _load(path, registry, "q8_0", "q4_0")
    prompts = [[int(t) for t in PROMPT[i:i + 5 + 3 * i]] for i in range(4)]
    sched = Scheduler(model, max_batch=3, prefill_chunk=7, prompt_cache=4)
    sched.start()
    try:
        for round_ in range(2):  # the second round: every prompt from the prompt cache
            out = run_requests(sched, [dict(prompt_ids=p, max_tokens=12) for p in prompts])
            assert out == [Generator(model).generate(p, 12) for p in prompts], f"round {round_}"
        assert sched.metrics.prompt_cache_hits >= 1
    finally:
        sched.stop()


def test_rows_grow_no_further_than_the_context(path, registry):
    """A sequence's buffers grow by doubling but never past the context (llama.cpp sizes its cache to n_ctx):
    70 + 20 tokens in a 100-token context hold 100 rows, not 140."""
    model = plinth.load_model(path, registry=registry, n_ctx=100, cache_type_k="q8_0", cache_type_v="q8_0")
    ctx = model.new_context()
    ctx.decode([int(t) for t in PROMPT[:35]] * 2)
    ctx.decode([int(t) for t in PROMPT[:20]])
    assert ctx.cache.kv(0).buffers(0)[0].shape[0] == 100


def test_typed_rows_are_stored_head_major(path, registry):
    """A typed field's rows are a view of head-major memory (one kv head's rows contiguous: what a decode row's
    attention task streams), through growth and seq_cp, and they hold the rows the model wrote."""
    from plinth.cache import KV

    model = _load(path, registry, "f16", "q8_0")
    ctx = model.new_context()
    ctx.decode(PROMPT[:20])  # 16 rows, then grown
    ctx.cache.seq_cp(0, 2)
    kv = next(k for k in ctx.cache.kinds() if isinstance(k, KV))
    for seq in (0, 2):
        for b, rb in zip(kv.buffers(seq)[:2], (2 * HD, 34 * HD // 32)):
            n = b.shape[0]
            assert b.shape == (n, N_HEAD_KV, rb) and b.strides == (rb, n * rb, 1), (seq, b.shape, b.strides)
        k, v, pos = kv.get(seq)
        assert k.shape == (20, N_HEAD_KV, HD) and list(pos) == list(range(20))
    np.testing.assert_array_equal(kv.get(0)[0], kv.get(2)[0])
    np.testing.assert_array_equal(kv.get(0)[1], kv.get(2)[1])

"""The ngram-cache drafter (plinth.speculative.ngram_cache): its table against a plain counting reference, the
file and its refusals, the chained draft, the shipped SmolLM2 cache, and output equal to plain decoding."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from plinth.errors import UserError
from plinth.generate import Generator
from plinth.speculative import ngram_cache as nc
from plinth.speculative.engine import SpecConfig, SpeculativeGenerator


def reference(seqs, n, min_count, min_share):
    """The table for contexts of ``n`` by counting every (context, next) pair one at a time."""
    counts: dict[tuple[int, ...], collections.Counter] = collections.defaultdict(collections.Counter)
    for toks, n_prompt in seqs:
        toks = [int(t) for t in toks]
        for i in range(max(n, n_prompt), len(toks)):
            counts[tuple(toks[i - n:i])][toks[i]] += 1
    out = {}
    for ctx, c in counts.items():
        total = sum(c.values())
        top = max(c.values())
        tok = min(t for t, k in c.items() if k == top)
        if total >= min_count and top >= min_share * total:
            out[ctx] = tok
    return out


@pytest.mark.parametrize("min_count, min_share", [(1, 0.5), (2, 0.6), (3, 0.34), (5, 0.9)])
def test_the_table_is_what_counting_gives(min_count, min_share):
    rng = np.random.default_rng(min_count)
    seqs = []
    for _ in range(40):  # a small vocabulary and a bias towards repeats: many contexts, ties among them
        n = int(rng.integers(0, 60))
        toks = rng.integers(0, 6, size=n) if rng.random() < 0.5 else np.tile(rng.integers(0, 9, size=5), 12)[:n]
        seqs.append((toks.astype(np.int32), int(rng.integers(0, 12))))
    table = nc.build(seqs, n_min=1, n_max=3, min_count=min_count, min_share=min_share)
    for n in (1, 2, 3):
        ctx, nxt = table[n]
        got = {tuple(c): int(t) for c, t in zip(ctx.tolist(), nxt.tolist())}
        assert got == reference(seqs, n, min_count, min_share), n
        assert ctx.dtype == nxt.dtype == np.int32 and ctx.shape == (len(nxt), n)


def tiny_meta(n_vocab=50, **kw):
    return {"target": "tiny", "n_vocab": n_vocab, **kw}


def test_a_file_round_trips_and_a_bad_one_is_refused_by_name(tmp_path):
    seqs = [(np.array([1, 2, 3, 1, 2, 3, 1, 2, 4], np.int32), 0)] * 3
    table = nc.build(seqs, min_count=2, min_share=0.5)
    path = tmp_path / "c.npz"
    nc.save(path, table, tiny_meta())
    got, info = nc.load(path, 50)
    assert got[2][(1, 2)] == 3 and got[3][(3, 1, 2)] == 3 and info["target"] == "tiny" and info["entries"] > 0
    with pytest.raises(nc.NgramCacheError, match="vocabulary of 50 tokens .*the target has 49152"):
        nc.load(path, 49152)
    (tmp_path / "x.npz").write_bytes(b"not a zip")
    with pytest.raises(nc.NgramCacheError, match="not an n-gram cache file"):
        nc.load(tmp_path / "x.npz")
    np.save(tmp_path / "one.npy", np.arange(3))
    with pytest.raises(nc.NgramCacheError, match="one array, not an .npz archive"):
        nc.load(tmp_path / "one.npy")
    nc.save(tmp_path / "small.npz", table, tiny_meta(n_vocab=3))  # token 3 is outside a 3-token vocabulary
    with pytest.raises(nc.NgramCacheError, match="outside 0..2"):
        nc.load(tmp_path / "small.npz")
    with open(tmp_path / "v.npz", "wb") as f:
        np.savez(f, meta=np.asarray(json.dumps({"format": nc.FORMAT, "version": 99})))
    with pytest.raises(nc.NgramCacheError, match="version 99"):
        nc.load(tmp_path / "v.npz")
    with pytest.raises(UserError, match="neither a file nor a shipped cache"):
        nc.resolve("no-such-cache", None)


def test_a_draft_chains_the_longest_kept_context():
    table = {2: {(1, 2): 3, (3, 9): 7}, 3: {(1, 2, 3): 9, (2, 3, 9): 5}}
    d = nc.NgramCacheDrafter(table)
    # (1,2,3) -> 9 by the longest context; then (2,3,9) -> 5; then (3,9,5) and (9,5) are not kept: stop
    assert d.draft(0, 8, history=[0, 1, 2, 3], pos=4).tokens == (9, 5)
    assert d.draft(0, 1, history=[0, 1, 2, 3], pos=4).tokens == (9,)
    assert d.draft(0, 8, history=[5, 3, 9], pos=3).tokens == (7,)  # (5,3,9) unknown: (3,9) -> 7, then nothing
    assert d.draft(0, 8, history=[4], pos=1).tokens == ()


def test_the_shipped_smollm2_cache_is_found_by_the_targets_name():
    path = nc.HERE / "smollm2-135m-instruct.npz"
    table, info = nc.load(path, 49152)
    target = type("T", (), {"metadata": {"general.name": info["target"]}, "n_vocab": 49152})()
    assert nc.resolve(None, target) == path and nc.resolve("smollm2-135m-instruct", None) == path
    assert nc.resolve("drafter.gguf", target) == path  # (--spec ngram-cache,dspark --draft drafter.gguf)
    assert info["answer_tokens"] >= 1_000_000 and sum(len(t) for t in table.values()) == info["entries"] > 100_000
    other = type("T", (), {"metadata": {"general.name": "another"}, "n_vocab": 49152})()
    with pytest.raises(UserError, match="needs a cache made for this model \\('another'\\)"):
        nc.resolve(None, other)


@pytest.mark.parametrize("policy", ["auto", "always"])
def test_output_equals_plain_decoding(byte_llama, tmp_path, policy):
    """A cache made from the target's own answers (to two of the prompts: long drafts kept; to others: drafts
    rejected): greedy output equals plain decoding under either policy."""
    g = Generator(byte_llama)
    corpus = [list(b"once upon a time"), list(b"the cat sat"), list(b"abcabc"), list(b"hello world")]
    seqs = [(np.array(p + g.generate(p, 60), np.int32), len(p)) for p in corpus]
    nc.save(tmp_path / "t.npz", nc.build(seqs, min_count=1, min_share=0.5), tiny_meta(n_vocab=byte_llama.n_vocab))
    drafter = nc.make_ngram_cache(byte_llama, {"draft": str(tmp_path / "t.npz"), "n_max": 8})
    gen = SpeculativeGenerator(byte_llama, [drafter], config=SpecConfig(n_max=8, policy=policy))
    drafts = accepted = 0
    for p in corpus[:2] + [list(b"the cat"), list(b"xyz abc"), list(b"hello")]:  # (answers in the cache, and not)
        assert gen.generate(p, 50) == g.generate(p, 50)
        drafts, accepted = drafts + gen.stats.n_drafts, accepted + gen.stats.n_accepted
    assert drafts >= 4 and accepted >= 10


def test_the_command_makes_a_file_from_shards(byte_llama, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    seqs = [[1, 2, 3, 10, 11, 12, 10, 11, 12], [4, 10, 11, 12, 10, 11, 12, 10]]
    toks = np.concatenate([np.array(s, np.int32) for s in seqs])
    np.savez(data / "shard-00000.npz", tokens=toks, offsets=np.array([0, 9, 17], np.int64),
             n_prompt=np.array([3, 1], np.int32), prompt_index=np.array([0, 1], np.int64))
    out = tmp_path / "c.npz"
    assert nc.main([str(byte_llama.path), str(data), "-o", str(out), "--min-count", "2", "--min-share", "0.9"]) == 0
    table, info = nc.load(out, byte_llama.n_vocab)
    assert table[2][(10, 11)] == 12 and table[2][(11, 12)] == 10 and info["answer_tokens"] == 13
    assert info["target"] == byte_llama.metadata.get("general.name") and info["n_vocab"] == byte_llama.n_vocab
    assert nc.main([str(byte_llama.path), str(tmp_path / "none"), "-o", str(out)]) == 1
    assert "no shards" in capsys.readouterr().err

"""Engram pieces of deepseek41: hash golden values, look-back, pad rows, validation, the lazy table.

The golden rows use the constants of a fork's test (multipliers [3, 5], primes [67, 71],
offsets [0, 67], pad 2, N = 2, two heads, identity token map); the expected rows are worked out
by hand in the comments (rolling = ctx0·3 XOR ctx1·5; row_h = rolling mod prime_h + offset_h).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.hparams import HParamsError, KeyReader
from plinth.testing import load_module
from plinth_deepseek41 import engram as eg
from plinth_deepseek41.convert import gguf_metadata
from plinth_deepseek41.deepseek41 import load_hparams

GOLDEN = Path(__file__).resolve().parent / "golden"
g41 = load_module(GOLDEN / "make_golden41.py")

FORK = dict(layer_ids=[1], n_head=2, max_ngram=2, key_length=32, pad_id=2, multipliers=[3, 5], primes=[67, 71],
            offsets=[0, 67], token_map=list(range(64)))


def fork_params(**changes):
    md, _ = g41.engram_metadata(dict(FORK, **changes))
    md["deepseek41.block_count"] = 4
    return eg.read_engram(KeyReader(md, "fork.gguf", "deepseek41"), n_layer=4, n_vocab=64)


def rows_of(ep, tokens, is_embd=None, history=None, seq_rows=None):
    seq_rows = seq_rows or [(0, slice(0, len(tokens)))]
    ctx, after = eg.engram_rows_for_batch(np.asarray(tokens), None if is_embd is None else np.asarray(is_embd),
                                          seq_rows, history or {}, ep)
    return eg.hash_rows(ctx, ep.multipliers[0], ep.primes[0], ep.offsets[0], ep.n_head).tolist(), after


# ---------------------------------------------------------------- hash golden values


def test_fork_constants_give_the_known_rows():
    ep = fork_params()
    rows, after = rows_of(ep, [10, 20, 30, 50, 40])
    assert rows == [
        [20, 87],  # t0 (10, pad 2): 30 ^ 10 = 20;  20 % 67 + 0 = 20, 20 % 71 + 67 = 87 (look-back before the start: pad)
        [14, 81],  # t1 (20, 10): 60 ^ 50 = 14
        [62, 129],  # t2 (30, 20): 90 ^ 100 = 62
        [0, 67],  # t3 (50, 30): 150 ^ 150 = 0
        [63, 126],  # t4 (40, 50): 120 ^ 250 = 130;  130 % 67 = 63, 130 % 71 + 67 = 126
    ]
    assert after[0].tolist() == [40]  # N - 1 = 1 id of look-back kept for the next batch


def test_lookback_continues_across_batches_and_stops_at_the_sequence_start():
    ep = fork_params()
    first, after = rows_of(ep, [10])
    assert first == [[20, 87]]  # (10, pad)
    second, _ = rows_of(ep, [20], history=after)
    assert second == [[14, 81]]  # (20, 10): the previous batch's token
    fresh, _ = rows_of(ep, [20])
    assert fresh == [[54, 121]]  # (20, pad): 60 ^ 10 = 54
    # two sequences in one batch: each has its own start
    both, after = rows_of(ep, [10, 20, 30], seq_rows=[(0, slice(0, 2)), (1, slice(2, 3))])
    assert both == [[20, 87], [14, 81], [13, 76]]  # seq 1 starts: (30, pad): 90 ^ 10 = 80
    assert after[0].tolist() == [20] and after[1].tolist() == [30]


def test_out_of_range_tokens_and_embedding_rows_hash_as_pad():
    ep = fork_params()  # token map of 64 ids
    oor, _ = rows_of(ep, [10, 99, 7])
    # t1 (pad 2, 10): 6 ^ 50 = 52 -> [52, 119];  t2 (7, pad): 21 ^ 10 = 31 -> [31, 98]
    assert oor == [[20, 87], [52, 119], [31, 98]]
    emb, _ = rows_of(ep, [10, 5, 7], is_embd=[False, True, False])
    assert emb == oor  # an embedding row is pad in its own ctx[0] and in the next row's look-back
    neg, _ = rows_of(ep, [10, -1, 7])
    assert neg == oor


def test_token_map_folds_ids():
    ep = fork_params(token_map=[t % 32 for t in range(64)])
    assert rows_of(ep, [42, 52])[0] == rows_of(ep, [10, 20])[0]


def test_uint64_wraparound_equals_python_integers():
    rng = np.random.default_rng(0)
    mult = [int(x) for x in rng.integers(1 << 62, (1 << 64) - 1, 4, dtype=np.uint64)]
    primes = [1000003, 999983, 2147483647, 4294967291, 1 << 61, 97]
    offsets = [0, 5, 77, 1 << 40, 3, 9]
    c = dict(FORK, max_ngram=4, n_head=2, multipliers=mult, primes=primes, offsets=offsets, pad_id=11,
             token_map=list(range(1 << 17)))
    md, forced = g41.engram_metadata(c)
    ep = eg.read_engram(KeyReader(md, "wrap.gguf", "deepseek41"), n_layer=4, n_vocab=1 << 17)
    toks = rng.integers(0, 1 << 17, 9).tolist()
    ctx, _ = eg.engram_rows_for_batch(np.asarray(toks), None, [(0, slice(0, 9))], {}, ep)
    got = eg.hash_rows(ctx, ep.multipliers[0], ep.primes[0], ep.offsets[0], ep.n_head)
    want = [g41.engram_rows_python(toks, t, c, 0) for t in range(9)]
    assert got.tolist() == want


# ---------------------------------------------------------------- validation


def v41_metadata(**engram):
    cfg = g41.v4.CASES["hca_only"]["config"]
    md = g41.relabel(gguf_metadata(cfg, "tiny/config.json", "tiny"))
    c = dict(FORK, token_map=list(range(256)))
    c.update(engram)
    md.update(g41.engram_metadata(c)[0])
    return md


@pytest.mark.parametrize("change, message", [
    (dict(layer_ids=[]), "engram.layer_ids' is empty"),
    (dict(layer_ids=[3]), r"engram.layer_ids' has layer\(s\) \[3\] out of range \(block_count = 3\)"),
    (dict(layer_ids=[1, 1]), "repeats a layer"),
    (dict(n_head=0), "engram.head_count' = 0; Engram needs at least one head"),
    (dict(max_ngram=1, multipliers=[3]), "engram.max_ngram_size' = 1; Engram n-grams have at least 2 tokens"),
    (dict(multipliers=[3, 5, 7]), r"engram.multipliers' has 3 values, expected n_engram · max_ngram_size = 1 · 2 = 2"),
    (dict(primes=[67]), r"engram.primes' has 1 values, expected n_engram · \(N - 1\) · head_count = 1 · 1 · 2 = 2"),
    (dict(offsets=[0, 67, 1]), "engram.offsets' has 3 values"),
    (dict(primes=[67, 0]), "engram.primes' has a zero at index 1"),
    (dict(token_map=list(range(200))), "engram.token_map' has 200 entries, fewer than n_vocab = 256"),
])
def test_engram_keys_are_validated(change, message):
    with pytest.raises(HParamsError, match=message):
        load_hparams(v41_metadata(**change), "tiny.gguf")


def test_candidate_block_keys_are_refused():
    md = v41_metadata()
    md["deepseek41.attention.candidate_top_k_blocks"] = 8
    with pytest.raises(HParamsError, match="candidate_top_k_blocks' .V4.1 candidate-block pre-selection. is not"):
        load_hparams(md, "tiny.gguf")


def test_table_with_too_few_rows_is_a_named_error_and_spare_rows_are_fine(tmp_path):
    import plinth
    from plinth.tensors import TensorCheckError

    reg = g41.v4.registry()
    md, tensors, forced = g41.deepseek41_parts("engram_hc2", tmp_path, reg)
    need = max(o + p for o, p in zip(md["deepseek41.engram.offsets"][4:], md["deepseek41.engram.primes"][4:]))
    assert tensors["blk.2.engram_embd.weight"].shape[0] == need + 5  # spare rows load (test_deepseek41)
    tensors["blk.2.engram_embd.weight"] = tensors["blk.2.engram_embd.weight"][:need - 1]
    with pytest.raises(TensorCheckError, match=rf"'blk.2.engram_embd.weight' has shape \[{need - 1}, 32\], "
                                               rf"expected \[>={need}, 32\]"):
        plinth.load_model(g41.write_file(tmp_path / "short.gguf", md, tensors, forced), registry=reg)


# ---------------------------------------------------------------- the table stays in the file


def test_bf16_table_is_read_row_by_row_from_the_mapped_file(tmp_path):
    """A BF16 table loads as a QuantWeight over the memory-mapped file (nothing copied), and a
    forward decodes only the rows it hashes to (recorded through ``gather_rows``)."""
    import mmap

    from plinth.graph import Batch
    from plinth.quant import QuantWeight
    from plinth.testing import new_cache

    m = g41.plinth_model("engram_hca", tmp_path)
    table = m.weights["blk.1.engram_embd.weight"]
    assert isinstance(table, QuantWeight) and table.type_name == "BF16"
    base = table.raw
    while getattr(base, "base", None) is not None:
        base = base.base
    base = base.obj if isinstance(base, memoryview) else base
    assert isinstance(base, mmap.mmap)  # a view of the file, not a copy
    assert eg.advise_random_access(table)  # MADV_RANDOM: a fault reads its page, not a read-around window
    assert not eg.advise_random_access(np.zeros((4, 4), np.float32))  # nothing to advise on owned memory
    from plinth_deepseek41 import deepseek41 as ds41

    taken = []
    real = ds41.gather_rows

    def spy(table_, rows, xp):
        taken.append(np.asarray(rows).copy())
        out = real(table_, rows, xp)
        np.testing.assert_array_equal(out, table_.take(rows))  # numpy's BF16 decode == the row kernel's
        return out

    ds41.gather_rows = spy
    try:
        toks = [5, 9, 200, 31]
        m.graph.forward(Batch.from_tokens(toks), new_cache(m.graph, m.hparams.n_layer))
    finally:
        ds41.gather_rows = real
    ep = m.hparams.engram
    assert len(taken) == 1 and taken[0].shape == (len(toks), ep.n_cols)
    c = g41.engram_constants("engram_hca")
    assert taken[0].tolist() == [g41.engram_rows_python(toks, t, c, 0) for t in range(len(toks))]

"""Every cache kind on small synthetic data: writes, commit / rollback, seq_rm, seq_cp, snapshot / restore, bytes.

Rollback equality is checked the way speculative decoding uses it: a cache that wrote extra rows
and was cut (or restored) must equal, array for array, a cache that never wrote them.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

from plinth.graph import KV, Cache, CompressedKV, IndexerKeys, Latent, Recurrent, SharedKV, run_layers

RNG = np.random.default_rng(0)


def rows(n, *shape):
    return RNG.standard_normal((n, *shape)).astype(np.float32)


def rows_of(seq, positions):
    """What Cache.forward reads of a batch: its rows' positions and sequences."""
    positions = np.asarray(positions, np.int64)
    return SimpleNamespace(positions=positions, seq_ids=np.full(len(positions), seq))


def forward(cache, seq, positions, write):
    """One forward's transaction: write every layer, committed at the end."""
    batch = rows_of(seq, positions)
    with cache.forward(batch):
        write(batch.positions)


def test_kv_append_cut_copy_restore_and_bytes():
    cache = Cache(2, layout=[(KV(),), (KV(),)])
    k, v = rows(10, 2, 4), rows(10, 2, 3)

    def write(pos, k=k, v=v):
        for il in range(2):
            cache.kv(il).update(0, pos, k[pos], v[pos])

    forward(cache, 0, range(6), write)
    snap = cache.snapshot(0)
    forward(cache, 0, range(6, 10), write)
    assert cache.n_cached(0) == 10 and cache.next_position(0) == 10
    assert cache.nbytes_by_kind() == {"kv": 2 * (10 * 8 * 4 + 10 * 6 * 4 + 10 * 8)}
    assert cache.cut_plan(0, 10, 14) == "cut" and cache.can_cut(0, 8)
    cache.seq_rm(0, 8)
    kk, vv, pos = cache.kv(1).get(0)
    np.testing.assert_array_equal(kk, k[:8])
    np.testing.assert_array_equal(pos, np.arange(8))
    cache.seq_cp(0, 5)
    cache.restore(snap)
    assert cache.n_cached(0) == 6 and cache.next_position(0) == 6
    np.testing.assert_array_equal(cache.kv(0).get(0)[1], v[:6])
    np.testing.assert_array_equal(cache.kv(0).get(5)[1], v[:8])  # the copy kept its rows
    cache.seq_rm(5, 2, 4)  # a middle range
    np.testing.assert_array_equal(cache.positions(5), [0, 1, 4, 5, 6, 7])
    np.testing.assert_array_equal(cache.kv(0).get(5)[0], k[[0, 1, 4, 5, 6, 7]])


def test_a_failed_forward_leaves_the_cache_unchanged():
    cache = Cache(1, layout=[(KV(), IndexerKeys())])
    forward(cache, 0, range(3), lambda p: (cache.kv(0).update(0, p, rows(3, 1, 2), rows(3, 1, 2)),
                                           cache.find(0, IndexerKeys).update(0, p, rows(3, 4))))
    with pytest.raises(ZeroDivisionError):
        with cache.forward(rows_of(0, [3])):
            cache.kv(0).update(0, np.array([3]), rows(1, 1, 2), rows(1, 1, 2))
            assert len(cache.kv(0).get(0)[0]) == 4  # visible to the forward writing it
            1 / 0
    assert cache.n_cached(0) == 3 and len(cache.kv(0).get(0)[0]) == 3 and not cache.in_forward
    assert len(cache.find(0, IndexerKeys).get(0)[0]) == 3
    forward(cache, 0, [3], lambda p: cache.kv(0).update(0, p, rows(1, 1, 2), rows(1, 1, 2)))
    assert cache.n_cached(0) == 4 and cache.next_position(0) == 4


def test_one_forward_is_one_transaction():
    """Cache.forward records the batch once, commits once; a nested forward is refused and leaves
    the open one's rows to its own end."""
    cache = Cache(1, layout=[(KV(),)])
    with cache.forward(rows_of(0, [0, 1])):
        cache.kv(0).update(0, np.arange(2), rows(2, 1, 2), rows(2, 1, 2))
        with pytest.raises(RuntimeError, match="already open"):
            with cache.forward(rows_of(0, [2])):
                pass
        assert cache.in_forward and cache.n_cached(0) == 0
    assert not cache.in_forward and cache.n_cached(0) == 2
    np.testing.assert_array_equal(cache.positions(0), [0, 1])
    with pytest.raises(RuntimeError, match="cache.forward"):  # the layer loop outside a transaction
        run_layers(np.zeros((1, 2), np.float32), 1, lambda il, x: x, cache)


def test_latent_and_indexer_keys_in_one_layer():
    cache = Cache(1, layout=[(Latent(), IndexerKeys())])
    c_kv, k_rope, idx = rows(7, 16), rows(7, 4), rows(7, 8)

    def write(pos):
        cache.find(0, Latent).update(0, pos, c_kv[pos], k_rope[pos])
        cache.find(0, IndexerKeys).update(0, pos, idx[pos])

    forward(cache, 0, range(5), write)
    forward(cache, 0, range(5, 7), write)
    assert cache.nbytes_by_kind() == {"latent": 7 * 20 * 4 + 7 * 8, "indexer": 7 * 8 * 4 + 7 * 8}
    cache.seq_rm(0, 5)
    got_c, got_r, pos = cache.find(0, Latent).get(0)
    np.testing.assert_array_equal(got_c, c_kv[:5])
    np.testing.assert_array_equal(got_r, k_rope[:5])
    np.testing.assert_array_equal(cache.find(0, IndexerKeys).get(0)[0], idx[:5])
    with pytest.raises(KeyError, match="layer 0 keeps no KV cache"):
        cache.kv(0)


def test_shared_kv_reads_its_source_and_holds_nothing():
    # layer 2 reuses layer 0's K/V; layer 3 reuses them but keeps its own indexer keys
    cache = Cache(4, layout=[(KV(),), (KV(),), (SharedKV(0),), (SharedKV(0), IndexerKeys())])
    k, v = rows(6, 1, 4), rows(6, 1, 4)

    def write(pos):
        for il in (0, 1):
            cache.kv(il).update(0, pos, k[pos] + il, v[pos])
        # a sharing layer sees the rows its source wrote in this very forward
        np.testing.assert_array_equal(cache.find(2, SharedKV).get(0)[0], k[: pos[-1] + 1])
        cache.find(3, IndexerKeys).update(0, pos, k[pos, 0])

    forward(cache, 0, range(4), write)
    forward(cache, 0, range(4, 6), write)
    assert cache.kv(2) is cache.kv(0) and cache.kv(3) is cache.kv(0)
    assert set(cache.nbytes_by_kind()) == {"kv", "shared", "indexer"} and cache.nbytes_by_kind()["shared"] == 0
    cache.seq_rm(0, 3)
    assert len(cache.find(2, SharedKV).get(0)[0]) == 3 and len(cache.find(3, IndexerKeys).get(0)[0]) == 3
    with pytest.raises(ValueError, match="not an earlier layer"):
        Cache(2, layout=[(SharedKV(1),), (KV(),)])


def _compress(block):
    return block.mean(axis=0)


def _write_compressed(cache, seq, raw):
    def write(pos):
        c = cache.find(0, CompressedKV)
        c.append_raw(seq, pos, raw[pos])
        for start in c.complete_blocks(seq):
            c.append_block(seq, start, _compress(c.raw_block(seq, start)))
    return write


def test_compressed_blocks_window_and_cut_only_at_block_boundaries():
    cache = Cache(1, layout=[(CompressedKV(ratio=4, window=3, keep=2),)])
    raw = rows(40, 5)
    write = _write_compressed(cache, 0, raw)
    for p in range(0, 30, 3):
        forward(cache, 0, range(p, p + 3), write)
    comp = cache.find(0, CompressedKV)
    blocks, bpos, held, rpos = comp.get(0)
    np.testing.assert_array_equal(bpos, np.arange(0, 28, 4))
    np.testing.assert_allclose(blocks, raw[:28].reshape(7, 4, 5).mean(axis=1), rtol=1e-6)
    assert rpos[0] > 0 and rpos[-1] == 29  # the raw rows were trimmed to the window
    np.testing.assert_array_equal(held, raw[rpos])
    assert comp.nbytes() == blocks.nbytes + held.nbytes + 8 * (len(bpos) + len(rpos))
    # position 26 sits inside the compressed block 24..27: no cut there, but at 28 (a boundary) yes
    assert not cache.can_cut(0, 26) and cache.can_cut(0, 28)
    with pytest.raises(ValueError, match="cannot cut sequence 0 at position 26"):
        cache.seq_rm(0, 26)
    assert cache.n_cached(0) == 30  # the refusal changed nothing
    # the plan: rows 30..33 complete block 28..31, so a cut at 29..31 would fail -> snapshot
    assert cache.cut_plan(0, 30, 34) == "snapshot" and cache.cut_plan(0, 28, 29) == "cut"


def test_compressed_snapshot_restore_equals_never_having_written():
    raw = rows(40, 5)
    a = Cache(1, layout=[(CompressedKV(ratio=4, window=3, keep=2),)])
    b = Cache(1, layout=[(CompressedKV(ratio=4, window=3, keep=2),)])
    for p in range(0, 18, 2):
        forward(a, 0, range(p, p + 2), _write_compressed(a, 0, raw))
        forward(b, 0, range(p, p + 2), _write_compressed(b, 0, raw))
    snap = a.snapshot(0)
    forward(a, 0, range(18, 23), _write_compressed(a, 0, raw))  # completes block 20..23 after the snapshot
    forward(a, 0, range(23, 26), _write_compressed(a, 0, raw))
    a.restore(snap)
    for got, want in zip(a.find(0, CompressedKV).get(0), b.find(0, CompressedKV).get(0)):
        np.testing.assert_array_equal(got, want)
    # and both continue identically
    forward(a, 0, range(18, 21), _write_compressed(a, 0, raw))
    forward(b, 0, range(18, 21), _write_compressed(b, 0, raw))
    for got, want in zip(a.find(0, CompressedKV).get(0), b.find(0, CompressedKV).get(0)):
        np.testing.assert_array_equal(got, want)
    a.seq_cp(0, 1)
    np.testing.assert_array_equal(a.find(0, CompressedKV).get(1)[0], b.find(0, CompressedKV).get(0)[0])


def test_recurrent_state_snapshot_restore_copy_and_refused_cut():
    cache = Cache(2, layout=[(Recurrent(),), (KV(),)])

    def write(pos):
        s = cache.state(0).get(0)
        s = np.zeros(3, np.float32) if s is None else s
        cache.state(0).set(0, s + len(pos))
        cache.kv(1).update(0, pos, rows(len(pos), 1, 2), rows(len(pos), 1, 2))

    forward(cache, 0, range(4), write)
    assert cache.cut_plan(0, 4, 6) == "snapshot" and not cache.can_cut(0, 2)
    snap = cache.snapshot(0)
    forward(cache, 0, range(4, 6), write)
    np.testing.assert_array_equal(cache.state(0).get(0), np.full(3, 6.0))
    with pytest.raises(ValueError, match="recurrent state"):
        cache.seq_rm(0, 5)
    assert cache.n_cached(0) == 6 and len(cache.kv(1).get(0)[0]) == 6  # the refusal changed nothing
    cache.seq_cp(0, 1)
    cache.restore(snap)
    np.testing.assert_array_equal(cache.state(0).get(0), np.full(3, 4.0))
    np.testing.assert_array_equal(cache.state(0).get(1), np.full(3, 6.0))
    assert cache.n_cached(0) == 4 and len(cache.kv(1).get(0)[0]) == 4
    assert cache.nbytes_by_kind()["state"] == 2 * 12
    cache.seq_rm(1, 0)  # dropping everything is always allowed
    assert cache.n_cached(1) == 0 and not cache.state(0).holds(1) and not cache.holds_state(1)


def test_snapshot_of_an_empty_sequence_restores_to_nothing():
    cache = Cache(1, layout=[(KV(), Recurrent())])
    snap = cache.snapshot(0)
    forward(cache, 0, range(2), lambda p: (cache.kv(0).update(0, p, rows(2, 1, 1), rows(2, 1, 1)),
                                           cache.state(0).set(0, np.ones(2))))
    cache.restore(snap)
    assert cache.n_cached(0) == 0 and cache.next_position(0) == 0 and cache.nbytes() == 0


def test_reserve_and_compiled_scatter_equal_append():
    """The server path's writes (room made by ``reserve_rows`` for every sequence, or ``reserve`` for
    one, and every sequence's rows written by one compiled call through the buffers' addresses) leave
    the cache a plain ``update`` leaves, across buffer growth, a forward rolled back, a sequence that
    joins late and strided rows; ``rows_table`` reads what ``n_rows``, ``addresses`` and ``strides`` say."""
    from plinth.ops._xp import compiled_ops

    c = compiled_ops()
    if c is None:
        pytest.skip("numba kernels off here")
    plain, fast = Cache(1, layout=[(KV(),)]), Cache(1, layout=[(KV(),)])
    for step in range(20):  # 1-3 rows a step: past the 16-row first capacity
        seqs = [0, 1, 2] if step < 5 else [2, 0, 1, 3]  # (sequence 3 joins late, out of order)
        sizes = [1 + (step + s) % 3 for s in seqs]
        wide = rows(sum(sizes), 2, 4 + 3)  # k and v side by side: strided views, as a fused projection gives
        k, v = wide[:, :, :4], wide[:, :, 4:]
        starts = np.cumsum([0] + sizes)
        pos = np.concatenate([np.arange(plain.kv(0).n_rows(s), plain.kv(0).n_rows(s) + n) for s, n in zip(seqs, sizes)])
        groups = [(s, slice(int(starts[i]), int(starts[i + 1]))) for i, s in enumerate(seqs)]
        for cache in (plain, fast):
            cache.begin(pos, np.repeat(np.array(seqs), sizes))
        for s, sel in groups:
            plain.kv(0).update(s, pos[sel], k[sel], v[sel])
        if step % 2:
            table = fast.kv(0).reserve_rows(groups, (k.shape[1:], v.shape[1:]))
        else:
            shapes = (k.shape[1:], v.shape[1:])
            table = np.array([(sel.start, sel.stop, fast.kv(0).reserve(s, sel.stop - sel.start, shapes),
                               *fast.kv(0).addresses(s), *fast.kv(0).strides(s)) for s, sel in groups],
                             dtype=np.int64)
        c.scatter_rows(k, v, pos, table)
        read = fast.kv(0).rows_table(groups)
        assert [tuple(r) for r in read] == [(sel.start, sel.stop, plain.kv(0).n_rows(s), *fast.kv(0).addresses(s),
                                             *fast.kv(0).strides(s)) for s, sel in groups]
        kb = fast.kv(0).buffers(groups[0][0])[0]  # (stored head-major: one kv head's rows contiguous)
        assert kb.strides == (4 * 4, kb.shape[0] * 4 * 4, 4)
        if step == 7:  # a failed forward: neither cache keeps its rows
            for cache in (plain, fast):
                cache.rollback_pending()
            continue
        for cache in (plain, fast):
            cache.commit()
    for s in range(4):
        for a, b in zip(plain.kv(0).contents(s), fast.kv(0).contents(s)):
            assert np.array_equal(a, b), s
        assert fast.kv(0).n_rows(s) == plain.kv(0).n_rows(s) > 16


def test_reserve_rows_reuses_the_step_before_only_where_it_holds():
    """A server step asks every layer for the groups of the step before; ``reserve_rows`` then reuses that
    call's table. Against tables made one sequence at a time (``reserve``, ``addresses``, ``strides``) on a
    second cache, over steps of the same groups: buffers that grow (new addresses), a forward rolled back, a
    verify cut back by ``seq_rm``, a sequence cleared and started again, a sequence copied over another, the
    caller writing into a returned table. Every table equal, every row written where the plain cache has it, and
    a cleared sequence's buffers freed (the kept table does not hold them)."""
    from plinth.ops._xp import compiled_ops

    c = compiled_ops()
    if c is None:
        pytest.skip("numba kernels off here")
    plain, fast = Cache(1, layout=[(KV(),)]), Cache(1, layout=[(KV(),)])
    seqs, sizes = [0, 1, 2], [1, 3, 1]
    starts = np.cumsum([0] + sizes)
    groups = [(s, slice(int(starts[i]), int(starts[i + 1]))) for i, s in enumerate(seqs)]
    shapes = ((2, 4), (2, 4))
    reused = 0
    for step in range(40):
        pos = np.concatenate([np.arange(plain.kv(0).n_rows(s), plain.kv(0).n_rows(s) + n) for s, n in zip(seqs, sizes)])
        k, v = rows(len(pos), 2, 4), rows(len(pos), 2, 4)
        for cache in (plain, fast):
            cache.begin(pos, np.repeat(np.array(seqs), sizes))
        before = fast.kv(0)._step_rows
        table = fast.kv(0).reserve_rows(list(groups), shapes)
        reused += before is not None and fast.kv(0)._step_rows is before
        before = None  # (not kept past the check)
        want = np.array([(sel.start, sel.stop, plain.kv(0).reserve(s, sel.stop - sel.start, shapes),
                          *plain.kv(0).addresses(s), *plain.kv(0).strides(s)) for s, sel in groups], dtype=np.int64)
        assert np.array_equal(table[:, :3], want[:, :3]), step
        assert [tuple(r[3:]) for r in table] == [(*fast.kv(0).addresses(s), *fast.kv(0).strides(s)) for s in seqs]
        c.scatter_rows(k, v, pos, want)
        c.scatter_rows(k, v, pos, table)
        table[:, 2:] = -1  # (the caller's to write: the next call's table is not this one)
        if step == 7:  # a failed forward
            for cache in (plain, fast):
                cache.rollback_pending()
            continue
        for cache in (plain, fast):
            cache.commit()
        if step == 12:  # a verify's rejected rows cut
            cut = plain.kv(0).n_rows(1) - 2
            for cache in (plain, fast):
                cache.seq_rm(1, cut, None)
        if step == 20:  # a sequence ended and its slot taken by a new one: its buffers freed, not kept by the table
            gone = weakref.ref(fast.kv(0).buffers(2)[0])
            for cache in (plain, fast):
                cache.seq_rm(2, 0, None)
            gc.collect()
            assert gone() is None
        if step == 27:  # a shorter sequence copied over a longer one (a forked prompt)
            for cache in (plain, fast):
                cache.seq_cp(2, 0)
    assert reused >= 30  # (the steps in between took the table of the one before)
    for s in seqs:
        for a, b in zip(plain.kv(0).contents(s), fast.kv(0).contents(s)):
            assert np.array_equal(a, b), s
        assert fast.kv(0).n_rows(s) == plain.kv(0).n_rows(s) > 16

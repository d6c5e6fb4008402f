"""The inference cache: per-layer cache kinds chosen by the architecture.

A graph declares, per layer, what that layer keeps between forwards (its
:meth:`cache_layout`): a tuple of *cache kinds*, possibly empty (an FFN-only
layer), possibly several (an MLA latent plus DSA indexer keys). :class:`Cache`
holds one instance of each per layer and, inside it, one entry per sequence.

Kinds (all in :mod:`plinth.graph`):

==================  ==========================================  ==============
kind                what it keeps per sequence                  rollback
==================  ==========================================  ==============
:class:`KV`         keys and values per position                cut
:class:`Latent`     MLA latent ``c_kv`` and ``k_rope``          cut
:class:`IndexerKeys` DSA indexer keys per position              cut
:class:`SharedKV`   nothing: reads an earlier layer's K/V       (the owner's)
:class:`CompressedKV` one row per ``ratio`` positions, plus a   cut at block
                    raw sliding window                          boundaries, else
                                                                snapshot
:class:`Recurrent`  one state (Mamba2 conv + SSM)               snapshot
==================  ==========================================  ==============

Every kind supports ``seq_rm`` (where it can: see :meth:`CacheKind.can_cut`),
``seq_cp``, ``snapshot`` / ``restore``, ``clear`` and reports its bytes.

One forward is one transaction on the cache, opened by ``with cache.forward(batch):``
(:meth:`Cache.forward`): the batch's positions are recorded once, the writes the
layers make are *pending* (visible to the forward that made them), and at the end of
the block they become part of the cache, or are all dropped when the block raises, so
a failed forward leaves the cache as it was.

Speculative decoding asks the cache, not the architecture, how to undo a verify
batch: :meth:`Cache.can_cut` says whether cutting at some position works after
rows ``start..end-1`` are added; when it does not, the engine takes a
:meth:`Cache.snapshot` before the batch and restores and replays after it.
"""

from __future__ import annotations

import operator
from contextlib import contextmanager
from typing import Any, Callable, ClassVar, Iterable, Iterator, Sequence

import attrs
import numpy as np

_BIG = np.iinfo(np.int64).max


def _rows_empty(xp: Any, cap: int, shape: tuple[int, ...]) -> Any:
    """float32 room for ``cap`` rows of ``shape``: ``[cap, *shape]``; on the host stored head-major (a view of
    ``[*shape[:-1], cap, shape[-1]]`` memory, as :meth:`plinth.kvtypes.Codec.alloc` stores typed rows: a decode
    row's attention task streams one contiguous run of its kv head's rows)."""
    if xp is not np or len(shape) < 2:
        return xp.empty((cap,) + tuple(shape), dtype=xp.float32)
    return np.moveaxis(np.empty(tuple(shape[:-1]) + (cap, shape[-1]), dtype=np.float32), len(shape) - 1, 0)


def _copy(v: Any) -> Any:
    if isinstance(v, tuple):
        return tuple(_copy(x) for x in v)
    return v.copy() if hasattr(v, "copy") else v


def _nbytes(v: Any) -> int:
    if isinstance(v, (tuple, list)):
        return sum(_nbytes(x) for x in v)
    return int(getattr(v, "nbytes", 0))


# ============================================================================ base


class CacheKind:
    """What one layer keeps of every sequence. Subclasses implement the storage.

    ``kind``: the name reported by ``plinth info`` / ``--stats`` ("kv", "latent", ...).
    ``rollback``: "cut" (rows can be dropped at any position), "block" (only at some
    positions: :meth:`can_cut` decides), "snapshot" (never: restore a snapshot and replay)
    or "none" (the kind holds nothing of its own).
    """

    kind: ClassVar[str] = "?"
    rollback: ClassVar[str] = "cut"

    def bind(self, xp: Any, layer: int, cache: "Cache") -> None:
        """Called once by :class:`Cache`: the array module, this kind's layer and its cache."""
        self.xp = xp
        self.layer = layer
        self.cache = cache

    # each method below works on one sequence; ``seq=None`` in clear means every sequence
    def can_cut(self, seq: int, p: int) -> bool:
        """Whether :meth:`seq_rm` ``(seq, p, None)`` would succeed now."""
        return True

    def seq_rm(self, seq: int, p0: int, p1: int | None) -> None:
        raise NotImplementedError

    def seq_cp(self, src: int, dst: int) -> None:
        raise NotImplementedError

    def snapshot(self, seq: int) -> Any:
        raise NotImplementedError

    def restore(self, seq: int, snap: Any) -> None:
        raise NotImplementedError

    def clear(self, seq: int | None = None) -> None:
        raise NotImplementedError

    def commit(self) -> None:
        pass

    def rollback_pending(self) -> None:
        pass

    def nbytes(self) -> int:
        return 0

    def holds(self, seq: int) -> bool:
        """Whether anything of ``seq`` is stored here."""
        return False

    def contents(self, seq: int) -> tuple[Any, ...]:
        """The committed arrays of ``seq`` (for tests comparing two caches)."""
        return ()


# ============================================================================ rows


class _StepRows:
    """What :meth:`Rows.reserve_rows` made for ``groups`` (a list of (seq, slice)): the sequences, their
    buffers (by identity), capacities and row counts a call adds, and the table (column 2 aside, valid while
    the buffers are these)."""

    __slots__ = ("groups", "seqs", "bufs", "counts", "caps", "table", "_get")

    def __init__(self, groups: list[tuple[int, slice]], bufs: list[list[Any]], table: np.ndarray) -> None:
        self.groups = groups
        self.seqs = [seq for seq, _ in groups]
        self.bufs = bufs
        self.counts = [sel.stop - sel.start for _, sel in groups]
        self.caps = [int(b[0].shape[0]) for b in bufs]
        self.table = table
        self._get = operator.itemgetter(*self.seqs) if len(self.seqs) > 1 else (lambda d, s=self.seqs[0]: (d[s],))

    def again(self, lens: dict[int, int], buffers: dict[int, list[Any]]) -> tuple[Sequence[int], list[int]] | None:
        """(each sequence's committed rows, the same plus its new ones) where the same call can reuse the table:
        every sequence still holds the buffers it had and has room for its rows; else None."""
        try:
            n_old, bufs = self._get(lens), self._get(buffers)
        except KeyError:  # (a sequence cleared since)
            return None
        if not all(map(operator.is_, bufs, self.bufs)):
            return None
        n_new = list(map(operator.add, n_old, self.counts))
        if not all(map(operator.le, n_new, self.caps)):
            return None
        return n_old, n_new


class Rows(CacheKind):
    """Per-position rows: one or more named arrays ``[n_cached, *shape]`` plus their positions.

    Storage grows by doubling, so appending one token is amortised O(1). Rows written
    by :meth:`append` are visible to the forward that wrote them and become part of the
    cache at commit. Any range of positions can be dropped (rollback "cut").

    Each field is stored in the cache's type for its ``roles`` entry ("k": ``--cache-type-k``,
    "v": ``--cache-type-v``; :class:`plinth.kvtypes.CacheTypes`): float32 arrays, or uint8 rows in a
    GGUF block layout ``[capacity, *shape[:-1], row bytes]`` (:attr:`codecs`), turned by the
    Hadamard rotation where it applies; on the host both are views of head-major memory (one kv head's
    rows contiguous: :func:`_rows_empty`, :meth:`plinth.kvtypes.Codec.alloc`; :meth:`strides`). :meth:`get`
    returns float32 rows in the model's space either way (unpacked and turned back: a copy for a typed
    field); the attention of
    :func:`plinth.graph.attend` reads the stored blocks themselves.
    """

    kind = "rows"
    fields: tuple[str, ...] = ("rows",)
    #: per field, the cache type it takes: "k" or "v" (none: float32 whatever the types)
    roles: tuple[str, ...] = ()
    #: whether typed storage turns rows whatever the rotation switch (DeepSeek's indexer keys)
    always_rotate: ClassVar[bool] = False

    def bind(self, xp: Any, layer: int, cache: "Cache") -> None:
        super().bind(xp, layer, cache)
        self._buf: dict[int, list[Any]] = {}  # seq -> one buffer per field
        self._pos: dict[int, np.ndarray] = {}
        self._len: dict[int, int] = {}
        self._pending: dict[int, int] = {}
        self._addr: dict[int, tuple[Any, ...]] = {}  # seq -> (its buffers, their addresses, K / V strides)
        self._step_rows: _StepRows | None = None  # what reserve_rows made last (a server step's next call reuses it)
        self.codecs: tuple[Any, ...] | None = None  # per field its kvtypes.Codec (None: float32); set on first rows
        self.widths: list[int] = []  # per field the values of a row's last axis

    @property
    def typed(self) -> bool:
        """Whether some field is stored in another type than float32 (known once rows were written)."""
        return self.codecs is not None and any(c is not None for c in self.codecs)

    def _codecs(self, shapes: Sequence[tuple[int, ...]]) -> tuple[Any, ...]:
        if self.codecs is None:
            types = getattr(self.cache, "types", None)
            if types is None or types.plain or len(self.roles) != len(shapes):
                self.codecs = tuple(None for _ in shapes)
            else:
                if self.xp is not np:
                    from .errors import UserError

                    raise UserError(f"a {types.k.name}/{types.v.name} K/V cache is kept on the host only; "
                                    "use the f32 cache types with this backend")
                self.codecs = tuple(types.codec(role, tuple(shape), self.always_rotate)
                                    for role, shape in zip(self.roles, shapes))
        return self.codecs

    def stored_codecs(self, shapes: Sequence[tuple[int, ...]]) -> tuple[Any, ...]:
        """Per field of row shapes ``shapes``, the :class:`plinth.kvtypes.Codec` its rows are stored with (None:
        float32); settled by the first call or the first rows, then fixed."""
        return self._codecs(shapes)

    def holds(self, seq: int) -> bool:
        return self._len.get(seq, 0) > 0

    def contents(self, seq: int) -> tuple[Any, ...]:
        n = self._len.get(seq, 0)
        if seq not in self._buf:
            return ()
        return tuple(b[:n] for b in self._buf[seq]) + (self._pos[seq][:n],)  # (as stored)

    def length(self, seq: int) -> int:
        """Committed rows of ``seq``."""
        return self._len.get(seq, 0)

    def n_rows(self, seq: int) -> int:
        """Rows of ``seq`` including this forward's (what :meth:`get` returns)."""
        return self._pending.get(seq, self._len.get(seq, 0))

    def buffers(self, seq: int) -> list[Any]:
        """``seq``'s storage, one array per field ``[capacity, *shape]`` (rows past :meth:`n_rows` unused)."""
        return self._buf[seq]

    def positions(self, seq: int) -> np.ndarray:
        n = self.n_rows(seq)
        return self._pos[seq][:n] if seq in self._pos else np.zeros(0, np.int64)

    def get(self, seq: int) -> tuple[Any, ...]:
        """Every field of ``seq`` (views, including this forward's rows; float32 copies of typed
        fields), then positions."""
        n = self.n_rows(seq)
        if seq not in self._buf:
            return tuple(None for _ in self.fields) + (np.zeros(0, np.int64),)
        return self._read(self._buf[seq], n) + (self._pos[seq][:n],)

    def _read(self, bufs: list[Any], n: int) -> tuple[Any, ...]:
        if not self.typed:
            return tuple(b[:n] for b in bufs)
        return tuple(b[:n] if c is None else c.decode(b[:n], self.widths[i]) for i, (b, c) in
                     enumerate(zip(bufs, self.codecs)))  # type: ignore[arg-type]

    def addresses(self, seq: int) -> tuple[int, ...]:
        """The data addresses of ``seq``'s host buffers, one per field (what :meth:`get` and
        :meth:`append` return are views at their start), then of its positions buffer; remembered
        until the buffers are replaced."""
        return self._layout(seq)[1]

    def _layout(self, seq: int) -> tuple[Any, ...]:
        """(``seq``'s buffers, :meth:`addresses`, :meth:`strides`), remembered until the buffers are replaced."""
        bufs = self._buf[seq]
        known = self._addr.get(seq)
        if known is None or known[0] is not bufs:
            strides = (bufs[0].strides[1], bufs[1].strides[1], bufs[0].strides[0], bufs[1].strides[0]) \
                if len(bufs) >= 2 and bufs[0].ndim >= 2 and bufs[1].ndim >= 2 else None
            known = self._addr[seq] = (bufs, tuple(b.ctypes.data for b in bufs) + (self._pos[seq].ctypes.data,),
                                       strides)
        return known

    def append(self, seq: int, positions: np.ndarray, *arrays: Any) -> tuple[Any, ...]:
        """Add rows of ``seq`` at ``positions`` ([n]); ``arrays`` one per field, [n, *shape].

        Returns every field's rows so far (views; float32 copies of typed fields) and their positions.
        """
        n_old = self.reserve(seq, len(positions), [a.shape[1:] for a in arrays])
        n_new = n_old + len(positions)
        bufs = self._buf[seq]
        for b, a, c in zip(bufs, arrays, self.codecs):  # type: ignore[arg-type]
            b[n_old:n_new] = a if c is None else c.encode(a)
        self._pos[seq][n_old:n_new] = positions
        return (*self._read(bufs, n_new), self._pos[seq][:n_new])

    def append_stored(self, seq: int, positions: np.ndarray, shapes: Sequence[tuple[int, ...]], *stored: Any) -> int:
        """:meth:`append` of rows already in their stored form (:meth:`encode`'s; ``shapes`` the fields' row
        shapes before it): returns where they start."""
        n_old = self.reserve(seq, len(positions), shapes)
        n_new = n_old + len(positions)
        bufs = self._buf[seq]
        for b, a in zip(bufs, stored):
            b[n_old:n_new] = a
        self._pos[seq][n_old:n_new] = positions
        return n_old

    def encode(self, *arrays: Any) -> tuple[Any, ...]:
        """Rows [n, *shape] of each field in their stored form (as they go into the buffers)."""
        codecs = self._codecs([a.shape[1:] for a in arrays])
        return tuple(a if c is None else c.encode(a) for a, c in zip(arrays, codecs))

    def reserve(self, seq: int, n: int, shapes: Sequence[tuple[int, ...]]) -> int:
        """Make room for ``n`` more rows of ``seq`` (fields of row shapes ``shapes``) and count them
        as this forward's; returns where they start. The caller writes them and their positions into
        the buffers at :meth:`addresses` (a server step writes every sequence's rows in one compiled
        call)."""
        n_old = self.n_rows(seq)
        n_new = n_old + n
        bufs = self._buf.get(seq)
        if bufs is None or bufs[0].shape[0] < n_new:
            xp = self.xp
            cap = max(n_new, 2 * (bufs[0].shape[0] if bufs is not None else 0), 16)
            if self.cache.max_rows:  # (never past the context: a sequence never holds more rows)
                cap = max(n_new, min(cap, self.cache.max_rows))
            codecs = self._codecs(shapes)
            self.widths = [int(shape[-1]) if len(shape) else 1 for shape in shapes]
            grown = [_rows_empty(xp, cap, tuple(shape)) if c is None else c.alloc(cap, tuple(shape))
                     for shape, c in zip(shapes, codecs)]
            pos = np.zeros(cap, np.int64)
            if bufs is not None:
                for g, b in zip(grown, bufs):
                    g[:n_old] = b[:n_old]
                pos[:n_old] = self._pos[seq][:n_old]
            else:
                self._len[seq] = 0
            self._forget(seq)
            self._buf[seq] = grown
            self._pos[seq] = pos
        self._pending[seq] = n_new
        return n_old

    def strides(self, seq: int) -> tuple[int, int, int, int]:
        """Bytes between the kv heads' rows of ``seq``'s K and V buffers, then between consecutive rows of each
        (a KV kind's two fields); remembered with the :meth:`addresses`."""
        return self._layout(seq)[2]

    def reserve_rows(self, groups: Sequence[tuple[int, slice]], shapes: Sequence[tuple[int, ...]]) -> np.ndarray:
        """:meth:`reserve` for several sequences at once (a server step's, per layer): ``groups`` holds
        (seq, its rows' slice of the batch); two fields (K and V). Returns int64 ``[len(groups), 10]``:
        per group its slice's start and stop, where its new rows start in its buffers, the
        :meth:`addresses` of its K, V and positions buffers and its buffers' :meth:`strides` (what
        :func:`plinth.ops.compiled.scatter_rows` takes).

        A server step asks each layer for the groups of the step before (the same sequences, the same
        rows each) while their buffers stay where they were: then the table of that call is reused, its
        column 2 set to the sequences' row counts, instead of a :meth:`reserve` and an address lookup per
        sequence (a 16-sequence step: 30 calls of ~18 us each)."""
        memo = self._step_rows
        if memo is not None and not self._pending and groups == memo.groups:
            again = memo.again(self._len, self._buf)
            if again is not None:
                n_old, n_new = again
                self._pending.update(zip(memo.seqs, n_new))
                table = memo.table.copy()
                table[:, 2] = n_old
                return table
        rows = [(sel.start, sel.stop, self.reserve(seq, sel.stop - sel.start, shapes)) for seq, sel in groups]
        table = np.array([r + self._columns(seq) for r, (seq, _) in zip(rows, groups)], dtype=np.int64)
        self._step_rows = _StepRows(list(groups), [self._buf[seq] for seq, _ in groups], table.copy())  # (callers write theirs)
        return table

    def _forget(self, seq: int | None) -> None:
        """Drop :meth:`reserve_rows`' table where it holds ``seq``'s buffers (None: any), which are being
        replaced or freed: the table would keep them alive."""
        memo = self._step_rows
        if memo is not None and (seq is None or seq in memo.seqs):
            self._step_rows = None

    def rows_table(self, groups: Sequence[tuple[int, slice]]) -> np.ndarray:
        """Like :meth:`reserve_rows` without reserving: per group its slice's start and stop, its
        :meth:`n_rows`, its :meth:`addresses` and :meth:`strides` (a layer reading an earlier layer's rows)."""
        return np.array([(sel.start, sel.stop, self.n_rows(seq)) + self._columns(seq) for seq, sel in groups],
                        dtype=np.int64)

    def _columns(self, seq: int) -> tuple[int, ...]:
        """:meth:`addresses` then :meth:`strides` of ``seq`` (a table row's last seven columns), one lookup."""
        _, addresses, strides = self._layout(seq)
        return addresses + strides

    def commit(self) -> None:
        for seq, n in self._pending.items():
            self._len[seq] = n
        self._pending.clear()

    def rollback_pending(self) -> None:
        self._pending.clear()

    def seq_rm(self, seq: int, p0: int, p1: int | None) -> None:
        if seq not in self._len:
            return
        n = self._len[seq]
        pos = self._pos[seq][:n]
        hi = _BIG if p1 is None else p1
        keep = ~((pos >= p0) & (pos < hi))
        if keep.all():
            return
        idx = np.nonzero(keep)[0]
        m = len(idx)
        if m == 0:
            self.clear(seq)
            return
        if not (idx == np.arange(m)).all():  # rows removed below the end: compact
            for b in self._buf[seq]:
                b[:m] = b[idx]
            self._pos[seq][:m] = pos[idx]
        self._len[seq] = m

    def seq_cp(self, src: int, dst: int) -> None:
        self.clear(dst)
        if src in self._len:
            n = self._len[src]
            self._len[dst] = n
            self._pos[dst] = self._pos[src][:n].copy()
            self._buf[dst] = [b[:n].copy(order="K") for b in self._buf[src]]  # (the head-major layout kept)

    def snapshot(self, seq: int) -> Any:
        # rows after a snapshot are only ever appended, so the length is enough
        return self._len.get(seq, 0)

    def restore(self, seq: int, snap: Any) -> None:
        if snap == 0:
            self.clear(seq)
        elif seq in self._len:
            if self._len[seq] < snap:
                raise ValueError(f"cannot restore sequence {seq} of layer {self.layer}: rows were removed "
                                 "below the snapshot")
            self._len[seq] = snap

    def clear(self, seq: int | None = None) -> None:
        self._forget(seq)
        for table in (self._buf, self._pos, self._len, self._pending, self._addr):
            if seq is None:
                table.clear()
            else:
                table.pop(seq, None)

    def nbytes(self) -> int:
        """Bytes held by the cached rows (not the spare capacity)."""
        total = 0
        for seq, bufs in self._buf.items():
            n = self._len.get(seq, 0)
            total += sum(int(b[:n].nbytes) for b in bufs) + 8 * n
        return total


class KV(Rows):
    """Plain attention keys and values: K ``[n, n_head_kv, head_dim_k]``, V ``[n, n_head_kv, head_dim_v]``."""

    kind = "kv"
    fields = ("k", "v")
    roles = ("k", "v")

    def update(self, seq: int, positions: np.ndarray, k: Any, v: Any) -> tuple[Any, Any, np.ndarray]:
        """Append this forward's rows of ``seq``; returns (K [n_total, ...], V [n_total, ...], positions)."""
        return self.append(seq, positions, k, v)  # type: ignore[return-value]


class Latent(Rows):
    """An MLA latent: ``c_kv`` ``[n, kv_lora_rank]`` (normed) and the shared rotated key ``k_rope`` ``[n, d_rope]``."""

    kind = "latent"
    fields = ("c_kv", "k_rope")
    roles = ("k", "k")  # (llama.cpp keeps an MLA latent in its K cache)

    def update(self, seq: int, positions: np.ndarray, c_kv: Any, k_rope: Any) -> tuple[Any, Any, np.ndarray]:
        return self.append(seq, positions, c_kv, k_rope)  # type: ignore[return-value]


class IndexerKeys(Rows):
    """DSA lightning-indexer keys ``[n, index_head_dim]`` (used to pick the top-k positions to attend)."""

    kind = "indexer"
    fields = ("k",)
    roles = ("k",)
    always_rotate = True  # (llama.cpp turns DeepSeek's indexer keys whatever its switch)

    def update(self, seq: int, positions: np.ndarray, k: Any) -> tuple[Any, np.ndarray]:
        return self.append(seq, positions, k)  # type: ignore[return-value]


# ============================================================================ shared


class SharedKV(CacheKind):
    """A layer that reads the K/V (or latent) of an earlier layer ``source`` and keeps none of its own.

    (Mistral Large 4's ``kv_sharing_modes`` "reuse"; with "reuse_but_indexer" the layer also
    holds its own :class:`IndexerKeys`.) Its rollback is its source's.
    """

    kind = "shared"
    rollback = "none"

    def __init__(self, source: int) -> None:
        self.source = source

    def bind(self, xp: Any, layer: int, cache: "Cache") -> None:
        if not 0 <= self.source < layer:
            raise ValueError(f"layer {layer} shares the cache of layer {self.source}, which is not an earlier layer")
        super().bind(xp, layer, cache)

    def owner(self, kind: type[Rows] = Rows) -> Any:
        """The source layer's cache kind of type ``kind`` (following chains of sharing)."""
        return self.cache.find(self.source, kind)

    def get(self, seq: int) -> tuple[Any, ...]:
        """The source layer's rows of ``seq`` (including the current forward's), then positions."""
        return self.owner().get(seq)

    def seq_rm(self, seq: int, p0: int, p1: int | None) -> None:
        pass

    def seq_cp(self, src: int, dst: int) -> None:
        pass

    def snapshot(self, seq: int) -> Any:
        return None

    def restore(self, seq: int, snap: Any) -> None:
        pass

    def clear(self, seq: int | None = None) -> None:
        pass


# ============================================================================ compressed


class CompressedKV(CacheKind):
    """Compressed KV blocks at ``ratio`` beside a raw sliding window (DeepSeek V4 CSA / HCA).

    Per sequence it keeps ``raw`` rows ``[n, dim]`` and one ``block`` row ``[dim_c]`` per
    complete block of ``ratio`` positions (its position is the block's first). The raw rows are
    what the architecture needs of recent positions: the last ``window`` positions (a sliding
    window attends to them) and the rows of the block being filled (its compressor's input; with
    ``overlap``, the block before it too, as an entry pools two consecutive blocks). Older raw rows
    are trimmed at commit, ``keep`` spare ones aside for rollback. ``ratio`` 0 keeps a raw window
    only (no blocks). The architecture writes raw rows with :meth:`append_raw` and, when a block is
    complete (:meth:`complete_blocks`), its compressed row with :meth:`append_block`.

    Rollback: a cut at position ``p`` works when no compressed block straddles ``p`` and the raw
    rows that position ``p`` needs are still held; otherwise :meth:`can_cut` is False and the engine
    restores a snapshot (a copy of the raw rows and the count of blocks: blocks are only appended)
    and replays. :meth:`contents` is what decides the next forward (the blocks and the raw rows
    still needed), not the spare rows.
    """

    kind = "compressed"
    rollback = "block"

    def __init__(self, ratio: int, window: int, keep: int = 32, overlap: bool = False) -> None:
        if ratio < 0 or window < 0 or keep < 0 or (overlap and ratio < 1):
            raise ValueError(f"CompressedKV needs ratio >= 0, window >= 0, keep >= 0 and a ratio for overlap "
                             f"(got {ratio}, {window}, {keep}, {overlap})")
        self.ratio, self.window, self.keep, self.overlap = int(ratio), int(window), int(keep), bool(overlap)

    def bind(self, xp: Any, layer: int, cache: "Cache") -> None:
        super().bind(xp, layer, cache)
        self.raw = Rows()
        self.raw.fields = ("raw",)
        self.blocks = Rows()
        self.blocks.fields = ("block",)
        self.raw.bind(xp, layer, cache)
        self.blocks.bind(xp, layer, cache)
        self._from: dict[int, int] = {}  # seq -> first position ever written (rows before it never existed)

    def holds(self, seq: int) -> bool:
        return self.raw.holds(seq) or self.blocks.holds(seq)

    def contents(self, seq: int) -> tuple[Any, ...]:
        """The blocks, their positions, and the raw rows the next position needs with theirs."""
        blocks = self.blocks.contents(seq)
        raw, pos = (self.raw.contents(seq) or (None, np.zeros(0, np.int64)))
        if pos.size:
            live = pos >= self._needed_from(seq, int(pos.max()) + 1)
            raw, pos = raw[live], pos[live]
        return blocks + ((raw, pos) if raw is not None else ())

    def _filling(self, seq: int) -> int:
        """Start position of the first block not compressed yet."""
        bpos = self.blocks.positions(seq)
        return int(bpos[-1]) + self.ratio if bpos.size else (self._from.get(seq, 0) // max(self.ratio, 1)) * self.ratio

    def _needed_from(self, seq: int, p: int, filling: int | None = None) -> int:
        """The first raw position a sequence standing at position ``p`` needs."""
        lo = p - self.window
        if self.ratio:
            f = (p // self.ratio) * self.ratio if filling is None else filling
            lo = min(lo, f - self.ratio * self.overlap)
        return max(self._from.get(seq, 0), lo)

    def append_raw(self, seq: int, positions: np.ndarray, rows: Any) -> tuple[Any, np.ndarray]:
        """Add raw rows [n, dim] at consecutive ``positions``; returns the raw rows held (views) and positions."""
        self._from.setdefault(seq, int(positions[0]) if len(positions) else 0)
        return self.raw.append(seq, positions, rows)  # type: ignore[return-value]

    def complete_blocks(self, seq: int) -> list[int]:
        """Start positions of the blocks whose raw rows are all written but that are not compressed yet."""
        raw_pos = self.raw.positions(seq)
        if raw_pos.size == 0 or not self.ratio:
            return []
        end = int(raw_pos.max()) + 1
        return list(range(self._filling(seq), end - self.ratio + 1, self.ratio))

    def raw_block(self, seq: int, start: int) -> Any:
        """The raw rows [ratio, dim] of the block starting at ``start``."""
        rows, pos = self.raw.get(seq)
        sel = np.nonzero((pos >= start) & (pos < start + self.ratio))[0]
        if len(sel) != self.ratio:
            raise ValueError(f"layer {self.layer}: block at {start} of sequence {seq} is not fully held")
        return rows[int(sel[0]):int(sel[-1]) + 1]

    def append_block(self, seq: int, start: int, row: Any) -> None:
        """Store the compressed row [dim_c] of the block starting at ``start``."""
        self.append_blocks(seq, np.array([start], np.int64), row[None])

    def append_blocks(self, seq: int, starts: np.ndarray, rows: Any) -> None:
        """Store the compressed rows [n, dim_c] of the blocks starting at ``starts`` (in order)."""
        self.blocks.append(seq, np.asarray(starts, np.int64), rows)

    def get(self, seq: int) -> tuple[Any, np.ndarray, Any, np.ndarray]:
        """(blocks [n_blocks, dim_c], their start positions, raw rows [n_raw, dim], their positions)."""
        blocks, bpos = self.blocks.get(seq)
        raw, rpos = self.raw.get(seq)
        return blocks, bpos, raw, rpos

    def commit(self) -> None:
        self.raw.commit()
        self.blocks.commit()
        for seq in list(self.raw._len):  # drop raw rows neither the next position nor a rollback can need
            pos = self.raw.positions(seq)
            if pos.size == 0:
                continue
            lo = self._needed_from(seq, int(pos.max()) + 1, self._filling(seq)) - self.keep
            if int(pos[0]) < lo:
                self.raw.seq_rm(seq, 0, lo)

    def rollback_pending(self) -> None:
        self.raw.rollback_pending()
        self.blocks.rollback_pending()

    def can_cut(self, seq: int, p: int) -> bool:
        bpos = self.blocks.positions(seq)
        if bpos.size and ((bpos < p) & (bpos + self.ratio > p)).any():
            return False  # a compressed block holds positions on both sides of p
        rpos = self.raw.positions(seq)
        need = self._needed_from(seq, p)
        return not rpos.size or int(rpos[0]) <= need or int(rpos.max()) < need

    def can_cut_after(self, seq: int, start: int, end: int) -> bool:
        """Whether, once rows ``start..end-1`` are written and committed, a cut at every ``p`` in
        ``start+1..end-1`` will work (no block completed by them straddles ``p``, and the raw rows
        ``p`` needs survive the trimming)."""
        r = self.ratio
        rpos = self.raw.positions(seq)
        first = int(rpos[0]) if rpos.size else start
        filling = (end // r) * r if r else end
        held = max(first, self._needed_from(seq, end, filling) - self.keep)
        for p in range(start + 1, end):
            if r:
                b = (p // r) * r
                if b < p and b + r <= end:  # the block around p is completed by this batch
                    return False
            if self._needed_from(seq, p) < held:
                return False
        return True

    def seq_rm(self, seq: int, p0: int, p1: int | None) -> None:
        if p1 is not None:
            rpos = self.raw.positions(seq)
            if rpos.size and int(rpos.max()) >= p1 and p0 < p1:
                raise ValueError(f"layer {self.layer} (compressed KV) cannot drop positions {p0}..{p1} from the "
                                 f"middle of sequence {seq}")
        if p0 <= self._from.get(seq, 0):
            self.clear(seq)
            return
        if not self.can_cut(seq, p0):
            raise ValueError(f"layer {self.layer} (compressed KV, ratio {self.ratio}) cannot cut sequence {seq} "
                             f"at position {p0}: take a snapshot() before the rows and restore() it instead")
        self.raw.seq_rm(seq, p0, None)
        self.blocks.seq_rm(seq, p0, None)

    def seq_cp(self, src: int, dst: int) -> None:
        self.raw.seq_cp(src, dst)
        self.blocks.seq_cp(src, dst)
        if src in self._from:
            self._from[dst] = self._from[src]

    def snapshot(self, seq: int) -> Any:
        # the raw rows are trimmed at commit, so a snapshot copies them; blocks are only appended (their count)
        raw, rpos = self.raw.get(seq)
        return (None if raw is None else raw.copy(), rpos.copy(), self.blocks.snapshot(seq), self._from.get(seq))

    def restore(self, seq: int, snap: Any) -> None:
        raw, rpos, n_blocks, start = snap
        self.raw.clear(seq)
        self.blocks._pending.pop(seq, None)
        self.blocks.restore(seq, n_blocks)
        self._from.pop(seq, None)
        if start is None:
            return
        self._from[seq] = start
        if len(rpos):
            self.raw.append(seq, rpos, raw)
            self.raw._len[seq] = self.raw._pending.pop(seq)

    def clear(self, seq: int | None = None) -> None:
        self.raw.clear(seq)
        self.blocks.clear(seq)
        if seq is None:
            self._from.clear()
        else:
            self._from.pop(seq, None)

    def nbytes(self) -> int:
        return self.raw.nbytes() + self.blocks.nbytes()


# ============================================================================ recurrent


class Recurrent(CacheKind):
    """One recurrent state per sequence (Mamba2: ``(conv_state [K-1, conv_dim], ssm_state [H, P, N])``).

    The state after token t depends on every earlier token, so it cannot drop positions:
    rollback is by snapshot (a copy of the state) and replay.
    """

    kind = "state"
    rollback = "snapshot"

    def bind(self, xp: Any, layer: int, cache: "Cache") -> None:
        super().bind(xp, layer, cache)
        self._state: dict[int, Any] = {}
        self._pending: dict[int, Any] = {}

    def holds(self, seq: int) -> bool:
        return seq in self._state

    def contents(self, seq: int) -> tuple[Any, ...]:
        v = self._state.get(seq)
        return () if v is None else (v if isinstance(v, tuple) else (v,))

    def get(self, seq: int) -> Any:
        """The state of ``seq`` after the rows written so far (None before the first token)."""
        if seq in self._pending:
            return self._pending[seq]
        return self._state.get(seq)

    def set(self, seq: int, value: Any) -> None:
        """The state after this forward's rows of ``seq`` (store new arrays; do not mutate the old)."""
        self._pending[seq] = value

    def commit(self) -> None:
        self._state.update(self._pending)
        self._pending.clear()

    def rollback_pending(self) -> None:
        self._pending.clear()

    def can_cut(self, seq: int, p: int) -> bool:
        return seq not in self._state or p <= 0

    def seq_rm(self, seq: int, p0: int, p1: int | None) -> None:
        if seq not in self._state:
            return
        if p0 <= 0 and p1 is None:
            self.clear(seq)
            return
        raise ValueError(f"sequence {seq} holds recurrent state (layer {self.layer}), which cannot drop positions "
                         f"{p0}..{'' if p1 is None else p1}; take a snapshot() before the rows and restore() it instead")

    def seq_cp(self, src: int, dst: int) -> None:
        self.clear(dst)
        if src in self._state:
            self._state[dst] = _copy(self._state[src])

    def snapshot(self, seq: int) -> Any:
        return _copy(self._state[seq]) if seq in self._state else None

    def restore(self, seq: int, snap: Any) -> None:
        self._pending.pop(seq, None)
        if snap is None:
            self._state.pop(seq, None)
        else:
            self._state[seq] = snap

    def clear(self, seq: int | None = None) -> None:
        if seq is None:
            self._state.clear()
            self._pending.clear()
        else:
            self._state.pop(seq, None)
            self._pending.pop(seq, None)

    def nbytes(self) -> int:
        return sum(_nbytes(v) for v in self._state.values())


# ============================================================================ the cache


@attrs.frozen
class CacheSnapshot:
    """What :meth:`Cache.snapshot` saved of one sequence: its token positions and every kind's part."""

    seq: int
    n_cached: int
    positions: np.ndarray
    layers: dict[tuple[int, int], Any]


Layout = Sequence[Sequence[CacheKind]]


class Cache:
    """Every layer's cache kinds, and per sequence the positions of the tokens run so far.

    ``layout``: per layer a sequence of :class:`CacheKind` instances (fresh ones: the cache
    owns them), as a graph's ``cache_layout()`` returns.
    """

    def __init__(self, n_layer: int, xp: Any = np, layout: Layout | None = None, types: Any = None,
                 max_rows: int | None = None) -> None:
        from .kvtypes import CacheTypes

        self.n_layer = n_layer
        self.xp = xp
        #: the storage types of the kinds that keep rows (:class:`plinth.kvtypes.CacheTypes`; float32 by default)
        self.types = types if types is not None else CacheTypes()
        #: the most rows a sequence's buffers grow to (the context size: its rows grow by doubling up to it)
        self.max_rows = int(max_rows) if max_rows else None
        if layout is None:
            raise TypeError("a Cache needs a layout: per layer, the cache kinds it keeps (a graph's cache_layout())")
        if len(layout) != n_layer:
            raise ValueError(f"the cache layout has {len(layout)} layers, the model {n_layer}")
        self.layers: list[list[CacheKind]] = [[] for _ in range(n_layer)]
        self._found: dict[tuple[int, type], Any] = {}  # find() answers (the layout never loses a kind)
        for il, kinds in enumerate(layout):
            for kind in kinds:
                self._add(il, kind)
        self._pos: dict[int, np.ndarray] = {}  # seq -> positions of the tokens run (committed)
        self._pending: dict[int, np.ndarray] = {}
        self._open = False  # inside forward()

    def _add(self, il: int, kind: CacheKind) -> CacheKind:
        kind.bind(self.xp, il, self)
        self.layers[il].append(kind)
        return kind

    # -------------------------------------------------------------- the kinds

    def find(self, il: int, kind: type) -> Any:
        """Layer ``il``'s cache of type ``kind`` (a :class:`SharedKV` resolves to its source's)."""
        found = self._found.get((il, kind))
        if found is not None:
            return found
        found = self._found[(il, kind)] = self._find(il, kind)
        return found

    def _find(self, il: int, kind: type) -> Any:
        for k in self.layers[il]:
            if isinstance(k, kind):
                return k
        for k in self.layers[il]:
            if isinstance(k, SharedKV):
                return self.find(k.source, kind)
        raise KeyError(f"layer {il} keeps no {kind.__name__} cache (its layout: "
                       f"{[type(k).__name__ for k in self.layers[il]] or 'nothing'})")

    def kv(self, il: int) -> KV:
        return self.find(il, KV)  # type: ignore[no-any-return]

    def state(self, il: int) -> Recurrent:
        return self.find(il, Recurrent)  # type: ignore[no-any-return]

    def kinds(self) -> Iterable[CacheKind]:
        for kinds in self.layers:
            yield from kinds

    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes held per kind name ("kv", "latent", "state", ...), over every layer and sequence."""
        out: dict[str, int] = {}
        for k in self.kinds():
            out[k.kind] = out.get(k.kind, 0) + k.nbytes()
        return out

    def nbytes(self) -> int:
        return sum(self.nbytes_by_kind().values())

    def nbytes_by_role(self) -> dict[str, int]:
        """Bytes of the stored K and V rows ("k", "v": what ``--cache-type-k`` / ``-v`` decide; keys,
        latents and indexer keys count as "k"), without positions; empty roles left out."""
        out: dict[str, int] = {}
        for k in self.kinds():
            if isinstance(k, Rows) and k.roles:
                for seq, bufs in k._buf.items():
                    n = k._len.get(seq, 0)
                    for role, b in zip(k.roles, bufs):
                        out[role] = out.get(role, 0) + int(b[:n].nbytes)
        return {r: n for r, n in out.items() if n}

    # -------------------------------------------------------------- tokens

    def begin(self, positions: np.ndarray, seq_ids: np.ndarray) -> None:
        """These (position, sequence) rows are being added (what :meth:`forward` does first; a graph
        calls :meth:`forward`, not this)."""
        for seq in np.unique(seq_ids):
            seq = int(seq)
            self._pending[seq] = positions[seq_ids == seq]

    def seqs(self) -> list[int]:
        return sorted(self._pos)

    def n_cached(self, seq: int) -> int:
        """Tokens of ``seq`` in the cache."""
        return len(self._pos.get(seq, ()))

    def positions(self, seq: int) -> np.ndarray:
        return self._pos.get(seq, np.zeros(0, np.int64))

    def next_position(self, seq: int) -> int:
        pos = self._pos.get(seq)
        return int(pos.max()) + 1 if pos is not None and pos.size else 0

    def holds_state(self, seq: int | None = None) -> bool:
        """Whether ``seq`` (any when None) has something that cannot be cut (a recurrent state)."""
        for k in self.kinds():
            if k.rollback == "snapshot" and (any(k.holds(s) for s in self.seqs()) if seq is None else k.holds(seq)):
                return True
        return False

    # -------------------------------------------------------------- the forward transaction

    @contextmanager
    def forward(self, batch: Any) -> Iterator["Cache"]:
        """One forward on this cache: ``with cache.forward(batch): <run the layers>``.

        Records ``batch``'s (position, sequence) rows as being added, then on leaving the block
        commits what the layers wrote (:meth:`commit`), or drops all of it if the block raises
        (:meth:`rollback_pending`). One transaction is open at a time: a second ``forward``
        inside the first is refused (it would count the batch twice).
        """
        with self._transaction():
            self.begin(batch.positions, batch.seq_ids)
            yield self

    @contextmanager
    def _transaction(self) -> Iterator["Cache"]:
        """Commit on leaving the block, roll back if it raises (the rows' positions: :meth:`begin`)."""
        if self._open:
            raise RuntimeError("a forward is already open on this cache (Cache.forward does not nest)")
        self._open = True
        try:
            yield self
        except BaseException:
            self.rollback_pending()
            raise
        else:
            self.commit()
        finally:
            self._open = False

    @property
    def in_forward(self) -> bool:
        """Whether a :meth:`forward` block is open."""
        return self._open

    def commit(self) -> None:
        """End of a forward: everything written becomes part of the cache."""
        for k in self.kinds():
            k.commit()
        for seq, pos in self._pending.items():
            old = self._pos.get(seq)
            self._pos[seq] = pos.copy() if old is None or not old.size else np.concatenate([old, pos])
        self._pending.clear()

    def rollback_pending(self) -> None:
        """Drop what a forward that failed half way wrote."""
        for k in self.kinds():
            k.rollback_pending()
        self._pending.clear()

    # -------------------------------------------------------------- rollback

    def can_cut(self, seq: int, p: int) -> bool:
        """Whether ``seq_rm(seq, p)`` (drop positions >= p) works on every layer now."""
        return all(k.can_cut(seq, p) for k in self.kinds())

    def cut_plan(self, seq: int, start: int, end: int) -> str:
        """How to undo rows ``start..end-1`` about to be added: "cut" or "snapshot".

        "cut" when every kind will be able to drop positions from any ``p`` in ``start+1..end-1``
        after those rows are written (a compressed kind checks whether a block would complete
        in between); "snapshot" otherwise.
        """
        for k in self.kinds():
            if k.rollback == "snapshot" and (k.holds(seq) or end > start):
                return "snapshot"
            if k.rollback == "block" and not k.can_cut_after(seq, start, end):
                return "snapshot"
        return "cut"

    def seq_rm(self, seq: int, p0: int = 0, p1: int | None = None) -> None:
        """Remove the cached positions ``p0 <= position < p1`` (p1 None = to the end) of ``seq``."""
        pos = self._pos.get(seq)
        if pos is None:
            return
        hi = _BIG if p1 is None else p1
        keep = ~((pos >= p0) & (pos < hi))
        if keep.all() and not (p0 <= 0 and p1 is None):
            return
        # kinds that may refuse go first, so a refusal leaves every layer as it was
        for k in sorted(self.kinds(), key=lambda k: k.rollback == "cut"):
            k.seq_rm(seq, p0, p1)
        if not keep.any():
            self.clear(seq)
            return
        self._pos[seq] = pos[keep]

    def seq_cp(self, src: int, dst: int) -> None:
        """Make ``dst`` a copy of ``src`` (replacing whatever ``dst`` held)."""
        self.clear(dst)
        for k in self.kinds():
            k.seq_cp(src, dst)
        if src in self._pos:
            self._pos[dst] = self._pos[src].copy()

    def snapshot(self, seq: int) -> CacheSnapshot:
        """Save ``seq`` (its rows' lengths, copies of its states and compressed blocks; on the backend)."""
        return CacheSnapshot(seq=seq, n_cached=self.n_cached(seq), positions=self.positions(seq).copy(),
                             layers={(il, j): k.snapshot(seq) for il, kinds in enumerate(self.layers)
                                     for j, k in enumerate(kinds)})

    def restore(self, snap: CacheSnapshot) -> None:
        """Put ``snap.seq`` back as it was at :meth:`snapshot` (rows added since are dropped).

        Only rows appended after the snapshot may be dropped: the cache must not have been
        edited below ``snap.n_cached`` in between.
        """
        seq = snap.seq
        pos = self.positions(seq)
        if len(pos) < snap.n_cached or not np.array_equal(pos[: snap.n_cached], snap.positions):
            raise ValueError(f"cannot restore sequence {seq}: the cache changed below the snapshot")
        for il, kinds in enumerate(self.layers):
            for j, k in enumerate(kinds):
                k.restore(seq, snap.layers[(il, j)])
        self._pending.pop(seq, None)
        if snap.n_cached:
            self._pos[seq] = snap.positions.copy()
        else:
            self._pos.pop(seq, None)

    def clear(self, seq: int | None = None) -> None:
        for k in self.kinds():
            k.clear(seq)
        for table in (self._pos, self._pending):
            if seq is None:
                table.clear()
            else:
                table.pop(seq, None)




def format_bytes_by_kind(by_kind: dict[str, int]) -> str:
    """``{"kv": 1572864, "state": 4096}`` -> ``"kv 1.50 MiB, state 4.0 KiB"`` (empty kinds left out)."""
    parts = []
    for kind, n in sorted(by_kind.items()):
        if n:
            parts.append(f"{kind} {n / 2**20:.2f} MiB" if n >= 2**20 else f"{kind} {n / 2**10:.1f} KiB")
    return ", ".join(parts) or "empty"


def run_layers(x: Any, n_layer: int, layer: Callable[[int, Any], Any], cache: Cache,
               taps: Sequence[int] = (), start: int = 0) -> tuple[Any, dict[int, Any]]:
    """``x = layer(il, x)`` for every layer ``start..n_layer-1``, inside the forward's transaction.

    Run it inside ``with cache.forward(batch):`` (as :meth:`plinth.graph.BaseGraph.forward_stage`
    does; outside one it is refused): the layers' writes are committed when that block ends.
    Returns the final residual and the feature taps asked for: the input of layer k for each tap k,
    and for tap ``n_layer`` the residual after the last layer run (before the final norm when
    ``n_layer`` is the model's last). A pipeline stage runs its slice with ``start`` and
    ``n_layer`` = the first layer of the next stage.
    """
    if not cache.in_forward:
        raise RuntimeError("run_layers runs inside the forward's cache transaction: `with cache.forward(batch):`")
    features: dict[int, Any] = {}
    for il in range(start, n_layer):
        if il in taps:
            features[il] = x
        x = layer(il, x)
    if n_layer in taps:
        features[n_layer] = x
    return x, features

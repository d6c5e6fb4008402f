"""Batches, the KV cache and the forward output struct.

A :class:`Batch` holds rows; each row is a token id or an embedding vector (or
a mix, per row), with its position, its sequence id and whether it wants an
output. A :class:`Context` owns the per-sequence KV cache; architectures append
to it and read it back through :meth:`KVCache.update`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import numpy as np

POOLING = ("none", "mean", "cls", "last")


@attrs.frozen
class Batch:
    """One forward's rows.

    tokens: [n_rows] int — token ids (ignored where ``is_embd`` is set).
    embeddings: [n_rows, n_embd] float32 or None — input embeddings for rows with ``is_embd``.
    is_embd: [n_rows] bool — which rows take ``embeddings`` instead of ``tokens``.
    positions: [n_rows] int — absolute position of each row in its sequence.
    seq_ids: [n_rows] int — the sequence each row belongs to.
    output: [n_rows] bool — rows whose logits (or embeddings) are returned.
    """

    tokens: np.ndarray
    positions: np.ndarray
    seq_ids: np.ndarray
    output: np.ndarray
    embeddings: np.ndarray | None = None
    is_embd: np.ndarray | None = None

    @property
    def n_rows(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def from_tokens(cls, tokens: Sequence[int], start: int = 0, seq: int = 0,
                    output: str | Sequence[bool] = "last") -> "Batch":
        """Rows ``tokens`` at positions ``start..`` of one sequence; ``output`` is "all", "last" or a mask."""
        n = len(tokens)
        return cls(
            tokens=np.asarray(tokens, dtype=np.int64),
            positions=np.arange(start, start + n, dtype=np.int64),
            seq_ids=np.full(n, seq, dtype=np.int64),
            output=_output_mask(output, n),
        )

    @classmethod
    def from_embeddings(cls, embeddings: Any, start: int = 0, seq: int = 0,
                        output: str | Sequence[bool] = "last") -> "Batch":
        emb = np.asarray(embeddings, dtype=np.float32)
        n = emb.shape[0]
        return cls(
            tokens=np.zeros(n, dtype=np.int64),
            positions=np.arange(start, start + n, dtype=np.int64),
            seq_ids=np.full(n, seq, dtype=np.int64),
            output=_output_mask(output, n),
            embeddings=emb,
            is_embd=np.ones(n, dtype=bool),
        )

    @classmethod
    def concat(cls, batches: Sequence["Batch"], n_embd: int | None = None) -> "Batch":
        """Rows of several batches in order (token and embedding rows may mix)."""
        any_embd = any(b.is_embd is not None for b in batches)
        emb = None
        is_embd = None
        if any_embd:
            if n_embd is None:
                n_embd = next(b.embeddings.shape[1] for b in batches if b.embeddings is not None)
            parts = [b.embeddings if b.embeddings is not None else np.zeros((b.n_rows, n_embd), np.float32)
                     for b in batches]
            emb = np.concatenate(parts)
            is_embd = np.concatenate([b.is_embd if b.is_embd is not None else np.zeros(b.n_rows, bool)
                                      for b in batches])
        return cls(
            tokens=np.concatenate([b.tokens for b in batches]),
            positions=np.concatenate([b.positions for b in batches]),
            seq_ids=np.concatenate([b.seq_ids for b in batches]),
            output=np.concatenate([b.output for b in batches]),
            embeddings=emb,
            is_embd=is_embd,
        )


def _output_mask(output: str | Sequence[bool], n: int) -> np.ndarray:
    if isinstance(output, str):
        mask = np.zeros(n, dtype=bool)
        if output == "all":
            mask[:] = True
        elif output == "last":
            if n:
                mask[-1] = True
        elif output != "none":
            raise ValueError(f"output must be 'all', 'last', 'none' or a mask, not {output!r}")
        return mask
    mask = np.asarray(output, dtype=bool)
    if mask.shape != (n,):
        raise ValueError(f"output mask has shape {mask.shape}, expected ({n},)")
    return mask


@attrs.frozen
class ForwardOutput:
    """What one forward returns.

    rows: [n_out] int — batch row index of each output row.
    logits: [n_out, n_vocab] float32, or None when the context pools embeddings.
    embeddings: [n_out, n_embd] (pooling "none") or [n_seq, n_embd] (pooled), or None.
    embedding_seqs: [n_seq] int — sequence id of each pooled embedding row (pooled only).
    features: {layer k: [n_rows, n_embd]} — inputs of layer k for every batch row
        (k = n_layer is the residual before the final norm), for the taps asked for.
    """

    rows: np.ndarray
    logits: Any = None
    embeddings: Any = None
    embedding_seqs: Any = None
    features: dict[int, Any] = attrs.field(factory=dict)


@attrs.frozen
class CacheSnapshot:
    """What :meth:`KVCache.snapshot` saved of one sequence: its length and recurrent states."""

    seq: int
    n_cached: int
    positions: np.ndarray
    states: dict[int, Any]
    next_position: int = 0


class KVCache:
    """Per-sequence, per-layer keys and values with their positions, and recurrent states.

    Layout per (sequence, layer): K [n_cached, n_head_kv, head_dim_k], V [n_cached,
    n_head_kv, head_dim_v], positions [n_cached]. Storage grows by doubling, so
    appending one token is amortised O(1).

    Recurrent layers (Mamba2 conv and SSM states, ...) keep their state here too,
    one value per (layer, sequence), through :meth:`get_state` / :meth:`set_state`.
    That is the architecture side of the rollback contract: a state kept here is
    saved by :meth:`snapshot` and put back by :meth:`restore`, so speculative
    decoding can undo a verify batch on any target. A recurrent state cannot drop
    single positions, so :meth:`seq_rm` refuses a partial range on such a sequence.
    """

    def __init__(self, n_layer: int, xp: Any = np) -> None:
        self.n_layer = n_layer
        self.xp = xp
        # seq -> layer -> [k_buf, v_buf]; seq -> positions buffer; seq -> used length
        self._kv: dict[int, list[list[Any] | None]] = {}
        self._pos: dict[int, np.ndarray] = {}
        self._len: dict[int, int] = {}
        self._pending: dict[int, int] = {}
        # seq -> layer -> state (committed) and the states written during the current forward
        self._state: dict[int, dict[int, Any]] = {}
        self._state_pending: dict[int, dict[int, Any]] = {}
        self._seen: dict[int, int] = {}

    # -------------------------------------------------------------- inspection

    def seqs(self) -> list[int]:
        return sorted(self._len)

    def n_cached(self, seq: int) -> int:
        return self._len.get(seq, 0)

    def positions(self, seq: int) -> np.ndarray:
        return self._pos[seq][: self._len[seq]] if seq in self._len else np.zeros(0, np.int64)

    def next_position(self, seq: int) -> int:
        pos = self.positions(seq)
        if pos.size:
            return int(pos.max()) + 1
        return int(self._seen.get(seq, 0))

    def observe(self, seq: int, next_position: int) -> None:
        """Record that ``seq`` has been run up to ``next_position`` (for sequences with no KV rows).

        :class:`plinth.model.Context` calls it after every forward, so a purely recurrent
        model still knows where its sequences stand.
        """
        if next_position > self._seen.get(seq, 0):
            self._seen[seq] = next_position

    def layer_kv(self, layer: int, seq: int) -> tuple[Any, Any] | None:
        """The cached (K, V) of ``layer`` for ``seq`` (views; None if that layer caches nothing)."""
        entry = self._kv.get(seq, [None] * self.n_layer)[layer]
        if entry is None:
            return None
        n = self._len[seq]
        return entry[0][:n], entry[1][:n]

    def states(self, seq: int) -> dict[int, Any]:
        """The committed recurrent states of ``seq`` by layer."""
        return dict(self._state.get(seq, {}))

    def has_state(self, seq: int | None = None) -> bool:
        """Whether ``seq`` (any sequence when None) holds recurrent state."""
        if seq is None:
            return any(self._state.values())
        return bool(self._state.get(seq))

    # -------------------------------------------------------------- recurrent state

    def get_state(self, layer: int, seq: int) -> Any:
        """The recurrent state of ``layer`` for ``seq`` (None before the first token)."""
        pending = self._state_pending.get(seq)
        if pending is not None and layer in pending:
            return pending[layer]
        return self._state.get(seq, {}).get(layer)

    def set_state(self, layer: int, seq: int, value: Any) -> None:
        """Store the state after this forward's rows of ``seq``; it becomes current at :meth:`commit`.

        Store a new array (or a tuple of arrays) rather than mutating the previous one in place.
        """
        self._state_pending.setdefault(seq, {})[layer] = value

    def snapshot(self, seq: int) -> CacheSnapshot:
        """Save ``seq``'s length and a copy of its recurrent states (on the backend, no host copy)."""
        def copy(v: Any) -> Any:
            if isinstance(v, tuple):
                return tuple(copy(x) for x in v)
            return v.copy() if hasattr(v, "copy") else v

        return CacheSnapshot(seq=seq, n_cached=self.n_cached(seq), positions=self.positions(seq).copy(),
                             states={k: copy(v) for k, v in self._state.get(seq, {}).items()},
                             next_position=self.next_position(seq))

    def restore(self, snap: CacheSnapshot) -> None:
        """Put ``snap.seq`` back as it was at :meth:`snapshot`: rows added since are dropped, states restored.

        Only rows appended after the snapshot may be dropped: the cache must not have been
        edited below ``snap.n_cached`` in between.
        """
        seq = snap.seq
        n = self.n_cached(seq)
        if n < snap.n_cached or not np.array_equal(self.positions(seq)[: snap.n_cached], snap.positions):
            raise ValueError(f"cannot restore sequence {seq}: the cache changed below the snapshot")
        if snap.n_cached == 0 and not snap.states:
            self.clear(seq)
            return
        if seq in self._len:
            self._len[seq] = snap.n_cached
        self._state[seq] = dict(snap.states)
        self._state_pending.pop(seq, None)
        self._seen[seq] = snap.next_position

    # -------------------------------------------------------------- writes

    def update(self, layer: int, seq: int, positions: np.ndarray, k: Any, v: Any) -> tuple[Any, Any, np.ndarray]:
        """Append this batch's rows of ``seq`` to ``layer`` and return the whole cache of that layer.

        Called by architectures once per (layer, sequence) per forward, in layer order.
        positions: [n] ; k: [n, n_head_kv, hd_k]; v: [n, n_head_kv, hd_v].
        Returns (K [n_total, ...], V [n_total, ...], positions [n_total]).
        """
        xp = self.xp
        if seq not in self._len:
            self._len[seq] = 0
            self._pos[seq] = np.zeros(0, np.int64)
            self._kv[seq] = [None] * self.n_layer
        n_old = self._len[seq]
        n_new = n_old + len(positions)
        slots = self._kv[seq]
        entry = slots[layer]
        if entry is None or entry[0].shape[0] < n_new:
            cap = max(n_new, 2 * (entry[0].shape[0] if entry is not None else 0), 16)
            kb = xp.empty((cap,) + tuple(k.shape[1:]), dtype=xp.float32)
            vb = xp.empty((cap,) + tuple(v.shape[1:]), dtype=xp.float32)
            if entry is not None:
                kb[:n_old] = entry[0][:n_old]
                vb[:n_old] = entry[1][:n_old]
            entry = [kb, vb]
            slots[layer] = entry
        entry[0][n_old:n_new] = k
        entry[1][n_old:n_new] = v
        if len(self._pos[seq]) < n_new:
            grown = np.zeros(max(n_new, 2 * len(self._pos[seq]), 16), np.int64)
            grown[:n_old] = self._pos[seq][:n_old]
            self._pos[seq] = grown
        self._pos[seq][n_old:n_new] = positions
        self._pending[seq] = n_new
        return entry[0][:n_new], entry[1][:n_new], self._pos[seq][:n_new]

    def commit(self) -> None:
        """End of a forward: the rows appended by every layer become part of the cache."""
        for seq, n in self._pending.items():
            self._len[seq] = n
        self._pending.clear()
        for seq, states in self._state_pending.items():
            self._state.setdefault(seq, {}).update(states)
        self._state_pending.clear()

    def rollback_pending(self) -> None:
        """Drop rows (and states) written during a forward that failed half way."""
        self._pending.clear()
        self._state_pending.clear()

    def seq_rm(self, seq: int, p0: int = 0, p1: int | None = None) -> None:
        """Remove the cached rows of ``seq`` with p0 <= position < p1 (p1 None = to the end)."""
        if seq not in self._len:
            return
        n = self._len[seq]
        pos = self._pos[seq][:n]
        hi = np.iinfo(np.int64).max if p1 is None else p1
        keep = ~((pos >= p0) & (pos < hi))
        if keep.all():
            return
        if self._state.get(seq) and keep.any():
            raise ValueError(
                f"sequence {seq} holds recurrent state, which cannot drop positions {p0}..{p1}; "
                "take a snapshot() before the rows and restore() it instead")
        idx = np.nonzero(keep)[0]
        m = len(idx)
        for entry in self._kv[seq]:
            if entry is not None:
                entry[0][:m] = entry[0][idx]
                entry[1][:m] = entry[1][idx]
        self._pos[seq][:m] = pos[idx]
        self._len[seq] = m
        self._seen[seq] = int(pos[idx].max()) + 1 if m else 0
        if m == 0:
            self.clear(seq)

    def seq_cp(self, src: int, dst: int) -> None:
        """Make ``dst`` a copy of ``src`` (its rows replace whatever ``dst`` held)."""
        self.clear(dst)
        if src in self._len:
            n = self._len[src]
            self._len[dst] = n
            self._pos[dst] = self._pos[src][:n].copy()
            self._kv[dst] = [None if e is None else [e[0][:n].copy(), e[1][:n].copy()] for e in self._kv[src]]
        if self._state.get(src):
            self._state[dst] = dict(self.snapshot(src).states)
        if src in self._seen:
            self._seen[dst] = self._seen[src]

    def clear(self, seq: int | None = None) -> None:
        for table in (self._kv, self._pos, self._len, self._pending, self._state, self._state_pending, self._seen):
            if seq is None:
                table.clear()
            else:
                table.pop(seq, None)


def run_layers(x: Any, n_layer: int, layer: Callable[[int, Any], Any], cache: KVCache,
               taps: Sequence[int] = ()) -> tuple[Any, dict[int, Any]]:
    """``x = layer(il, x)`` for every layer, as one unit of work on ``cache``.

    The rows and states the layers write become part of the cache at the end
    (:meth:`KVCache.commit`), or are dropped if a layer raises. Returns the final
    residual and the feature taps asked for: the input of layer k for each tap k,
    and for tap ``n_layer`` the residual before the final norm.
    """
    features: dict[int, Any] = {}
    try:
        for il in range(n_layer):
            if il in taps:
                features[il] = x
            x = layer(il, x)
    except BaseException:
        cache.rollback_pending()
        raise
    cache.commit()
    if n_layer in taps:
        features[n_layer] = x
    return x, features


def pool(hidden: Any, batch: Batch, pooling: str, xp: Any = np) -> tuple[Any, np.ndarray]:
    """Pool per-row hidden states into one vector per sequence.

    hidden: [n_rows, n_embd]. pooling: "mean", "cls" (the sequence's first row in the
    batch) or "last" (its last row). Returns ([n_seq, n_embd], seq ids [n_seq]).
    """
    if pooling not in POOLING or pooling == "none":
        raise ValueError(f"pooling must be one of mean, cls, last, not {pooling!r}")
    seqs = np.unique(batch.seq_ids)
    out = []
    for s in seqs:
        rows = np.nonzero(batch.seq_ids == s)[0]
        if pooling == "mean":
            out.append(hidden[rows].mean(axis=0))
        elif pooling == "cls":
            out.append(hidden[rows[np.argmin(batch.positions[rows])]])
        else:
            out.append(hidden[rows[np.argmax(batch.positions[rows])]])
    return xp.stack(out), seqs

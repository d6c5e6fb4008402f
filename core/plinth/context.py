"""Batches, the KV cache and the forward output struct.

A :class:`Batch` holds rows; each row is a token id or an embedding vector (or
a mix, per row), with its position, its sequence id and whether it wants an
output. A :class:`Context` owns the per-sequence KV cache; architectures append
to it and read it back through :meth:`KVCache.update`.
"""

from __future__ import annotations

from typing import Any, Sequence

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


class KVCache:
    """Per-sequence, per-layer keys and values with their positions.

    Layout per (sequence, layer): K [n_cached, n_head_kv, head_dim_k], V [n_cached,
    n_head_kv, head_dim_v], positions [n_cached]. Storage grows by doubling, so
    appending one token is amortised O(1).
    """

    def __init__(self, n_layer: int, xp: Any = np) -> None:
        self.n_layer = n_layer
        self.xp = xp
        # seq -> layer -> [k_buf, v_buf]; seq -> positions buffer; seq -> used length
        self._kv: dict[int, list[list[Any] | None]] = {}
        self._pos: dict[int, np.ndarray] = {}
        self._len: dict[int, int] = {}
        self._pending: dict[int, int] = {}

    # -------------------------------------------------------------- inspection

    def seqs(self) -> list[int]:
        return sorted(self._len)

    def n_cached(self, seq: int) -> int:
        return self._len.get(seq, 0)

    def positions(self, seq: int) -> np.ndarray:
        return self._pos[seq][: self._len[seq]] if seq in self._len else np.zeros(0, np.int64)

    def next_position(self, seq: int) -> int:
        pos = self.positions(seq)
        return int(pos.max()) + 1 if pos.size else 0

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

    def rollback_pending(self) -> None:
        """Drop rows appended during a forward that failed half way."""
        self._pending.clear()

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
        idx = np.nonzero(keep)[0]
        m = len(idx)
        for entry in self._kv[seq]:
            if entry is not None:
                entry[0][:m] = entry[0][idx]
                entry[1][:m] = entry[1][idx]
        self._pos[seq][:m] = pos[idx]
        self._len[seq] = m
        if m == 0:
            self.clear(seq)

    def seq_cp(self, src: int, dst: int) -> None:
        """Make ``dst`` a copy of ``src`` (its rows replace whatever ``dst`` held)."""
        self.clear(dst)
        if src not in self._len:
            return
        n = self._len[src]
        self._len[dst] = n
        self._pos[dst] = self._pos[src][:n].copy()
        self._kv[dst] = [None if e is None else [e[0][:n].copy(), e[1][:n].copy()] for e in self._kv[src]]

    def clear(self, seq: int | None = None) -> None:
        for table in (self._kv, self._pos, self._len, self._pending):
            if seq is None:
                table.clear()
            else:
                table.pop(seq, None)


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

"""What a forward takes and gives: :class:`Batch` (rows in) and :class:`ForwardOutput` (out).

A :class:`Batch` holds rows; each row is a token id or an embedding vector (or
a mix, per row), with its position, its sequence id and whether it wants an
output. Plugin code imports these from :mod:`plinth.graph`.
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

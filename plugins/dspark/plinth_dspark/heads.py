"""The two DSpark heads, vectorised over all blocks of a batch (llama.cpp ``build_dspark_markov_head``).

Markov head, for every block j (rows block-major, ``b`` rows per block, ``s`` the first prediction row):

    prev_s = anchor_j
    for i = s .. b-1:
        e_i    = w1[prev_i]                      # [R], w1 indexed by target ids
        out_i  = Z_i + w2 . e_i                  # [V_d] (w2's scale folded in at load)
        conf_i = sigmoid(conf_w . [h_i ; e_i] + conf_b)
        prev_{i+1} = d2t[argmax(out_i)]          # greedy chain, whatever the final pick

On the host (numpy arrays of one float type) the chain runs in one compiled call, row after row
(:func:`_chain_rows`: each row's bias and argmax in one pass over ``w2``, which a draft keeps transposed,
``[R, V_d]``, so the pass vectorises over the vocabulary). Elsewhere (a device) it is computed by fixed-point
rounds over all rows at once, which gives exactly the sequential chain in a few large products.

The bias is computed in the draft vocabulary, which is the same as llama.cpp's scatter through ``d2t``
into a -inf/0 target-vocabulary row: rows outside the draft vocabulary can never win the argmax.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
from numba import njit

from plinth.errors import UserError


class BlockShapeError(UserError):
    """Blocks of unequal size, or a block longer than the trained block size."""


@attrs.frozen
class MarkovOutput:
    logits: Any  # [n_blocks, b - s, V_d] biased logits of the prediction rows (draft vocabulary)
    tokens: Any  # [n_blocks, b - s] chained draft tokens (target ids)
    conf: Any  # [n_blocks, b - s] confidences, or None without a confidence head
    prev_emb: Any  # [n_blocks, b - s, R] the Markov embeddings e_i


def sigmoid(x: Any, xp: Any) -> Any:
    return 1.0 / (1.0 + xp.exp(-x))


@njit(cache=True, nogil=True)
def _chain_rows(zb: np.ndarray, w1: np.ndarray, w2t: np.ndarray, d2t: np.ndarray, anchors: np.ndarray,
                logits: np.ndarray, prev: np.ndarray) -> None:
    """The greedy chain, row after row: ``logits[j, i] = zb[j, i] + w2t.T @ w1[prev[j, i]]`` and ``prev[j, i + 1]``
    the (first) argmax of that row, through ``d2t`` (empty: the identity). Each bias element sums its R terms in
    order (one pass over ``w2t`` a row, vectorised over the vocabulary)."""
    n_blocks, m, vd = zb.shape
    rank = w2t.shape[0]
    acc = np.empty(vd, logits.dtype)
    for j in range(n_blocks):
        p = anchors[j]
        for i in range(m):
            prev[j, i] = p
            acc[:] = 0
            for r in range(rank):
                e = w1[p, r]
                w = w2t[r]
                for v in range(vd):
                    acc[v] += w[v] * e
            out = logits[j, i]
            z = zb[j, i]
            for v in range(vd):
                out[v] = z[v] + acc[v]
            best = 0
            for v in range(vd):  # numpy's argmax: the first maximum, or the first NaN
                x = out[v]
                if x != x:
                    best = v
                    break
                if x > out[best]:
                    best = v
            p = best if d2t.shape[0] == 0 else d2t[best]


def _host(xp: Any, zb: Any, w1: Any, w2: Any) -> bool:
    """Whether :func:`_chain_rows` takes the chain: numpy arrays of one float type."""
    return xp is np and zb.dtype in (np.float32, np.float64) and all(
        isinstance(a, np.ndarray) and a.dtype == zb.dtype for a in (zb, w1, w2))


def transposed_w2(w2: Any, xp: Any) -> Any:
    """``w2`` as :func:`markov_chain`'s host path reads it (``[R, V_d]``, C order); a draft makes it once."""
    return xp.ascontiguousarray(w2.T)


def markov_chain(z: Any, hidden: Any, anchors: Any, n_blocks: int, *, w1: Any, w2: Any, d2t: Any = None,
                 conf_w: Any = None, conf_b: Any = None, first_row: int = 0, max_block: int | None = None,
                 xp: Any, w2t: Any = None) -> MarkovOutput:
    """z: [n_tok, V_d] base logits of the block rows, hidden: [n_tok, E] their final-normed hidden states,
    anchors: [n_blocks] target ids (row 0 of each block); rows block-major. ``w2t``: :func:`transposed_w2`
    of ``w2`` where the caller keeps it (the host path makes it otherwise).

    Every block must have the same size (``n_tok % n_blocks == 0``). A block longer than ``max_block`` (the
    trained block size; the worst-case reservation in llama.cpp) gets no bias: the plain logits come back.
    """
    n_tok = int(z.shape[0])
    if n_blocks <= 0 or n_tok % n_blocks:
        raise BlockShapeError(f"dspark Markov head: {n_tok} rows do not split into {n_blocks} equal blocks; every "
                              "block of a draft batch must have the same size")
    b = n_tok // n_blocks
    s = int(first_row)
    zb = z.reshape(n_blocks, b, -1)[:, s:]
    hb = hidden.reshape(n_blocks, b, -1)[:, s:]
    d2t_map = (lambda ids: ids) if d2t is None else (lambda ids: d2t[ids])
    if max_block is not None and b > max_block:
        return MarkovOutput(logits=zb, tokens=d2t_map(xp.argmax(zb, axis=-1)), conf=None, prev_emb=None)
    m = b - s
    anchors = xp.asarray(anchors).reshape(n_blocks).astype(xp.int64)
    if _host(xp, zb, w1, w2):
        logits = np.empty(zb.shape, dtype=zb.dtype)
        prev = np.empty((n_blocks, m), dtype=np.int64)
        _chain_rows(zb, w1, transposed_w2(w2, np) if w2t is None else w2t,
                    np.empty(0, np.int64) if d2t is None else np.asarray(d2t, dtype=np.int64), anchors, logits, prev)
        return _heads_out(logits, prev, hb, w1, conf_w, conf_b, d2t_map, xp)
    # The chain is sequential, but one w2 product per row would stream all of w2 (V_d x R) once per row.
    # Instead: guess every prev from the unbiased argmax, bias a window of rows in one product, and re-bias the
    # rows whose prev changed. Invariant: every fresh row's successor holds that row's argmax, so once rows
    # 0..c-1 are fresh, prev_c is exact: the first stale row is final after each round (at most m rounds) and
    # the fixed point is exactly the sequential chain (same argmax, same first-index ties). The window starts at
    # the whole block and halves while rounds keep flipping guesses (a bias that dominates the logits).
    prev = xp.empty((n_blocks, m), dtype=xp.int64)
    prev[:, 0] = anchors
    if m > 1:
        prev[:, 1:] = d2t_map(xp.argmax(zb[:, :-1], axis=-1))
    logits = xp.empty(zb.shape, dtype=xp.result_type(zb.dtype, w2.dtype))
    stale = xp.ones((n_blocks, m), dtype=bool)
    cols = xp.arange(m)[None, :]
    window = m
    for _ in range(m):
        first = int(xp.argmax(stale.any(axis=0)))  # the first column with a stale row
        blk, col = xp.nonzero(stale & (cols < first + window))
        logits[blk, col] = zb[blk, col] + w1[prev[blk, col]] @ w2.T  # [k, R] @ [R, V_d]: one pass over w2
        stale[blk, col] = False
        inner = col < m - 1
        blk, col = blk[inner], col[inner]
        nxt = d2t_map(xp.argmax(logits[blk, col], axis=-1))
        flip = nxt != prev[blk, col + 1]
        prev[blk[flip], col[flip] + 1] = nxt[flip]
        stale[blk[flip], col[flip] + 1] = True
        if not bool(stale.any()):
            break
        if int(flip.sum()) > 1:
            window = max(2, window // 2)
    return _heads_out(logits, prev, hb, w1, conf_w, conf_b, d2t_map, xp)


def _heads_out(logits: Any, prev: Any, hb: Any, w1: Any, conf_w: Any, conf_b: Any, d2t_map: Any,
               xp: Any) -> MarkovOutput:
    """The chained tokens, the Markov embeddings and the confidence head's output of the chain's rows."""
    tokens = d2t_map(xp.argmax(logits, axis=-1))
    emb = w1[prev]  # [n_blocks, m, R]
    conf = None
    if conf_w is not None:
        feats = xp.concatenate([hb, emb], axis=-1) if conf_w.shape[-1] == hb.shape[-1] + emb.shape[-1] else hb
        c = feats @ conf_w.reshape(-1)
        if conf_b is not None:
            c = c + conf_b.reshape(-1)[0]
        conf = sigmoid(c, xp)
    return MarkovOutput(logits=logits, tokens=tokens, conf=conf, prev_emb=emb)

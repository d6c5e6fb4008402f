"""Engram: hashed n-gram memory added into the hyper-connection streams (DeepSeek V4.1 Flash).

Per Engram layer e (constants from the GGUF keys ``deepseek41.engram.*``)::

    N = max_ngram_size (>= 2), Hh = head count, n_cols = (N - 1)·Hh, dk = key_length
    ctx[0] = map(token_t);  ctx[s] = map(token_{t-s}), s = 1..N-1
        (pad_id before the sequence start, for embedding rows and for ids outside the token map)
    rolling = ctx[0]·mult[e][0]
    for s = 1..N-1:
        rolling ^= ctx[s]·mult[e][s]                       (uint64, wrapping)
        row[(s-1)·Hh + h] = rolling mod prime[e][b] + offset[e][b]   for h < Hh
    emb  = concat_b table_e[row[b]]                         [n_cols·dk]
    kv   = W_wkv · emb                                      hc keys, then one shared value, each E wide
    k_c  = RMSNorm(key_c)·engram_k[c];  q_c = RMSNorm(X_c)·engram_q[c]
    s_c  = k_c·q_c / sqrt(E);  gate_c = sigmoid(sign(s_c)·sqrt(max(|s_c|, 1e-6)))
    X_c += gate_c · value

The hashing runs on the host (token ids are host data); only the table rows a token needs are
read (``table[rows]`` on a memory-mapped F32 table, or :meth:`QuantWeight.take` on a BF16/F16
one, which dequantizes just those rows).
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import numpy as np

from plinth import ops
from plinth.graph import HParamsError, KeyReader, QuantWeight, Recurrent

LLAMA_MAX_LAYERS = 512
GATE_FLOOR = 1e-6


@attrs.frozen(eq=False)
class EngramHParams:
    """The Engram constants of a file.

    layer_ids: the layers whose input gets Engram memory (before the block);
    multipliers: uint64 [n_engram, N];  primes, offsets: uint64 [n_engram, n_cols];
    token_map: int64 [>= n_vocab] (folds case / accents);  pad_id: the id used where there is no token.
    """

    layer_ids: tuple[int, ...]
    n_head: int
    key_length: int
    max_ngram: int
    pad_id: int
    multipliers: np.ndarray
    primes: np.ndarray
    offsets: np.ndarray
    token_map: np.ndarray

    @property
    def n_cols(self) -> int:
        return (self.max_ngram - 1) * self.n_head

    def index(self, il: int) -> int:
        """Position of layer ``il`` in ``layer_ids``."""
        return self.layer_ids.index(il)

    def rows_needed(self, e: int) -> int:
        """The smallest table that every hashed row of Engram layer ``e`` fits: max_b(offset + prime)."""
        return int((self.offsets[e] + self.primes[e]).max())


def read_engram(r: KeyReader, n_layer: int, n_vocab: int) -> EngramHParams:
    """The ``engram.*`` keys, validated (every problem an :class:`HParamsError` naming its key)."""
    src = r.source
    layer_ids = r.get_array("engram.layer_ids")
    if not layer_ids:
        raise HParamsError(f"{src}: key '{r.key('engram.layer_ids')}' is empty; an Engram model names at least one "
                           "layer (leave the key out for a model without Engram)")
    if len(layer_ids) > LLAMA_MAX_LAYERS:
        raise HParamsError(f"{src}: key '{r.key('engram.layer_ids')}' has {len(layer_ids)} entries, more than "
                           f"{LLAMA_MAX_LAYERS} layers")
    bad = [il for il in layer_ids if not 0 <= il < n_layer]
    if bad:
        raise HParamsError(f"{src}: key '{r.key('engram.layer_ids')}' has layer(s) {bad} out of range "
                           f"(block_count = {n_layer})")
    if len(set(layer_ids)) != len(layer_ids):
        raise HParamsError(f"{src}: key '{r.key('engram.layer_ids')}' = {list(layer_ids)} repeats a layer")
    n_head = r.get("engram.head_count")
    if n_head < 1:
        raise HParamsError(f"{src}: key '{r.key('engram.head_count')}' = {n_head}; Engram needs at least one head")
    n = r.get("engram.max_ngram_size")
    if n < 2:
        raise HParamsError(f"{src}: key '{r.key('engram.max_ngram_size')}' = {n}; Engram n-grams have at least 2 "
                           "tokens")
    dk = r.get("engram.key_length")
    if dk < 1:
        raise HParamsError(f"{src}: key '{r.key('engram.key_length')}' = {dk}; expected a positive width")
    n_e, n_cols = len(layer_ids), (n - 1) * n_head
    mult = r.get_array("engram.multipliers")
    if len(mult) != n_e * n:
        raise HParamsError(f"{src}: key '{r.key('engram.multipliers')}' has {len(mult)} values, expected "
                           f"n_engram · max_ngram_size = {n_e} · {n} = {n_e * n}")
    primes, offsets = r.get_array("engram.primes"), r.get_array("engram.offsets")
    for name, vals in (("engram.primes", primes), ("engram.offsets", offsets)):
        if len(vals) != n_e * n_cols:
            raise HParamsError(f"{src}: key '{r.key(name)}' has {len(vals)} values, expected n_engram · (N - 1) · "
                               f"head_count = {n_e} · {n - 1} · {n_head} = {n_e * n_cols}")
        if any(v < 0 or v >= 1 << 64 for v in vals):
            raise HParamsError(f"{src}: key '{r.key(name)}' has a value outside uint64")
    if any(v < 0 or v >= 1 << 64 for v in mult):
        raise HParamsError(f"{src}: key '{r.key('engram.multipliers')}' has a value outside uint64")
    zero = [i for i, p in enumerate(primes) if p == 0]
    if zero:
        raise HParamsError(f"{src}: key '{r.key('engram.primes')}' has a zero at index {zero[0]} (row = hash mod "
                           "prime)")
    token_map = r.get_array("engram.token_map")
    if n_vocab > 0 and len(token_map) < n_vocab:
        raise HParamsError(f"{src}: key '{r.key('engram.token_map')}' has {len(token_map)} entries, fewer than "
                           f"n_vocab = {n_vocab}")
    pad = r.get("engram.pad_id")
    return EngramHParams(
        layer_ids=tuple(int(i) for i in layer_ids), n_head=n_head, key_length=dk, max_ngram=n, pad_id=pad,
        multipliers=np.asarray(mult, dtype=np.uint64).reshape(n_e, n),
        primes=np.asarray(primes, dtype=np.uint64).reshape(n_e, n_cols),
        offsets=np.asarray(offsets, dtype=np.uint64).reshape(n_e, n_cols),
        token_map=np.asarray(token_map, dtype=np.int64))


class AtLeast(int):
    """A tensor dimension that matches any size >= its value (an Engram table may have spare rows).

    ``check_tensors`` compares shapes as tuples; an int subclass's ``__eq__`` takes precedence
    over ``int.__eq__`` in ``n == AtLeast(m)``, so the comparison reads ``n >= m``."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (int, np.integer)) and int(other) >= int(self)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = int.__hash__

    def __repr__(self) -> str:
        return f">={int(self)}"


# ============================================================================ token context and hashing


class EngramTokens(Recurrent):
    """Per sequence: the last N-1 mapped token ids before the next row (pad before the start).

    Kept on the host (the hash runs there); rolled back by snapshot like any recurrent state."""

    kind = "engram_tokens"


def map_tokens(tokens: np.ndarray, is_embd: np.ndarray | None, ep: EngramHParams) -> np.ndarray:
    """ctx[0] of each row: ``token_map[t]``, or pad for embedding rows and ids outside the map. -> uint64 [n]."""
    tokens = np.asarray(tokens, dtype=np.int64)
    inside = (tokens >= 0) & (tokens < ep.token_map.shape[0])
    mapped = np.where(inside, ep.token_map[np.where(inside, tokens, 0)], ep.pad_id)
    if is_embd is not None:
        mapped = np.where(np.asarray(is_embd, dtype=bool), ep.pad_id, mapped)
    return mapped.astype(np.uint64)


def ngram_context(mapped: np.ndarray, history: np.ndarray, n: int) -> np.ndarray:
    """ctx [rows, n] for one sequence's consecutive rows: ctx[i, s] = the mapped id s rows back.

    mapped: uint64 [rows] (this batch's rows of the sequence, in order);
    history: uint64 [n - 1], the ids before the first row, oldest first (pad at the sequence start)."""
    stream = np.concatenate([np.asarray(history, dtype=np.uint64), mapped])
    k = len(history)
    return np.stack([stream[k - s:k - s + len(mapped)] for s in range(n)], axis=1)


def hash_rows(ctx: np.ndarray, multipliers: np.ndarray, primes: np.ndarray, offsets: np.ndarray,
              n_head: int) -> np.ndarray:
    """Table rows [rows, n_cols] (int64) of one Engram layer: the wrapping multiply-XOR rolling hash of
    each n-gram prefix, mod prime, + offset. ctx: uint64 [rows, N]; multipliers: uint64 [N];
    primes, offsets: uint64 [n_cols]."""
    n = ctx.shape[1]
    out = np.empty((ctx.shape[0], (n - 1) * n_head), dtype=np.uint64)
    with np.errstate(over="ignore"):
        rolling = ctx[:, 0] * multipliers[0]
        for s in range(1, n):
            rolling = rolling ^ (ctx[:, s] * multipliers[s])
            for h in range(n_head):
                b = (s - 1) * n_head + h
                out[:, b] = rolling % primes[b] + offsets[b]
    return out.astype(np.int64)


# ============================================================================ the block


@attrs.frozen
class EngramWeights:
    """table: [rows, dk] (memory-mapped; rows gathered on demand); wkv: [(hc + 1)·E, n_cols·dk];
    q_norm, k_norm: [hc, E] (per-copy RMSNorm weights)."""

    table: Any
    wkv: Any
    q_norm: Any
    k_norm: Any


def advise_random_access(table: Any) -> bool:
    """Tell the kernel that a memory-mapped table is read at random rows (``madvise(MADV_RANDOM)``), so
    a page fault reads that page only instead of megabytes of read-around. Returns whether it was
    applied (host arrays that view a file mapping, on Linux)."""
    raw = table.raw if isinstance(table, QuantWeight) else table
    if not isinstance(raw, np.ndarray) or raw.flags.owndata or raw.nbytes == 0:
        return False
    try:
        import ctypes
        import mmap

        libc = ctypes.CDLL(None, use_errno=True)
        addr = raw.__array_interface__["data"][0]
        start = addr - addr % mmap.PAGESIZE
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(addr + raw.nbytes - start),
                            getattr(mmap, "MADV_RANDOM", 1)) == 0
    except (OSError, AttributeError, TypeError):
        return False


def gather_rows(table: Any, rows: np.ndarray, xp: Any) -> Any:
    """table[rows] as float32 [*rows.shape, dk], reading only those rows."""
    if isinstance(table, QuantWeight) and table.type_name in ("BF16", "F16") and table.raw16 is not None:
        # a few rows a token: decode them in numpy (no kernel launch across threads for 8 rows)
        bits = table.raw16[np.asarray(rows)]  # [..., dk] uint16, read from the mapping
        vals = (bits.astype(np.uint32) << 16).view(np.float32) if table.type_name == "BF16" else \
            bits.view(np.float16).astype(np.float32)
        return xp.asarray(vals)
    if isinstance(table, QuantWeight):
        return xp.asarray(table.take(rows))  # a quantized (BF16/F16) table: dequantize just these rows
    return xp.asarray(table[xp.asarray(rows)], dtype=np.float32)


def engram_mix(X: Any, emb: Any, w: EngramWeights, eps: float) -> Any:
    """X_c + gate_c · value. X: [n, hc, E]; emb: [n, n_cols·dk] (the gathered rows) -> [n, hc, E]."""
    xp = ops.array_module(X)
    n, hc, e = X.shape
    kv = ops.linear(emb, w.wkv)  # [n, (hc + 1)·E]
    keys = kv[:, :hc * e].reshape(n, hc, e)
    value = kv[:, hc * e:]
    k = ops.rms_norm(keys, None, eps) * w.k_norm
    q = ops.rms_norm(X, None, eps) * w.q_norm
    s = (k * q).sum(axis=-1) * np.float32(e ** -0.5)  # [n, hc]
    gate = ops.sigmoid(xp.sign(s) * xp.sqrt(xp.maximum(xp.abs(s), np.float32(GATE_FLOOR))))
    return X + gate[:, :, None] * value[:, None, :]


def engram_rows_for_batch(tokens: np.ndarray, is_embd: np.ndarray | None, seq_rows: Sequence[tuple[int, Any]],
                          histories: dict[int, np.ndarray], ep: EngramHParams) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """The n-gram contexts of every row, ctx uint64 [n, N], and each sequence's history after this batch.

    seq_rows: (seq, row selector) with each sequence's rows in position order; histories: the
    history before the batch of each sequence (missing: a sequence start, all pad)."""
    n = ep.max_ngram
    mapped = map_tokens(tokens, is_embd, ep)
    ctx = np.empty((len(mapped), n), dtype=np.uint64)
    after = {}
    for seq, sel in seq_rows:
        hist = histories.get(seq)
        if hist is None:
            hist = np.full(n - 1, ep.pad_id, dtype=np.uint64)
        ctx[sel] = ngram_context(mapped[sel], hist, n)
        after[seq] = np.concatenate([hist, mapped[sel]])[len(mapped[sel]):]
    return ctx, after


__all__ = ["AtLeast", "advise_random_access", "EngramHParams", "EngramTokens", "EngramWeights", "engram_mix", "engram_rows_for_batch",
           "gather_rows", "hash_rows", "map_tokens", "ngram_context", "read_engram"]

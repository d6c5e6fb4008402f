"""Choosing the draft from a block's outputs: DFlash argmax, the DFlash2 lattice walk, the LiLiCorr walk.

Every chooser returns ``(tokens, confidences)`` for block positions 1..b-1 and stops
early at the first confidence below ``p_min`` (0 disables). The lattice walks are
index-based: a transition row is picked by the previously chosen *candidate index*,
and ties go to the lower index.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from plinth import ops

F32 = np.float32


def _np(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def _np_all(*arrays: Any) -> list[np.ndarray]:
    """Host float64 copies of several arrays in one device-to-host transfer (ids stay exact below 2**53)."""
    xp = ops.array_module(*arrays)
    if xp is np:
        return [np.asarray(a, dtype=np.float64) for a in arrays]
    flat = _np(xp.concatenate([a.reshape(-1).astype(xp.float64) for a in arrays]))
    out, o = [], 0
    for a in arrays:
        out.append(flat[o:o + a.size].reshape(a.shape))
        o += a.size
    return out


# ---------------------------------------------------------------------- DFlash


def argmax_walk(logits: Any, p_min: float = 0.0) -> tuple[list[int], list[float]]:
    """logits: [n, V] (block rows 1..b-1). Greedy argmax (lower index on ties) with top-1 softmax probability."""
    xp = ops.array_module(logits)
    ids = xp.argmax(logits, axis=-1)
    m = xp.max(logits, axis=-1, keepdims=True)
    top1 = 1.0 / xp.sum(xp.exp(logits - m), axis=-1)
    ids, top1 = _np_all(ids, top1)
    toks: list[int] = []
    conf: list[float] = []
    for i in range(ids.shape[0]):
        if p_min > 0 and top1[i] < p_min:
            break
        toks.append(int(ids[i]))
        conf.append(float(top1[i]))
    return toks, conf


# ---------------------------------------------------------------------- DFlash2


def dflash2_lattice(hidden: Any, logits: Any, anchors: Any, w: Mapping[str, Any], top_k: int, n_blocks: int = 1,
                    max_block: int | None = None) -> Any:
    """The packed candidate lattice of llama.cpp's ``build_dflash2_selector``.

    hidden: [n, E] final-normed draft hidden, block-major (``n_blocks`` blocks of b rows);
    logits: [n, V] (logit scale / soft-cap applied); anchors: [n_blocks] the anchor token of each block.
    Row p of a block (1 <= p < b) is ``[cand_p (K ids as floats) | S_p flattened q-major (K*K) | 0 pad]``
    with ``S_p[q][c] = sum_r succ[cand_p[c]][r] * pred[prev_q][r] * gate_p[r] + logits_p[cand_p[c]]``,
    ``prev`` = the block's anchor at p = 1 (one predecessor, repeated K times), else cand_{p-1};
    row 0 is all zeros. Returns [n, E] float32.
    """
    xp = ops.array_module(hidden)
    n, e = hidden.shape
    k = top_k
    if n % n_blocks:
        raise ValueError(f"dflash2 lattice: {n} rows do not split into {n_blocks} equal blocks")
    b = n // n_blocks
    if max_block is not None and b > max_block:
        raise ValueError(f"dflash2 lattice: blocks of {b} rows exceed the trained block size {max_block}")
    if e < k * (k + 1):
        raise ValueError(f"dflash2 lattice: E = {e} cannot hold K + K*K = {k * (k + 1)} values")
    tk = ops.top_k(logits, k, axis=-1)
    cand, unary = tk.indices, tk.values  # [n, K], descending
    gate = ops.linear(hidden, w["selector_hidden.weight"])  # [n, R]
    pred_t, succ_t = w["selector_predecessor.weight"], w["selector_successor.weight"]
    out = xp.zeros((n, e), dtype=F32)
    anchors = xp.asarray(np.asarray(_np(anchors), dtype=np.int64))
    for j in range(n_blocks):
        r0 = j * b
        if b < 2:
            continue
        prev = xp.concatenate([xp.broadcast_to(anchors[j], (1, k)), cand[r0 + 1:r0 + b - 1]], axis=0)  # [b-1, K]
        p_emb = pred_t[prev] * gate[r0 + 1:r0 + b, None, :]  # [b-1, K(q), R]
        s_emb = succ_t[cand[r0 + 1:r0 + b]]  # [b-1, K(c), R]
        scores = xp.matmul(p_emb, s_emb.transpose(0, 2, 1)) + unary[r0 + 1:r0 + b, None, :]  # [b-1, q, c]
        out[r0 + 1:r0 + b, :k] = cand[r0 + 1:r0 + b].astype(F32)
        out[r0 + 1:r0 + b, k:k + k * k] = scores.reshape(b - 1, k * k)
    return out


def lattice_walk(lattice: Any, top_k: int, n_rows: int, p_min: float = 0.0,
                 start: int = 0) -> tuple[list[int], list[float]]:
    """The DFlash2 greedy walk over packed rows ``start+1 .. start+n_rows-1`` (llama.cpp speculative.cpp).

    q starts at 0 (position 1 has a single predecessor, so every q row is the same); each step takes
    the first maximum of ``row[K + q*K : K + (q+1)*K]``; with p_min > 0 it stops when the softmax
    of that row at the choice is below p_min. Returns (tokens, confidences).
    """
    lat = _np(lattice)
    k = top_k
    q = 0
    toks: list[int] = []
    conf: list[float] = []
    for i in range(1, n_rows):
        row = lat[start + i].astype(np.float64)
        scores = row[k + q * k:k + (q + 1) * k]
        q = int(np.argmax(scores))
        c = 1.0 / float(np.sum(np.exp(scores - scores[q])))
        if p_min > 0 and c < p_min:
            break
        toks.append(int(row[q]))
        conf.append(c)
    return toks, conf


# ---------------------------------------------------------------------- LiLiCorr


def _l2n(x: Any, eps: float) -> Any:
    xp = ops.array_module(x)
    return x / xp.maximum(xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True)), F32(eps))


def candidate_features(logp: Any) -> Any:
    """The 5 candidate features in order: logp, p, logp - max logp, rank fraction, is-top1.

    logp: [S, K] full-vocabulary log-probs of the candidates (descending). Returns [S, K, 5].
    """
    xp = ops.array_module(logp)
    s, k = logp.shape
    rank = xp.arange(k, dtype=F32) / F32(k - 1) if k > 1 else xp.zeros(k, dtype=F32)
    top1 = (xp.arange(k) == 0).astype(F32)
    return xp.stack([logp, xp.exp(logp), logp - xp.max(logp, axis=-1, keepdims=True),
                     xp.broadcast_to(rank, (s, k)), xp.broadcast_to(top1, (s, k))], axis=-1).astype(F32)


def slot_bias(rel: Any, same: Any, slots: Any, block_size: int) -> Any:
    """Additive attention bias [H, T, T] of the lattice transformer.

    rel: [H, 2B-1]; same: [H]; slots: [T] slot of each lattice token.
    bias[h, i, j] = rel[h, clamp(s_i - s_j, -(B-1), B-1) + B-1] + same[h] * (s_i == s_j).
    """
    xp = ops.array_module(rel)
    d = slots[:, None] - slots[None, :]
    idx = xp.clip(d, -(block_size - 1), block_size - 1) + (block_size - 1)
    return rel[:, idx] + same[:, None, None] * (d == 0)[None].astype(F32)


def lilicorr_candidates(hidden: Any, head: Any, k: int) -> tuple[Any, Any]:
    """Top-K candidates per slot and their log-probs normalised over the **full** vocabulary.

    hidden: [S, E]; head: [V, E]. Returns (ids [S, K], logp [S, K]), descending.
    """
    logp_all = ops.log_softmax(ops.linear(hidden, head), axis=-1)
    tk = ops.top_k(logp_all, k, axis=-1)
    return tk.indices, tk.values


def lilicorr_scores(hidden: Any, head: Any, embed: Any, anchor_row: Any, anchor_valid: bool, w: Mapping[str, Any],
                    lh: Any, block_size: int, norm_eps: float) -> tuple[Any, Any, Any]:
    """Candidates and cosine scores of the LiLiCorr head for one block.

    hidden: [S, E] final-normed draft hidden of slots 1..S (block rows 1..b-1); head: [V, E] LM head;
    embed: [V, E] the target's input embedding; anchor_row: [E] the fused context row of the last
    committed position (zeroed when ``anchor_valid`` is False).
    Returns (ids [S, K], start [K], pair [S-1, K, K]), scores already multiplied by lambda.
    """
    xp = ops.array_module(hidden)
    p = "lilicorr."
    s_n, _ = hidden.shape
    k = lh.top_k
    d = lh.hidden
    ids, logp = lilicorr_candidates(hidden, head, k)  # [S, K]
    feats = candidate_features(logp)  # [S, K, 5]
    emb = embed[ids.reshape(-1)].reshape(s_n, k, -1)
    tok = ops.linear(emb, w[p + "token_proj.weight"], w.get(p + "token_proj.bias")) \
        if p + "token_proj.weight" in w else emb
    fh = ops.layer_norm(feats, w[p + "feat_norm.weight"], w[p + "feat_norm.bias"], eps=1e-5)
    fh = ops.linear(ops.silu(ops.linear(fh, w[p + "feat_up.weight"], w.get(p + "feat_up.bias"))),
                    w[p + "feat_down.weight"], w.get(p + "feat_down.bias"))
    ph = ops.linear(hidden, w[p + "pass_hidden_proj.weight"], w.get(p + "pass_hidden_proj.bias"))  # [S, D]
    z = tok + ph[:, None, :] + fh + w[p + "slot_embd.weight"][:s_n, None, :] + w[p + "rank_embd.weight"][None, :, :]
    z = z.reshape(s_n * k, d)
    slots = xp.repeat(xp.arange(s_n), k)
    hd = d // lh.n_head
    for il in range(lh.n_layer):
        b = f"{p}blk.{il}."
        u = ops.rms_norm(z, w[b + "attn_norm.weight"], norm_eps)
        qkv = ops.linear(u, w[b + "attn_qkv.weight"], w.get(b + "attn_qkv.bias"))
        q, kk, v = (qkv[:, i * d:(i + 1) * d].reshape(-1, lh.n_head, hd).transpose(1, 0, 2) for i in range(3))
        att = xp.matmul(q, kk.transpose(0, 2, 1)) * F32(1.0 / hd ** 0.5)
        att = att + slot_bias(w[b + "attn_rel_bias"], w[b + "attn_same_bias"], slots, block_size)
        att = att - xp.max(att, axis=-1, keepdims=True)
        att = xp.exp(att)
        att /= xp.sum(att, axis=-1, keepdims=True)
        o = xp.matmul(att, v).transpose(1, 0, 2).reshape(-1, d)
        z = z + ops.linear(o, w[b + "attn_output.weight"], w.get(b + "attn_output.bias"))
        u = ops.rms_norm(z, w[b + "ffn_norm.weight"], norm_eps)
        z = z + ops.linear(ops.silu(ops.linear(u, w[b + "ffn_up.weight"], w.get(b + "ffn_up.bias"))),
                           w[b + "ffn_down.weight"], w.get(b + "ffn_down.bias"))
    z = ops.rms_norm(z, w[p + "output_norm.weight"], norm_eps)
    a_in = anchor_row if anchor_valid else xp.zeros_like(anchor_row)
    a = ops.linear(a_in[None, :], w[p + "ctx_proj.weight"], w.get(p + "ctx_proj.bias"))
    a = a * F32(1.0 if anchor_valid else 0.0)
    a = ops.rms_norm(a, w[p + "anchor_norm.weight"], norm_eps)  # [1, D]
    ab = xp.broadcast_to(a, z.shape)
    phi = ops.silu(ops.linear(xp.concatenate([z, ab, z * ab], axis=-1), w[p + "factor_in.weight"],
                              w.get(p + "factor_in.bias")))
    eps = lh.vector_eps
    out_vec = _l2n(ops.linear(phi, w[p + "out_head.weight"], w.get(p + "out_head.bias")), eps).reshape(s_n, k, -1)
    in_vec = _l2n(ops.linear(phi, w[p + "in_head.weight"], w.get(p + "in_head.bias")), eps).reshape(s_n, k, -1)
    a_out = _l2n(ops.linear(a, w[p + "anchor_out_head.weight"], w.get(p + "anchor_out_head.bias")), eps)[0]
    lam = F32(lh.logit_scale)
    start = lam * (in_vec[0] @ a_out)  # [K]
    pair = lam * xp.matmul(out_vec[:-1], in_vec[1:].transpose(0, 2, 1))  # [S-1, K(p), K(c)]
    return ids, start, pair


def lilicorr_walk(ids: Any, start: Any, pair: Any, p_min: float = 0.0) -> tuple[list[int], list[float]]:
    """Greedy walk: c_0 = argmax start; c_s = argmax pair[s-1][c_{s-1}] (first maximum on ties).

    ids: [S, K]; start: [K]; pair: [S-1, K, K]. p_min compares softmax(row)[choice] [inferred].
    """
    ids, start, pair = _np_all(ids, start, pair)
    toks: list[int] = []
    conf: list[float] = []
    row = start
    c = -1
    for s in range(ids.shape[0]):
        if s > 0:
            row = pair[s - 1, c]
        c = int(np.argmax(row))
        pc = 1.0 / float(np.sum(np.exp(row - row[c])))
        if p_min > 0 and pc < p_min:
            break
        toks.append(int(ids[s, c]))
        conf.append(pc)
    return toks, conf


def whole_blocks(n_tokens: int, n_blocks: int, block_size: int) -> int:
    """Rows per block of a multi-block lattice batch; refuses ragged or oversized blocks (LiLiCorr n_tokens
    condition)."""
    if n_blocks < 1 or n_tokens % n_blocks:
        raise ValueError(f"a lattice batch of {n_tokens} rows does not split into {n_blocks} whole, equal blocks")
    b = n_tokens // n_blocks
    if b > block_size:
        raise ValueError(f"blocks of {b} rows exceed the trained block size {block_size}")
    return b

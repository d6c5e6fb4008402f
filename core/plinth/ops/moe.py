"""Mixture-of-experts routing and the routed expert FFN."""

from __future__ import annotations

from typing import Any

import attrs
import numpy

from ._xp import F32, array_module, as_f32
from .activations import get_activation, sigmoid, softmax
from .ffn import linear
from .misc import top_k


@attrs.frozen
class MoeRoute:
    """Chosen experts per token.

    ids: [n_tokens, k] int — expert indices, best first.
    weights: [n_tokens, k] float32 — mixing weight of each chosen expert.
    """

    ids: Any
    weights: Any


def moe_route(
    logits: Any,
    top_k_experts: int,
    score_func: str = "softmax",
    norm_topk: bool = False,
    score_bias: Any = None,
    n_group: int = 1,
    topk_group: int | None = None,
    routed_scaling: float = 1.0,
) -> MoeRoute:
    """Pick ``top_k_experts`` experts per token from router logits.

    logits: [n_tokens, n_expert] (router output x @ W_gate_inp.T)
    score_func: "softmax" (probabilities over all experts), "sigmoid" (independent scores),
        or "softmax_topk" (select on raw logits, weights = softmax over the chosen k; gpt-oss).
    norm_topk: renormalise the chosen weights to sum to 1.
    score_bias: [n_expert] or None — added to the scores for *selection only*; the weights
        stay the unbiased scores (DeepSeek V3 e_score_correction_bias).
    n_group, topk_group: group-limited routing — experts split into n_group equal groups,
        a group scores the sum of its two best (biased) experts, and only the topk_group best
        groups are eligible (DeepSeek V3).
    routed_scaling: final weight multiplier.
    Returns MoeRoute(ids [n_tokens, k], weights [n_tokens, k]).
    """
    xp = array_module(logits)
    logits = as_f32(logits, xp)
    n_tok, n_exp = logits.shape
    if score_func == "softmax":
        probs = softmax(logits, axis=-1)
    elif score_func == "sigmoid":
        probs = sigmoid(logits)
    elif score_func == "softmax_topk":
        probs = logits
    else:
        raise ValueError(f"moe_route: unknown score_func {score_func!r}; use softmax, sigmoid or softmax_topk")
    sel = probs if score_bias is None else probs + as_f32(score_bias, xp)
    if n_group > 1 and topk_group is not None and topk_group < n_group:
        if n_exp % n_group:
            raise ValueError(f"moe_route: n_expert {n_exp} is not divisible by n_group {n_group}")
        grouped = sel.reshape(n_tok, n_group, n_exp // n_group)
        best2 = top_k(grouped, min(2, n_exp // n_group), axis=-1).values
        group_score = xp.sum(best2, axis=-1)  # [n_tok, n_group]
        keep = top_k(group_score, topk_group, axis=-1).indices
        allowed = xp.any(xp.arange(n_group)[None, None, :] == keep[:, :, None], axis=1)  # [n_tok, n_group]
        sel = xp.where(xp.repeat(allowed, n_exp // n_group, axis=-1), sel, F32(-xp.inf))
    ids = top_k(sel, top_k_experts, axis=-1).indices
    w = xp.take_along_axis(probs, ids, axis=-1)
    if score_func == "softmax_topk":
        w = softmax(w, axis=-1)
    if norm_topk:
        s = xp.sum(w, axis=-1, keepdims=True)
        w = w / xp.where(s > 0, s, F32(1.0))
    if routed_scaling != 1.0:
        w = w * F32(routed_scaling)
    return MoeRoute(ids=ids, weights=w.astype(F32, copy=False))


def moe_ffn(
    x: Any,
    route: MoeRoute,
    gate_exps: Any,
    up_exps: Any,
    down_exps: Any,
    act: str | Any = "silu",
) -> Any:
    """Routed experts: sum_j w_j * down_e( act(x @ gate_e.T) * (x @ up_e.T) ), e = ids_j.

    x: [n_tokens, n_embd]
    route: MoeRoute with ids, weights [n_tokens, k]
    gate_exps: [n_expert, n_ff, n_embd] or None (ungated: down_e(act(x @ up_e.T)), e.g. relu2)
    up_exps: [n_expert, n_ff, n_embd]
    down_exps: [n_expert, n_embd, n_ff]
    act: activation name or callable.
    Loops over the experts that are actually used; each gathers its tokens and runs dense
    matmuls. Shared experts are the caller's (a plain swiglu added to the result).
    Returns [n_tokens, n_embd] float32.
    """
    xp = array_module(x)
    x = as_f32(x, xp)
    fn = get_activation(act) if isinstance(act, str) else act
    n_tok, k = route.ids.shape
    if xp is not numpy and n_tok * k <= GATHER_MAX_PAIRS:
        return _moe_ffn_gathered(x, route, gate_exps, up_exps, down_exps, fn, xp)
    out = xp.zeros((n_tok, down_exps.shape[1]), dtype=F32)
    flat_ids = route.ids.reshape(-1)
    order = xp.argsort(flat_ids, kind="stable")
    sorted_ids = flat_ids[order]
    tok_of = order // k
    w_sorted = as_f32(route.weights, xp).reshape(-1)[order]
    uniq, starts = _run_starts(sorted_ids, xp)
    bounds = list(starts) + [int(flat_ids.shape[0])]
    for j, e in enumerate(uniq):
        a, b = bounds[j], bounds[j + 1]
        toks = tok_of[a:b]
        xe = x[toks]
        if gate_exps is None:
            h = fn(linear(xe, up_exps[e]))
        else:
            h = fn(linear(xe, gate_exps[e]))
            h *= linear(xe, up_exps[e])
        ye = linear(h, down_exps[e])
        ye *= w_sorted[a:b, None]
        out[toks] += ye  # a token picks an expert at most once, so no duplicate rows
    return out


# On a device, batches of at most this many (token, expert) pairs (decode, speculative
# verify) gather their experts' matrices instead of grouping tokens by expert: grouping
# needs the expert ids on the host, a device round trip per layer.
GATHER_MAX_PAIRS = 64


def _moe_ffn_gathered(x: Any, route: MoeRoute, gate_exps: Any, up_exps: Any, down_exps: Any,
                      fn: Any, xp: Any) -> Any:
    """moe_ffn as batched products over the gathered (token, expert) pairs; reads nothing back.

    x: [n_tokens, n_embd]; returns [n_tokens, n_embd].
    """
    n_tok, k = route.ids.shape
    flat = route.ids.reshape(-1)  # [P] expert of each pair, P = n_tok * k
    xe = xp.repeat(x, k, axis=0)[:, :, None]  # [P, n_embd, 1]: pair p is token p // k
    up = xp.matmul(up_exps[flat], xe)[:, :, 0]  # [P, n_ff]
    if gate_exps is None:
        h = fn(up)
    else:
        h = fn(xp.matmul(gate_exps[flat], xe)[:, :, 0])
        h *= up
    ye = xp.matmul(down_exps[flat], h[:, :, None])[:, :, 0]  # [P, n_embd]
    ye *= as_f32(route.weights, xp).reshape(-1)[:, None]
    return ye.reshape(n_tok, k, -1).sum(axis=1)


def _run_starts(sorted_ids: Any, xp: Any) -> tuple[list[int], list[int]]:
    """Distinct values of a sorted int vector and where each run starts (as host ints).

    On a device the ids come back to the host in one transfer.
    """
    if sorted_ids.shape[0] == 0:
        return [], []
    host = sorted_ids if xp is numpy else xp.asnumpy(sorted_ids)
    starts = [0] + (numpy.nonzero(host[1:] != host[:-1])[0] + 1).tolist()
    return host[starts].tolist(), starts

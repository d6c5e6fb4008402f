"""Mistral Large 4 ("le chonk"): MLA + DSA sparse indexer + KV sharing + MoE (``mistral_large4``).

The model card, top to bottom:

* every layer is ``x += attn(rms_norm(x)); x += ffn(rms_norm(x))``; the first
  ``leading_dense_block_count`` layers have a dense SwiGLU FFN, the rest a softmax-routed MoE
  (group-limited: groups scored by the sum of their two best experts), renormalised top-k,
  ``expert_weights_scale``, plus always-on shared experts;
* attention is multi-head latent attention without a query LoRA: ``q = W_q x`` per head split
  ``[nope | rope]``; ``[c_kv ; k_rope] = W_kv_a x``, ``c_kv = rms_norm(c_kv)``; ``W_kv_b`` expands
  ``c_kv`` into per-head ``k_nope`` and ``v``; ``k_rope`` is one rotated key shared by every head;
* RoPE is YaRN with learned per-frequency scaling (LeRoPE: ``inv_freq * exp(alpha)``, ``alpha`` stored
  as ``rope_alpha.weight``), on interleaved pairs; NoPE layers
  (``rope.layers`` = 0) rotate nothing and fold the rope width into the nope part;
* queries are scaled per head by ``scale * log(pos + 1) + bias`` (log-position scaling);
* DSA: on "full" indexer layers a Lightning indexer picks the top-k keys of each query
  (``I(t, s) = sum_h w_h(t) relu(q_h(t) . k(s)) / sqrt(d)``, queries from the layer-normed input,
  keys layer-normed, interleaved RoPE on their first ``n_rot`` dims except on NoPE layers);
  "shared" layers reuse the previous full layer's selection;
* KV sharing (``attention.kv_source_layers``): a layer whose source is itself computes its latent
  ("own", or "store" when later layers read it); a "reuse" layer reads its source's latent and
  has no KV projection and no cache; "reuse_but_indexer" shares the latent but keeps its own
  indexer keys;
* final RMSNorm, untied LM head, logits soft-capped ``c * tanh(z / c)``.

The cache holds the latent, never the expanded K/V (per-layer kinds ``Latent``, ``IndexerKeys``,
``SharedKV``; see :meth:`MistralLarge4Graph.cache_layout`). The graph is a core
:class:`~plinth.graph.BaseGraph`: embedding, the layer loop, the cache commit, the final norm and
the soft-capped head are the core's; this file holds :meth:`MistralLarge4Graph.layer` and its parts.
Weights are used in GGUF layout (a linear weight is ``[n_out, n_in]``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs
import numpy as np

from plinth import ops
from plinth.graph import (Architecture, BaseGraph, Batch, Cache, HParamsError, IndexerKeys, KeyReader, Latent, PerLayer,
                          SharedKV, Step, TensorSpec, expert_tensors)

ARCH = "mistral_large4"
SHARING_MODES = ("own", "store", "reuse", "reuse_but_indexer")
INDEXER_TYPES = ("full", "shared")
INDEXER_NORM_EPS = 1e-6  # the indexer's LayerNorms (not a file key: fixed by the reference)
# a sequence with at most this many rows in a forward (decode, verify) runs the absorbed MLA form
ABSORB_MAX_ROWS = 16


# ============================================================================ hparams

@attrs.frozen
class MistralLarge4HParams:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ctx_train: int
    norm_eps: float
    # multi-head latent attention
    n_head: int
    kv_lora_rank: int
    n_rot: int  # rope width of q/k on RoPE layers (qk_rope_head_dim)
    head_dim_k: int  # nope + rope
    head_dim_v: int
    attn_scale: float
    # rope (YaRN + the learned scaling rope_alpha)
    rope_base: float
    rope_scaling: str
    rope_factor: float
    rope_orig_ctx: int
    rope_beta_fast: float
    rope_beta_slow: float
    rope_attn_factor: float
    # per-layer patterns
    rope_layers: PerLayer  # 1 = RoPE, 0 = NoPE
    indexer_types: tuple[str, ...]  # "full" | "shared"
    kv_source: PerLayer  # layer whose latent each layer attends to
    kv_sharing: tuple[str, ...]  # "own" | "store" | "reuse" | "reuse_but_indexer"
    roles: tuple[str, ...]  # one readable line per layer (plinth info)
    # DSA indexer
    idx_n_head: int
    idx_head_dim: int
    idx_top_k: int
    # FFN / MoE
    n_ff: int
    n_layer_dense_lead: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_expert_shared: int
    n_expert_group: int
    n_group_used: int
    expert_weights_scale: float
    logit_softcap: float

    def uses_rope(self, il: int) -> bool:
        return bool(self.rope_layers[il])

    def rope_width(self, il: int) -> int:
        """Rotated dims of layer ``il``'s q/k (0 on NoPE layers)."""
        return self.n_rot if self.uses_rope(il) else 0

    def nope_width(self, il: int) -> int:
        return self.head_dim_k - self.rope_width(il)

    def owns_kv(self, il: int) -> bool:
        return self.kv_sharing[il] in ("own", "store")

    def has_indexer(self, il: int) -> bool:
        return self.indexer_types[il] == "full"

    def is_moe(self, il: int) -> bool:
        return il >= self.n_layer_dense_lead


def sharing_modes(kv_source: list[int], indexer_types: list[str]) -> list[str]:
    """The KV-sharing mode each layer's sources imply (the reference's rule)."""
    n = len(kv_source)
    modes = ["own" if kv_source[i] == i else "reuse" for i in range(n)]
    for i in range(n):
        if modes[i] == "reuse" and indexer_types[i] != "shared":
            modes[i] = "reuse_but_indexer"
        if kv_source[i] == i and i in kv_source[i + 1:]:
            modes[i] = "store"
    return modes


def _check_layers(source: str, r: KeyReader, n_layer: int, rope: PerLayer, idx_types: list[str],
                  kv_source: PerLayer, modes: list[str]) -> None:
    """Refuse a layer pattern the graph cannot run, naming the key and the layer."""
    for il, t in enumerate(idx_types):
        if t not in INDEXER_TYPES:
            raise HParamsError(f"{source}: key '{r.key('attention.indexer.types')}' layer {il} is {t!r}; "
                               f"known indexer types: {', '.join(INDEXER_TYPES)}")
    if idx_types and idx_types[0] == "shared":
        raise HParamsError(f"{source}: layer 0 is a 'shared' indexer layer, but no earlier 'full' layer has a "
                           f"top-k selection to lend it (key '{r.key('attention.indexer.types')}')")
    for il, mode in enumerate(modes):
        if mode not in SHARING_MODES:
            raise HParamsError(f"{source}: key '{r.key('attention.kv_sharing')}' layer {il} is {mode!r}; "
                               f"known sharing modes: {', '.join(SHARING_MODES)}")
    for il, src in enumerate(kv_source):
        if not 0 <= src <= il:
            raise HParamsError(f"{source}: key '{r.key('attention.kv_source_layers')}' makes layer {il} reuse "
                               f"layer {src}'s KV; a layer can only reuse an earlier layer's cache")
        if kv_source[src] != src:
            raise HParamsError(f"{source}: key '{r.key('attention.kv_source_layers')}' makes layer {il} reuse "
                               f"layer {src}, which itself reuses layer {kv_source[src]}; point it at the owner")
        if rope[src] != rope[il]:
            raise HParamsError(f"{source}: layer {il} ({'RoPE' if rope[il] else 'NoPE'}) reuses the KV of layer "
                               f"{src} ({'RoPE' if rope[src] else 'NoPE'}); shared keys must have the same rope")
    implied = sharing_modes(list(kv_source), idx_types)
    for il, src in enumerate(kv_source):
        # the reference hands a reuse layer the latest stored latent of its rope kind, not its source's
        between = [j for j in range(src + 1, il) if implied[j] == "store" and rope[j] == rope[src]]
        if src != il and between:
            raise HParamsError(f"{source}: layer {il} reuses layer {src}'s KV across layer {between[-1]}, a later "
                               f"{'RoPE' if rope[src] else 'NoPE'} store layer; transformers reads layer "
                               f"{between[-1]}'s there, so this '{r.key('attention.kv_source_layers')}' pattern "
                               "is ambiguous and refused")
    for il, (mode, want) in enumerate(zip(modes, implied)):
        if mode != want:
            raise HParamsError(f"{source}: key '{r.key('attention.kv_sharing')}' says layer {il} is {mode!r}, but "
                               f"'{r.key('attention.kv_source_layers')}' and the indexer types make it {want!r}")


#: llama.cpp's expert gating function ids (``expert_gating_func``): this model routes by softmax
GATING_SOFTMAX = 1


def _check_fixed(r: KeyReader, source: str, n_head: int) -> None:
    """Keys the converter writes for llama.cpp whose value this model fixes: MLA keeps one K/V head per
    query head, and the router is a softmax whose top-k weights are renormalised. Another value is a
    different model, refused by name."""
    fixed = (("attention.head_count_kv", int, n_head, "MLA: one K/V head per query head"),
             ("expert_gating_func", int, GATING_SOFTMAX, "the router is a softmax (llama.cpp's 1)"),
             ("expert_weights_norm", bool, True, "the top-k routing weights are renormalised"))
    for key, cast, want, why in fixed:
        got = r.get(key, cast, required=False, default=want)
        if got != want:
            raise HParamsError(f"{source}: key '{r.key(key)}' = {got!r}: this architecture needs {want!r} ({why})")


def read_hparams(r: KeyReader) -> MistralLarge4HParams:
    """The file's keys as :class:`MistralLarge4HParams`; a layer pattern the graph cannot run is refused."""
    source, metadata = r.source, r.metadata
    n_layer = r.get("block_count")
    n_head = r.get("attention.head_count")
    head_dim_k = r.get("attention.key_length")
    n_rot = r.get("rope.dimension_count")
    rope = r.get_key_or_arr("rope.layers", n_layer, required=False, default=1)
    idx_types = list(r.get_array("attention.indexer.types", str))
    kv_source = r.get_key_or_arr("attention.kv_source_layers", n_layer, required=False, default=None)
    if kv_source[0] is None:
        kv_source = PerLayer(list(range(n_layer)), r.key("attention.kv_source_layers"))
    if len(idx_types) != n_layer:
        raise HParamsError(f"{source}: key '{r.key('attention.indexer.types')}' has {len(idx_types)} entries, "
                           f"expected n_layer = {n_layer}")
    modes = list(r.get_array("attention.kv_sharing", str, required=False, default=None)
                 or sharing_modes(list(kv_source), idx_types))
    if len(modes) != n_layer:
        raise HParamsError(f"{source}: key '{r.key('attention.kv_sharing')}' has {len(modes)} entries, "
                           f"expected n_layer = {n_layer}")
    _check_layers(source, r, n_layer, rope, idx_types, kv_source, modes)
    if n_rot % 2 or n_rot > head_dim_k:
        raise HParamsError(f"{source}: '{r.key('rope.dimension_count')}' = {n_rot} must be even and at most "
                           f"'{r.key('attention.key_length')}' = {head_dim_k}")
    n_dense = r.get("leading_dense_block_count", required=False, default=0)
    n_expert = r.get("expert_count", required=n_dense < n_layer, default=0)
    _check_fixed(r, source, n_head)
    tokens = metadata.get("tokenizer.ggml.tokens")
    roles = []
    for il in range(n_layer):
        kv = modes[il] + ("" if kv_source[il] == il else f"<-{kv_source[il]}")
        roles.append(f"{il}: kv {kv}, indexer {idx_types[il]}, {'rope' if rope[il] else 'nope'}, "
                     f"{'moe' if il >= n_dense else 'dense'}")
    return MistralLarge4HParams(
        arch=r.arch,
        n_vocab=r.get("vocab_size", required=False, default=len(tokens) if tokens is not None else -1),
        n_embd=r.get("embedding_length"),
        n_layer=n_layer,
        n_ctx_train=r.get("context_length"),
        norm_eps=r.get("attention.layer_norm_rms_epsilon", float),
        n_head=n_head,
        kv_lora_rank=r.get("attention.kv_lora_rank"),
        n_rot=n_rot,
        head_dim_k=head_dim_k,
        head_dim_v=r.get("attention.value_length"),
        attn_scale=r.get("attention.scale", float, required=False, default=None) or 1.0 / math.sqrt(head_dim_k),
        rope_base=r.get("rope.freq_base", float, required=False, default=10000.0),
        rope_scaling=r.get("rope.scaling.type", str, required=False, default="none"),
        rope_factor=r.get("rope.scaling.factor", float, required=False, default=1.0),
        rope_orig_ctx=r.get("rope.scaling.original_context_length", required=False, default=0),
        rope_beta_fast=r.get("rope.scaling.yarn_beta_fast", float, required=False, default=32.0),
        rope_beta_slow=r.get("rope.scaling.yarn_beta_slow", float, required=False, default=1.0),
        rope_attn_factor=r.get("rope.scaling.attn_factor", float, required=False, default=1.0),
        rope_layers=rope,
        indexer_types=tuple(idx_types),
        kv_source=kv_source,
        kv_sharing=tuple(modes),
        roles=tuple(roles),
        idx_n_head=r.get("attention.indexer.head_count"),
        idx_head_dim=r.get("attention.indexer.key_length"),
        idx_top_k=r.get("attention.indexer.top_k"),
        n_ff=r.get("feed_forward_length", required=n_dense > 0, default=0),
        n_layer_dense_lead=n_dense,
        n_expert=n_expert,
        n_expert_used=r.get("expert_used_count", required=n_expert > 0, default=0),
        n_ff_exp=r.get("expert_feed_forward_length", required=n_expert > 0, default=0),
        n_expert_shared=r.get("expert_shared_count", required=False, default=0),
        n_expert_group=r.get("expert_group_count", required=False, default=1) or 1,
        n_group_used=r.get("expert_group_used_count", required=False, default=1) or 1,
        expert_weights_scale=r.get("expert_weights_scale", float, required=False, default=1.0) or 1.0,
        logit_softcap=r.get("final_logit_softcapping", float, required=False, default=0.0),
    )


# ============================================================================ tensors (per block)

def model_tensors(hp: MistralLarge4HParams) -> list[TensorSpec]:
    """Embedding, final norm, the untied head and the optional LeRoPE scaling."""
    e, v = hp.n_embd, hp.n_vocab
    return [
        TensorSpec("token_embd.weight", (v, e)),
        TensorSpec("output_norm.weight", (e,)),
        TensorSpec("output.weight", (v, e)),
        TensorSpec("rope_alpha.weight", (hp.n_rot // 2,), required=False),  # LeRoPE: inv_freq * exp(alpha)
    ]


def attention_tensors(hp: MistralLarge4HParams, il: int) -> list[TensorSpec]:
    """MLA of layer ``il``: reuse layers have no KV-A projection (they read their source's latent)."""
    b, e, h = f"blk.{il}.", hp.n_embd, hp.n_head
    specs = [
        TensorSpec(b + "attn_norm.weight", (e,)),
        TensorSpec(b + "attn_q.weight", (h * hp.head_dim_k, e)),
        TensorSpec(b + "attn_kv_b.weight", (h * (hp.nope_width(il) + hp.head_dim_v), hp.kv_lora_rank)),
        TensorSpec(b + "attn_output.weight", (e, h * hp.head_dim_v)),
        TensorSpec(b + "attn_log_scale.weight", (h,)),
        TensorSpec(b + "attn_log_scale.bias", (h,)),
    ]
    if hp.owns_kv(il):
        specs += [TensorSpec(b + "attn_kv_a_mqa.weight", (hp.kv_lora_rank + hp.rope_width(il), e)),
                  TensorSpec(b + "attn_kv_a_norm.weight", (hp.kv_lora_rank,))]
    return specs


def indexer_tensors(hp: MistralLarge4HParams, il: int) -> list[TensorSpec]:
    """The Lightning indexer of a "full" layer (none on "shared" layers)."""
    if not hp.has_indexer(il):
        return []
    b, e, ni, di = f"blk.{il}.indexer.", hp.n_embd, hp.idx_n_head, hp.idx_head_dim
    return [
        TensorSpec(b + "q_norm.weight", (e,)),
        TensorSpec(b + "q_norm.bias", (e,)),
        TensorSpec(b + "attn_q_b.weight", (ni * di, e)),
        TensorSpec(b + "attn_k.weight", (di, e)),
        TensorSpec(b + "k_norm.weight", (di,)),
        TensorSpec(b + "k_norm.bias", (di,)),
        TensorSpec(b + "proj.weight", (ni, e)),
        TensorSpec(b + "log_scale.weight", (ni,)),
        TensorSpec(b + "log_scale.bias", (ni,)),
    ]


def ffn_tensors(hp: MistralLarge4HParams, il: int) -> list[TensorSpec]:
    """Dense SwiGLU (the leading layers), or routed experts plus shared experts."""
    b, e = f"blk.{il}.", hp.n_embd
    specs = [TensorSpec(b + "ffn_norm.weight", (e,))]
    if not hp.is_moe(il):
        return specs + [TensorSpec(b + "ffn_gate.weight", (hp.n_ff, e)),
                        TensorSpec(b + "ffn_up.weight", (hp.n_ff, e)),
                        TensorSpec(b + "ffn_down.weight", (e, hp.n_ff))]
    n_exp, ff = hp.n_expert, hp.n_ff_exp
    specs += expert_tensors(b, n_exp, ff, e)
    if hp.n_expert_shared:
        sh = ff * hp.n_expert_shared
        specs += [TensorSpec(b + "ffn_gate_shexp.weight", (sh, e)),
                  TensorSpec(b + "ffn_up_shexp.weight", (sh, e)),
                  TensorSpec(b + "ffn_down_shexp.weight", (e, sh))]
    return specs


# ============================================================================ rope

def rope_inv_freq(hp: MistralLarge4HParams, alpha: Any = None) -> np.ndarray:
    """YaRN inverse frequencies [n_rot / 2] times the learned scaling ``exp(alpha)`` (LeRoPE), in float32.

    The steps and their float32 rounding follow the reference (base power, extrapolated and
    interpolated frequencies, linear ramp between the correction dims), so the angles agree to
    the last bit or two: see :meth:`MistralLarge4Graph.cos_sin` for why that matters here.
    """
    f32 = np.float32
    dims = np.arange(0, hp.n_rot, 2, dtype=np.int64).astype(f32) / f32(hp.n_rot)
    pos_freqs = np.power(f32(hp.rope_base), dims, dtype=f32)
    inv = f32(1.0) / pos_freqs
    if hp.rope_scaling == "yarn":
        low, high = ops.yarn_corr_dims(hp.n_rot, hp.rope_orig_ctx, hp.rope_base, hp.rope_beta_fast,
                                       hp.rope_beta_slow)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(hp.n_rot // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
        extrapolate = f32(1) - ramp
        interp = f32(1.0) / (f32(hp.rope_factor) * pos_freqs)
        inv = interp * (f32(1) - extrapolate) + inv * extrapolate
    elif hp.rope_scaling not in ("none", None):
        raise ValueError(f"{hp.arch}: rope scaling {hp.rope_scaling!r} is not supported (yarn or none)")
    if alpha is not None:
        inv = inv * np.exp(np.asarray(alpha, dtype=f32))
    return inv.astype(f32)


# ============================================================================ the cache

@attrs.frozen
class LayerCacheWidths:
    """What one layer keeps per token: the latent ``[c_kv ; k_rope]`` and/or its indexer key."""

    latent: int  # floats of c_kv + k_rope (0: reads another layer's latent, or nothing)
    index_key: int  # floats of the indexer key (0: no own indexer)


def cache_widths(hp: MistralLarge4HParams) -> list[LayerCacheWidths]:
    """Per layer, the floats cached per token. "reuse" layers hold nothing."""
    out = []
    for il in range(hp.n_layer):
        latent = hp.kv_lora_rank + hp.rope_width(il) if hp.owns_kv(il) else 0
        out.append(LayerCacheWidths(latent=latent, index_key=hp.idx_head_dim if hp.has_indexer(il) else 0))
    return out


def cache_bytes_per_token(hp: MistralLarge4HParams) -> tuple[int, int]:
    """(latent cache, an expanded per-head K/V cache of the same model) in bytes per token (float32).

    The expanded figure is what a plain K/V cache would hold: per owning layer H keys of
    ``head_dim_k`` and H values of ``head_dim_v``, plus the same indexer keys.
    """
    latent = expanded = 0
    for il, kind in enumerate(cache_widths(hp)):
        latent += 4 * (kind.latent + kind.index_key)
        expanded += 4 * kind.index_key
        if kind.latent:
            expanded += 4 * hp.n_head * (hp.head_dim_k + hp.head_dim_v)
    return latent, expanded


def layer_cache_kinds(hp: MistralLarge4HParams, il: int) -> tuple[Any, ...]:
    """The cache kinds of layer ``il`` (fresh instances): the latent and/or indexer keys, or a share."""
    kinds: list[Any] = [Latent()] if hp.owns_kv(il) else [SharedKV(hp.kv_source[il])]
    if hp.has_indexer(il):
        kinds.append(IndexerKeys())
    return tuple(kinds)


# ============================================================================ graph

class MistralLarge4Graph(BaseGraph):
    """Forward of Mistral Large 4: :meth:`layer` per block on the core's :class:`BaseGraph`.

    Per-forward state in ``step.memo``: ``"cos_sin"`` (this batch's RoPE rows) and ``"topk"``
    (the latest full indexer layer's key selection per sequence, read by "shared" layers).
    """

    def __init__(self, hp: MistralLarge4HParams, weights: Mapping[str, Any], backend: Any) -> None:
        super().__init__(hp, weights, backend, softcap=hp.logit_softcap)  # output [V, E], soft-capped
        alpha = weights.get("rope_alpha.weight")
        self.inv_freq = rope_inv_freq(hp, None if alpha is None else backend.to_numpy(alpha))
        self._cos_sin: tuple[Any, Any] | None = None
        self.index_margins: list | None = None  # set to [] to record top-k boundary gaps (tests)

    def cache_layout(self) -> list[tuple[Any, ...]]:
        """Per layer: ``Latent`` (+ ``IndexerKeys``) where it owns its KV, ``SharedKV(source)`` (+ its own
        ``IndexerKeys`` for reuse_but_indexer) where it reuses; "reuse" layers hold nothing."""
        return [layer_cache_kinds(self.hp, il) for il in range(self.hp.n_layer)]

    def split_points(self) -> list[int]:
        """The layers a pipeline stage may start at (besides 0): a "full" indexer layer that no later layer
        reads an earlier latent across (a "shared" layer needs the top-k of the layer before it, a reuse
        layer its source's latent, and a stage holds only its own layers' state)."""
        hp = self.hp
        return [s for s in range(1, hp.n_layer)
                if hp.has_indexer(s) and all(hp.kv_source[il] >= s for il in range(s, hp.n_layer))]

    def forward_stage(self, batch: Batch, cache: Cache, x: Any, start: int, stop: int, **kw: Any) -> Any:
        """:meth:`BaseGraph.forward_stage`; a stage starting or ending elsewhere than :meth:`split_points` is
        refused before it computes (the first stage sees the bad cut in its ``stop``)."""
        for cut in (start, stop):
            if 0 < cut < self.hp.n_layer and cut not in self.split_points():
                raise ValueError(f"{self.hp.arch}: a pipeline stage cannot start at layer {cut} (a 'shared' indexer "
                                 "layer, or a later layer reads a latent from before it); this model splits at "
                                 f"layers {self.split_points() or 'none'}")
        return super().forward_stage(batch, cache, x, start, stop, **kw)

    # -------------------------------------------------------------- RoPE and scaling

    def cos_sin(self, positions: np.ndarray) -> tuple[Any, Any]:
        """(cos, sin) [n, n_rot / 2] times the attention factor, from a table grown on demand.

        The angle ``pos * inv_freq`` is a float32 product, as in the reference and in ggml: this
        model's logits move by ~1e-4 for a 1e-5 rad change of the angle at position 200.
        """
        need = int(positions.max()) + 1 if positions.size else 0
        if self._cos_sin is None or self._cos_sin[0].shape[0] < need:
            n = max(need, 2 * (0 if self._cos_sin is None else self._cos_sin[0].shape[0]), 256)
            ang = np.arange(n, dtype=np.float32)[:, None] * self.inv_freq[None, :]
            m = np.float32(self.hp.rope_attn_factor)
            self._cos_sin = (self.xp.asarray(np.cos(ang) * m), self.xp.asarray(np.sin(ang) * m))
        idx = self.xp.asarray(positions)
        return self._cos_sin[0][idx], self._cos_sin[1][idx]

    def rotate(self, x: Any, step: Step) -> Any:
        """Interleaved RoPE on the first n_rot dims at the batch positions. x: [n, heads, >= n_rot]."""
        cos_sin = step.once("cos_sin", lambda: self.cos_sin(step.batch.positions))
        return ops.apply_rope(x, cos_sin=cos_sin, mode="normal")

    def log_scale(self, step: Step, weight: Any, bias: Any) -> Any:
        """Per-row, per-head query multiplier ``weight * log(pos + 1) + bias``: [n, heads, 1]."""
        lp = step.once("log_pos", lambda: self.xp.asarray(
            np.log(step.batch.positions.astype(np.float64) + 1.0).astype(np.float32)))
        return (lp[:, None] * weight[None, :] + bias[None, :])[:, :, None]

    # -------------------------------------------------------------- the block

    def layer(self, il: int, x: Any, step: Step) -> Any:
        w, eps, b = self.w, self.hp.norm_eps, f"blk.{il}."
        x = x + self.attention(il, ops.rms_norm(x, w[b + "attn_norm.weight"], eps), step)
        return x + self.ffn(il, ops.rms_norm(x, w[b + "ffn_norm.weight"], eps))

    def attention(self, il: int, h: Any, step: Step) -> Any:
        """MLA + DSA of layer ``il``. h: [n_rows, n_embd] (normed) -> [n_rows, n_embd].

        A full indexer layer leaves its key selection in ``step.memo["topk"]`` for the shared layers after it.
        """
        hp, w, b, xp = self.hp, self.w, f"blk.{il}.", self.xp
        n, nh, r = h.shape[0], hp.n_head, hp.rope_width(il)
        nope = hp.head_dim_k - r
        q = ops.linear(h, w[b + "attn_q.weight"]).reshape(n, nh, hp.head_dim_k)
        if r:
            q = xp.concatenate([q[..., :nope], self.rotate(q[..., nope:], step)], axis=-1)
        q = q * self.log_scale(step, w[b + "attn_log_scale.weight"], w[b + "attn_log_scale.bias"])
        latent = None
        if hp.owns_kv(il):
            kv = ops.linear(h, w[b + "attn_kv_a_mqa.weight"])  # [n, R + r]
            c = ops.rms_norm(kv[:, :hp.kv_lora_rank], w[b + "attn_kv_a_norm.weight"], hp.norm_eps)
            k_rope = self.rotate(kv[:, None, hp.kv_lora_rank:], step)[:, 0, :] if r else kv[:, hp.kv_lora_rank:]
            latent = (c, k_rope)
        q_idx = k_idx = None
        if hp.has_indexer(il):
            q_idx, k_idx = self.indexer(il, h, step)
        if q_idx is not None:
            step.memo["topk"] = {}
        topk = step.memo["topk"]
        out = xp.empty((n, nh, hp.head_dim_v), dtype=xp.float32)
        w_kv_b = w[b + "attn_kv_b.weight"]
        for seq, sel in step.groups:
            pos = step.batch.positions[sel]
            lat_all, kpos = self.latent_rows(il, seq, pos, None if latent is None else (latent[0][sel], latent[1][sel]),
                                             step.cache)
            if q_idx is not None:
                idx_all, _ = step.cache.find(il, IndexerKeys).update(seq, pos, k_idx[sel])
                topk[seq] = self.select_topk(il, h[sel], q_idx[sel], idx_all, pos, kpos)
            mla = self.mla_absorbed if len(pos) <= ABSORB_MAX_ROWS else self.mla_expanded
            out[sel] = mla(q[sel], lat_all, w_kv_b, nope, pos, kpos, topk[seq])
        return ops.linear(out.reshape(n, -1), w[b + "attn_output.weight"])

    def latent_rows(self, il: int, seq: int, positions: np.ndarray, latent: Any, cache: Cache) -> tuple[Any, Any]:
        """Append this forward's ``(c_kv, k_rope)`` rows to layer ``il``'s :class:`Latent` (None on reuse layers:
        the source layer's latent is read, this forward's rows included); returns every cached row
        ``[c_kv ; k_rope]`` [T, R + r] and their positions [T]."""
        c_all, r_all, pos = (cache.find(il, Latent).update(seq, positions, *latent) if latent is not None
                             else cache.find(self.hp.kv_source[il], Latent).get(seq))
        return (self.xp.concatenate([c_all, r_all], axis=-1) if r_all.shape[1] else c_all), pos

    def indexer(self, il: int, h: Any, step: Step) -> tuple[Any, Any]:
        """Lightning-indexer queries [n, n_idx, d] and keys [n, d] of layer ``il``. h: [n, n_embd] (normed)."""
        hp, w, b = self.hp, self.w, f"blk.{il}.indexer."
        n = h.shape[0]
        q = ops.layer_norm(h, w[b + "q_norm.weight"], w[b + "q_norm.bias"], INDEXER_NORM_EPS)
        q = ops.linear(q, w[b + "attn_q_b.weight"]).reshape(n, hp.idx_n_head, hp.idx_head_dim)
        q = q * self.log_scale(step, w[b + "log_scale.weight"], w[b + "log_scale.bias"])
        k = ops.layer_norm(ops.linear(h, w[b + "attn_k.weight"]), w[b + "k_norm.weight"], w[b + "k_norm.bias"],
                           INDEXER_NORM_EPS)[:, None, :]
        if hp.uses_rope(il):
            q, k = self.rotate(q, step), self.rotate(k, step)
        return q, k[:, 0, :]


    def select_topk(self, il: int, h: Any, q_idx: Any, k_idx: Any, q_pos: np.ndarray, k_pos: np.ndarray) -> Any:
        """The keys each query attends to: [n, T] bool, the top-k of the index scores among visible keys.

        h: [n, n_embd] (normed); q_idx: [n, n_idx, d]; k_idx: [T, d].
        """
        hp, xp, w = self.hp, self.xp, self.w
        visible = xp.asarray(k_pos[None, :] <= q_pos[:, None])
        k = hp.idx_top_k
        if k >= len(k_pos):  # every key is kept (the reference's topk(min(k, T)))
            return visible
        scores = xp.matmul(q_idx.transpose(1, 0, 2), k_idx.T[None]) * np.float32(hp.idx_head_dim ** -0.5)
        head_w = ops.linear(h, w[f"blk.{il}.indexer.proj.weight"]) * np.float32(hp.idx_n_head ** -0.5)  # [n, nI]
        index = xp.einsum("nh,hnt->nt", head_w, xp.maximum(scores, 0))
        index = xp.where(visible, index, np.float32(-np.inf))
        top = ops.top_k(index, k + 1)  # one more than kept: the boundary gap
        if self.index_margins is not None:
            self._record_margins(top.values, k)
        chosen = xp.zeros(index.shape, dtype=bool)
        chosen[xp.arange(index.shape[0])[:, None], top.indices[:, :k]] = True
        return chosen & visible

    def _record_margins(self, values: Any, k: int) -> None:
        """Gap between the k-th and (k+1)-th index score of each query with more than k visible keys,
        relative to the row's largest score magnitude. values: [n, k + 1], sorted descending."""
        v = np.asarray(self.backend.to_numpy(values), dtype=np.float64)
        full = np.isfinite(v[:, k])
        scale = np.maximum(np.abs(v[full]).max(axis=1), 1e-30)
        self.index_margins.extend(((v[full, k - 1] - v[full, k]) / scale).tolist())

    def mla_expanded(self, q: Any, lat: Any, w_kv_b: Any, nope: int, q_pos: np.ndarray, k_pos: np.ndarray,
                     mask: Any) -> Any:
        """MLA with per-head keys and values expanded from the latent (prefill).

        q: [n, H, nope + r]; lat: [T, R + r] (``[c_kv ; k_rope]``); w_kv_b: [H (nope + v), R];
        mask: [n, T] bool. Returns [n, H, v].
        """
        hp, xp = self.hp, self.xp
        t, nh, rank = lat.shape[0], hp.n_head, hp.kv_lora_rank
        kvb = ops.linear(lat[:, :rank], w_kv_b).reshape(t, nh, nope + hp.head_dim_v)
        k = kvb[..., :nope]
        if lat.shape[1] > rank:
            k = xp.concatenate([k, xp.broadcast_to(lat[:, None, rank:], (t, nh, lat.shape[1] - rank))], axis=-1)
        return ops.attention(q, k, kvb[..., nope:], q_pos=q_pos, k_pos=k_pos, scale=self.hp.attn_scale, causal=True,
                             mask=mask)

    def mla_absorbed(self, q: Any, lat: Any, w_kv_b: Any, nope: int, q_pos: np.ndarray, k_pos: np.ndarray,
                     mask: Any) -> Any:
        """The same attention with ``W_kv_b`` absorbed into the query and the output (decode, verify).

        Every head attends to one shared key ``[c_kv ; k_rope]`` with value ``c_kv`` (MQA over the
        latent): ``q~_h = W_UK_h^T q_nope_h``, ``o_h = W_UV_h (sum_s p_hs c_s)``. Shapes as
        :meth:`mla_expanded`.
        """
        hp, xp = self.hp, self.xp
        rank, nh = hp.kv_lora_rank, hp.n_head
        w = w_kv_b.reshape(nh, nope + hp.head_dim_v, rank)
        q_lat = xp.einsum("nhd,hdr->nhr", q[..., :nope], w[:, :nope, :])
        q_full = xp.concatenate([q_lat, q[..., nope:]], axis=-1)  # [n, H, R + r]
        o_lat = ops.attention(q_full, lat[:, None, :], lat[:, None, :rank], q_pos=q_pos, k_pos=k_pos,
                              scale=hp.attn_scale, causal=True, mask=mask)  # [n, H, R]
        return xp.einsum("nhr,hvr->nhv", o_lat, w[:, nope:, :])

    def ffn(self, il: int, x: Any) -> Any:
        """Dense SwiGLU, or routed SwiGLU experts plus shared experts. x: [n_rows, n_embd] (normed)."""
        hp, w, b = self.hp, self.w, f"blk.{il}."
        if not hp.is_moe(il):
            return ops.swiglu(x, w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"], w[b + "ffn_down.weight"])
        route = ops.moe_route(ops.linear(x, w[b + "ffn_gate_inp.weight"]), hp.n_expert_used, score_func="softmax",
                              norm_topk=True, n_group=hp.n_expert_group, topk_group=hp.n_group_used,
                              routed_scaling=hp.expert_weights_scale)
        y = ops.moe_ffn(x, route, w[b + "ffn_gate_exps.weight"], w[b + "ffn_up_exps.weight"],
                        w[b + "ffn_down_exps.weight"], act="silu")
        if hp.n_expert_shared:
            y = y + ops.swiglu(x, w[b + "ffn_gate_shexp.weight"], w[b + "ffn_up_shexp.weight"],
                               w[b + "ffn_down_shexp.weight"])
        return y


# ============================================================================ architecture

class MistralLarge4(Architecture):
    """``mistral_large4``: Mistral Large 4 text tower (MLA, DSA indexer, KV sharing, MoE)."""

    name = ARCH
    graph = MistralLarge4Graph

    def hparams(self, r: KeyReader) -> MistralLarge4HParams:
        return read_hparams(r)

    def tensors(self, hp: MistralLarge4HParams) -> list[TensorSpec]:
        return model_tensors(hp) + [s for il in range(hp.n_layer) for s in
                                    attention_tensors(hp, il) + indexer_tensors(hp, il) + ffn_tensors(hp, il)]


__all__ = ["ARCH", "LayerCacheWidths", "MistralLarge4", "MistralLarge4Graph", "MistralLarge4HParams",
           "cache_bytes_per_token", "cache_widths", "layer_cache_kinds", "read_hparams", "sharing_modes"]

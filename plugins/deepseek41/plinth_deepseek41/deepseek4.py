"""DeepSeek V4 Flash (``deepseek4``): hyper-connection streams, compressed + sparse attention, hash MoE.

The model card, top to bottom:

* **Residual = hc streams.** The embedding is repeated ``hc`` times into X: [n, hc, E]
  (:meth:`DeepSeek4Graph.embed`). Each sublayer (attention, then MoE) is wrapped by a
  manifold-constrained hyper-connection (mHC): from the flattened, RMS-normed streams a learned
  ``fn`` gives ``pre`` (collapse weights), ``post`` (expand weights) and ``comb`` (an hc×hc mix
  made doubly stochastic by Sinkhorn); the sublayer reads ``Σ pre·X`` and writes
  ``X' = post·y + combᵀ·X``. A learned hc head collapses the streams before ``output_norm`` and
  ``output`` (:meth:`DeepSeek4Graph.final_norm`).
* **Attention = MQA over one latent head** of width d (K = V): low-rank q with its norm, a
  weightless per-head q norm, RoPE on the trailing ``n_rot`` dims (interleaved pairs), per-head
  sinks, a raw sliding window of ``n_swa`` keys, the output de-roped at the query position and
  projected by a grouped low-rank ``Wo_a`` (``o_groups`` blocks) then ``Wo_b``.
  Per layer, ``compress_ratios[il]`` picks its attention type (:meth:`DeepSeek4HParams.attention_type`):

  - 0, "window": the window only (main RoPE base, no YaRN);
  - the CSA ratio (4), "csa": overlapping blocks (entry j pools block j-1's first-half channels
    and block j's second-half channels, softmax per channel over 2r rows, block -1 padded with
    -inf scores), and a Lightning indexer (its own compressor, queries from the q latent,
    ``Σ_h w_h ReLU(q_h·k)``) keeps the top ``indexer.top_k`` visible entries per query;
  - the HCA ratio (128), "hca": one entry per block of r rows, all visible entries attended.

  Entries are RMS-normed and roped at their block's first position (compress RoPE base with
  YaRN); a query at t sees entries j < (t + 1) // r.
* **MoE**: ``sqrt(softplus(W x))`` scores; routed layers choose the top-k of scores + bias
  (``exp_probs_b``), the first ``hash_layer_count`` layers take their experts from the token
  (``ffn_gate_tid2eid[token]``); weights = chosen scores, normalised, × ``expert_weights_scale``;
  SwiGLU experts with ``min(gate, c)`` and ``clip(up, -c, c)``; plus a clamped shared expert.
* **Feature taps** (what drafters read): tap k is the hc-mean of the streams entering layer k,
  [n, E] (tap n_layer: the streams before the hc head); tap ``n_layer + 1`` (:attr:`DeepSeek4Graph.wide_tap`)
  is the whole final streams [n, hc·E], which the MTP block reads.

Cache (``cache_layout``), all :class:`~plinth.graph.CompressedKV` kinds trimmed to what the next
position needs: every layer keeps its raw keys for the window (:class:`WindowKeys`, K-only since
K = V); a compressed layer also its stream (:class:`CompressedStream`: one entry per block, the raw
compressor rows of the block being filled, and on CSA the block before) and on CSA layers the
indexer's (:class:`IndexerStream`). Rollback is a cut where no entry straddles the position, else
snapshot + replay. Weights are used in GGUF layout (a linear weight is ``[n_out, n_in]``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from plinth import ops
from plinth.errors import UserError
from plinth.graph import (
    Architecture,
    BaseGraph,
    Batch,
    Cache,
    CompressedKV,
    ForwardOutput,
    HParamsError,
    KeyReader,
    Linear,
    LMHead,
    PerLayer,
    Step,
    TensorSpec,
    expert_tensors,
    embed_rows,
)

ARCH = "deepseek4"
GATING_SQRT_SOFTPLUS = 4  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
WINDOW, CSA, HCA = "window", "csa", "hca"
#: spare raw rows each cache kind holds beyond what the next position needs, so that a verify batch of up to
#: this many rows is undone by a cut
ROLLBACK_ROWS = 16


# ============================================================================ hparams

@attrs.frozen
class DeepSeek4HParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ctx_train: int
    norm_eps: float
    # attention
    n_head: int
    head_dim: int  # d: the single latent K = V head
    n_rot: int  # trailing rotated dims of each head
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_swa: int
    rope_base: float
    compress_rope_base: float
    rope_yarn_factor: float  # 1.0 = no YaRN on the compressed layers
    rope_yarn_orig_ctx: int
    rope_yarn_beta_fast: float
    rope_yarn_beta_slow: float
    compress_ratios: PerLayer
    csa_ratio: int
    hca_ratio: int
    n_idx_head: int
    idx_head_dim: int
    idx_top_k: int
    # hyper-connections
    hc: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # MoE
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_expert_shared: int
    expert_weights_scale: float
    expert_weights_norm: bool
    swiglu_clamp_exp: PerLayer
    swiglu_clamp_shexp: PerLayer
    n_hash_layers: int
    n_nextn: int
    # llama.cpp's separate MTP head file (convert --mtp): the MTP block(s), the shared embedding / head / final
    # norm and the block's own hc head as output_hc_*; no trunk. It serves as the ``mtp`` drafter's head
    mtp_only: bool = False

    def attention_type(self, il: int) -> str:
        """The attention of layer ``il``: "window", "csa" or "hca" (MTP layers follow the main ones)."""
        if not isinstance(il, (int, np.integer)) or not 0 <= il < self.n_layer + self.n_nextn:
            raise IndexError(f"attention_type({il}): layer out of range (n_layer = {self.n_layer}, "
                             f"nextn = {self.n_nextn})")
        r = self.compress_ratios[int(il)]
        return WINDOW if r == 0 else CSA if r == self.csa_ratio else HCA

    def ratio(self, il: int) -> int:
        return int(self.compress_ratios[int(il)])

    def is_hash(self, il: int) -> bool:
        return int(il) < self.n_hash_layers


def load_hparams(metadata: Mapping[str, Any], source: str) -> DeepSeek4HParams:
    return DeepSeek4HParams(**read_v4_params(KeyReader(metadata, source, ARCH), metadata, source))


def read_v4_params(r: KeyReader, metadata: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The fields of :class:`DeepSeek4HParams` from the keys under ``r.arch`` (``deepseek4``, or
    ``deepseek41``, which inherits every V4 key)."""
    n_layer = r.get("block_count")
    n_nextn = r.get("nextn_predict_layers", required=False, default=0)
    ratios = r.get_array("attention.compress_ratios")
    # plinth's combined file: block_count is the trunk, the ratios cover trunk + MTP. llama.cpp counts the MTP
    # layers in block_count and writes them to a head-only file of their own (its ratios: the release list)
    mtp_only = bool(n_nextn) and len(ratios) != n_layer + n_nextn
    if mtp_only:
        if n_nextn >= n_layer:
            raise HParamsError(f"{source}: '{r.key('nextn_predict_layers')}' = {n_nextn} must be below "
                               f"'{r.key('block_count')}' = {n_layer}, which counts the MTP layers")
        n_layer -= n_nextn
    head_dim = r.get("attention.key_length")
    gating = r.get("expert_gating_func", required=False, default=GATING_SQRT_SOFTPLUS)
    if gating != GATING_SQRT_SOFTPLUS:
        raise HParamsError(f"{source}: key '{r.key('expert_gating_func')}' = {gating}; {r.arch} routes experts "
                           f"with sqrt-softplus scores only (value {GATING_SQRT_SOFTPLUS}); this file is not a "
                           "DeepSeek V4 model or was converted wrongly")
    csa, hca = r.get("attention.csa_ratio", required=False, default=4), r.get("attention.hca_ratio",
                                                                               required=False, default=128)
    if len(ratios) < n_layer + n_nextn * mtp_only:
        raise HParamsError(f"{source}: key '{r.key('attention.compress_ratios')}' has {len(ratios)} entries, expected "
                           f"n_layer = {n_layer}")
    # llama.cpp's converter writes the release config's list, which also covers the MTP layer it leaves out
    ratios = ratios[:n_layer + n_nextn]
    bad = sorted({x for x in ratios if x not in (0, csa, hca)})
    if bad or csa == hca or csa < 1 or hca < 1:
        raise HParamsError(f"{source}: key '{r.key('attention.compress_ratios')}' has ratio(s) {bad}; {r.arch} "
                           f"defines 0 (window only), {csa} (CSA) and {hca} (HCA)")
    n_used = r.get("expert_used_count")
    clamp = _per_layer_with_mtp(r, "swiglu_clamp_exp", n_layer, n_nextn, 0.0)
    clamp_sh = _per_layer_with_mtp(r, "swiglu_clamp_shexp", n_layer, n_nextn, None)
    if clamp_sh[0] is None:
        clamp_sh = PerLayer(list(clamp), r.key("swiglu_clamp_shexp"))
    scaling = r.get("rope.scaling.type", str, required=False, default="none")
    factor = r.get("rope.scaling.factor", float, required=False, default=1.0) if scaling == "yarn" else 1.0
    n_head = r.get("attention.head_count")
    # one shared K = V head: the KV head count and the value width are implied; a file saying otherwise is refused
    n_head_kv = r.get("attention.head_count_kv", required=False, default=1)
    head_dim_v = r.get("attention.value_length", required=False, default=head_dim)
    if n_head_kv != 1 or head_dim_v != head_dim:
        raise HParamsError(f"{source}: keys '{r.key('attention.head_count_kv')}' = {n_head_kv} and "
                           f"'{r.key('attention.value_length')}' = {head_dim_v}; {r.arch} attends with one K = V "
                           f"head of width key_length = {head_dim}")
    o_groups = r.get("attention.output_group_count")
    if n_head % o_groups:
        raise HParamsError(f"{source}: {n_head} heads cannot be split into "
                           f"'{r.key('attention.output_group_count')}' = {o_groups} groups")
    hc = r.get("hyper_connection.count")
    n_embd_out = r.get("embedding_length_out", required=False, default=None)  # llama.cpp: the hc streams' width
    if n_embd_out is not None and n_embd_out != hc * r.get("embedding_length"):
        raise HParamsError(f"{source}: key '{r.key('embedding_length_out')}' = {n_embd_out}, expected "
                           f"hyper_connection.count x embedding_length = {hc * r.get('embedding_length')}")
    tokens = metadata.get("tokenizer.ggml.tokens")
    return dict(
        n_vocab=r.get("vocab_size", required=False, default=len(tokens) if tokens is not None else -1),
        n_embd=r.get("embedding_length"),
        n_layer=n_layer,
        n_ctx_train=r.get("context_length"),
        norm_eps=r.get("attention.layer_norm_rms_epsilon", float),
        n_head=n_head,
        head_dim=head_dim,
        n_rot=r.get("rope.dimension_count"),
        q_lora_rank=r.get("attention.q_lora_rank"),
        o_groups=o_groups,
        o_lora_rank=r.get("attention.output_lora_rank"),
        n_swa=r.get("attention.sliding_window"),
        rope_base=r.get("rope.freq_base", float, required=False, default=10000.0),
        compress_rope_base=r.get("attention.compress_rope_freq_base", float, required=False, default=160000.0),
        rope_yarn_factor=factor,
        rope_yarn_orig_ctx=r.get("rope.scaling.original_context_length", required=scaling == "yarn", default=0),
        rope_yarn_beta_fast=r.get("rope.scaling.yarn_beta_fast", float, required=False, default=32.0),
        rope_yarn_beta_slow=r.get("rope.scaling.yarn_beta_slow", float, required=False, default=1.0),
        compress_ratios=PerLayer(list(ratios) + [0] * (n_layer + n_nextn - len(ratios)),
                                 r.key("attention.compress_ratios")),
        csa_ratio=csa,
        hca_ratio=hca,
        n_idx_head=r.get("attention.indexer.head_count", required=csa in ratios, default=0),
        idx_head_dim=r.get("attention.indexer.key_length", required=csa in ratios, default=0),
        idx_top_k=r.get("attention.indexer.top_k", required=csa in ratios, default=0),
        hc=hc,
        hc_sinkhorn_iters=r.get("hyper_connection.sinkhorn_iterations"),
        hc_eps=r.get("hyper_connection.epsilon", float),
        n_expert=r.get("expert_count"),
        n_expert_used=n_used,
        n_ff_exp=r.get("expert_feed_forward_length"),
        n_expert_shared=r.get("expert_shared_count", required=False, default=1),
        expert_weights_scale=r.get("expert_weights_scale", float, required=False, default=1.0),
        expert_weights_norm=bool(r.get("expert_weights_norm", bool, required=False, default=True)),
        swiglu_clamp_exp=clamp,
        swiglu_clamp_shexp=clamp_sh,
        n_hash_layers=r.get("hash_layer_count", required=False, default=0),
        n_nextn=n_nextn,
        mtp_only=mtp_only,
    )


def _per_layer_with_mtp(r: KeyReader, name: str, n_layer: int, n_nextn: int, default: Any) -> PerLayer:
    """A scalar-or-array float key over n_layer (or n_layer + nextn) entries, extended to the MTP layers
    with the last main layer's value."""
    value = r.metadata.get(r.key(name))
    n = n_layer + n_nextn if isinstance(value, (list, np.ndarray)) and len(value) == n_layer + n_nextn else n_layer
    vals = list(r.get_key_or_arr(name, n, float, required=False, default=default))
    return PerLayer(vals + vals[-1:] * (n_layer + n_nextn - n), r.key(name))


# ============================================================================ tensors

#: GGML types of ``ffn_gate_tid2eid``: integers (llama.cpp writes I32), or F32 holding whole numbers
TID2EID_TYPES = ("I32", "I64", "I16", "I8", "F32")


def expert_ids(table: np.ndarray, n_expert: int, name: str) -> np.ndarray:
    """A hash layer's token -> experts table [n_vocab, top_k] as int64; refuses ids that are not experts."""
    ids = np.asarray(table)
    if ids.dtype.kind == "f":
        if not np.all(np.isfinite(ids)) or np.any(ids != np.round(ids)):
            raise UserError(f"{name}: a float expert-id table must hold whole numbers")
    ids = ids.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
        raise UserError(f"{name}: expert ids must lie in 0..{n_expert - 1}, found {int(ids.min())}..{int(ids.max())}")
    return ids


def tensor_specs(hp: DeepSeek4HParams) -> list[TensorSpec]:
    """GGUF tensor names and numpy-order shapes (llama.cpp's deepseek4 names)."""
    e, v, hc, d = hp.n_embd, hp.n_vocab, hp.hc, hp.head_dim
    n_mix = (2 + hc) * hc
    specs = [
        TensorSpec("token_embd.weight", (v, e)),
        TensorSpec("output_norm.weight", (e,)),
        TensorSpec("output.weight", (v, e)),
        TensorSpec("output_hc_fn.weight", (hc, hc * e)),
        TensorSpec("output_hc_base.weight", (hc,)),
        TensorSpec("output_hc_scale.weight", (1,)),
    ]
    for il in range(hp.n_layer + hp.n_nextn):
        mtp = il >= hp.n_layer  # an MTP block: optional (a file may drop it; the mtp drafter then refuses)
        if hp.mtp_only and not mtp:
            continue  # llama.cpp's head-only file: no trunk
        b = f"blk.{il}."
        hd_all = hp.n_head * d
        if mtp and hp.mtp_only:  # required here; the block's hc head is the file's output_hc_*
            specs += [TensorSpec(b + "nextn.eh_proj.weight", (e, 2 * e)),
                      TensorSpec(b + "nextn.enorm.weight", (e,)),
                      TensorSpec(b + "nextn.hnorm.weight", (e,)),
                      TensorSpec(b + "nextn.shared_head_norm.weight", (e,))]
        elif mtp:
            specs += [TensorSpec(b + "nextn.eh_proj.weight", (e, 2 * e), required=False),
                      TensorSpec(b + "nextn.enorm.weight", (e,), required=False),
                      TensorSpec(b + "nextn.hnorm.weight", (e,), required=False),
                      TensorSpec(b + "nextn.shared_head_norm.weight", (e,), required=False),
                      TensorSpec(b + "nextn.hc_head_fn.weight", (hc, hc * e), required=False),
                      TensorSpec(b + "nextn.hc_head_base.weight", (hc,), required=False),
                      TensorSpec(b + "nextn.hc_head_scale.weight", (1,), required=False)]
        block = [
            TensorSpec(b + "attn_norm.weight", (e,)),
            TensorSpec(b + "ffn_norm.weight", (e,)),
            TensorSpec(b + "hc_attn_fn.weight", (n_mix, hc * e)),
            TensorSpec(b + "hc_attn_base.weight", (n_mix,)),
            TensorSpec(b + "hc_attn_scale.weight", (3,)),
            TensorSpec(b + "hc_ffn_fn.weight", (n_mix, hc * e)),
            TensorSpec(b + "hc_ffn_base.weight", (n_mix,)),
            TensorSpec(b + "hc_ffn_scale.weight", (3,)),
            TensorSpec(b + "attn_sinks.weight", (hp.n_head,)),
            TensorSpec(b + "attn_q_a.weight", (hp.q_lora_rank, e)),
            TensorSpec(b + "attn_q_a_norm.weight", (hp.q_lora_rank,)),
            TensorSpec(b + "attn_q_b.weight", (hd_all, hp.q_lora_rank)),
            TensorSpec(b + "attn_kv.weight", (d, e)),
            TensorSpec(b + "attn_kv_a_norm.weight", (d,)),
            TensorSpec(b + "attn_output_a.weight", (hp.o_groups * hp.o_lora_rank, hd_all // hp.o_groups)),
            TensorSpec(b + "attn_output_b.weight", (e, hp.o_groups * hp.o_lora_rank)),
        ]
        atype = hp.attention_type(il)
        if atype != WINDOW:
            coff = 2 if atype == CSA else 1
            block += [
                TensorSpec(b + "attn_compressor_kv.weight", (coff * d, e)),
                TensorSpec(b + "attn_compressor_gate.weight", (coff * d, e)),
                TensorSpec(b + "attn_compressor_ape.weight", (hp.ratio(il), coff * d)),
                TensorSpec(b + "attn_compressor_norm.weight", (d,)),
            ]
        if atype == CSA:
            di = hp.idx_head_dim
            block += [
                TensorSpec(b + "indexer.proj.weight", (hp.n_idx_head, e)),
                TensorSpec(b + "indexer.attn_q_b.weight", (hp.n_idx_head * di, hp.q_lora_rank)),
                TensorSpec(b + "indexer_compressor_kv.weight", (2 * di, e)),
                TensorSpec(b + "indexer_compressor_gate.weight", (2 * di, e)),
                TensorSpec(b + "indexer_compressor_ape.weight", (hp.ratio(il), 2 * di)),
                TensorSpec(b + "indexer_compressor_norm.weight", (di,)),
            ]
        n_exp, ff = hp.n_expert, hp.n_ff_exp
        block += expert_tensors(b, n_exp, ff, e)
        if hp.is_hash(il):
            # llama.cpp writes the token -> experts table as I32; plinth's converter wrote F32 (exact ids) before
            block.append(TensorSpec(b + "ffn_gate_tid2eid.weight", (v, hp.n_expert_used), dtypes=TID2EID_TYPES))
        else:
            block.append(TensorSpec(b + "exp_probs_b.bias", (n_exp,)))
        if hp.n_expert_shared:
            sh = hp.n_ff_exp * hp.n_expert_shared
            block += [TensorSpec(b + "ffn_gate_shexp.weight", (sh, e)),
                      TensorSpec(b + "ffn_up_shexp.weight", (sh, e)),
                      TensorSpec(b + "ffn_down_shexp.weight", (e, sh))]
        specs += [attrs.evolve(t, required=False) for t in block] if mtp and not hp.mtp_only else block
    return specs


# ============================================================================ hyper-connections

@attrs.frozen
class HcMix:
    """The three maps of one hyper-connection, per token.

    pre: [n, hc] collapse weights;  post: [n, hc] expand weights;
    comb: [n, hc, hc] stream mix, comb[t, src, dst] (doubly stochastic).
    """

    pre: Any
    post: Any
    comb: Any


def sinkhorn(logits: Any, iters: int, eps: float) -> Any:
    """Sinkhorn-Knopp on [..., hc(src), hc(dst)]: softmax over dst, + eps, then normalise
    columns (sum over src), then ``iters - 1`` times rows then columns (each + eps)."""
    xp = ops.array_module(logits)
    c = ops.softmax(logits, axis=-1) + np.float32(eps)
    c = c / (c.sum(axis=-2, keepdims=True) + np.float32(eps))
    for _ in range(iters - 1):
        c = c / (c.sum(axis=-1, keepdims=True) + np.float32(eps))
        c = c / (c.sum(axis=-2, keepdims=True) + np.float32(eps))
    return xp.asarray(c, dtype=np.float32)


def hc_mixes(X: Any, fn: Any, norm_eps: float) -> Any:
    """fn · RMSNorm_noweight(flatten X), with the norm applied after the product (the fused form:
    one GEMV over the raw stream, then one scale per token). X: [n, hc, E]; fn: [m, hc·E] -> [n, m]."""
    xp = ops.array_module(X)
    flat = X.reshape(X.shape[0], X.shape[1] * X.shape[2])
    ms = (flat * flat).mean(axis=-1, keepdims=True) + np.float32(norm_eps)
    return ops.linear(flat, fn) * (np.float32(1.0) / xp.sqrt(ms))


def hc_mix(X: Any, fn: Any, base: Any, scale: Any, hp: DeepSeek4HParams) -> HcMix:
    """pre, post, comb of one sublayer from its input streams X: [n, hc, E]."""
    hc = hp.hc
    m = hc_mixes(X, fn, hp.norm_eps)
    pre = ops.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + np.float32(hp.hc_eps)
    post = np.float32(2.0) * ops.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(-1, hc, hc)
    return HcMix(pre=pre, post=post, comb=sinkhorn(logits, hp.hc_sinkhorn_iters, hp.hc_eps))


def hc_collapse(X: Any, pre: Any) -> Any:
    """Σ_h pre[h]·X[h]. X: [n, hc, E]; pre: [n, hc] -> [n, E]."""
    return (pre[:, :, None] * X).sum(axis=1)


def hc_expand(X: Any, y: Any, mix: HcMix) -> Any:
    """X'[dst] = post[dst]·y + Σ_src comb[src, dst]·X[src]. X: [n, hc, E]; y: [n, E] -> [n, hc, E]."""
    xp = ops.array_module(X)
    return mix.post[:, :, None] * y[:, None, :] + xp.matmul(mix.comb.transpose(0, 2, 1), X)


# ============================================================================ cache kinds


class WindowKeys(CompressedKV):
    """A layer's raw keys [n, d] (K = V) for the sliding window: the last ``n_swa`` positions."""

    kind = "window"

    def __init__(self, window: int) -> None:
        super().__init__(0, window, keep=ROLLBACK_ROWS)


class CompressedStream(CompressedKV):
    """A compressed layer's entries [n_e, d] and the raw compressor rows [n, 2·coff·d] (kv | score) of
    the block being filled (on CSA also the block before: entries overlap two blocks)."""

    kind = "compressed"

    def __init__(self, ratio: int, overlap: bool) -> None:
        super().__init__(ratio, 0, keep=ROLLBACK_ROWS, overlap=overlap)


class IndexerStream(CompressedStream):
    """A CSA layer's indexer keys [n_e, d_idx], compressed like the entries (its own compressor)."""

    kind = "indexer"


# ============================================================================ compressor

@attrs.frozen
class Compressor:
    """Weights of one compressor (the attention's or the indexer's)."""

    w_kv: Any  # [coff·width, E]
    w_gate: Any  # [coff·width, E]
    ape: Any  # [ratio, coff·width]
    norm: Any  # [width]
    ratio: int
    overlap: bool  # CSA: entries pool two consecutive blocks

    @property
    def width(self) -> int:
        return int(self.norm.shape[0])


def compress(stream: CompressedKV, seq: int, comp: Compressor, x: Any, positions: np.ndarray, rope: Any,
             n_rot: int, eps: float) -> Any:
    """Add the rows x: [n, E] of ``seq`` at consecutive ``positions`` to ``stream`` and append the entries of
    every block they complete; returns all of the sequence's entries [n_e, width].

    Entry j = RMSNorm(Σ_slots softmax_slots(score) ⊙ kv), roped at j·r; the slots are block j's rows
    (with ``overlap``, block j-1's first-half channels and block j's second-half ones, block -1 being
    padding rows of score -inf). The stream holds each row as kv | score (score with the ape bias)."""
    xp = ops.array_module(x)
    r, w = comp.ratio, comp.width
    kv = ops.linear(x, comp.w_kv)
    score = ops.linear(x, comp.w_gate) + comp.ape[xp.asarray(positions % r)]
    stream.append_raw(seq, positions, xp.concatenate([kv, score], axis=1))
    starts = stream.complete_blocks(seq)
    if starts:
        rows, rpos = stream.raw.get(seq)  # consecutive positions from rpos[0]
        half = rows.shape[1] // 2
        s0, s1, base = starts[0], starts[-1] + r, int(rpos[0])
        blocks = rows[s0 - base:s1 - base].reshape(len(starts), r, -1)
        blocks_kv, blocks_sc = blocks[:, :, :half], blocks[:, :, half:]
        if comp.overlap:
            prev_kv = xp.zeros(blocks_kv[:, :, w:].shape, dtype=np.float32)
            prev_sc = xp.full(prev_kv.shape, -np.inf, dtype=np.float32)
            lo = max(s0 - r, 0)  # block -1 of the sequence is padding rows
            prev = rows[lo - base:s1 - r - base].reshape(-1, r, rows.shape[1])
            k = len(starts) - prev.shape[0]
            prev_kv[k:], prev_sc[k:] = prev[:, :, :w], prev[:, :, half:half + w]
            slots_kv = xp.concatenate([prev_kv, blocks_kv[:, :, w:]], axis=1)
            slots_sc = xp.concatenate([prev_sc, blocks_sc[:, :, w:]], axis=1)
        else:
            slots_kv, slots_sc = blocks_kv, blocks_sc
        pooled = (ops.softmax(slots_sc, axis=1) * slots_kv).sum(axis=1)
        pooled = ops.rms_norm(pooled, comp.norm, eps)
        starts_a = np.asarray(starts, dtype=np.int64)
        pooled = ops.apply_rope(pooled[:, None, :], cos_sin=rope(starts_a), offset=w - n_rot)[:, 0, :]
        stream.append_blocks(seq, starts_a, pooled)
    entries = stream.blocks.get(seq)[0]
    return entries if entries is not None else xp.zeros((0, comp.width), dtype=np.float32)


# ============================================================================ indexer

@attrs.frozen
class TopKSelection:
    """indices: [n, k] int — chosen compressed entries per query, best first (-1 = none);
    ties: queries whose k-th and (k+1)-th visible scores are equal (a tie at the boundary makes
    the choice depend on the tie-break, so references may differ there)."""

    indices: Any
    ties: int = 0


def indexer_topk(q_idx: Any, weights: Any, keys: Any, q_pos: np.ndarray, ratio: int, top_k: int) -> TopKSelection:
    """Lightning indexer: I(t, s) = Σ_h w_h(t)·ReLU(q_{t,h}·k_s) over visible entries s < (t+1)//r;
    keep the top min(top_k, #visible) (ties: lower index).

    q_idx: [n, n_idx, d_idx] (roped); weights: [n, n_idx] (already scaled); keys: [n_e, d_idx]."""
    xp = ops.array_module(q_idx)
    n, n_e = q_idx.shape[0], keys.shape[0]
    k = min(top_k, n_e)
    if k == 0:
        return TopKSelection(xp.full((n, 0), -1, dtype=np.int64))
    dots = xp.maximum(xp.matmul(q_idx, keys.T), np.float32(0.0))  # [n, n_idx, n_e]
    scores = (dots * weights[:, :, None]).sum(axis=1)
    visible = xp.arange(n_e)[None, :] < xp.asarray((q_pos + 1) // ratio)[:, None]
    scores = xp.where(visible, scores, np.float32(-np.inf))
    order = xp.argsort(-scores, axis=-1, kind="stable")
    ranked = xp.take_along_axis(scores, order, axis=-1)
    ties = 0
    if k < n_e:
        kth, nxt = ranked[:, k - 1], ranked[:, k]
        ties = int(xp.count_nonzero(xp.isfinite(nxt) & (kth == nxt)))
    chosen_visible = xp.take_along_axis(visible, order[:, :k], axis=-1)
    return TopKSelection(xp.where(chosen_visible, order[:, :k], -1), ties)


# ============================================================================ MTP head

class MtpHead:
    """The draft head "mtp": what the ``mtp`` drafter runs (``run``) and the cache it keeps (``new_cache``).

    taps: the target feature tap the head reads (the whole streams entering the hc head, [n, hc·E]).
    """

    def __init__(self, graph: "DeepSeek4Graph") -> None:
        self._graph = graph
        self.n_blocks = graph.n_mtp
        self.taps = (graph.wide_tap,)
        self.xp = graph.xp

    def new_cache(self) -> Cache:
        g = self._graph
        n = g.hp.n_layer + g.hp.n_nextn
        layout = [g.layer_kinds(il) if il >= g.hp.n_layer else () for il in range(n)]
        return Cache(n, g.xp, layout)

    def run(self, batch: Batch, hidden: Any, cache: Cache, depth: int = 0) -> "MtpOutput":
        """See :meth:`DeepSeek4Graph.mtp`."""
        return self._graph.mtp(batch, hidden, cache, depth)

    def to_numpy(self, a: Any) -> Any:
        return self._graph.backend.to_numpy(a)


@attrs.frozen
class MtpOutput:
    """logits: [n, V] — next-next-token logits per row; hidden: [n, hc·E] — the MTP block's streams."""

    logits: Any
    hidden: Any


# ============================================================================ graph

class DeepSeek4Graph(BaseGraph):
    """Forward of a deepseek4 model: ``embed`` makes the hc streams, ``layer`` is mHC around
    :meth:`attention` then around :meth:`moe`, ``final_norm`` is the hc head and ``output_norm``."""

    def __init__(self, hp: DeepSeek4HParams, weights: Mapping[str, Any], backend: Any) -> None:
        output = weights["output.weight"]
        super().__init__(hp, weights, backend)
        xp = self.xp
        # the head multiplies in GGUF layout [V, E]: a decode row's product through a transposed copy is ~6x
        # slower here (one thread, V 32000 x E 512: 46 ms against 7.7)
        if isinstance(weights, dict):
            weights["output.weight"] = output
        self.head = LMHead(Linear(output, transposed=False), tied=False)
        # MTP blocks present in the file (the llama.cpp probe: no eh_proj, no MTP)
        self.n_mtp = sum(1 for il in range(hp.n_layer, hp.n_layer + hp.n_nextn)
                         if f"blk.{il}.nextn.eh_proj.weight" in weights)
        self.wide_tap = hp.n_layer + 1
        self.extra_taps = (self.wide_tap,)
        main = ops.rope_freqs(hp.n_rot, hp.rope_base, xp=xp)
        if hp.rope_yarn_factor != 1.0:
            f = hp.rope_yarn_factor
            comp = ops.rope_freqs(hp.n_rot, hp.compress_rope_base, "yarn", f, hp.rope_yarn_orig_ctx,
                                  hp.rope_yarn_beta_fast, hp.rope_yarn_beta_slow,
                                  attn_factor=1.0 / (1.0 + 0.1 * np.log(f)), xp=xp)  # cos/sin unscaled
        else:
            comp = ops.rope_freqs(hp.n_rot, hp.compress_rope_base, xp=xp)
        self.rope_main, self.rope_comp = ops.RopeCache(main), ops.RopeCache(comp)
        self.compressors: dict[int, Compressor] = {}
        self.indexers: dict[int, Compressor] = {}
        self.tid2eid: dict[int, Any] = {}
        self.topk_ties = 0  # indexer top-k boundary ties seen so far (see TopKSelection)
        # the layer whose compressed stream each compressed layer attends to (itself in V4; deepseek41
        # lets a layer without a compressor read an earlier one's, see ``stream_sources``)
        self.stream_source: dict[int, int] = self.stream_sources(hp, weights)
        for il in range(hp.n_layer * hp.mtp_only, hp.n_layer + self.n_mtp):
            b, atype = f"blk.{il}.", hp.attention_type(il)
            if atype != WINDOW and self.stream_source[il] == il:
                kv = weights[b + "attn_compressor_kv.weight"]
                gate = weights.get(b + "attn_compressor_gate.weight")
                self.compressors[il] = Compressor(kv, xp.zeros(kv.shape, dtype=np.float32) if gate is None else gate,
                                                  weights[b + "attn_compressor_ape.weight"],
                                                  weights[b + "attn_compressor_norm.weight"], hp.ratio(il),
                                                  atype == CSA)
            if atype == CSA:
                self.indexers[il] = Compressor(weights[b + "indexer_compressor_kv.weight"],
                                               weights[b + "indexer_compressor_gate.weight"],
                                               weights[b + "indexer_compressor_ape.weight"],
                                               weights[b + "indexer_compressor_norm.weight"], hp.ratio(il), True)
            if hp.is_hash(il):
                self.tid2eid[il] = xp.asarray(expert_ids(self.backend.to_numpy(weights[b + "ffn_gate_tid2eid.weight"]),
                                                         hp.n_expert, f"blk.{il}.ffn_gate_tid2eid.weight"))

    def stream_sources(self, hp: DeepSeek4HParams, weights: Mapping[str, Any]) -> dict[int, int]:
        """Per compressed layer, the layer that compresses the stream it reads: V4 layers own theirs."""
        return {il: il for il in range(hp.n_layer + hp.n_nextn) if hp.attention_type(il) != WINDOW}

    def draft_heads(self) -> dict[str, Any]:
        """The file's MTP block(s) as the draft head "mtp" (none when the file has no MTP block)."""
        return {"mtp": MtpHead(self)} if self.n_mtp else {}

    # -------------------------------------------------------------- cache

    def layer_kinds(self, il: int) -> tuple[CompressedKV, ...]:
        """What layer ``il`` keeps: its window keys; its compressed stream if it compresses one; the indexer's on CSA."""
        hp = self.hp
        atype = hp.attention_type(il)
        kinds: tuple[CompressedKV, ...] = (WindowKeys(hp.n_swa),)
        if atype != WINDOW and self.stream_source[il] == il:
            kinds += (CompressedStream(hp.ratio(il), overlap=atype == CSA),)
        if atype == CSA:
            kinds += (IndexerStream(hp.ratio(il), overlap=True),)
        return kinds

    def cache_layout(self) -> list[tuple[Any, ...]]:
        return [self.layer_kinds(il) for il in range(self.hp.n_layer)]

    # -------------------------------------------------------------- the forward's pieces

    def step(self, batch: Batch, cache: Cache) -> Step:
        """The shared per-forward state; each sequence's rows must sit at consecutive positions continuing
        its cache (compressed streams cannot skip)."""
        step = super().step(batch, cache)
        step.require_in_order(ARCH, "compressed KV stream", cache.next_position)
        step.memo["tokens"] = self.xp.asarray(batch.tokens)
        return step

    def check_rows(self, batch: Batch) -> None:
        """Refuse what V4 cannot run: embedding rows (hash-routed layers need token ids)."""
        if batch.is_embd is not None and bool(np.any(batch.is_embd)):
            raise UserError(f"{ARCH}: embedding rows are not supported (hash-routed layers need token ids)")

    def embed(self, batch: Batch) -> Any:
        """The hc streams X [n, hc, E]: the token's embedding, once per copy."""
        x0 = embed_rows(self.embed_table, batch, self.xp)
        return self.xp.ascontiguousarray(self.xp.broadcast_to(x0[:, None, :], (x0.shape[0], self.hp.hc,
                                                                                 self.hp.n_embd)))

    def streams(self, x: Any) -> Any:
        """The hc streams [n, hc, E] of a residual ``x`` as :meth:`layer` passes it on."""
        return x

    def tap(self, x: Any) -> Any:
        """A feature tap: the hc-mean of the streams, [n, E] (what the seed's drafters read)."""
        return self.streams(x).mean(axis=1)

    def final_norm(self, x: Any) -> Any:
        """The hc head, then ``output_norm``. x: [n, hc, E] -> [n, E]."""
        return ops.rms_norm(self.hc_head(x), self.w["output_norm.weight"], self.hp.norm_eps)

    def forward_stage(self, batch: Batch, cache: Cache, x: Any, start: int, stop: int, *,
                      taps: Sequence[int] = (), pooling: str = "none", embeddings: bool = False) -> Any:
        """:meth:`BaseGraph.forward_stage` with this architecture's taps (see the module docstring)."""
        if self.hp.mtp_only:
            raise UserError(f"{ARCH}: this is llama.cpp's MTP head file (no trunk): run the trunk GGUF as the model "
                            "and pass this file to the mtp drafter (--spec mtp --draft FILE)")
        if pooling != "none":
            raise UserError(f"{ARCH}: pooled embeddings are not supported by this architecture")
        self.check_rows(batch)
        n_layer = self.hp.n_layer
        inner = {t for t in taps if t != self.wide_tap} | ({n_layer} if self.wide_tap in taps else set())
        out = super().forward_stage(batch, cache, x, start, stop, taps=tuple(sorted(inner)), embeddings=embeddings)
        if not isinstance(out, ForwardOutput) or not inner:
            return out
        feats = {k: self.tap(v) for k, v in out.features.items() if k in taps}
        if self.wide_tap in taps and n_layer in out.features:
            s = self.streams(out.features[n_layer])
            feats[self.wide_tap] = s.reshape(s.shape[0], -1)
        return attrs.evolve(out, features=feats)

    def layer(self, il: int, X: Any, step: Step) -> Any:
        """One decoder block on the streams X: [n, hc, E]: mHC around attention, then around the MoE."""
        return self.block(il, X, step)

    def block(self, il: int, X: Any, step: Step) -> Any:
        hp, w, b = self.hp, self.w, f"blk.{il}."
        mix = hc_mix(X, w[b + "hc_attn_fn.weight"], w[b + "hc_attn_base.weight"], w[b + "hc_attn_scale.weight"], hp)
        h = ops.rms_norm(hc_collapse(X, mix.pre), w[b + "attn_norm.weight"], hp.norm_eps)
        X = hc_expand(X, self.attention(il, h, step), mix)
        mix = hc_mix(X, w[b + "hc_ffn_fn.weight"], w[b + "hc_ffn_base.weight"], w[b + "hc_ffn_scale.weight"], hp)
        h = ops.rms_norm(hc_collapse(X, mix.pre), w[b + "ffn_norm.weight"], hp.norm_eps)
        return hc_expand(X, self.moe(il, h, step), mix)

    def hc_head(self, X: Any, prefix: str = "output_hc_") -> Any:
        """The learned collapse before the final norm. X: [n, hc, E] -> [n, E]."""
        w = self.w
        m = hc_mixes(X, w[prefix + "fn.weight"], self.hp.norm_eps)
        pre = ops.sigmoid(m * w[prefix + "scale.weight"][0] + w[prefix + "base.weight"]) + np.float32(self.hp.hc_eps)
        return hc_collapse(X, pre)

    # -------------------------------------------------------------- attention

    def attention(self, il: int, x: Any, step: Step) -> Any:
        """MQA over the raw window and the layer's compressed stream. x: [n, E] (normed) -> [n, E]."""
        hp, w, b, xp = self.hp, self.w, f"blk.{il}.", self.xp
        batch, cache = step.batch, step.cache
        n, d, H = x.shape[0], hp.head_dim, hp.n_head
        atype = hp.attention_type(il)
        off = d - hp.n_rot
        qr = ops.rms_norm(ops.linear(x, w[b + "attn_q_a.weight"]), w[b + "attn_q_a_norm.weight"], hp.norm_eps)
        q = ops.rms_norm(ops.linear(qr, w[b + "attn_q_b.weight"]).reshape(n, H, d), None, hp.norm_eps)
        kv = ops.rms_norm(ops.linear(x, w[b + "attn_kv.weight"]), w[b + "attn_kv_a_norm.weight"], hp.norm_eps)
        cs = self.rope_table(step, main=atype == WINDOW)
        q = ops.apply_rope(q, cos_sin=cs, offset=off)
        kv = ops.apply_rope(kv[:, None, :], cos_sin=cs, offset=off)[:, 0, :]
        if atype == CSA:
            di = hp.idx_head_dim
            q_idx = ops.linear(qr, w[b + "indexer.attn_q_b.weight"]).reshape(n, hp.n_idx_head, di)
            q_idx = ops.apply_rope(q_idx, cos_sin=self.rope_table(step, main=False), offset=di - hp.n_rot)
            idx_w = ops.linear(x, w[b + "indexer.proj.weight"]) * np.float32((di * hp.n_idx_head) ** -0.5)
        out = xp.empty((n, H, d), dtype=np.float32)
        window = cache.find(il, WindowKeys)
        for seq, sel in step.groups:
            pos = batch.positions[sel]
            keys, kpos = window.append_raw(seq, pos, kv[sel])
            d_q = pos[:, None] - kpos[None, :]
            vis = (d_q >= 0) & (d_q < hp.n_swa)
            if atype != WINDOW:
                src = self.stream_source[il]
                if src == il:
                    entries = compress(cache.find(il, CompressedStream), seq, self.compressors[il], x[sel], pos,
                                       self.rope_comp, hp.n_rot, hp.norm_eps)
                else:  # an earlier layer's stream (same ratio), written earlier in this forward
                    entries = cache.find(src, CompressedStream).blocks.get(seq)[0]
                    entries = entries if entries is not None else xp.zeros((0, d), dtype=np.float32)
                ent_vis = np.arange(entries.shape[0])[None, :] < ((pos + 1) // hp.ratio(il))[:, None]
                if atype == CSA:
                    idx_keys = compress(cache.find(il, IndexerStream), seq, self.indexers[il], x[sel], pos,
                                        self.rope_comp, hp.n_rot, hp.norm_eps)
                    selection = indexer_topk(q_idx[sel], idx_w[sel], idx_keys, pos, hp.ratio(il), hp.idx_top_k)
                    self.topk_ties += selection.ties
                    n_e = entries.shape[0]
                    picked = np.zeros((len(pos), n_e + 1), dtype=bool)
                    ch = np.asarray(self.backend.to_numpy(selection.indices))
                    np.put_along_axis(picked, np.where(ch >= 0, ch, n_e), True, axis=1)
                    ent_vis = ent_vis & picked[:, :n_e]
                keys = xp.concatenate([keys, entries])
                vis = np.concatenate([vis, ent_vis], axis=1)
            out[sel] = ops.attention(q[sel], keys[:, None, :], keys[:, None, :], scale=d ** -0.5, causal=False,
                                     sinks=w[b + "attn_sinks.weight"], mask=xp.asarray(vis))
        o = ops.apply_rope(out, cos_sin=cs, offset=off, inverse=True)
        G, R = hp.o_groups, hp.o_lora_rank
        wa = w[b + "attn_output_a.weight"].reshape(G, R, -1)  # group g: [R, H·d/G]
        og = o.reshape(n, G, -1).transpose(1, 0, 2)  # [G, n, H·d/G]
        z = xp.matmul(og, wa.transpose(0, 2, 1)).transpose(1, 0, 2).reshape(n, G * R)
        return ops.linear(z, w[b + "attn_output_b.weight"])

    def rope_table(self, step: Step, main: bool) -> Any:
        """cos/sin at the batch positions: the main base (window layers) or the compressed layers' (YaRN)."""
        rope = self.rope_main if main else self.rope_comp
        return step.once(("rope", main), lambda: rope(step.batch.positions))

    # -------------------------------------------------------------- MoE

    def moe(self, il: int, x: Any, step: Step, bias: Any = None) -> Any:
        """sqrt-softplus routed SwiGLU experts (hash-routed in the first layers) + the shared expert.

        bias: the selection bias of a routed layer ([n_expert] or per row [n, n_expert]); default
        the layer's ``exp_probs_b``."""
        hp, w, b, xp = self.hp, self.w, f"blk.{il}.", self.xp
        scores = xp.sqrt(ops.softplus(ops.linear(x, w[b + "ffn_gate_inp.weight"])))  # [n, n_expert]
        if hp.is_hash(il):
            ids = self.tid2eid[il][step.memo["tokens"]]
        else:
            bias = w[b + "exp_probs_b.bias"] if bias is None else bias
            ids = ops.top_k(scores + bias, hp.n_expert_used, axis=-1).indices
        weights = xp.take_along_axis(scores, ids, axis=-1)
        if hp.expert_weights_norm:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
        weights = weights * np.float32(hp.expert_weights_scale)
        limit = hp.swiglu_clamp_exp[il]
        gate, up, down = w[b + "ffn_gate_exps.weight"], w[b + "ffn_up_exps.weight"], w[b + "ffn_down_exps.weight"]
        y = xp.zeros_like(x)
        ids_host = np.asarray(self.backend.to_numpy(ids))
        for e in np.unique(ids_host):
            tok, slot = np.nonzero(ids_host == e)
            h = clamped_swiglu(x[tok], gate[e], up[e], down[e], limit)
            y[tok] += h * weights[tok, slot][:, None]
        if hp.n_expert_shared:
            y += clamped_swiglu(x, w[b + "ffn_gate_shexp.weight"], w[b + "ffn_up_shexp.weight"],
                                w[b + "ffn_down_shexp.weight"], hp.swiglu_clamp_shexp[il])
        return y

    # -------------------------------------------------------------- MTP

    def mtp(self, batch: Batch, hidden: Any, cache: Cache, depth: int = 0) -> MtpOutput:
        """The next-token-prediction block ``depth`` (layer n_layer + depth) over its own ``cache``.

        Row i holds the token t_{p+1} and the target's streams h_p at position p (``batch``
        positions are p): ``X = eh_proj · [enorm(embed(t)); hnorm(h_copy)]`` per copy, one
        V4 block, its own hc head and norm, the target's LM head.
        hidden: [n, hc·E]. Returns logits [n, V] (every row) and the block's streams [n, hc·E].
        """
        hp, w, xp = self.hp, self.w, self.xp
        if depth >= self.n_mtp:
            raise UserError(f"{ARCH}: this file has {self.n_mtp} MTP block(s) (nextn_predict_layers = "
                            f"{hp.n_nextn}); block {depth} is missing")
        il = hp.n_layer + depth
        b = f"blk.{il}.nextn."
        n, hc, e = batch.n_rows, hp.hc, hp.n_embd
        emb = ops.rms_norm(self.embed_table[xp.asarray(batch.tokens)], w[b + "enorm.weight"], hp.norm_eps)
        hn = ops.rms_norm(hidden.reshape(n, hc, e), w[b + "hnorm.weight"], hp.norm_eps)  # [n, hc, E]
        both = xp.concatenate([xp.broadcast_to(emb[:, None, :], (n, hc, e)), hn], axis=-1)  # [n, hc, 2E]
        X = ops.linear(both, w[b + "eh_proj.weight"])
        with cache.forward(batch):
            X = self.block(il, X, self.step(batch, cache))
        hc_prefix = "output_hc_" if hp.mtp_only else b + "hc_head_"  # llama.cpp's head file: the block's at the root
        h = ops.rms_norm(self.hc_head(X, hc_prefix), w[b + "shared_head_norm.weight"], hp.norm_eps)
        return MtpOutput(logits=self.head(h), hidden=X.reshape(n, hc * e))


def clamped_swiglu(x: Any, w_gate: Any, w_up: Any, w_down: Any, limit: float) -> Any:
    """down(silu(min(gate x, c)) · clip(up x, -c, c)); c <= 0 means no clamp. x: [n, E] -> [n, E]."""
    xp = ops.array_module(x)
    g = ops.linear(x, w_gate)
    u = ops.linear(x, w_up)
    if limit > 0:
        g = xp.minimum(g, np.float32(limit))
        u = xp.clip(u, np.float32(-limit), np.float32(limit))
    return ops.linear(ops.silu(g) * u, w_down)


# ============================================================================ architecture

class DeepSeek4(Architecture):
    """``deepseek4``: DeepSeek V4 Flash."""

    name = ARCH
    graph = DeepSeek4Graph

    def hparams(self, r: KeyReader) -> DeepSeek4HParams:
        return DeepSeek4HParams(**read_v4_params(r, r.metadata, r.source))

    def tensors(self, hp: DeepSeek4HParams) -> list[TensorSpec]:
        return tensor_specs(hp)


__all__ = ["CompressedStream", "Compressor", "DeepSeek4", "DeepSeek4Graph", "DeepSeek4HParams", "HcMix",
           "IndexerStream", "MtpHead", "TopKSelection", "WindowKeys", "compress", "hc_mix", "indexer_topk",
           "load_hparams", "sinkhorn", "tensor_specs"]

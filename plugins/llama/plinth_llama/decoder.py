"""The dense pre-norm decoder shared by llama, qwen2, qwen3 and gemma3.

One block: ``x += attn(norm(x))``, ``x += ffn(norm(x))``, with the optional pieces
the architectures switch on through :class:`DecoderHParams` (q/k bias, per-head
q/k norms, post-norms, sliding-window layers, embedding scale, soft-capping).
Weights are used in GGUF layout: a linear weight is ``[n_out, n_in]``.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import numpy as np

from plinth import ops
from plinth.context import Batch, ForwardOutput, KVCache, pool
from plinth.hparams import KeyReader, PerLayer
from plinth.tensors import TensorSpec


@attrs.frozen
class DecoderHParams:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ctx_train: int
    n_head: PerLayer
    n_head_kv: PerLayer
    n_ff: PerLayer
    head_dim: int
    head_dim_v: int
    n_rot: int
    norm_eps: float
    rope_base: PerLayer  # per layer (gemma3 uses another base on sliding-window layers)
    rope_mode: str  # "normal" or "neox"
    rope_scaling: str
    rope_factor: float
    rope_ctx_orig: int
    sliding_window: PerLayer  # 0 = full attention on that layer
    attn_scale: float
    act: str = "silu"
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    embd_scale: float = 1.0
    final_softcap: float = 0.0
    attn_softcap: float = 0.0


def read_common(md: Mapping[str, Any], source: str, arch: str) -> dict[str, Any]:
    """The keys every dense decoder has, as keyword arguments of :class:`DecoderHParams`."""
    r = KeyReader(md, source, arch)
    n_embd = r.get("embedding_length")
    n_layer = r.get("block_count")
    n_head = r.get_key_or_arr("attention.head_count", n_layer)
    n_head_kv = r.get_key_or_arr("attention.head_count_kv", n_layer, required=False, default=n_head[0])
    head_dim = r.get("attention.key_length", required=False, default=n_embd // n_head[0])
    tokens = md.get("tokenizer.ggml.tokens")
    n_vocab = r.get("vocab_size", required=False, default=len(tokens) if tokens is not None else None)
    if n_vocab is None:
        n_vocab = -1  # resolved from token_embd's shape by the loader
    scaling = r.get("rope.scaling.type", str, required=False, default="none")
    return dict(
        arch=arch,
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_ctx_train=r.get("context_length", required=False, default=2048),
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=r.get_key_or_arr("feed_forward_length", n_layer),
        head_dim=head_dim,
        head_dim_v=r.get("attention.value_length", required=False, default=head_dim),
        n_rot=r.get("rope.dimension_count", required=False, default=head_dim),
        norm_eps=r.get("attention.layer_norm_rms_epsilon", float, required=False, default=1e-5),
        rope_base=r.get_key_or_arr("rope.freq_base", n_layer, float, required=False, default=10000.0),
        rope_mode="normal",
        rope_scaling=scaling,
        rope_factor=r.get("rope.scaling.factor", float, required=False, default=1.0),
        rope_ctx_orig=r.get("rope.scaling.original_context_length", required=False, default=0),
        sliding_window=PerLayer([0] * n_layer, f"{arch}.attention.sliding_window"),
        attn_scale=1.0 / float(head_dim) ** 0.5,
    )


def tensor_specs(hp: DecoderHParams, tied_output_optional: bool = True) -> list[TensorSpec]:
    """GGUF tensor names and numpy-order shapes of a dense decoder."""
    e, v = hp.n_embd, hp.n_vocab
    specs = [
        TensorSpec("token_embd.weight", (v, e)),
        TensorSpec("output_norm.weight", (e,)),
        TensorSpec("output.weight", (v, e), required=not tied_output_optional),
    ]
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        nq, nkv, ff = hp.n_head[il] * hp.head_dim, hp.n_head_kv[il] * hp.head_dim, hp.n_ff[il]
        nv = hp.n_head_kv[il] * hp.head_dim_v
        specs += [
            TensorSpec(b + "attn_norm.weight", (e,)),
            TensorSpec(b + "attn_q.weight", (nq, e)),
            TensorSpec(b + "attn_k.weight", (nkv, e)),
            TensorSpec(b + "attn_v.weight", (nv, e)),
            TensorSpec(b + "attn_output.weight", (e, hp.n_head[il] * hp.head_dim_v)),
            TensorSpec(b + "ffn_norm.weight", (e,)),
            TensorSpec(b + "ffn_gate.weight", (ff, e)),
            TensorSpec(b + "ffn_up.weight", (ff, e)),
            TensorSpec(b + "ffn_down.weight", (e, ff)),
        ]
        if hp.qkv_bias:
            specs += [TensorSpec(b + "attn_q.bias", (nq,)), TensorSpec(b + "attn_k.bias", (nkv,)),
                      TensorSpec(b + "attn_v.bias", (nv,))]
        if hp.qk_norm:
            specs += [TensorSpec(b + "attn_q_norm.weight", (hp.head_dim,)),
                      TensorSpec(b + "attn_k_norm.weight", (hp.head_dim,))]
        if hp.post_norms:
            specs += [TensorSpec(b + "post_attention_norm.weight", (e,)),
                      TensorSpec(b + "post_ffw_norm.weight", (e,))]
    return specs


class DecoderGraph:
    """Forward of a dense decoder over a :class:`Batch`, reading and extending a :class:`KVCache`."""

    def __init__(self, hp: DecoderHParams, weights: Mapping[str, Any], backend: Any) -> None:
        self.hp = hp
        self.backend = backend
        self.xp = backend.xp
        self.w = weights
        self.output_weight = weights.get("output.weight")
        if self.output_weight is None:
            self.output_weight = weights["token_embd.weight"]  # tied LM head
        self.rope = [
            ops.RopeCache(ops.rope_freqs(hp.n_rot, base=hp.rope_base[il], scaling=hp.rope_scaling,
                                         factor=hp.rope_factor, n_ctx_orig=hp.rope_ctx_orig, xp=self.xp))
            for il in range(hp.n_layer)
        ]
        # layers sharing a frequency base share one cos/sin cache
        by_base: dict[float, Any] = {}
        self.rope = [by_base.setdefault(hp.rope_base[il], self.rope[il]) for il in range(hp.n_layer)]

    # -------------------------------------------------------------- pieces

    def embed(self, batch: Batch) -> Any:
        """Input rows: token embeddings, or the batch's own embeddings where ``is_embd``. [n_rows, n_embd]"""
        xp = self.xp
        table = self.w["token_embd.weight"]
        x = table[xp.asarray(batch.tokens)]
        if batch.is_embd is not None and batch.is_embd.any():
            x = xp.where(xp.asarray(batch.is_embd)[:, None], xp.asarray(batch.embeddings, dtype=xp.float32), x)
        if self.hp.embd_scale != 1.0:
            x = x * np.float32(self.hp.embd_scale)
        return x

    def attention(self, il: int, x: Any, batch: Batch, cache: KVCache) -> Any:
        """Self-attention of layer ``il``. x: [n_rows, n_embd] (normed) -> [n_rows, n_embd]."""
        hp, w, b = self.hp, self.w, f"blk.{il}."
        n = x.shape[0]
        q = ops.linear(x, w[b + "attn_q.weight"], w.get(b + "attn_q.bias")).reshape(n, hp.n_head[il], hp.head_dim)
        k = ops.linear(x, w[b + "attn_k.weight"], w.get(b + "attn_k.bias")).reshape(n, hp.n_head_kv[il], hp.head_dim)
        v = ops.linear(x, w[b + "attn_v.weight"], w.get(b + "attn_v.bias")).reshape(n, hp.n_head_kv[il],
                                                                                    hp.head_dim_v)
        if hp.qk_norm:
            q = ops.head_rms_norm(q, w[b + "attn_q_norm.weight"], hp.norm_eps)
            k = ops.head_rms_norm(k, w[b + "attn_k_norm.weight"], hp.norm_eps)
        cs = self.rope[il](batch.positions)
        q = ops.apply_rope(q, mode=hp.rope_mode, cos_sin=cs)
        k = ops.apply_rope(k, mode=hp.rope_mode, cos_sin=cs)
        window = hp.sliding_window[il] or None
        out = self.xp.empty((n, hp.n_head[il], hp.head_dim_v), dtype=self.xp.float32)
        for seq in np.unique(batch.seq_ids):
            rows = np.nonzero(batch.seq_ids == seq)[0]
            sel = slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows) else rows
            kc, vc, kpos = cache.update(il, int(seq), batch.positions[sel], k[sel], v[sel])
            out[sel] = ops.attention(q[sel], kc, vc, q_pos=batch.positions[sel], k_pos=kpos, scale=hp.attn_scale,
                                     causal=True, sliding_window=window, soft_cap=hp.attn_softcap or None)
        return ops.linear(out.reshape(n, -1), w[b + "attn_output.weight"])

    def ffn(self, il: int, x: Any) -> Any:
        w, b = self.w, f"blk.{il}."
        return ops.glu_ffn(x, w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"], w[b + "ffn_down.weight"],
                           act=self.hp.act)

    def block(self, il: int, x: Any, batch: Batch, cache: KVCache) -> Any:
        hp, w, b = self.hp, self.w, f"blk.{il}."
        h = self.attention(il, ops.rms_norm(x, w[b + "attn_norm.weight"], hp.norm_eps), batch, cache)
        if hp.post_norms:
            h = ops.rms_norm(h, w[b + "post_attention_norm.weight"], hp.norm_eps)
        x = x + h
        h = self.ffn(il, ops.rms_norm(x, w[b + "ffn_norm.weight"], hp.norm_eps))
        if hp.post_norms:
            h = ops.rms_norm(h, w[b + "post_ffw_norm.weight"], hp.norm_eps)
        return x + h

    # -------------------------------------------------------------- forward

    def forward(self, batch: Batch, cache: KVCache, *, taps: tuple[int, ...] = (), pooling: str = "none",
                embeddings: bool = False) -> ForwardOutput:
        """Run the batch; logits for rows with ``batch.output`` (none when ``pooling`` != "none")."""
        hp = self.hp
        features: dict[int, Any] = {}
        x = self.embed(batch)
        try:
            for il in range(hp.n_layer):
                if il in taps:
                    features[il] = x
                x = self.block(il, x, batch, cache)
        except BaseException:
            cache.rollback_pending()
            raise
        cache.commit()
        if hp.n_layer in taps:
            features[hp.n_layer] = x
        rows = np.nonzero(batch.output)[0]
        if pooling != "none":
            # pooled embeddings: no LM head is built and no logits buffer is kept
            normed = ops.rms_norm(x, self.w["output_norm.weight"], hp.norm_eps)
            pooled, seqs = pool(normed, batch, pooling, self.xp)
            return ForwardOutput(rows=rows, embeddings=pooled, embedding_seqs=seqs, features=features)
        h = ops.rms_norm(x[rows], self.w["output_norm.weight"], hp.norm_eps)
        logits = ops.linear(h, self.output_weight)
        if hp.final_softcap:
            c = np.float32(hp.final_softcap)
            logits = self.xp.tanh(logits / c) * c
        return ForwardOutput(rows=rows, logits=logits, embeddings=h if embeddings else None, features=features)

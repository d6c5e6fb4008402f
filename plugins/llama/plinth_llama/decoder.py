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

from plinth import ops, quant
from plinth.context import Batch, ForwardOutput, KVCache, pool, run_layers
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
    rope_scaled: PerLayer | None = None  # layers the rope.scaling.* keys apply to (None = every layer)


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


@attrs.define
class _Step:
    """What one forward computes once and every layer shares.

    groups: (sequence id, its rows) — a slice when the rows are contiguous.
    cos_sin: RoPE tables at the batch positions, one per distinct frequency table.
    bias: attention score bias per (sequence, window), built at the first layer that needs it.
    """

    groups: list[tuple[int, Any]]
    cos_sin: dict[int, tuple[Any, Any]]
    bias: dict[tuple[int, int], Any] = attrs.field(factory=dict)


def _groups(seq_ids: np.ndarray) -> list[tuple[int, Any]]:
    """The batch's rows per sequence, in order of sequence id."""
    n = len(seq_ids)
    if n and seq_ids[0] == seq_ids[-1] and (n < 3 or (seq_ids == seq_ids[0]).all()):
        return [(int(seq_ids[0]), slice(0, n))]  # one sequence: the common case
    groups = []
    for seq in np.unique(seq_ids):
        rows = np.nonzero(seq_ids == seq)[0]
        contiguous = rows[-1] - rows[0] + 1 == len(rows)
        groups.append((int(seq), slice(int(rows[0]), int(rows[-1]) + 1) if contiguous else rows))
    return groups


@attrs.frozen
class Dense:
    """A linear layer ``x -> x @ W.T (+ bias)`` with W kept in the layout BLAS runs fastest.

    OpenBLAS streams a matrix-vector product through a row-major [n_in, n_out] matrix
    faster than through [n_out, n_in] when the output is at least as wide as the input
    (QKV, gate/up, the attention output), and slower for narrow outputs (FFN down); see
    benchmarks/README.md. ``transposed`` says which layout ``w`` has.
    """

    w: Any  # [n_out, n_in], or [n_in, n_out] when transposed
    transposed: bool
    bias: Any = None

    def __call__(self, x: Any) -> Any:
        return ops.linear_t(x, self.w, self.bias) if self.transposed else ops.linear(x, self.w, self.bias)


def _offsets(parts: list[Any]) -> list[int]:
    """Start row of each part when the parts are stacked on axis 0."""
    out, o = [], 0
    for p in parts:
        out.append(o)
        o += p.shape[0]
    return out


class DecoderGraph:
    """Forward of a dense decoder over a :class:`Batch`, reading and extending a :class:`KVCache`.

    Q, K and V of a layer are computed by one matrix (their weights stacked on the output
    axis), and so are the FFN gate and up projections: fewer, larger GEMMs. The GGUF-named
    weights stay in ``weights`` as views of the stacked matrices, so memory is not doubled.
    """

    def __init__(self, hp: DecoderHParams, weights: Mapping[str, Any], backend: Any) -> None:
        self.hp = hp
        self.backend = backend
        self.xp = backend.xp
        self.w = weights
        # the LM head (tied to token_embd when output.weight is absent); a tied table is
        # then read through its transposed copy by the embedding lookup too
        head = "output.weight" if "output.weight" in weights else "token_embd.weight"
        self.lm_head = self._dense([head])
        # [n_vocab, n_embd] in GGUF layout (a view), for code that shares the head
        self.output_weight = self.lm_head.w.T if self.lm_head.transposed else self.lm_head.w
        if isinstance(weights, dict):
            weights[head] = self.output_weight
        # layers sharing a frequency base and scaling share one cos/sin cache
        by_key: dict[tuple[float, str], Any] = {}
        self.rope = []
        for il in range(hp.n_layer):
            scaling = hp.rope_scaling if hp.rope_scaled is None or hp.rope_scaled[il] else "none"
            key = (hp.rope_base[il], scaling)
            if key not in by_key:
                by_key[key] = ops.RopeCache(ops.rope_freqs(hp.n_rot, base=hp.rope_base[il], scaling=scaling,
                                                           factor=hp.rope_factor, n_ctx_orig=hp.rope_ctx_orig,
                                                           xp=self.xp))
            self.rope.append(by_key[key])
        self.qkv, self.attn_out, self.gate_up, self.down = [], [], [], []
        for il in range(hp.n_layer):
            b = f"blk.{il}."
            bias = None
            if hp.qkv_bias:
                bias = self.xp.concatenate([self.xp.asarray(weights[b + f"attn_{t}.bias"], dtype=self.xp.float32)
                                            for t in "qkv"])
            self.qkv.append(self._dense([b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"], bias))
            self.attn_out.append(self._dense([b + "attn_output.weight"]))
            self.gate_up.append(self._dense([b + "ffn_gate.weight", b + "ffn_up.weight"]))
            self.down.append(self._dense([b + "ffn_down.weight"]))

    def _dense(self, names: list[str], bias: Any = None) -> Dense:
        """The named [n_out, n_in] weights stacked on the output axis as one :class:`Dense`.

        The names in ``weights`` become views of the stacked matrix (same values and shapes).
        """
        xp = self.xp
        stacked = quant.stack([self.w[n] for n in names])  # quantized weights stay quantized
        if stacked is not None:
            parts = [self.w[n] for n in names]
            views = [stacked[o:o + p.shape[0]] for o, p in zip(_offsets(parts), parts)]
            dense = Dense(stacked, transposed=False, bias=bias)
        else:
            parts = [xp.asarray(self.w[n], dtype=xp.float32) for n in names]
            dense, views = self._dense_f32(parts, bias)
        if isinstance(self.w, dict):
            for n, v in zip(names, views):
                self.w[n] = v
        return dense

    def _dense_f32(self, parts: list[Any], bias: Any) -> tuple[Dense, list[Any]]:
        """float32 parts stacked in the layout BLAS runs fastest, and views of each part."""
        xp = self.xp
        n_in, n_out = parts[0].shape[1], sum(p.shape[0] for p in parts)
        if n_out < n_in:
            w = parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=0)
            w = xp.ascontiguousarray(w)
            views = [w[o:o + p.shape[0]] for o, p in zip(_offsets(parts), parts)]
            dense = Dense(w, transposed=False, bias=bias)
        else:
            w_t = xp.empty((n_in, n_out), dtype=xp.float32)
            for o, p in zip(_offsets(parts), parts):
                for r in range(0, p.shape[0], 256):  # in blocks: a whole-matrix transpose thrashes the cache
                    r1 = min(r + 256, p.shape[0])
                    w_t[:, o + r:o + r1] = p[r:r1].T
            views = [w_t[:, o:o + p.shape[0]].T for o, p in zip(_offsets(parts), parts)]
            dense = Dense(w_t, transposed=True, bias=bias)
        return dense, views

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

    def attention(self, il: int, x: Any, batch: Batch, cache: KVCache, step: _Step) -> Any:
        """Self-attention of layer ``il``. x: [n_rows, n_embd] (normed) -> [n_rows, n_embd]."""
        hp, w, b = self.hp, self.w, f"blk.{il}."
        n = x.shape[0]
        n_head, n_head_kv, hd = hp.n_head[il], hp.n_head_kv[il], hp.head_dim
        nq, nk = n_head * hd, n_head_kv * hd
        qkv = self.qkv[il](x)  # [n, nq + nk + nv]
        v = qkv[:, nq + nk:].reshape(n, n_head_kv, hp.head_dim_v)
        # Q and K heads side by side: one normalisation and one rotation for both
        qk = qkv[:, :nq + nk].reshape(n, n_head + n_head_kv, hd)
        if hp.qk_norm:
            qk = ops.head_rms_norm(qk, None, hp.norm_eps)
            qk[:, :n_head] *= w[b + "attn_q_norm.weight"]
            qk[:, n_head:] *= w[b + "attn_k_norm.weight"]
        qk = ops.apply_rope(qk, mode=hp.rope_mode, cos_sin=step.cos_sin[id(self.rope[il])])
        q, k = qk[:, :n_head], qk[:, n_head:]
        window = hp.sliding_window[il] or 0
        out = self.xp.empty((n, n_head, hp.head_dim_v), dtype=self.xp.float32)
        for seq, sel in step.groups:
            pos = batch.positions[sel]
            kc, vc, kpos = cache.update(il, seq, pos, k[sel], v[sel])
            key = (seq, window)
            if key not in step.bias:
                step.bias[key] = ops.attention_bias(pos, kpos, causal=True, sliding_window=window or None)
            out[sel] = ops.attention(q[sel], kc, vc, scale=hp.attn_scale, causal=False, bias=step.bias[key],
                                     soft_cap=hp.attn_softcap or None)
        return self.attn_out[il](out.reshape(n, -1))

    def ffn(self, il: int, x: Any) -> Any:
        ff = self.hp.n_ff[il]
        gate_up = self.gate_up[il](x)  # [n, 2 * n_ff]
        h = ops.get_activation(self.hp.act)(gate_up[:, :ff])
        h *= gate_up[:, ff:]
        return self.down[il](h)

    def block(self, il: int, x: Any, batch: Batch, cache: KVCache, step: _Step) -> Any:
        hp, w, b = self.hp, self.w, f"blk.{il}."
        h = self.attention(il, ops.rms_norm(x, w[b + "attn_norm.weight"], hp.norm_eps), batch, cache, step)
        if hp.post_norms:
            h = ops.rms_norm(h, w[b + "post_attention_norm.weight"], hp.norm_eps)
        x = x + h
        h = self.ffn(il, ops.rms_norm(x, w[b + "ffn_norm.weight"], hp.norm_eps))
        if hp.post_norms:
            h = ops.rms_norm(h, w[b + "post_ffw_norm.weight"], hp.norm_eps)
        h += x
        return h

    # -------------------------------------------------------------- forward

    def forward(self, batch: Batch, cache: KVCache, *, taps: tuple[int, ...] = (), pooling: str = "none",
                embeddings: bool = False) -> ForwardOutput:
        """Run the batch; logits for rows with ``batch.output`` (none when ``pooling`` != "none")."""
        hp = self.hp
        x = self.embed(batch)
        tables = {id(r): r for r in self.rope}
        step = _Step(groups=_groups(batch.seq_ids), cos_sin={k: r(batch.positions) for k, r in tables.items()})
        x, features = run_layers(x, hp.n_layer, lambda il, h: self.block(il, h, batch, cache, step), cache, taps)
        rows = np.nonzero(batch.output)[0]
        if pooling != "none":
            # pooled embeddings: no LM head is built and no logits buffer is kept
            normed = ops.rms_norm(x, self.w["output_norm.weight"], hp.norm_eps)
            pooled, seqs = pool(normed, batch, pooling, self.xp)
            return ForwardOutput(rows=rows, embeddings=pooled, embedding_seqs=seqs, features=features)
        h = ops.rms_norm(x[rows], self.w["output_norm.weight"], hp.norm_eps)
        logits = self.lm_head(h)
        if hp.final_softcap:
            c = np.float32(hp.final_softcap)
            logits = self.xp.tanh(logits / c) * c
        return ForwardOutput(rows=rows, logits=logits, embeddings=h if embeddings else None, features=features)

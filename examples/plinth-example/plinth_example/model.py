"""minidense: a small dense pre-norm decoder.

Per block::

    h = x + attn(rms_norm(x))     # grouped-query attention, NeoX RoPE, 1/sqrt(head_dim) scale
    x = h + ffn(rms_norm(h))      # down(silu(gate(h)) * up(h))

then ``logits = head(rms_norm(x))``; the head is ``token_embd`` when the file has no
``output.weight``. Every layer keeps plain K/V in the cache (the :class:`BaseGraph` default).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from plinth import ops
from plinth.graph import Architecture, BaseGraph, KeyReader, Linear, Rope, Step, TensorSpec, attend


@attrs.frozen
class MiniDenseHParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ctx_train: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    norm_eps: float
    rope_base: float


class MiniDenseGraph(BaseGraph):
    def __init__(self, hp: MiniDenseHParams, weights: Mapping[str, Any], backend: Any) -> None:
        super().__init__(hp, weights, backend)  # embedding, LM head (tied or not), final norm
        xp = self.xp
        self.rope = Rope(hp.head_dim, [hp.rope_base] * hp.n_layer, xp, mode="neox")
        # Q, K and V as one product, gate and up as another
        self.qkv = [Linear.stack(weights, [f"blk.{il}.attn_{t}.weight" for t in "qkv"], xp)
                    for il in range(hp.n_layer)]
        self.gate_up = [Linear.stack(weights, [f"blk.{il}.ffn_gate.weight", f"blk.{il}.ffn_up.weight"], xp)
                        for il in range(hp.n_layer)]

    def layer(self, il: int, x: Any, step: Step) -> Any:
        w, eps, b = self.w, self.hp.norm_eps, f"blk.{il}."
        x = x + self.attention(il, ops.rms_norm(x, w[b + "attn_norm.weight"], eps), step)
        return x + self.ffn(il, ops.rms_norm(x, w[b + "ffn_norm.weight"], eps))

    def attention(self, il: int, x: Any, step: Step) -> Any:
        """x: [n, n_embd] (normed) -> [n, n_embd]."""
        hp, n = self.hp, x.shape[0]
        nh, nkv, hd = hp.n_head, hp.n_head_kv, hp.head_dim
        qkv = self.qkv[il](x)
        qk = self.rope(il, qkv[:, :(nh + nkv) * hd].reshape(n, nh + nkv, hd), step)  # Q and K heads together
        v = qkv[:, (nh + nkv) * hd:].reshape(n, nkv, hd)
        out = attend(il, qk[:, :nh], qk[:, nh:], v, step, scale=hd ** -0.5)  # appends K/V to the cache
        return ops.linear(out.reshape(n, nh * hd), self.w[f"blk.{il}.attn_output.weight"])

    def ffn(self, il: int, x: Any) -> Any:
        gate_up = self.gate_up[il](x)
        h = ops.silu(gate_up[:, :self.hp.n_ff]) * gate_up[:, self.hp.n_ff:]
        return ops.linear(h, self.w[f"blk.{il}.ffn_down.weight"])


class MiniDense(Architecture):
    name = "minidense"
    graph = MiniDenseGraph

    def hparams(self, r: KeyReader) -> MiniDenseHParams:
        n_embd, n_head = r.get("embedding_length"), r.get("attention.head_count")
        return MiniDenseHParams(
            n_vocab=r.get("vocab_size"),
            n_embd=n_embd,
            n_layer=r.get("block_count"),
            n_ctx_train=r.get("context_length"),
            n_head=n_head,
            n_head_kv=r.get("attention.head_count_kv", required=False, default=n_head),
            head_dim=r.get("attention.key_length", required=False, default=n_embd // n_head),
            n_ff=r.get("feed_forward_length"),
            norm_eps=r.get("attention.layer_norm_rms_epsilon", float),
            rope_base=r.get("rope.freq_base", float, required=False, default=10000.0),
        )

    def tensors(self, hp: MiniDenseHParams) -> list[TensorSpec]:
        e, hd = hp.n_embd, hp.head_dim
        specs = [TensorSpec("token_embd.weight", (hp.n_vocab, e)),
                 TensorSpec("output_norm.weight", (e,)),
                 TensorSpec("output.weight", (hp.n_vocab, e), required=False)]  # absent: tied
        for il in range(hp.n_layer):
            b = f"blk.{il}."
            specs += [TensorSpec(b + "attn_norm.weight", (e,)),
                      TensorSpec(b + "attn_q.weight", (hp.n_head * hd, e)),
                      TensorSpec(b + "attn_k.weight", (hp.n_head_kv * hd, e)),
                      TensorSpec(b + "attn_v.weight", (hp.n_head_kv * hd, e)),
                      TensorSpec(b + "attn_output.weight", (e, hp.n_head * hd)),
                      TensorSpec(b + "ffn_norm.weight", (e,)),
                      TensorSpec(b + "ffn_gate.weight", (hp.n_ff, e)),
                      TensorSpec(b + "ffn_up.weight", (hp.n_ff, e)),
                      TensorSpec(b + "ffn_down.weight", (e, hp.n_ff))]
        return specs

"""llama (SmolLM2, Llama 2/3), qwen2 and qwen3: the plain dense pre-norm decoders.

llama, per block::

    h = x + attn(rms_norm(x))        # GQA, RoPE on interleaved pairs (the GGUF converter
                                      # permutes Q/K rows for it), 1/sqrt(head_dim) scale
    x = h + swiglu_ffn(rms_norm(h))  # down(silu(gate(h)) * up(h))

then ``logits = lm_head(rms_norm(x))``; the head is tied to ``token_embd`` when the file
has no ``output.weight``.

* qwen2: as llama with NeoX RoPE and biases on Q, K and V.
* qwen3: as llama with NeoX RoPE and a per-head RMSNorm on Q and K before RoPE.

Weights are used in GGUF layout (a linear weight is ``[n_out, n_in]``); Q, K and V are one
stacked :class:`~plinth.graph.Linear`, and so are the FFN gate and up projections.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from plinth import ops
from plinth.graph import Architecture, BaseGraph, KeyReader, Linear, PerLayer, Rope, Step, TensorSpec, attend


@attrs.frozen
class LlamaHParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ctx_train: int
    n_head: PerLayer
    n_head_kv: PerLayer
    n_ff: PerLayer
    head_dim: int
    n_rot: int
    norm_eps: float
    rope_base: float
    rope_scaling: str
    rope_factor: float
    rope_ctx_orig: int


def read_hparams(r: KeyReader, **defaults: Any) -> dict[str, Any]:
    """The keys of a llama-style file, as keyword arguments of :class:`LlamaHParams`."""
    n_embd, n_layer = r.get("embedding_length"), r.get("block_count")
    n_head = r.get_key_or_arr("attention.head_count", n_layer)
    head_dim = r.get("attention.key_length", required=False, default=n_embd // n_head[0])
    tokens = r.metadata.get("tokenizer.ggml.tokens")
    return dict(
        n_vocab=r.get("vocab_size", required=False, default=len(tokens) if tokens is not None else -1),
        n_embd=n_embd,
        n_layer=n_layer,
        n_ctx_train=r.get("context_length", required=False, default=2048),
        n_head=n_head,
        n_head_kv=r.get_key_or_arr("attention.head_count_kv", n_layer, required=False, default=n_head[0]),
        n_ff=r.get_key_or_arr("feed_forward_length", n_layer),
        head_dim=head_dim,
        n_rot=r.get("rope.dimension_count", required=False, default=head_dim),
        norm_eps=r.get("attention.layer_norm_rms_epsilon", float, required=False,
                       default=defaults.get("norm_eps", 1e-5)),
        rope_base=r.get("rope.freq_base", float, required=False, default=defaults.get("rope_base", 10000.0)),
        rope_scaling=r.get("rope.scaling.type", str, required=False, default="none"),
        rope_factor=r.get("rope.scaling.factor", float, required=False, default=1.0),
        rope_ctx_orig=r.get("rope.scaling.original_context_length", required=False, default=0),
    )


def block_tensors(hp: Any, il: int) -> list[TensorSpec]:
    """One pre-norm attention + GLU-FFN block's tensors."""
    b, e = f"blk.{il}.", hp.n_embd
    nq, nkv, ff = hp.n_head[il] * hp.head_dim, hp.n_head_kv[il] * hp.head_dim, hp.n_ff[il]
    return [
        TensorSpec(b + "attn_norm.weight", (e,)),
        TensorSpec(b + "attn_q.weight", (nq, e)),
        TensorSpec(b + "attn_k.weight", (nkv, e)),
        TensorSpec(b + "attn_v.weight", (nkv, e)),
        TensorSpec(b + "attn_output.weight", (e, nq)),
        TensorSpec(b + "ffn_norm.weight", (e,)),
        TensorSpec(b + "ffn_gate.weight", (ff, e)),
        TensorSpec(b + "ffn_up.weight", (ff, e)),
        TensorSpec(b + "ffn_down.weight", (e, ff)),
    ]


def model_tensors(hp: Any) -> list[TensorSpec]:
    """Embedding, final norm, optional untied head."""
    return [
        TensorSpec("token_embd.weight", (hp.n_vocab, hp.n_embd)),
        TensorSpec("output_norm.weight", (hp.n_embd,)),
        TensorSpec("output.weight", (hp.n_vocab, hp.n_embd), required=False),  # absent: tied
    ]


class LlamaGraph(BaseGraph):
    rope_mode = "normal"

    def __init__(self, hp: Any, weights: Mapping[str, Any], backend: Any, **kw: Any) -> None:
        super().__init__(hp, weights, backend, **kw)
        w, xp = self.w, self.xp
        self.rope = self.make_rope()
        self.attn_scale = 1.0 / float(hp.head_dim) ** 0.5
        self.qkv, self.attn_out, self.gate_up, self.down = [], [], [], []
        for il in range(hp.n_layer):
            b = f"blk.{il}."
            self.qkv.append(Linear.stack(w, [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"], xp,
                                         bias=self.qkv_bias(b)))
            self.attn_out.append(Linear.stack(w, [b + "attn_output.weight"], xp))
            self.gate_up.append(Linear.stack(w, [b + "ffn_gate.weight", b + "ffn_up.weight"], xp))
            self.down.append(Linear.stack(w, [b + "ffn_down.weight"], xp))

    def make_rope(self) -> Rope:
        hp = self.hp
        return Rope(hp.n_rot, [hp.rope_base] * hp.n_layer, self.xp, mode=self.rope_mode, scaling=hp.rope_scaling,
                    factor=hp.rope_factor, n_ctx_orig=hp.rope_ctx_orig)

    def qkv_bias(self, b: str) -> list[str]:
        return []

    def qk_norm(self, il: int, qk: Any) -> Any:
        return qk

    def layer(self, il: int, x: Any, step: Step) -> Any:
        w, eps, b = self.w, self.hp.norm_eps, f"blk.{il}."
        x = x + self.attention(il, ops.rms_norm(x, w[b + "attn_norm.weight"], eps), step)
        h = self.ffn(il, ops.rms_norm(x, w[b + "ffn_norm.weight"], eps))
        h += x
        return h

    def attention(self, il: int, x: Any, step: Step, window: int = 0, soft_cap: float | None = None) -> Any:
        """Self-attention of layer ``il``. x: [n_rows, n_embd] (normed) -> [n_rows, n_embd]."""
        hp, n = self.hp, x.shape[0]
        n_head, n_head_kv, hd = hp.n_head[il], hp.n_head_kv[il], hp.head_dim
        qkv = self.qkv[il](x)  # [n, (n_head + 2 n_head_kv) * hd]
        v = qkv[:, (n_head + n_head_kv) * hd:].reshape(n, n_head_kv, hd)
        # Q and K heads side by side: one normalisation and one rotation for both
        qk = self.qk_norm(il, qkv[:, :(n_head + n_head_kv) * hd].reshape(n, n_head + n_head_kv, hd))
        qk = self.rope(il, qk, step)
        out = attend(il, qk[:, :n_head], qk[:, n_head:], v, step, scale=self.attn_scale, window=window,
                     soft_cap=soft_cap)
        return self.attn_out[il](out.reshape(n, -1))

    def ffn(self, il: int, x: Any, act: Any = ops.silu) -> Any:
        ff = self.hp.n_ff[il]
        gate_up = self.gate_up[il](x)  # [n, 2 n_ff]
        h = act(gate_up[:, :ff])
        h *= gate_up[:, ff:]
        return self.down[il](h)


class Qwen2Graph(LlamaGraph):
    rope_mode = "neox"

    def qkv_bias(self, b: str) -> list[str]:
        return [b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias"]


class Qwen3Graph(LlamaGraph):
    rope_mode = "neox"

    def qk_norm(self, il: int, qk: Any) -> Any:
        """Per-head RMSNorm of Q and K, each with its own weight [head_dim]."""
        w, b, n_head = self.w, f"blk.{il}.", self.hp.n_head[il]
        qk = ops.head_rms_norm(qk, None, self.hp.norm_eps)
        qk[:, :n_head] *= w[b + "attn_q_norm.weight"]
        qk[:, n_head:] *= w[b + "attn_k_norm.weight"]
        return qk


class Llama(Architecture):
    name = "llama"
    graph = LlamaGraph

    def hparams(self, r: KeyReader) -> LlamaHParams:
        return LlamaHParams(**read_hparams(r))

    def tensors(self, hp: LlamaHParams) -> list[TensorSpec]:
        return model_tensors(hp) + [s for il in range(hp.n_layer) for s in self.layer_tensors(hp, il)]

    def layer_tensors(self, hp: Any, il: int) -> list[TensorSpec]:
        return block_tensors(hp, il)


class Qwen2(Llama):
    name = "qwen2"
    graph = Qwen2Graph

    def layer_tensors(self, hp: Any, il: int) -> list[TensorSpec]:
        nq, nkv = hp.n_head[il] * hp.head_dim, hp.n_head_kv[il] * hp.head_dim
        return block_tensors(hp, il) + [TensorSpec(f"blk.{il}.attn_{t}.bias", (n,))
                                        for t, n in (("q", nq), ("k", nkv), ("v", nkv))]


class Qwen3(Llama):
    name = "qwen3"
    graph = Qwen3Graph

    def layer_tensors(self, hp: Any, il: int) -> list[TensorSpec]:
        return block_tensors(hp, il) + [TensorSpec(f"blk.{il}.attn_{t}_norm.weight", (hp.head_dim,)) for t in "qk"]


__all__ = ["Llama", "LlamaGraph", "LlamaHParams", "Qwen2", "Qwen3"]

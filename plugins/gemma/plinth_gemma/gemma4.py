"""gemma4: Gemma 4 text models (E2B / E4B with per-layer embeddings and KV sharing, 31B dense, 26B-A4B MoE).

Per block (Gemma 4's norms multiply by their weight as stored; no +1)::

    h = x + post_attention_norm(attn(attn_norm(x)))
    f = post_ffw_norm_1(mlp(ffn_norm(h))) + post_ffw_norm_2(moe(pre_ffw_norm_2(h)))   # MoE files
    f = mlp(ffn_norm(h))                                                                # dense files
    x = h + post_ffw_norm(f)                                                           # mlp: down(gelu_tanh(gate) * up)
    x = x + post_norm(proj(gelu_tanh(inp_gate(x)) * ple[il]))                         # with per-layer embeddings
    x = x * layer_output_scale                                                         # when the file has it

then ``logits = softcap(lm_head(output_norm(x)))``, the head tied to ``token_embd`` unless the file
has ``output.weight``, ``tanh(z / c) * c`` with ``c = final_logit_softcapping`` when set.

* Input: ``token_embd[t] * sqrt(n_embd)``.
* Attention: per-head RMSNorm of Q and K (``attn_{q,k}_norm``), an RMSNorm without weight of V,
  NeoX RoPE, scale 1 (the norms replace 1/sqrt(head_dim)), no soft-capping. Layers are sliding
  (``attention.sliding_window_pattern`` true: window ``attention.sliding_window``, head size
  ``attention.key_length_swa``, RoPE base ``rope.freq_base_swa`` over ``rope.dimension_count_swa``
  dims) or full (head size ``attention.key_length``, base ``rope.freq_base``, "proportional" RoPE:
  ``rope_freqs.weight`` divides each frequency, 1e30 for the pairs that do not turn), each with
  its own KV head count (``attention.head_count_kv`` per layer). A layer without ``attn_v`` uses
  its raw K projection as V (``attention_k_eq_v``).
* KV sharing: the last ``attention.shared_kv_layers`` layers have no K/V of their own; each reads
  the K/V of the last earlier layer of its own kind (sliding or full) that has them, with that
  kind's window (a :class:`~plinth.graph.SharedKV` cache: no bytes of its own).
* Per-layer embeddings (``embedding_length_per_layer_input`` n_pl > 0): for every row,
  ``ple = (rms_norm(proj(x0) / sqrt(n_embd)) + per_layer_token_embd[t] * sqrt(n_pl)) / sqrt(2)``,
  [n_layer, n_pl] per row (x0 the scaled input embedding, ``proj = per_layer_model_proj``, the norm
  ``per_layer_proj_norm`` per layer slice); layer il adds its slice as above. An embedding row
  (no token id) takes token 0's per-layer embedding, as llama.cpp does for image rows.
* MoE (``expert_count`` > 0; every layer): the dense MLP above runs beside the experts. Router:
  ``softmax(ffn_gate_inp(rms_norm(h) * ffn_gate_inp.scale / sqrt(n_embd)))``, the
  ``expert_used_count`` best renormalised to sum to 1 and multiplied by ``ffn_down_exps.scale``
  (the per-expert scale); each expert ``down(gelu_tanh(gate) * up)`` with gate|up fused in
  ``ffn_gate_up_exps`` (or separate ``ffn_gate_exps`` / ``ffn_up_exps``).
* ``feed_forward_length`` may be per layer (the double-wide MLP of the KV-shared layers).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs
import numpy as np

from plinth import ops
from plinth.errors import UserError
from plinth.graph import (DENSE_RANGES, KV, Architecture, BaseGraph, HParamsError, KeyReader, Linear, PerLayer, Rope,
                          SharedKV, Step, TensorSpec, attend, embed_rows)


@attrs.frozen
class Gemma4HParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ctx_train: int
    n_head: PerLayer
    n_head_kv: PerLayer
    n_ff: PerLayer
    head_dim: int  # full-attention layers
    head_dim_swa: int  # sliding layers
    n_rot: int
    n_rot_swa: int
    norm_eps: float
    rope_base: float
    rope_base_swa: float
    swa: tuple[bool, ...]  # per layer: sliding window attention
    sliding_window: int
    kv_source: tuple[int, ...]  # per layer: the layer whose K/V it attends to (itself unless shared)
    n_embd_per_layer: int = 0  # per-layer embedding width (0: none)
    final_softcap: float = 0.0
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: PerLayer = PerLayer([], "expert_feed_forward_length")

    def hd(self, il: int) -> int:
        """Head size of layer ``il`` (Q, K and V)."""
        return self.head_dim_swa if self.swa[il] else self.head_dim

    def owns_kv(self, il: int) -> bool:
        return self.kv_source[il] == il

    def window(self, il: int) -> int:
        return self.sliding_window if self.swa[il] else 0


def kv_sources(swa: list[bool], n_shared: int, source: str, key: str) -> tuple[int, ...]:
    """Per layer, the layer whose K/V it reads: the last ``n_shared`` layers read the last earlier
    layer of their own kind (sliding or full) that keeps K/V, as transformers' Gemma 4 does."""
    n_layer = len(swa)
    first = n_layer - n_shared
    if not 0 <= n_shared < n_layer:
        raise HParamsError(f"{source}: key '{key}' = {n_shared}: must be 0..{n_layer - 1} (some layer must keep "
                           "its own K/V)")
    out = []
    for il in range(n_layer):
        if il < first:
            out.append(il)
            continue
        same = [j for j in range(first) if swa[j] == swa[il]]
        if not same:
            kind = "sliding" if swa[il] else "full"
            raise HParamsError(f"{source}: key '{key}' = {n_shared}: shared layer {il} is {kind} attention, "
                               f"but no layer before {first} of that kind keeps K/V to share")
        out.append(same[-1])
    return tuple(out)


class Gemma4Graph(BaseGraph):
    def __init__(self, hp: Gemma4HParams, weights: Mapping[str, Any], backend: Any) -> None:
        super().__init__(hp, weights, backend, softcap=hp.final_softcap)
        w, xp, n = self.w, self.xp, hp.n_layer
        self.rope_swa = Rope(hp.n_rot_swa, [hp.rope_base_swa] * n, xp, mode="neox")
        factors = w.get("rope_freqs.weight")  # [head_dim / 2]; a narrower rotation reads its first n_rot / 2
        factors = None if factors is None else xp.asarray(factors, dtype=xp.float32)[:hp.n_rot // 2]
        self.rope_full = Rope(hp.n_rot, [hp.rope_base] * n, xp, mode="neox", freq_factors=factors)
        self.qkv, self.o, self.gate_up, self.down, self.ple_gate, self.ple_proj = ([] for _ in range(6))
        self.out_scale: list[Any] = []
        self.experts: list[Any] = []
        for il in range(n):
            b = f"blk.{il}."
            names = [b + "attn_q.weight"]
            if hp.owns_kv(il):
                names += [b + "attn_k.weight"] + ([b + "attn_v.weight"] if b + "attn_v.weight" in w else [])
            self.qkv.append(Linear.stack(w, names, xp))
            self.o.append(Linear.stack(w, [b + "attn_output.weight"], xp))
            self.gate_up.append(Linear.stack(w, [b + "ffn_gate.weight", b + "ffn_up.weight"], xp))
            self.down.append(Linear.stack(w, [b + "ffn_down.weight"], xp))
            if hp.n_embd_per_layer:
                self.ple_gate.append(Linear.stack(w, [b + "inp_gate.weight"], xp))
                self.ple_proj.append(Linear.stack(w, [b + "proj.weight"], xp))
            scale = w.get(b + "layer_output_scale.weight")
            self.out_scale.append(None if scale is None else xp.asarray(scale, dtype=xp.float32).reshape(1))
            self.experts.append(self.expert_weights(il) if hp.n_expert else None)
        if hp.n_embd_per_layer:
            self.ple_model_proj = Linear.stack(w, ["per_layer_model_proj.weight"], xp)

    def expert_weights(self, il: int) -> tuple[Any, Any, Any, Any]:
        """Layer ``il``'s experts: gate [E, ff, n_embd], up [E, ff, n_embd], down [E, n_embd, ff] and the
        per-expert scale [E] (ones when the file has none)."""
        w, xp, b, ff = self.w, self.xp, f"blk.{il}.", self.hp.n_ff_exp[il]
        fused = w.get(b + "ffn_gate_up_exps.weight")
        if fused is not None:
            if b + "ffn_gate_exps.weight" in w or b + "ffn_up_exps.weight" in w:
                raise UserError(f"layer {il} has both '{b}ffn_gate_up_exps.weight' and separate gate/up experts")
            gate, up = fused[:, :ff], fused[:, ff:]
        elif b + "ffn_gate_exps.weight" in w and b + "ffn_up_exps.weight" in w:
            gate, up = w[b + "ffn_gate_exps.weight"], w[b + "ffn_up_exps.weight"]
        else:
            raise UserError(f"missing tensor '{b}ffn_gate_up_exps.weight' (layer {il} has neither it nor both "
                            f"'{b}ffn_gate_exps.weight' and '{b}ffn_up_exps.weight')")
        scale = w.get(b + "ffn_down_exps.scale")
        scale = xp.ones(self.hp.n_expert, dtype=xp.float32) if scale is None else xp.asarray(scale, dtype=xp.float32)
        return gate, up, w[b + "ffn_down_exps.weight"], scale

    def cache_layout(self) -> list[tuple[Any, ...]]:
        hp = self.hp
        return [(KV(),) if hp.owns_kv(il) else (SharedKV(hp.kv_source[il]),) for il in range(hp.n_layer)]

    # ------------------------------------------------------------------ input rows

    def embed(self, batch: Any) -> Any:
        """Input rows [n, n_embd]: token (or embedding) rows times sqrt(n_embd)."""
        return embed_rows(self.embed_table, batch, self.xp, scale=math.sqrt(self.hp.n_embd))

    def per_layer_inputs(self, batch: Any) -> Any:
        """The per-layer embeddings of the batch's rows: [n, n_layer, n_pl]."""
        hp, xp, w = self.hp, self.xp, self.w
        n, n_pl = len(batch.tokens), hp.n_embd_per_layer
        tokens = batch.tokens if batch.is_embd is None else np.where(batch.is_embd, 0, batch.tokens)
        table = w["per_layer_token_embd.weight"]  # [n_vocab, n_layer * n_pl]
        tok = xp.asarray(table[xp.asarray(tokens)], dtype=xp.float32).reshape(n, hp.n_layer, n_pl)
        tok = tok * np.float32(math.sqrt(n_pl))
        proj = self.ple_model_proj(self.embed(batch)) * np.float32(1.0 / math.sqrt(hp.n_embd))
        proj = ops.rms_norm(proj.reshape(n, hp.n_layer, n_pl), w["per_layer_proj_norm.weight"], hp.norm_eps)
        proj += tok
        proj *= np.float32(1.0 / math.sqrt(2.0))
        return proj

    # ------------------------------------------------------------------ the block

    def layer(self, il: int, x: Any, step: Step) -> Any:
        hp, w, eps, b = self.hp, self.w, self.hp.norm_eps, f"blk.{il}."
        h = self.attention(il, ops.rms_norm(x, w[b + "attn_norm.weight"], eps), step)
        x = x + ops.rms_norm(h, w[b + "post_attention_norm.weight"], eps)
        f = self.mlp(il, ops.rms_norm(x, w[b + "ffn_norm.weight"], eps))
        if hp.n_expert:
            f = ops.rms_norm(f, w[b + "post_ffw_norm_1.weight"], eps)
            f += ops.rms_norm(self.moe(il, x), w[b + "post_ffw_norm_2.weight"], eps)
        x = x + ops.rms_norm(f, w[b + "post_ffw_norm.weight"], eps)
        if hp.n_embd_per_layer:
            ple = step.once("per_layer_inputs", lambda: self.per_layer_inputs(step.batch))
            g = ops.gelu(self.ple_gate[il](x))
            g *= ple[:, il]
            x = x + ops.rms_norm(self.ple_proj[il](g), w[b + "post_norm.weight"], eps)
        if self.out_scale[il] is not None:
            x = x * self.out_scale[il]
        return x

    def attention(self, il: int, x: Any, step: Step) -> Any:
        """Self-attention of layer ``il``. x: [n, n_embd] (normed) -> [n, n_embd]."""
        hp, w, eps, b, n = self.hp, self.w, self.hp.norm_eps, f"blk.{il}.", x.shape[0]
        n_head, n_kv, hd = hp.n_head[il], hp.n_head_kv[il], hp.hd(il)
        rope = self.rope_swa if hp.swa[il] else self.rope_full
        qkv = self.qkv[il](x)  # [n, (n_head [+ 2 n_kv]) * hd]; V absent: K is V
        q = ops.head_rms_norm(qkv[:, :n_head * hd].reshape(n, n_head, hd), w[b + "attn_q_norm.weight"], eps)
        q = rope(il, q, step)
        if hp.owns_kv(il):
            k_raw = qkv[:, n_head * hd:(n_head + n_kv) * hd].reshape(n, n_kv, hd)
            v = qkv[:, (n_head + n_kv) * hd:].reshape(n, n_kv, hd) if qkv.shape[1] > (n_head + n_kv) * hd else k_raw
            v = ops.head_rms_norm(v, None, eps)
            k = rope(il, ops.head_rms_norm(k_raw, w[b + "attn_k_norm.weight"], eps), step)
        else:  # reads layer kv_source's K/V (SharedKV); these are placeholders of the right head size
            k = v = q[:, :1]
        out = attend(il, q, k, v, step, scale=1.0, window=hp.window(il))
        return self.o[il](out.reshape(n, -1))

    def mlp(self, il: int, x: Any) -> Any:
        ff = self.hp.n_ff[il]
        gate_up = self.gate_up[il](x)  # [n, 2 n_ff]
        h = ops.gelu(gate_up[:, :ff])
        h *= gate_up[:, ff:]
        return self.down[il](h)

    def moe(self, il: int, x: Any) -> Any:
        """The routed experts of layer ``il``. x: [n, n_embd] (the residual after attention) -> [n, n_embd]."""
        hp, w, eps, b = self.hp, self.w, self.hp.norm_eps, f"blk.{il}."
        gate, up, down, expert_scale = self.experts[il]
        r = ops.rms_norm(x, None, eps)
        r *= w[b + "ffn_gate_inp.scale"] * np.float32(1.0 / math.sqrt(hp.n_embd))
        route = ops.moe_route(ops.linear(r, w[b + "ffn_gate_inp.weight"]), hp.n_expert_used, score_func="softmax",
                              norm_topk=True)
        route = attrs.evolve(route, weights=route.weights * expert_scale[route.ids])
        return ops.moe_ffn(ops.rms_norm(x, w[b + "pre_ffw_norm_2.weight"], eps), route, gate, up, down, act="gelu")


class Gemma4(Architecture):
    """gemma4 as llama.cpp's converter writes it (keys and tensors: the plugin README)."""

    name = "gemma4"
    graph = Gemma4Graph
    ranges = DENSE_RANGES

    def hparams(self, r: KeyReader) -> Gemma4HParams:
        n_embd, n_layer = r.get("embedding_length"), r.get("block_count")
        swa = self.sliding_pattern(r, n_layer)
        head_dim = r.get("attention.key_length")
        head_dim_swa = r.get("attention.key_length_swa", required=False, default=head_dim)
        for name, k in (("attention.value_length", head_dim), ("attention.value_length_swa", head_dim_swa)):
            v = r.get(name, required=False, default=k)
            if v != k:
                raise HParamsError(f"{r.source}: key '{r.key(name)}' = {v} differs from the key length {k}; "
                                   "Gemma 4 needs equal key and value head sizes")
        n_shared = r.get("attention.shared_kv_layers", required=False, default=0)
        n_expert, n_expert_used = r.expert_counts()
        n_head = r.get_key_or_arr("attention.head_count", n_layer)
        return Gemma4HParams(
            n_vocab=r.n_vocab(),
            n_embd=n_embd,
            n_layer=n_layer,
            n_ctx_train=r.get("context_length", required=False, default=131072),
            n_head=n_head,
            n_head_kv=r.get_key_or_arr("attention.head_count_kv", n_layer, required=False, default=n_head[0]),
            n_ff=r.get_key_or_arr("feed_forward_length", n_layer),
            head_dim=head_dim,
            head_dim_swa=head_dim_swa,
            n_rot=r.get("rope.dimension_count", required=False, default=head_dim),
            n_rot_swa=r.get("rope.dimension_count_swa", required=False, default=head_dim_swa),
            norm_eps=r.get("attention.layer_norm_rms_epsilon", float),
            rope_base=r.get("rope.freq_base", float, required=False, default=1_000_000.0),
            rope_base_swa=r.get("rope.freq_base_swa", float, required=False, default=10_000.0),
            swa=tuple(swa),
            sliding_window=r.get("attention.sliding_window"),
            kv_source=kv_sources(swa, n_shared, r.source, r.key("attention.shared_kv_layers")),
            n_embd_per_layer=r.get("embedding_length_per_layer_input", required=False, default=0),
            final_softcap=r.get("final_logit_softcapping", float, required=False, default=0.0),
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            n_ff_exp=r.get_key_or_arr("expert_feed_forward_length", n_layer, required=n_expert > 0, default=0),
        )

    @staticmethod
    def sliding_pattern(r: KeyReader, n_layer: int) -> list[bool]:
        """``attention.sliding_window_pattern``: one bool per layer (true: sliding window), as llama.cpp reads it."""
        key = r.key("attention.sliding_window_pattern")
        value = r.metadata.get(key)
        if value is None:
            raise HParamsError(f"{r.source}: missing required key '{key}' (architecture '{r.arch}')")
        value = value.tolist() if hasattr(value, "tolist") else value
        if not isinstance(value, (list, tuple)) or len(value) != n_layer or not all(
                isinstance(v, (bool, np.bool_)) for v in value):
            raise HParamsError(f"{r.source}: key '{key}' must hold {n_layer} booleans (one per layer)")
        return [bool(v) for v in value]

    def tensors(self, hp: Gemma4HParams) -> list[TensorSpec]:
        e, n_pl = hp.n_embd, hp.n_embd_per_layer
        out = [
            TensorSpec("token_embd.weight", (hp.n_vocab, e)),
            TensorSpec("output_norm.weight", (e,)),
            TensorSpec("output.weight", (hp.n_vocab, e), required=False),  # absent: tied
            TensorSpec("rope_freqs.weight", (hp.head_dim // 2,), required=not all(hp.swa)),
        ]
        if n_pl:
            out += [TensorSpec("per_layer_token_embd.weight", (hp.n_vocab, hp.n_layer * n_pl)),
                    TensorSpec("per_layer_model_proj.weight", (hp.n_layer * n_pl, e)),
                    TensorSpec("per_layer_proj_norm.weight", (n_pl,))]
        return out + [s for il in range(hp.n_layer) for s in self.layer_tensors(hp, il)]

    def layer_tensors(self, hp: Gemma4HParams, il: int) -> list[TensorSpec]:
        b, e, hd, ff = f"blk.{il}.", hp.n_embd, hp.hd(il), hp.n_ff[il]
        nq, nkv = hp.n_head[il] * hd, hp.n_head_kv[il] * hd
        out = [TensorSpec(b + "attn_norm.weight", (e,)),
               TensorSpec(b + "attn_q.weight", (nq, e)),
               TensorSpec(b + "attn_q_norm.weight", (hd,))]
        if hp.owns_kv(il):
            out += [TensorSpec(b + "attn_k.weight", (nkv, e)),
                    TensorSpec(b + "attn_v.weight", (nkv, e), required=False),  # absent: V = K (attention_k_eq_v)
                    TensorSpec(b + "attn_k_norm.weight", (hd,))]
        else:  # a KV-shared layer's own K/V weights, which some checkpoints carry: unused by the model
            out += [TensorSpec(n, shape, required=False) for n, shape in self.unused_kv_tensors(hp, il)]
        out += [TensorSpec(b + "attn_output.weight", (e, nq)),
                TensorSpec(b + "post_attention_norm.weight", (e,)),
                TensorSpec(b + "ffn_norm.weight", (e,)),
                TensorSpec(b + "ffn_gate.weight", (ff, e)),
                TensorSpec(b + "ffn_up.weight", (ff, e)),
                TensorSpec(b + "ffn_down.weight", (e, ff)),
                TensorSpec(b + "post_ffw_norm.weight", (e,)),
                TensorSpec(b + "layer_output_scale.weight", (1,), required=False)]
        if hp.n_expert:
            n, ffe = hp.n_expert, hp.n_ff_exp[il]
            out += [TensorSpec(b + "ffn_gate_inp.weight", (n, e)),
                    TensorSpec(b + "ffn_gate_inp.scale", (e,)),
                    TensorSpec(b + "pre_ffw_norm_2.weight", (e,)),
                    TensorSpec(b + "post_ffw_norm_1.weight", (e,)),
                    TensorSpec(b + "post_ffw_norm_2.weight", (e,)),
                    TensorSpec(b + "ffn_gate_up_exps.weight", (n, 2 * ffe, e), required=False),
                    TensorSpec(b + "ffn_gate_exps.weight", (n, ffe, e), required=False),
                    TensorSpec(b + "ffn_up_exps.weight", (n, ffe, e), required=False),
                    TensorSpec(b + "ffn_down_exps.weight", (n, e, ffe)),
                    TensorSpec(b + "ffn_down_exps.scale", (n,), required=False)]
        if hp.n_embd_per_layer:
            out += [TensorSpec(b + "inp_gate.weight", (hp.n_embd_per_layer, e)),
                    TensorSpec(b + "proj.weight", (e, hp.n_embd_per_layer)),
                    TensorSpec(b + "post_norm.weight", (e,))]
        return out

    #: optional tensors a plain Gemma 4 file has (name endings): what plinth.testing's synthetic files hold
    plain_optional = ("output.weight", "attn_v.weight", "layer_output_scale.weight", "ffn_gate_up_exps.weight",
                      "ffn_down_exps.scale", "rope_freqs.weight")

    @staticmethod
    def unused_kv_tensors(hp: Gemma4HParams, il: int) -> list[tuple[str, tuple[int, ...]]]:
        """K/V weights of the KV-shared layer ``il`` that a checkpoint may carry and nothing reads
        (transformers ignores them on load, llama.cpp loads them optionally and never uses them)."""
        b, hd, nkv = f"blk.{il}.", hp.hd(il), hp.n_head_kv[il] * hp.hd(il)
        return [(b + "attn_k.weight", (nkv, hp.n_embd)), (b + "attn_v.weight", (nkv, hp.n_embd)),
                (b + "attn_k_norm.weight", (hd,))]

    def synthetic_tensors(self, hp: Gemma4HParams) -> list[TensorSpec]:
        unused = {n for il in range(hp.n_layer) if not hp.owns_kv(il) for n, _ in self.unused_kv_tensors(hp, il)}
        return [s for s in self.tensors(hp)
                if (s.required or s.name.endswith(self.plain_optional)) and s.name not in unused]


__all__ = ["Gemma4", "Gemma4Graph", "Gemma4HParams"]

"""MiMo-V2-Flash (``mimo2``): hybrid sliding / global attention with sinks, a value scale, MoE.

The model card, per block (transformers' ``mimo_v2_flash``; llama.cpp's ``src/models/mimo2.cpp``)::

    h = x + value_scale * o_proj(attn(rms_norm(x)))   # GQA; K heads of head_dim_k, V heads of head_dim_v
    x = h + ffn(rms_norm(h))                          # dense SwiGLU or sigmoid-routed MoE

then ``logits = lm_head(rms_norm(x))``.

* Layers are "sliding" or "full" (``attention.sliding_window_pattern``, one flag a layer). A sliding
  layer sees its ``attention.sliding_window`` most recent positions (itself included), has its own
  KV head count (twice the full layers' in the release: ``attention.head_count_kv`` per layer), its
  own RoPE base (``rope.freq_base_swa``) and attention sinks (``attn_sinks``: one logit a head that
  joins the softmax and carries no value). Full layers see every earlier position.
* RoPE (NeoX pairs) turns the first ``rope.dimension_count`` dims of each Q and K head
  (``int(head_dim_k * partial_rotary_factor)``), the rest pass through; scale ``head_dim_k^-1/2``.
* V is multiplied by ``attention.value_scale`` (0.707 in the release); applied here to the attention
  output, which is linear in V.
* FFN: a layer with ``ffn_gate_inp`` is MoE (no shared expert): sigmoid scores, the top
  ``expert_used_count`` by score + ``exp_probs_b`` (selection only; within the best
  ``expert_group_used_count`` of ``expert_group_count`` groups), weights renormalised
  (``expert_weights_norm``) and scaled (``expert_weights_scale``); else a dense SwiGLU. Which layers are
  which is the tensors' business, as in llama.cpp (the release: layer 0 dense).
* Q/K/V separate or fused (``attn_qkv``, rows Q|K|V), as llama.cpp reads them.

MTP: llama.cpp's files count ``nextn_predict_layers`` MTP blocks in ``block_count`` (3 for MiMo, with
or without their tensors); the trunk is the first ``block_count - nextn_predict_layers`` layers. An MTP
block ``il`` whose tensors the file carries is a draft head (llama.cpp's ``graph_mtp``): with the token
after position p and the trunk's residual h_p before the final norm,
``x = eh_proj([rms_norm(embed(t), enorm) ; rms_norm(h_p, hnorm)])`` (``nextn.embed_tokens`` if the
block has its own table), then a sliding-window block (attention with its sinks and the value scale,
a dense SwiGLU), and the logits ``head(rms_norm(x, shared_head_norm or layer_output_norm or
output_norm))`` (``nextn.shared_head_head`` if it has its own head). ``x`` (before that norm) is the
next step's h. The first block is the draft head "mtp" (drafter ``mtp``); later ones are heads
"mtp.1", "mtp.2".
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from plinth import ops
from plinth.errors import UserError
from plinth.graph import (KV, Architecture, BaseGraph, Batch, Cache, HParamsError, KeyReader, Linear, PerLayer, Rope,
                          Step, TensorSpec, attend, expert_tensors, seq_groups)

ARCH = "mimo2"
GATING_SIGMOID = 2  # llama.cpp's expert_gating_func for sigmoid routing (the only one MiMo uses)


@attrs.frozen
class MiMo2HParams:
    n_vocab: int
    n_embd: int
    n_layer: int  # trunk layers (block_count - nextn_predict_layers)
    n_ctx_train: int
    n_head: int
    n_head_kv: PerLayer
    head_dim_k: int
    head_dim_v: int
    n_rot: int
    norm_eps: float
    rope_base: float
    rope_base_swa: float
    swa: tuple[bool, ...]  # per block, the MTP blocks included
    sliding_window: int
    value_scale: float
    n_ff: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_group: int
    n_group_used: int
    expert_weights_scale: float
    expert_weights_norm: bool
    n_nextn: int
    roles: tuple[str, ...]


def read_hparams(r: KeyReader) -> MiMo2HParams:
    """The ``mimo2.*`` keys as llama.cpp's converter writes them."""
    n_block = r.get("block_count")
    n_nextn = r.get("nextn_predict_layers", required=False, default=0)
    n_layer = n_block - n_nextn
    if not 0 < n_layer <= n_block:
        raise HParamsError(f"{r.source}: key '{r.key('nextn_predict_layers')}' = {n_nextn} leaves no trunk layer "
                           f"of '{r.key('block_count')}' = {n_block}")
    n_head = r.get("attention.head_count")
    head_k = r.get("attention.key_length")
    pattern = list(r.get_array("attention.sliding_window_pattern", bool))
    if len(pattern) != n_block:
        raise HParamsError(f"{r.source}: key '{r.key('attention.sliding_window_pattern')}' has {len(pattern)} "
                           f"entries, expected block_count = {n_block}")
    n_rot = r.rotary_dims("rope.dimension_count", head_k)
    scaling = r.get("rope.scaling.type", str, required=False, default="none")
    if scaling != "none":
        raise HParamsError(f"{r.source}: key '{r.key('rope.scaling.type')}' = {scaling!r}: MiMo-V2-Flash uses plain "
                           "RoPE; plinth's mimo2 computes no rope scaling")
    gating = r.get("expert_gating_func", required=False, default=GATING_SIGMOID)
    if gating != GATING_SIGMOID:
        raise HParamsError(f"{r.source}: key '{r.key('expert_gating_func')}' = {gating}: mimo2 routes by sigmoid "
                           f"({GATING_SIGMOID})")
    n_expert = r.get("expert_count", required=False, default=0)
    n_used = r.get("expert_used_count", required=n_expert > 0, default=0)
    if n_expert and not 0 < n_used <= n_expert:
        raise HParamsError(f"{r.source}: key '{r.key('expert_used_count')}' = {n_used}: must be 1..{n_expert}")
    n_group = r.get("expert_group_count", required=False, default=1) or 1
    n_group_used = r.get("expert_group_used_count", required=False, default=n_group) or n_group
    if n_expert and (n_expert % n_group or not 0 < n_group_used <= n_group):
        raise HParamsError(f"{r.source}: keys '{r.key('expert_group_count')}' = {n_group} / "
                           f"'{r.key('expert_group_used_count')}' = {n_group_used} do not split {n_expert} experts")
    n_head_kv = r.get_key_or_arr("attention.head_count_kv", n_block)
    for il in range(n_layer):
        if n_head % n_head_kv[il]:
            raise HParamsError(f"{r.source}: layer {il} has {n_head_kv[il]} KV heads for {n_head} query heads "
                               f"(key '{r.key('attention.head_count_kv')}'); GQA needs a divisor")
    window = r.get("attention.sliding_window")
    swa = tuple(pattern)
    return MiMo2HParams(
        n_vocab=r.n_vocab(),
        n_embd=r.get("embedding_length"),
        n_layer=n_layer,
        n_ctx_train=r.get("context_length", required=False, default=4096),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_k,
        head_dim_v=r.get("attention.value_length", required=False, default=head_k),
        n_rot=n_rot,
        norm_eps=r.get("attention.layer_norm_rms_epsilon", float),
        rope_base=(base := r.get("rope.freq_base", float, required=False, default=10000.0)),
        rope_base_swa=r.get("rope.freq_base_swa", float, required=False, default=base),
        swa=swa,
        sliding_window=window,
        value_scale=r.get("attention.value_scale", float, required=False, default=1.0),
        n_ff=r.get("feed_forward_length", required=False, default=0),
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=r.get_key_or_arr("expert_feed_forward_length", n_block, required=n_expert > 0, default=0)[0],
        n_group=n_group,
        n_group_used=n_group_used,
        expert_weights_scale=r.get("expert_weights_scale", float, required=False, default=1.0) or 1.0,
        expert_weights_norm=r.get("expert_weights_norm", bool, required=False, default=True),
        n_nextn=n_nextn,
        roles=tuple(f"{il}: {'sliding ' + str(window) if swa[il] else 'full'}, {n_head_kv[il]} kv heads"
                    for il in range(n_layer)),
    )


# ============================================================================ tensors (per block)

def model_tensors(hp: MiMo2HParams) -> list[TensorSpec]:
    return [TensorSpec("token_embd.weight", (hp.n_vocab, hp.n_embd)),
            TensorSpec("output_norm.weight", (hp.n_embd,)),
            TensorSpec("output.weight", (hp.n_vocab, hp.n_embd), required=False)]  # absent: tied


def attention_tensors(hp: MiMo2HParams, il: int) -> list[TensorSpec]:
    """Q/K/V separate or fused (the graph takes one layout), the output, optional sinks."""
    b, e, h, kv = f"blk.{il}.", hp.n_embd, hp.n_head, hp.n_head_kv[il]
    nq, nk, nv = h * hp.head_dim_k, kv * hp.head_dim_k, kv * hp.head_dim_v
    return [TensorSpec(b + "attn_norm.weight", (e,)),
            TensorSpec(b + "attn_q.weight", (nq, e), required=False),
            TensorSpec(b + "attn_k.weight", (nk, e), required=False),
            TensorSpec(b + "attn_v.weight", (nv, e), required=False),
            TensorSpec(b + "attn_qkv.weight", (nq + nk + nv, e), required=False),
            TensorSpec(b + "attn_output.weight", (e, h * hp.head_dim_v)),
            TensorSpec(b + "attn_sinks.weight", (h,), required=False)]


def ffn_tensors(hp: MiMo2HParams, il: int) -> list[TensorSpec]:
    """Dense SwiGLU or routed experts (which one: the tensors present, as llama.cpp decides)."""
    b, e, ff = f"blk.{il}.", hp.n_embd, hp.n_ff
    specs = [TensorSpec(b + "ffn_norm.weight", (e,))]
    if ff:
        specs += [TensorSpec(b + "ffn_gate.weight", (ff, e), required=False),
                  TensorSpec(b + "ffn_up.weight", (ff, e), required=False),
                  TensorSpec(b + "ffn_down.weight", (e, ff), required=False)]
    if hp.n_expert:
        n, fe = hp.n_expert, hp.n_ff_exp
        specs += expert_tensors(b, n, fe, e, required=False) + [TensorSpec(b + "exp_probs_b.bias", (n,), required=False)]
    return specs


def mtp_tensors(hp: MiMo2HParams, il: int) -> list[TensorSpec]:
    """MTP block ``il`` (n_layer <= il < block_count): all optional (llama.cpp's files count the blocks
    without always carrying them); the graph wants all of a block's own tensors or none."""
    b, e, v = f"blk.{il}.", hp.n_embd, hp.n_vocab
    specs = attention_tensors(hp, il) + [TensorSpec(b + "ffn_norm.weight", (e,)),
                                         TensorSpec(b + "ffn_gate.weight", (hp.n_ff, e)),
                                         TensorSpec(b + "ffn_up.weight", (hp.n_ff, e)),
                                         TensorSpec(b + "ffn_down.weight", (e, hp.n_ff)),
                                         TensorSpec(b + "nextn.eh_proj.weight", (e, 2 * e)),
                                         TensorSpec(b + "nextn.enorm.weight", (e,)),
                                         TensorSpec(b + "nextn.hnorm.weight", (e,)),
                                         TensorSpec(b + "nextn.embed_tokens.weight", (v, e)),
                                         TensorSpec(b + "nextn.shared_head_head.weight", (v, e)),
                                         TensorSpec(b + "nextn.shared_head_norm.weight", (e,)),
                                         TensorSpec(b + "layer_output_norm.weight", (e,))]
    return [attrs.evolve(s, required=False) for s in specs]


#: an MTP block's own tensors (besides its attention's); the rest are optional
MTP_REQUIRED = ("attn_norm.weight", "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                "ffn_down.weight", "nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight")


# ============================================================================ graph

class MiMo2Graph(BaseGraph):
    def __init__(self, hp: MiMo2HParams, weights: Mapping[str, Any], backend: Any) -> None:
        super().__init__(hp, weights, backend)
        w, xp = self.w, self.xp
        base = [hp.rope_base_swa if swa else hp.rope_base for swa in hp.swa]
        self.rope = Rope(hp.n_rot, base, xp, mode="neox")
        self.attn_scale = float(hp.head_dim_k) ** -0.5
        self.mtp_blocks = [il for il in range(hp.n_layer, hp.n_layer + hp.n_nextn) if self.has_mtp_block(il)]
        self.qkv, self.attn_out, self.sinks, self.moe_layer, self.gate_up, self.down = [], [], [], [], [], []
        for il in range(hp.n_layer + hp.n_nextn):
            b = f"blk.{il}."
            if il >= hp.n_layer and il not in self.mtp_blocks:
                for table in (self.qkv, self.attn_out, self.sinks, self.moe_layer, self.gate_up, self.down):
                    table.append(None)
                continue
            self.qkv.append(self.qkv_linear(il))
            self.attn_out.append(Linear.stack(w, [b + "attn_output.weight"], xp))
            self.sinks.append(w.get(b + "attn_sinks.weight"))
            moe = self.ffn_kind(il) == "moe"
            self.moe_layer.append(moe)
            self.gate_up.append(None if moe else Linear.stack(w, [b + "ffn_gate.weight", b + "ffn_up.weight"], xp))
            self.down.append(None if moe else Linear.stack(w, [b + "ffn_down.weight"], xp))

    def has_mtp_block(self, il: int) -> bool:
        """Whether the file carries MTP block ``il``; half a block is refused by name."""
        b = f"blk.{il}."
        have = [b + n in self.w for n in MTP_REQUIRED]
        if any(have) and not all(have):
            raise UserError(f"missing tensor '{b}{MTP_REQUIRED[have.index(False)]}' (MTP block {il} is incomplete)")
        return all(have)

    def qkv_linear(self, il: int) -> Linear:
        """Q|K|V of layer ``il``: the fused ``attn_qkv``, or the three stacked (one layout a layer)."""
        w, b = self.w, f"blk.{il}."
        names = [b + f"attn_{t}.weight" for t in "qkv"]
        have = [n for n in names if n in w]
        if b + "attn_qkv.weight" in w and not have:
            return Linear.stack(w, [b + "attn_qkv.weight"], self.xp)
        if len(have) != 3:
            missing = [n for n in names if n not in w]
            raise UserError(f"missing tensor '{missing[0]}' (layer {il} has neither all of Q/K/V nor a fused "
                            f"'{b}attn_qkv.weight')")
        return Linear.stack(w, names, self.xp)

    def ffn_kind(self, il: int) -> str:
        """"moe" when layer ``il`` has a router, else "dense"; a layer with both or a part missing is refused."""
        w, b = self.w, f"blk.{il}."
        moe = [b + n for n in ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
                               "ffn_down_exps.weight")]
        dense = [b + n for n in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")]
        has_moe, has_dense = [n in w for n in moe], [n in w for n in dense]
        if any(has_moe) and any(has_dense):
            raise UserError(f"layer {il} has both a dense FFN ('{dense[has_dense.index(True)]}') and experts "
                            f"('{moe[has_moe.index(True)]}'); a mimo2 layer has one or the other")
        parts, have = (moe, has_moe) if any(has_moe) else (dense, has_dense)
        if not all(have):
            raise UserError(f"missing tensor '{parts[have.index(False)]}' (layer {il}'s FFN)")
        if not any(has_moe) and b + "exp_probs_b.bias" in w:
            raise UserError(f"'{b}exp_probs_b.bias' on layer {il}, whose FFN is dense (no router)")
        return "moe" if any(has_moe) else "dense"

    def layer(self, il: int, x: Any, step: Step) -> Any:
        w, eps, b = self.w, self.hp.norm_eps, f"blk.{il}."
        x = x + self.attention(il, ops.rms_norm(x, w[b + "attn_norm.weight"], eps), step)
        h = ops.rms_norm(x, w[b + "ffn_norm.weight"], eps)
        h = self.moe(il, h) if self.moe_layer[il] else self.ffn(il, h)
        h += x
        return h

    def attention(self, il: int, x: Any, step: Step) -> Any:
        """x: [n_rows, n_embd] (normed) -> [n_rows, n_embd]."""
        hp, n = self.hp, x.shape[0]
        nh, nkv, dk, dv = hp.n_head, hp.n_head_kv[il], hp.head_dim_k, hp.head_dim_v
        qkv = self.qkv[il](x)
        qk = self.rope(il, qkv[:, :(nh + nkv) * dk].reshape(n, nh + nkv, dk), step)  # Q and K heads side by side
        v = qkv[:, (nh + nkv) * dk:].reshape(n, nkv, dv)
        window = hp.sliding_window if hp.swa[il] else 0
        if self.sinks[il] is None:
            out = attend(il, qk[:, :nh], qk[:, nh:], v, step, scale=self.attn_scale, window=window)
        else:
            out = self.attend_with_sinks(il, qk[:, :nh], qk[:, nh:], v, step, window)
        out = out.reshape(n, nh * dv)
        if hp.value_scale != 1.0:
            out *= self.xp.float32(hp.value_scale)
        return self.attn_out[il](out)

    def attend_with_sinks(self, il: int, q: Any, k: Any, v: Any, step: Step, window: int) -> Any:
        """Causal attention per sequence over layer ``il``'s :class:`KV` cache, each head's sink logit in the
        softmax. q: [n, H, dk]; k: [n, Hkv, dk]; v: [n, Hkv, dv] -> [n, H, dv]."""
        kv, positions = step.cache.kv(il), step.batch.positions
        out = self.xp.empty(q.shape[:2] + (v.shape[2],), dtype=self.xp.float32)
        for seq, sel in step.groups:
            kc, vc, kpos = kv.update(seq, positions[sel], k[sel], v[sel])
            out[sel] = ops.attention(q[sel], kc, vc, q_pos=positions[sel], k_pos=kpos, scale=self.attn_scale,
                                     causal=True, sliding_window=window or None, sinks=self.sinks[il])
        return out

    def ffn(self, il: int, x: Any) -> Any:
        ff = self.hp.n_ff
        gate_up = self.gate_up[il](x)
        h = ops.silu(gate_up[:, :ff])
        h *= gate_up[:, ff:]
        return self.down[il](h)

    def moe(self, il: int, x: Any) -> Any:
        hp, w, b = self.hp, self.w, f"blk.{il}."
        route = ops.moe_route(ops.linear(x, w[b + "ffn_gate_inp.weight"]), hp.n_expert_used, score_func="sigmoid",
                              norm_topk=hp.expert_weights_norm, score_bias=w.get(b + "exp_probs_b.bias"),
                              n_group=hp.n_group, topk_group=hp.n_group_used, routed_scaling=hp.expert_weights_scale)
        return ops.moe_ffn(x, route, w[b + "ffn_gate_exps.weight"], w[b + "ffn_up_exps.weight"],
                           w[b + "ffn_down_exps.weight"], act="silu")


    # -------------------------------------------------------------- the MTP heads

    def draft_heads(self) -> dict[str, Any]:
        """The file's MTP blocks as draft heads: "mtp" (the first), "mtp.1", "mtp.2"..."""
        return {("mtp" if j == 0 else f"mtp.{j}"): MtpHead(self, il) for j, il in enumerate(self.mtp_blocks)}

    def mtp(self, il: int, batch: Batch, hidden: Any, cache: Cache) -> "MtpOutput":
        """MTP block ``il`` over its own ``cache`` (see the module docstring). Row i pairs ``batch.tokens[i]``
        (the token after position ``batch.positions[i]``) with ``hidden[i]`` [n_embd], the trunk's residual
        before the final norm at that position (or this head's own ``hidden`` output when chaining)."""
        hp, w, xp, b = self.hp, self.w, self.xp, f"blk.{il}."
        table = w.get(b + "nextn.embed_tokens.weight")
        table = self.embed_table if table is None else table
        e = ops.rms_norm(table[xp.asarray(batch.tokens)], w[b + "nextn.enorm.weight"], hp.norm_eps)
        h = ops.rms_norm(hidden, w[b + "nextn.hnorm.weight"], hp.norm_eps)
        x = ops.linear(xp.concatenate([e, h], axis=-1), w[b + "nextn.eh_proj.weight"])
        with cache.forward(batch):
            x = self.layer(il, x, Step(batch=batch, cache=cache, groups=seq_groups(batch.seq_ids)))
        norm = next((w[n] for n in (b + "nextn.shared_head_norm.weight", b + "layer_output_norm.weight",
                                    self.output_norm) if n in w))
        out = ops.rms_norm(x, norm, hp.norm_eps)
        own = w.get(b + "nextn.shared_head_head.weight")
        return MtpOutput(logits=self.head(out) if own is None else ops.linear(out, own), hidden=x)


@attrs.frozen
class MtpOutput:
    """logits: [n, n_vocab], the token after next per row; hidden: [n, n_embd], the block's output before its
    head norm (the next step's h)."""

    logits: Any
    hidden: Any


class MtpHead:
    """A draft head the core's :class:`~plinth.speculative.draft_head.HeadDrafter` drives: it reads tap
    ``n_layer`` (the trunk's residual before the final norm) and keeps one :class:`KV` for its block."""

    def __init__(self, graph: MiMo2Graph, il: int) -> None:
        self._graph, self.il = graph, il
        self.taps = (graph.hp.n_layer,)
        self.xp = graph.xp

    def new_cache(self) -> Cache:
        n = self._graph.hp.n_layer + self._graph.hp.n_nextn
        return Cache(n, self.xp, [(KV(),) if il == self.il else () for il in range(n)])

    def run(self, batch: Batch, hidden: Any, cache: Cache) -> MtpOutput:
        return self._graph.mtp(self.il, batch, hidden, cache)

    def to_numpy(self, a: Any) -> Any:
        return self._graph.backend.to_numpy(a)


class MiMo2(Architecture):
    """mimo2: MiMo-V2-Flash's text model (trunk layers; see the module docstring)."""

    name = ARCH
    graph = MiMo2Graph

    def hparams(self, r: KeyReader) -> MiMo2HParams:
        return read_hparams(r)

    def tensors(self, hp: MiMo2HParams) -> list[TensorSpec]:
        return (model_tensors(hp) + [s for il in range(hp.n_layer) for s in attention_tensors(hp, il) + ffn_tensors(hp, il)]
                + [s for il in range(hp.n_layer, hp.n_layer + hp.n_nextn) for s in mtp_tensors(hp, il)])

    def synthetic_tensors(self, hp: MiMo2HParams) -> list[TensorSpec]:
        """A plain model (what plinth.testing's synthetic files hold): separate Q/K/V, an own head, sinks on
        sliding layers, layer 0 dense and the rest MoE with a selection bias (dense throughout without
        experts), as the release."""
        def keep(s: TensorSpec) -> bool:
            if s.required or s.name == "output.weight":
                return True
            il = int(s.name.split(".")[1])
            if il >= hp.n_layer:  # an MTP block: its own tensors, separate Q/K/V and sinks (no own table or head)
                return s.name.endswith(MTP_REQUIRED + ("attn_q.weight", "attn_k.weight", "attn_v.weight",
                                                       "attn_sinks.weight", "nextn.shared_head_norm.weight"))
            moe = hp.n_expert > 0 and (il > 0 or not hp.n_ff)  # (the release: layer 0 dense)
            if s.name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight")):
                return True
            if s.name.endswith("attn_sinks.weight"):
                return hp.swa[il]
            if s.name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")):
                return not moe
            return moe  # the router, the experts and exp_probs_b
        return [s for s in self.tensors(hp) if keep(s)]


__all__ = ["ARCH", "MiMo2", "MiMo2Graph", "MiMo2HParams", "MtpHead", "MtpOutput", "read_hparams"]

"""Nemotron-H: hybrid Mamba-2 / attention / MLP / MoE decoders (``nemotron_h``, ``nemotron_h_moe``).

Every one of the ``n_layer`` blocks is a single mixer, ``x += mixer(rms_norm(x))``; what the
mixer is follows from the per-layer arrays, as in llama.cpp:

* Mamba-2 (recurrent) where ``head_count_kv(il) == 0`` and ``feed_forward_length(il) == 0``;
* attention (GQA, no positional encoding) where only ``feed_forward_length(il) == 0``;
* an FFN where ``feed_forward_length(il) > 0``: a routed MoE (sigmoid router with a score-
  correction bias, normalised top-k, routed scaling, shared expert, optional LatentMoE
  projections) when the file has experts and that layer's ``expert_used_count`` is non-zero,
  else a dense ReLU² MLP.

Per-layer experts (NVIDIA Puzzle): ``expert_feed_forward_length`` and ``expert_used_count`` are
scalar-or-array keys; ``n_ff_exp(il)`` and ``n_expert_used(il)`` read them per layer and refuse
an out-of-range layer. A layer without its own expert width uses ``n_ff(il) / n_expert_used(il)``.

Recurrent state lives in the cache (a :class:`~plinth.graph.Recurrent` kind per Mamba layer): per Mamba layer and
sequence a tuple ``(conv_state [K-1, conv_dim], ssm_state [H, P, N])`` of backend arrays, so
the speculative engine's snapshot / restore makes any drafter lossless on these models.
Weights are used in GGUF layout (a linear weight is ``[n_out, n_in]``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from plinth import ops
from plinth.errors import UserError
from plinth.graph import (KV, Architecture, BaseGraph, Batch, Cache, HParamsError, KeyReader, PerLayer, Recurrent,
                          Step, TensorSpec, attend, seq_groups)
from plinth.ops import causal_conv1d, gated_group_rms_norm, ssm_scan, ssm_step

MAMBA, ATTENTION, MLP, MOE = "mamba", "attention", "mlp", "moe"
MIXER_OF_CHAR = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}  # the hparams.pattern letters

# chunk length of the SSD prefill (an exact computation: any length gives the same result)
SSM_CHUNK = 64


# ============================================================================ hparams

@attrs.frozen
class NemotronHParams:
    arch: str
    model_type: str  # llama.cpp's size label ("120B.A12B", "75B.A9B", ..., "?B")
    pattern: str  # one char per trunk layer: M mamba, * attention, - MLP, E MoE
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ctx_train: int
    norm_eps: float
    # attention
    n_head: PerLayer
    n_head_kv: PerLayer
    head_dim: int
    head_dim_v: int
    attn_scale: float
    # FFN / MoE
    n_ff: PerLayer
    n_expert: int
    n_expert_used_arr: PerLayer  # top-k per layer (0 where the layer has no router)
    n_ff_exp_arr: PerLayer  # expert width per layer, resolved (0 where the layer has no experts)
    n_ff_shexp: PerLayer  # shared-expert width per layer (0 = no shared expert)
    moe_latent: PerLayer  # LatentMoE width per layer (0 = experts work in n_embd)
    expert_weights_norm: bool
    expert_weights_scale: float
    n_expert_group: int
    n_group_used: int
    # Mamba-2
    ssm_d_conv: int
    ssm_d_inner: int
    ssm_d_state: int
    ssm_n_head: int
    ssm_n_group: int
    # the MTP head's sub-blocks ("*E": attention then MoE), "" when the file has none
    mtp_pattern: str = ""
    # llama.cpp's layout: both sub-blocks folded into one block blk.{n_layer} (the MoE one normed by
    # post_attention_norm); else plinth's earlier layout, one block each (blk.{n_layer}, blk.{n_layer+1})
    mtp_folded: bool = False

    @property
    def n_nextn(self) -> int:
        """Number of GGUF blocks after the trunk (``nextn_predict_layers``): 1 folded, 2 split, 0 none."""
        return 1 if self.mtp_folded else len(self.mtp_pattern)

    def mtp_sublayers(self) -> list[tuple[int, str, str]]:
        """The MTP head's sub-blocks in order: (GGUF block index, mixer, pre-norm tensor suffix)."""
        n = self.n_layer
        if self.mtp_folded:
            return [(n, ATTENTION, "attn_norm.weight"), (n, MOE, "post_attention_norm.weight")]
        return [(n + j, MIXER_OF_CHAR[c], "attn_norm.weight") for j, c in enumerate(self.mtp_pattern)]

    @property
    def ssm_head_dim(self) -> int:
        return self.ssm_d_inner // self.ssm_n_head

    @property
    def ssm_conv_dim(self) -> int:
        return self.ssm_d_inner + 2 * self.ssm_n_group * self.ssm_d_state

    def _layer(self, il: int, what: str) -> int:
        if not isinstance(il, (int, np.integer)) or not 0 <= il < self.n_layer + self.n_nextn:
            extra = f" + {self.n_nextn} MTP blocks" if self.n_nextn else ""
            raise IndexError(f"{what}({il}): layer out of range (n_layer = {self.n_layer}{extra})")
        return int(il)

    def mixer(self, il: int) -> str:
        """The mixer of layer ``il`` (trunk or split MTP block; a folded MTP block reads as its MoE part)."""
        il = self._layer(il, "mixer")
        if self.mtp_folded and il == self.n_layer:
            return MOE
        return MIXER_OF_CHAR[(self.pattern + self.mtp_pattern)[il]]

    def is_recurrent(self, il: int) -> bool:
        return self.mixer(il) == MAMBA

    def n_ff_exp(self, il: int = 0) -> int:
        """Width of layer ``il``'s routed experts (raises IndexError outside 0..n_layer-1)."""
        return int(self.n_ff_exp_arr[self._layer(il, "n_ff_exp")])

    def n_expert_used(self, il: int = 0) -> int:
        """Top-k of layer ``il``'s router (raises IndexError outside 0..n_layer-1)."""
        return int(self.n_expert_used_arr[self._layer(il, "n_expert_used")])

    def moe_width(self, il: int) -> int:
        """Width the experts of layer ``il`` read and write: the latent size, or n_embd."""
        return int(self.moe_latent[il]) or self.n_embd


def model_type(arch: str, n_layer: int, n_expert_used: Sequence[int]) -> str:
    """llama.cpp's size label from the trunk: the per-layer top-k array alone tells Puzzle from Super 3.

    n_expert_used: the trunk layers' top-k (MTP blocks excluded).
    """
    if arch == "nemotron_h_moe":
        if n_layer == 52:
            return "31B.A3.5B"
        if n_layer == 88:
            return "120B.A12B" if len(set(n_expert_used)) <= 1 else "75B.A9B"
    if n_layer == 56:
        return "9B"
    return "?B"


def read_norm_eps(r: KeyReader, source: str) -> float:
    """The RMSNorm epsilon: ``attention.layer_norm_rms_epsilon``, else ``attention.layer_norm_epsilon``.

    llama.cpp's converter writes only ``layer_norm_epsilon`` for these models, and its loader
    requires that key and uses it where ``layer_norm_rms_epsilon`` is absent; plinth reads either.
    """
    rms = r.get("attention.layer_norm_rms_epsilon", float, required=False)
    plain = r.get("attention.layer_norm_epsilon", float, required=False)  # llama.cpp's MTP final LayerNorm's too
    if rms is not None:
        return rms
    if plain is not None:
        return plain
    raise HParamsError(f"{source}: missing required key '{r.key('attention.layer_norm_rms_epsilon')}' (or "
                       f"'{r.key('attention.layer_norm_epsilon')}', as llama.cpp writes it)")


def load_hparams(metadata: Mapping[str, Any], source: str, arch: str) -> NemotronHParams:
    r = KeyReader(metadata, source, arch)
    n_embd = r.get("embedding_length")
    # as in llama.cpp, block_count counts the MTP blocks too; per-layer arrays cover all of them
    n_all = r.get("block_count")
    n_nextn = r.get("nextn_predict_layers", required=False, default=0)
    if not 0 <= n_nextn < n_all:
        raise HParamsError(f"{source}: key '{r.key('nextn_predict_layers')}' = {n_nextn} must lie in "
                           f"0..{n_all - 1} ('{r.key('block_count')}' = {n_all} counts the MTP blocks too)")
    n_layer = n_all - n_nextn
    ssm = dict(
        ssm_d_conv=r.get("ssm.conv_kernel"),
        ssm_d_inner=r.get("ssm.inner_size"),
        ssm_d_state=r.get("ssm.state_size"),
        ssm_n_head=r.get("ssm.time_step_rank"),
        ssm_n_group=r.get("ssm.group_count"),
    )
    norm_eps = read_norm_eps(r, source)
    # keys llama.cpp writes that change nothing here: Nemotron-H has no positional encoding (llama.cpp's
    # converter still writes the head size as rope.dimension_count, and its graph applies no rope either),
    # and rope.scaling.finetuned is a flag for tools
    r.get("rope.dimension_count", required=False)
    r.get("rope.scaling.finetuned", bool, required=False)
    n_shared = r.get("expert_shared_count", required=False, default=1)
    if n_shared > 1:
        raise HParamsError(f"{source}: key '{r.key('expert_shared_count')}' = {n_shared}; Nemotron-H has one shared "
                           "expert (its width is expert_shared_feed_forward_length)")
    n_head = r.get_key_or_arr("attention.head_count", n_all, required=False, default=0)
    # as in llama.cpp, head_count_kv defaults to head_count (then no layer is recurrent)
    n_head_kv = r.get_key_or_arr("attention.head_count_kv", n_all, required=False, default=None)
    if n_head_kv[0] is None:
        n_head_kv = PerLayer(list(n_head), r.key("attention.head_count_kv"))
    n_ff = r.get_key_or_arr("feed_forward_length", n_all, required=False, default=0)

    n_expert = r.get("expert_count", required=False, default=0)
    # the central llama.cpp loader reads expert_used_count over every layer; optional unless experts exist
    n_used = r.get_key_or_arr("expert_used_count", n_all, required=n_expert > 0, default=0)
    ff_exp_raw = r.get_key_or_arr("expert_feed_forward_length", n_all, required=False, default=0)
    n_ff_shexp = r.get_key_or_arr("expert_shared_feed_forward_length", n_all, required=False, default=0)
    latent = r.get_key_or_arr("moe_latent_size", n_all, required=False, default=0)
    if n_expert and max(n_used) > n_expert:
        raise HParamsError(f"{source}: key '{r.key('expert_used_count')}' has a layer using {max(n_used)} "
                           f"experts, more than '{r.key('expert_count')}' = {n_expert}")

    pattern = []
    for il in range(n_all):
        if n_ff[il] == 0:
            pattern.append("M" if n_head_kv[il] == 0 else "*")
        elif n_expert > 0 and n_used[il] > 0:
            pattern.append("E")
        else:
            pattern.append("-")
    ff_exp = []
    for il in range(n_all):
        if pattern[il] != "E":
            ff_exp.append(0)
        elif ff_exp_raw[il]:
            ff_exp.append(int(ff_exp_raw[il]))
        else:  # llama.cpp's fallback for files without expert_feed_forward_length
            ff_exp.append(int(n_ff[il]) // int(n_used[il]))
    for il, c in enumerate(pattern):
        if c == "*" and n_head[il] == 0:
            raise HParamsError(f"{source}: layer {il} is an attention layer (head_count_kv > 0) but key "
                               f"'{r.key('attention.head_count')}' gives it 0 heads")

    mtp_pattern = "".join(pattern[n_layer:])
    # llama.cpp folds the head into one block that has both attention heads and experts
    folded = n_nextn == 1 and mtp_pattern == "E" and n_head_kv[n_layer] > 0
    if folded:
        mtp_pattern = "*E"
        if n_head[n_layer] == 0:
            raise HParamsError(f"{source}: the MTP block {n_layer} has KV heads but key "
                               f"'{r.key('attention.head_count')}' gives it 0 heads")
    elif n_nextn and mtp_pattern != "*E":
        raise HParamsError(f"{source}: the {n_nextn} MTP block(s) after layer {n_layer - 1} have the pattern "
                           f"{mtp_pattern!r}; a Nemotron-H MTP head is one attention block then one MoE block ('*E'), "
                           "or llama.cpp's single block with both (head_count_kv > 0 and experts)")
    attn_heads = [n_head[il] for il in range(n_all) if pattern[il] == "*"]
    default_hd = n_embd // attn_heads[0] if attn_heads else 0
    head_dim = r.get("attention.key_length", required=False, default=default_hd)
    scale = r.get("attention.scale", float, required=False, default=0.0)
    n_vocab = r.n_vocab()
    if ssm["ssm_n_head"] and ssm["ssm_d_inner"] % ssm["ssm_n_head"]:
        raise HParamsError(f"{source}: '{r.key('ssm.inner_size')}' = {ssm['ssm_d_inner']} is not a multiple of "
                           f"'{r.key('ssm.time_step_rank')}' = {ssm['ssm_n_head']} (the SSM head count)")
    if ssm["ssm_n_group"] and ssm["ssm_n_head"] % ssm["ssm_n_group"]:
        raise HParamsError(f"{source}: '{r.key('ssm.time_step_rank')}' = {ssm['ssm_n_head']} heads cannot be "
                           f"split into '{r.key('ssm.group_count')}' = {ssm['ssm_n_group']} groups")
    return NemotronHParams(
        arch=arch,
        model_type=model_type(arch, n_layer, n_used[:n_layer]),
        pattern="".join(pattern[:n_layer]),
        mtp_pattern=mtp_pattern,
        mtp_folded=folded,
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=n_layer,
        n_ctx_train=r.get("context_length"),
        norm_eps=norm_eps,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        head_dim_v=r.get("attention.value_length", required=False, default=head_dim),
        attn_scale=scale if scale else (1.0 / float(head_dim) ** 0.5 if head_dim else 1.0),
        n_ff=n_ff,
        n_expert=n_expert,
        n_expert_used_arr=n_used,
        n_ff_exp_arr=PerLayer(ff_exp, r.key("expert_feed_forward_length")),
        n_ff_shexp=n_ff_shexp,
        moe_latent=latent,
        expert_weights_norm=bool(r.get("expert_weights_norm", bool, required=False, default=False)),
        expert_weights_scale=r.get("expert_weights_scale", float, required=False, default=1.0) or 1.0,
        n_expert_group=r.get("expert_group_count", required=False, default=1) or 1,
        n_group_used=r.get("expert_group_used_count", required=False, default=0),
        **ssm,
    )


# ============================================================================ tensors

def tensor_specs(hp: NemotronHParams) -> list[TensorSpec]:
    """GGUF tensor names and numpy-order shapes, per layer mixer."""
    e, v = hp.n_embd, hp.n_vocab
    specs = [
        TensorSpec("token_embd.weight", (v, e)),
        TensorSpec("output_norm.weight", (e,)),
        TensorSpec("output.weight", (v, e), required=False),  # absent: tied to token_embd
    ]
    d_in_proj = 2 * hp.ssm_d_inner + 2 * hp.ssm_n_group * hp.ssm_d_state + hp.ssm_n_head
    blocks = [(il, hp.mixer(il)) for il in range(hp.n_layer)] + [(il, mixer) for il, mixer, _ in hp.mtp_sublayers()]
    for il, mixer in blocks:
        b = f"blk.{il}."
        if hp.mtp_folded and il == hp.n_layer and mixer == MOE:  # the folded block's second sub-block
            specs.append(TensorSpec(b + "post_attention_norm.weight", (e,)))
        else:
            specs.append(TensorSpec(b + "attn_norm.weight", (e,)))
        if hp.n_nextn and (il, mixer) == blocks[hp.n_layer]:  # the MTP head's input: eh_proj([enorm(embed); hnorm(h)])
            specs += [TensorSpec(b + "nextn.eh_proj.weight", (e, 2 * e)),
                      TensorSpec(b + "nextn.enorm.weight", (e,)),
                      TensorSpec(b + "nextn.hnorm.weight", (e,))]
        if hp.n_nextn and (il, mixer) == blocks[-1]:  # the MTP head's final norm
            specs.append(TensorSpec(b + "nextn.shared_head_norm.weight", (e,)))
        if mixer == MAMBA:
            cd, h = hp.ssm_conv_dim, hp.ssm_n_head
            specs += [
                TensorSpec(b + "ssm_in.weight", (d_in_proj, e)),
                TensorSpec(b + "ssm_in.bias", (d_in_proj,), required=False),
                TensorSpec(b + "ssm_conv1d.weight", (cd, hp.ssm_d_conv)),
                TensorSpec(b + "ssm_conv1d.bias", (cd,), required=False),
                TensorSpec(b + "ssm_dt.bias", (h,)),
                TensorSpec(b + "ssm_a", (h, 1)),
                TensorSpec(b + "ssm_d", (h, 1)),
                TensorSpec(b + "ssm_norm.weight", (hp.ssm_n_group, hp.ssm_d_inner // hp.ssm_n_group)),
                TensorSpec(b + "ssm_out.weight", (e, hp.ssm_d_inner)),
                TensorSpec(b + "ssm_out.bias", (e,), required=False),
            ]
        elif mixer == ATTENTION:
            nq, nkv = hp.n_head[il] * hp.head_dim, hp.n_head_kv[il] * hp.head_dim
            nv = hp.n_head_kv[il] * hp.head_dim_v
            specs += [
                TensorSpec(b + "attn_q.weight", (nq, e)),
                TensorSpec(b + "attn_k.weight", (nkv, e)),
                TensorSpec(b + "attn_v.weight", (nv, e)),
                TensorSpec(b + "attn_output.weight", (e, hp.n_head[il] * hp.head_dim_v)),
                TensorSpec(b + "attn_q.bias", (nq,), required=False),
                TensorSpec(b + "attn_k.bias", (nkv,), required=False),
                TensorSpec(b + "attn_v.bias", (nv,), required=False),
                TensorSpec(b + "attn_output.bias", (e,), required=False),
            ]
        elif mixer == MLP:
            ff = hp.n_ff[il]
            specs += [
                TensorSpec(b + "ffn_up.weight", (ff, e)),
                TensorSpec(b + "ffn_down.weight", (e, ff)),
                TensorSpec(b + "ffn_up.bias", (ff,), required=False),
                TensorSpec(b + "ffn_down.bias", (e,), required=False),
            ]
        else:
            n_exp, ff, m = hp.n_expert, hp.n_ff_exp(il), hp.moe_width(il)
            specs += [
                TensorSpec(b + "ffn_gate_inp.weight", (n_exp, e)),
                TensorSpec(b + "exp_probs_b.bias", (n_exp,)),
                TensorSpec(b + "ffn_up_exps.weight", (n_exp, ff, m)),
                TensorSpec(b + "ffn_down_exps.weight", (n_exp, m, ff)),
            ]
            if hp.moe_latent[il]:
                specs += [TensorSpec(b + "ffn_latent_down.weight", (m, e)),
                          TensorSpec(b + "ffn_latent_up.weight", (e, m))]
            if hp.n_ff_shexp[il]:
                sh = hp.n_ff_shexp[il]
                specs += [TensorSpec(b + "ffn_up_shexp.weight", (sh, e)),
                          TensorSpec(b + "ffn_down_shexp.weight", (e, sh))]
    return specs


# ============================================================================ graph

class NemotronHGraph(BaseGraph):
    """Forward of a Nemotron-H model: ``x += mixer(rms_norm(x))`` per layer, the mixer by ``hp.mixer(il)``."""

    def __init__(self, hp: NemotronHParams, weights: Mapping[str, Any], backend: Any) -> None:
        super().__init__(hp, weights, backend)
        xp = self.xp
        # per Mamba layer: A = -exp(A_log) [H], D [H], norm weight [d_inner]
        self.ssm = {}
        for il in range(hp.n_layer):
            if hp.is_recurrent(il):
                b = f"blk.{il}."
                self.ssm[il] = (xp.ascontiguousarray(weights[b + "ssm_a"].reshape(-1)),
                                xp.ascontiguousarray(weights[b + "ssm_d"].reshape(-1)),
                                weights[b + "ssm_norm.weight"].reshape(-1))
        self.mixers = {MAMBA: self.mamba, ATTENTION: self.attention, MLP: self.mlp, MOE: self.moe}

    def cache_layout(self) -> list[tuple[Any, ...]]:
        """Mamba layers keep a recurrent state (rollback by snapshot + replay), attention layers K/V."""
        kinds = {MAMBA: lambda: (Recurrent(),), ATTENTION: lambda: (KV(),)}
        return [kinds.get(self.hp.mixer(il), tuple)() for il in range(self.hp.n_layer)]

    def layer(self, il: int, x: Any, step: Step) -> Any:
        h = ops.rms_norm(x, self.w[f"blk.{il}.attn_norm.weight"], self.hp.norm_eps)
        return x + self.mixers[self.hp.mixer(il)](il, h, step)

    # -------------------------------------------------------------- mixers

    def mamba(self, il: int, u: Any, step: Step) -> Any:
        """Mamba-2 mixer of layer ``il``. u: [n_rows, n_embd] (normed) -> [n_rows, n_embd]."""
        hp, w, b, xp = self.hp, self.w, f"blk.{il}.", self.xp
        d_inner, h, p = hp.ssm_d_inner, hp.ssm_n_head, hp.ssm_head_dim
        g, n = hp.ssm_n_group, hp.ssm_d_state
        A, D, norm_w = self.ssm[il]
        states = step.cache.state(il)
        proj = ops.linear(u, w[b + "ssm_in.weight"], w.get(b + "ssm_in.bias"))  # [n, 2 d_inner + 2GN + H]
        z = proj[:, :d_inner]
        xbc = proj[:, d_inner:d_inner + hp.ssm_conv_dim]
        dt_raw = proj[:, d_inner + hp.ssm_conv_dim:]
        y = xp.empty((u.shape[0], d_inner), dtype=xp.float32)
        for seq, sel in step.groups:
            state = states.get(seq)
            conv_state, ssm_state = (None, None) if state is None else state
            conv = causal_conv1d(xbc[sel], w[b + "ssm_conv1d.weight"], w.get(b + "ssm_conv1d.bias"), conv_state)
            xbc_t = ops.silu(conv.y)
            t = xbc_t.shape[0]
            x = xbc_t[:, :d_inner].reshape(t, h, p)
            B = xbc_t[:, d_inner:d_inner + g * n].reshape(t, g, n)
            C = xbc_t[:, d_inner + g * n:].reshape(t, g, n)
            dt = ops.softplus(dt_raw[sel] + w[b + "ssm_dt.bias"])
            if t == 1:
                out = ssm_step(x, dt, A, B, C, D, state=ssm_state)
            else:
                out = ssm_scan(x, dt, A, B, C, D, state=ssm_state, chunk=SSM_CHUNK)
            states.set(seq, (conv.state, out.state))
            y[sel] = out.y.reshape(t, d_inner)
        y = gated_group_rms_norm(y, z, norm_w, g, hp.norm_eps)
        return ops.linear(y, w[b + "ssm_out.weight"], w.get(b + "ssm_out.bias"))

    def attention(self, il: int, x: Any, step: Step, slot: int | None = None) -> Any:
        """GQA self-attention of layer ``il`` (no positional encoding). x: [n_rows, n_embd] (normed).

        slot: the cache layer holding its K/V (default ``il``; the MTP head keeps its own cache)."""
        hp, w, b = self.hp, self.w, f"blk.{il}."
        n = x.shape[0]
        q = ops.linear(x, w[b + "attn_q.weight"], w.get(b + "attn_q.bias")).reshape(n, hp.n_head[il], hp.head_dim)
        k = ops.linear(x, w[b + "attn_k.weight"], w.get(b + "attn_k.bias")).reshape(n, hp.n_head_kv[il],
                                                                                    hp.head_dim)
        v = ops.linear(x, w[b + "attn_v.weight"], w.get(b + "attn_v.bias")).reshape(n, hp.n_head_kv[il],
                                                                                    hp.head_dim_v)
        out = attend(il if slot is None else slot, q, k, v, step, scale=hp.attn_scale)
        return ops.linear(out.reshape(n, -1), w[b + "attn_output.weight"], w.get(b + "attn_output.bias"))

    def mlp(self, il: int, x: Any, step: Step | None = None) -> Any:
        """Dense ReLU² MLP (no gate). x: [n_rows, n_embd] -> [n_rows, n_embd]."""
        w, b = self.w, f"blk.{il}."
        h = ops.relu2(ops.linear(x, w[b + "ffn_up.weight"], w.get(b + "ffn_up.bias")))
        return ops.linear(h, w[b + "ffn_down.weight"], w.get(b + "ffn_down.bias"))

    def moe(self, il: int, x: Any, step: Step | None = None) -> Any:
        """Routed ReLU² experts (+ LatentMoE projections) plus the shared expert. x: [n_rows, n_embd]."""
        hp, w, b = self.hp, self.w, f"blk.{il}."
        logits = ops.linear(x, w[b + "ffn_gate_inp.weight"])  # the router sees the full-width x
        route = ops.moe_route(logits, hp.n_expert_used(il), score_func="sigmoid", norm_topk=hp.expert_weights_norm,
                              score_bias=w[b + "exp_probs_b.bias"], n_group=hp.n_expert_group,
                              topk_group=hp.n_group_used or None, routed_scaling=hp.expert_weights_scale)
        latent = hp.moe_latent[il] > 0
        z = ops.linear(x, w[b + "ffn_latent_down.weight"]) if latent else x
        y = ops.moe_ffn(z, route, None, w[b + "ffn_up_exps.weight"], w[b + "ffn_down_exps.weight"], act="relu2")
        if latent:
            y = ops.linear(y, w[b + "ffn_latent_up.weight"])
        if hp.n_ff_shexp[il]:
            y = y + ops.relu2_mlp(x, w[b + "ffn_up_shexp.weight"], w[b + "ffn_down_shexp.weight"])
        return y

    # -------------------------------------------------------------- image input (VL models)

    def image_encoder(self, mmproj: str | None) -> Any:
        """``encode(image_path, max_rows) -> [n, n_embd]`` (numpy) with the vision tower of ``mmproj``."""
        from .vision import encode_image, load_vision_gguf

        if mmproj is None:
            raise UserError(f"{self.hp.arch}: the vision tower of a Nemotron-H VL model is its own GGUF (mmproj); "
                            "pass it with --mmproj FILE")
        tower = load_vision_gguf(mmproj)
        n_embd = self.hp.n_embd
        if tower.cfg.text_n_embd != n_embd:
            raise UserError(f"{mmproj}: the vision tower projects to width {tower.cfg.text_n_embd}, this "
                            f"{self.hp.arch} model has n_embd = {n_embd}; they are not one model")

        def encode(path: str, max_rows: int | None = None) -> Any:
            return encode_image(tower, path, n_embd, max_rows, self.hp.arch)  # host rows: the batch carries them

        return encode

    # -------------------------------------------------------------- the MTP head

    def draft_heads(self) -> dict[str, Any]:
        """The file's MTP head as the draft head "mtp" (none when the file has no MTP blocks)."""
        return {"mtp": MtpHead(self)} if self.hp.n_nextn else {}

    def mtp(self, batch: Batch, hidden: Any, cache: Cache) -> "MtpOutput":
        """The MTP head over its own ``cache`` (one :class:`KV` for its attention block).

        Row i pairs the token t_{p+1} (``batch.tokens``) with the hidden row h_p of position p
        (``batch.positions``): ``x = eh_proj([enorm(embed(t)); hnorm(h)])``, then the attention
        block and the MoE block (``x += mixer(rms_norm(x))`` each), ``shared_head_norm``, and the
        target's LM head. hidden: [n, n_embd], the target's final-normed output rows (or this
        head's own ``hidden`` output when chaining). Returns logits [n, n_vocab] for every row and
        the head's normed output [n, n_embd].
        """
        hp, w, xp = self.hp, self.w, self.xp
        il0 = hp.n_layer
        b = f"blk.{il0}.nextn."
        emb = ops.rms_norm(self.embed_table[xp.asarray(batch.tokens)], w[b + "enorm.weight"], hp.norm_eps)
        hn = ops.rms_norm(hidden, w[b + "hnorm.weight"], hp.norm_eps)
        x = ops.linear(xp.concatenate([emb, hn], axis=-1), w[b + "eh_proj.weight"])
        with cache.forward(batch):
            step = Step(batch=batch, cache=cache, groups=seq_groups(batch.seq_ids))
            for j, (il, mixer, norm) in enumerate(hp.mtp_sublayers()):
                h = ops.rms_norm(x, w[f"blk.{il}.{norm}"], hp.norm_eps)
                x = x + (self.attention(il, h, step, slot=j) if mixer == ATTENTION else self.moe(il, h))
        out = ops.rms_norm(x, w[f"blk.{il0 + hp.n_nextn - 1}.nextn.shared_head_norm.weight"], hp.norm_eps)
        return MtpOutput(logits=self.head(out), hidden=out)

    # -------------------------------------------------------------- forward

    def step(self, batch: Batch, cache: Cache) -> Step:
        """A recurrent state needs each sequence's rows in order, continuing where the state stands."""
        step = super().step(batch, cache)
        if "M" in self.hp.pattern:  # the state continues where it stands (a fresh sequence at 0)
            step.require_in_order(self.hp.arch, "recurrent state",
                                  lambda seq: cache.next_position(seq) if cache.holds_state(seq) else 0,
                                  hint="; drop rows with Cache.restore(snapshot), not seq_rm")
        else:
            step.require_in_order(self.hp.arch, "recurrent state")
        return step


# ============================================================================ the MTP draft head

@attrs.frozen
class MtpOutput:
    """logits: [n, n_vocab] — the token after next, per row; hidden: [n, n_embd] — the head's normed output."""

    logits: Any
    hidden: Any


class MtpHead:
    """The draft head "mtp" that the ``mtp`` drafter drives.

    taps: the target feature tap it reads (n_layer: the residual before the final norm);
    :meth:`target_rows` turns tapped rows into the head's input, :meth:`run` runs the head
    (:meth:`NemotronHGraph.mtp`) over a cache from :meth:`new_cache`.
    """

    def __init__(self, graph: NemotronHGraph) -> None:
        self._graph = graph
        self.n_blocks = 1  # one MTP depth of hp.n_nextn sub-blocks
        self.taps = (graph.hp.n_layer,)
        self.xp = graph.xp

    def new_cache(self) -> Cache:
        hp = self._graph.hp
        layout = [(KV(),) if mixer == ATTENTION else () for _, mixer, _ in hp.mtp_sublayers()]
        return Cache(len(layout), self.xp, layout)

    def target_rows(self, tapped: Any) -> Any:
        """Tapped residual rows [n, n_embd] -> the target's final-normed rows the head reads."""
        return self._graph.final_norm(tapped)

    def run(self, batch: Batch, hidden: Any, cache: Cache) -> MtpOutput:
        return self._graph.mtp(batch, hidden, cache)

    def to_numpy(self, a: Any) -> Any:
        return self._graph.backend.to_numpy(a)


# ============================================================================ architectures

class NemotronH(Architecture):
    """``nemotron_h``: Mamba-2 + attention + dense ReLU² MLP layers."""

    name = "nemotron_h"
    graph = NemotronHGraph

    def hparams(self, r: KeyReader) -> NemotronHParams:
        return load_hparams(r.metadata, r.source, self.name)

    def tensors(self, hp: NemotronHParams) -> list[TensorSpec]:
        return tensor_specs(hp)


class NemotronHMoE(NemotronH):
    """``nemotron_h_moe``: as nemotron_h, with routed-expert (and LatentMoE) FFN layers."""

    name = "nemotron_h_moe"


__all__ = ["MtpHead", "MtpOutput", "NemotronH", "NemotronHGraph", "NemotronHMoE", "NemotronHParams", "load_hparams",
           "model_type", "tensor_specs"]

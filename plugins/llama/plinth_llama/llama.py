"""llama (SmolLM2, Llama 2/3), qwen2 and qwen3: the plain dense pre-norm decoders.

llama, per block::

    h = x + attn(rms_norm(x))        # GQA, RoPE on interleaved pairs (the GGUF converter
                                      # permutes Q/K rows for it), 1/sqrt(head_dim) scale
    x = h + swiglu_ffn(rms_norm(h))  # down(silu(gate(h)) * up(h))

then ``logits = lm_head(rms_norm(x))``; the head is tied to ``token_embd`` when the file
has no ``output.weight``.

* qwen2: as llama with NeoX RoPE and biases on Q, K and V (and optionally on the LM head).
* qwen3: as llama with NeoX RoPE and a per-head RMSNorm on Q and K before RoPE.

What llama.cpp's loader accepts in these files, plinth reads too:

* RoPE scaling: ``rope.scaling.type`` none / linear / yarn (a factor without a type is linear;
  the old ``rope.scale_linear`` key), any other type refused by name; Llama 3.1+ files carry
  no type but ``rope_freqs.weight`` [n_rot/2], a divisor per rotary frequency (llama only).
* Optional biases on Q, K, V (all four archs); on the attention output and the FFN (llama).
* Q/K/V fused as ``attn_qkv`` (llama.cpp's converter with ``--fuse-qkv``), with its bias.
* llama with ``expert_count`` > 0 (Mixtral): each FFN routes every token to the
  ``expert_used_count`` experts of highest softmax probability (``ffn_gate_inp``), their weights
  renormalised to sum to 1, each expert a SwiGLU (``ffn_{gate,up,down}_exps``).

Weights are used in GGUF layout (a linear weight is ``[n_out, n_in]``); Q, K and V are one
stacked :class:`~plinth.graph.Linear`, and so are the FFN gate and up projections.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from plinth import ops
from plinth.errors import UserError
from plinth.graph import (DENSE_RANGES, Architecture, BaseGraph, DenseBlocks, HParamsError, KeyReader, Linear, PerLayer,
                          Rope, Step, TensorSpec, attend, expert_tensors)


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
    rope_attn_factor: float = 1.0  # multiplies cos and sin (rope.scaling.attn_factor, YaRN's magnitude)
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_ext_factor: float | None = None  # None: 1 for YaRN
    n_expert: int = 0  # > 0: every FFN is a Mixtral-style routed MoE
    n_expert_used: int = 0


#: rope.scaling.type values plinth computes (llama.cpp also has longrope: refused by name)
ROPE_SCALING_TYPES = ("none", "linear", "yarn")


def read_rope_scaling(r: KeyReader) -> dict[str, Any]:
    """The ``rope.scaling.*`` keys as llama.cpp reads them for the dense archs.

    No type and no factor: none. A factor without a type: linear (llama.cpp's default type; the
    old key ``rope.scale_linear`` is the factor when ``rope.scaling.factor`` is absent). A type
    plinth does not implement is refused by name. YaRN: ``original_context_length`` (default the
    training context), ``yarn_beta_fast`` / ``yarn_beta_slow`` / ``yarn_ext_factor`` when the file
    sets them, cos and sin scaled by ``1 + 0.1 ln(factor)`` (or, with ``yarn_attn_factor``, by that
    value, as transformers' ``attention_factor``; with ``yarn_log_multiplier`` m, by
    ``(1 + 0.1 ln f) / (1 + 0.1 m ln f)`` as llama.cpp); ``rope.scaling.attn_factor`` multiplies all.
    """
    kind = r.get("rope.scaling.type", str, required=False, default=None)
    factor = r.get("rope.scaling.factor", float, required=False, default=None)
    old = r.get("rope.scale_linear", float, required=False, default=None)
    if factor is None and old is not None:
        if not old > 0:
            raise HParamsError(f"{r.source}: key '{r.key('rope.scale_linear')}' = {old}: must be > 0")
        factor = old
    if kind is None:
        kind = "linear" if factor is not None else "none"
    if kind not in ROPE_SCALING_TYPES:
        raise HParamsError(f"{r.source}: key '{r.key('rope.scaling.type')}' = {kind!r}: plinth computes rope "
                           f"scaling {', '.join(ROPE_SCALING_TYPES)} for '{r.arch}', not {kind!r}; refusing the file "
                           "rather than computing without it")
    factor = 1.0 if factor is None else factor
    n_ctx_train = r.get("context_length", required=False, default=2048)
    r.get("rope.scaling.finetuned", bool, required=False)  # informational only
    alpha = r.get("rope.scaling.alpha", float, required=False, default=0.0)
    if alpha:
        raise HParamsError(f"{r.source}: key '{r.key('rope.scaling.alpha')}' = {alpha}: NTK-alpha rope scaling "
                           f"is not implemented for '{r.arch}'")
    attn = r.get("rope.scaling.attn_factor", float, required=False, default=1.0)
    yarn = dict(
        yarn_beta_fast=r.get("rope.scaling.yarn_beta_fast", float, required=False, default=32.0),
        yarn_beta_slow=r.get("rope.scaling.yarn_beta_slow", float, required=False, default=1.0),
        yarn_ext_factor=r.get("rope.scaling.yarn_ext_factor", float, required=False, default=None),
    )
    yarn_attn = r.get("rope.scaling.yarn_attn_factor", float, required=False, default=None)
    log_mul = r.get("rope.scaling.yarn_log_multiplier", float, required=False, default=0.0)
    if kind == "yarn" and factor > 1.0:
        ramp_mscale = 1.0 + 0.1 * math.log(factor)  # what plinth.ops.rope_freqs multiplies in for YaRN
        if yarn_attn is not None:
            attn *= yarn_attn / ramp_mscale
        elif log_mul:
            attn /= 1.0 + 0.1 * log_mul * math.log(factor)
    return dict(rope_scaling=kind, rope_factor=factor, rope_attn_factor=attn,
                rope_ctx_orig=r.get("rope.scaling.original_context_length", required=False, default=n_ctx_train),
                **yarn)


def read_hparams(r: KeyReader, **defaults: Any) -> dict[str, Any]:
    """The keys of a llama-style file, as keyword arguments of :class:`LlamaHParams`."""
    n_embd, n_layer = r.get("embedding_length"), r.get("block_count")
    n_head = r.get_key_or_arr("attention.head_count", n_layer)
    head_dim = r.get("attention.key_length", required=False, default=n_embd // n_head[0])
    value_dim = r.get("attention.value_length", required=False, default=head_dim)
    if value_dim != head_dim:
        raise HParamsError(f"{r.source}: key '{r.key('attention.value_length')}' = {value_dim} differs from the key "
                           f"length {head_dim}; '{r.arch}' needs equal key and value head sizes")
    n_expert, n_expert_used = r.expert_counts()
    return dict(
        n_vocab=r.n_vocab(),
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
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        **read_rope_scaling(r),
    )


def no_experts(r: KeyReader, hp: Any) -> Any:
    """``hp`` of an architecture whose llama.cpp graph has no MoE branch: expert keys refused by name."""
    if hp.n_expert:
        raise HParamsError(f"{r.source}: key '{r.key('expert_count')}' = {hp.n_expert}: '{r.arch}' has no "
                           "mixture-of-experts FFN (a MoE Qwen is 'qwen2moe' / 'qwen3moe')")
    return hp


def attention_tensors(hp: Any, il: int) -> list[TensorSpec]:
    """Q, K, V (separate) and the output projection of layer ``il``.

    Q/K/V are optional here because a file may hold them fused instead (``attn_qkv``, see
    :func:`optional_block_tensors`); the graph refuses a layer with neither or both.
    """
    b, e = f"blk.{il}.", hp.n_embd
    nq, nkv = hp.n_head[il] * hp.head_dim, hp.n_head_kv[il] * hp.head_dim
    return [
        TensorSpec(b + "attn_q.weight", (nq, e), required=False),
        TensorSpec(b + "attn_k.weight", (nkv, e), required=False),
        TensorSpec(b + "attn_v.weight", (nkv, e), required=False),
        TensorSpec(b + "attn_output.weight", (e, nq)),
    ]


def block_tensors(hp: Any, il: int) -> list[TensorSpec]:
    """One pre-norm attention + GLU-FFN block's tensors (dense FFN, or routed experts when n_expert > 0)."""
    b, e, ff = f"blk.{il}.", hp.n_embd, hp.n_ff[il]
    out = ([TensorSpec(b + "attn_norm.weight", (e,))] + attention_tensors(hp, il)
           + [TensorSpec(b + "ffn_norm.weight", (e,))])
    if getattr(hp, "n_expert", 0):
        return out + expert_tensors(b, hp.n_expert, ff, e)
    return out + [
        TensorSpec(b + "ffn_gate.weight", (ff, e)),
        TensorSpec(b + "ffn_up.weight", (ff, e)),
        TensorSpec(b + "ffn_down.weight", (e, ff)),
    ]


def qkv_bias_tensors(hp: Any, il: int) -> list[TensorSpec]:
    """Optional Q, K, V biases (qwen2's; a llama file may carry them too)."""
    nq, nkv = hp.n_head[il] * hp.head_dim, hp.n_head_kv[il] * hp.head_dim
    return [TensorSpec(f"blk.{il}.attn_{t}.bias", (n,), required=False) for t, n in (("q", nq), ("k", nkv), ("v", nkv))]


def fused_qkv_tensors(hp: Any, il: int) -> list[TensorSpec]:
    """The fused alternative to separate Q/K/V (llama.cpp's converter with ``--fuse-qkv``): rows Q|K|V."""
    n = (hp.n_head[il] + 2 * hp.n_head_kv[il]) * hp.head_dim
    return [TensorSpec(f"blk.{il}.attn_qkv.weight", (n, hp.n_embd), required=False),
            TensorSpec(f"blk.{il}.attn_qkv.bias", (n,), required=False)]


def linear_bias_tensors(hp: Any, il: int) -> list[TensorSpec]:
    """llama's other optional biases: attention output and the dense FFN's three projections."""
    b, e, ff = f"blk.{il}.", hp.n_embd, hp.n_ff[il]
    out = [TensorSpec(b + "attn_output.bias", (e,), required=False)]
    if not getattr(hp, "n_expert", 0):
        out += [TensorSpec(b + "ffn_gate.bias", (ff,), required=False),
                TensorSpec(b + "ffn_up.bias", (ff,), required=False),
                TensorSpec(b + "ffn_down.bias", (e,), required=False)]
    return out


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
        #: per layer (query heads, kv heads, head size), read once (a decode step asks 3 times a layer)
        self.heads = [(hp.n_head[il], hp.n_head_kv[il], hp.head_dim) for il in range(hp.n_layer)]
        #: per layer its attention and FFN norm weights
        self.norms = [(w[f"blk.{il}.attn_norm.weight"], w[f"blk.{il}.ffn_norm.weight"]) for il in range(hp.n_layer)]
        self.qkv, self.attn_out, self.gate_up, self.down = [], [], [], []
        for il in range(hp.n_layer):
            b = f"blk.{il}."
            self.qkv.append(self.qkv_linear(il))
            self.attn_out.append(with_bias(Linear.stack(w, [b + "attn_output.weight"], xp),
                                           [(w.get(b + "attn_output.bias"), hp.n_embd)], xp))
            if hp.n_expert:
                self.gate_up.append(None)
                self.down.append(None)
                continue
            ff = hp.n_ff[il]
            self.gate_up.append(with_bias(Linear.stack(w, [b + "ffn_gate.weight", b + "ffn_up.weight"], xp),
                                          [(w.get(b + "ffn_gate.bias"), ff), (w.get(b + "ffn_up.bias"), ff)], xp))
            self.down.append(with_bias(Linear.stack(w, [b + "ffn_down.weight"], xp),
                                       [(w.get(b + "ffn_down.bias"), hp.n_embd)], xp))
        #: the host fast path of a block (one compiled call a layer), for the graphs whose layer has a form the
        #: call takes (:meth:`fused_form`); None for the others (MoE, a layer a subclass changed)
        form = self.fused_form() if not hp.n_expert and xp is np else None
        self.fused = DenseBlocks(self, **form) if form is not None else None

    def fused_form(self) -> dict[str, Any] | None:
        """The :class:`plinth.graph.DenseBlocks` form of this graph's layer (its keywords), or None where the
        call does not compute it: a subclass that changed the layer, its attention, FFN or Q/K norm."""
        return {} if _own(type(self), LlamaGraph, ("layer", "attention", "ffn", "qk_norm")) else None

    def fused_norms(self, il: int) -> tuple[Any, Any, Any, Any]:
        """Layer ``il``'s Q-norm, K-norm, post-attention and post-FFN norm weights for the fused call (None:
        the layer has none)."""
        return None, None, None, None

    def qkv_linear(self, il: int) -> Linear:
        """Q|K|V of layer ``il`` as one Linear: the separate projections stacked, or the fused ``attn_qkv``.

        A file holds one layout or the other (llama.cpp's loader takes ``attn_qkv`` when present and
        then refuses separate ones as surplus). plinth's synthetic test files hold every declared
        tensor, so with both present the separate projections are used.
        """
        w, xp, b = self.w, self.xp, f"blk.{il}."
        names = [b + f"attn_{t}.weight" for t in "qkv"]
        have = [n for n in names if n in w]
        fused = b + "attn_qkv.weight"
        if fused in w and not have:
            biases = [b + "attn_qkv.bias"] if b + "attn_qkv.bias" in w else self.qkv_bias_names(b)
            return Linear.stack(w, [fused], xp, bias=biases)
        if len(have) != 3:
            missing = [n for n in names if n not in w]
            raise UserError(f"missing tensor '{missing[0]}' (layer {il} has neither all of Q/K/V nor a fused "
                            f"'{fused}')")
        return Linear.stack(w, names, xp, bias=self.qkv_bias_names(b))

    def qkv_bias_names(self, b: str) -> list[str]:
        """The Q, K and V biases of block ``b`` (all three or none)."""
        names = [b + f"attn_{t}.bias" for t in "qkv"]
        have = [n for n in names if n in self.w]
        if have and len(have) != 3:
            raise UserError(f"{', '.join(have)} without the other Q/K/V biases (all three or none)")
        return names if have else []

    def make_rope(self) -> Rope:
        hp = self.hp
        return Rope(hp.n_rot, [hp.rope_base] * hp.n_layer, self.xp, mode=self.rope_mode, **rope_scaling_args(hp),
                    freq_factors=self.w.get("rope_freqs.weight"))

    def qk_norm(self, il: int, qk: Any) -> Any:
        return qk

    def layer(self, il: int, x: Any, step: Step) -> Any:
        if self.fused is not None:
            out = self.fused.block(il, x, step)
            if out is not None:  # (the same bits as the lines below)
                return out
        attn_norm, ffn_norm = self.norms[il]
        eps = self.hp.norm_eps
        x = x + self.attention(il, ops.rms_norm(x, attn_norm, eps), step)
        h = ops.rms_norm(x, ffn_norm, eps)
        h = self.moe(il, h) if self.hp.n_expert else self.ffn(il, h)
        h += x
        return h

    def attention(self, il: int, x: Any, step: Step, window: int = 0, soft_cap: float | None = None) -> Any:
        """Self-attention of layer ``il``. x: [n_rows, n_embd] (normed) -> [n_rows, n_embd]."""
        n = x.shape[0]
        n_head, n_head_kv, hd = self.heads[il]
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

    def moe(self, il: int, x: Any) -> Any:
        """Mixtral-style routed FFN. x: [n, n_embd] -> [n, n_embd].

        Softmax over all experts' router logits, the ``n_expert_used`` best, their weights
        renormalised to sum to 1 (llama.cpp's llama MoE branch; transformers' Mixtral block).
        """
        w, b = self.w, f"blk.{il}."
        route = ops.moe_route(ops.linear(x, w[b + "ffn_gate_inp.weight"]), self.hp.n_expert_used,
                              score_func="softmax", norm_topk=True)
        return ops.moe_ffn(x, route, w[b + "ffn_gate_exps.weight"], w[b + "ffn_up_exps.weight"],
                           w[b + "ffn_down_exps.weight"], act="silu")


def rope_scaling_args(hp: Any) -> dict[str, Any]:
    """The :class:`~plinth.graph.Rope` keywords of ``hp``'s rope scaling."""
    return dict(scaling=hp.rope_scaling, factor=hp.rope_factor, n_ctx_orig=hp.rope_ctx_orig,
                beta_fast=hp.yarn_beta_fast, beta_slow=hp.yarn_beta_slow, ext_factor=hp.yarn_ext_factor,
                attn_factor=hp.rope_attn_factor)


def _own(cls: type, base: type, names: Sequence[str]) -> bool:
    """Whether ``cls`` takes each method of ``names`` from ``base`` (no subclass between them replaced it)."""
    return all(getattr(cls, n) is getattr(base, n) for n in names)


def with_bias(lin: Linear, parts: list[tuple[Any, int]], xp: Any) -> Linear:
    """``lin`` with a bias made of ``parts`` ((vector or None, size) per stacked output; None: zeros)."""
    if all(p is None for p, _ in parts):
        return lin
    bias = xp.concatenate([xp.zeros(n, dtype=xp.float32) if p is None else xp.asarray(p, dtype=xp.float32)
                           for p, n in parts])
    return attrs.evolve(lin, bias=bias)


class Qwen2Graph(LlamaGraph):
    rope_mode = "neox"

    def __init__(self, hp: Any, weights: Mapping[str, Any], backend: Any, **kw: Any) -> None:
        super().__init__(hp, weights, backend, **kw)
        if "output.bias" in self.w:  # an LM head bias (llama.cpp's qwen2 reads one when present)
            head = self.head
            bias = self.xp.asarray(self.w["output.bias"], dtype=self.xp.float32)
            self.head = attrs.evolve(head, linear=attrs.evolve(head.linear, bias=bias))


class Qwen3Graph(LlamaGraph):
    rope_mode = "neox"

    def fused_form(self) -> dict[str, Any] | None:
        ok = _own(type(self), LlamaGraph, ("layer", "attention", "ffn")) and _own(type(self), Qwen3Graph, ("qk_norm",))
        return {"qk_norm": True} if ok else None

    def fused_norms(self, il: int) -> tuple[Any, Any, Any, Any]:
        b = f"blk.{il}."
        return self.w[b + "attn_q_norm.weight"], self.w[b + "attn_k_norm.weight"], None, None

    def qk_norm(self, il: int, qk: Any) -> Any:
        """Per-head RMSNorm of Q and K, each with its own weight [head_dim]."""
        w, b, n_head = self.w, f"blk.{il}.", self.hp.n_head[il]
        qk = ops.head_rms_norm(qk, None, self.hp.norm_eps)
        qk[:, :n_head] *= w[b + "attn_q_norm.weight"]
        qk[:, n_head:] *= w[b + "attn_k_norm.weight"]
        return qk


class Llama(Architecture):
    """llama: dense, or Mixtral-style MoE when ``expert_count`` > 0. Optional tensors as llama.cpp reads
    them: ``rope_freqs.weight`` (Llama 3.1+ per-frequency divisors), Q/K/V biases or a fused
    ``attn_qkv``, biases on the attention output and the FFN projections."""

    name = "llama"
    ranges = DENSE_RANGES  # every layer is attention + FFN: 0 heads or an empty FFN is refused by name
    graph = LlamaGraph

    def hparams(self, r: KeyReader) -> LlamaHParams:
        return LlamaHParams(**read_hparams(r))

    def tensors(self, hp: LlamaHParams) -> list[TensorSpec]:
        # the optional tensors follow all the others (the seeded test weights of the rest keep their values)
        return (model_tensors(hp) + [s for il in range(hp.n_layer) for s in self.layer_tensors(hp, il)]
                + self.optional_tensors(hp))

    def layer_tensors(self, hp: Any, il: int) -> list[TensorSpec]:
        return block_tensors(hp, il)

    def synthetic_tensors(self, hp: Any) -> list[TensorSpec]:
        """The tensors of a plain model of this architecture (what plinth.testing's synthetic files hold):
        every required one, the separate Q/K/V, the untied head and :attr:`plain_optional`, in declaration
        order; not the fused QKV, the rope factors or the optional biases."""
        keep = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "output.weight") + self.plain_optional
        return [s for s in self.tensors(hp) if s.required or s.name.endswith(keep)]

    #: optional tensors a plain model of the architecture has (name endings)
    plain_optional: tuple[str, ...] = ()

    def optional_tensors(self, hp: Any) -> list[TensorSpec]:
        return ([TensorSpec("rope_freqs.weight", (hp.n_rot // 2,), required=False)]
                + [s for il in range(hp.n_layer)
                   for s in qkv_bias_tensors(hp, il) + fused_qkv_tensors(hp, il) + linear_bias_tensors(hp, il)])


class Qwen2(Llama):
    name = "qwen2"
    graph = Qwen2Graph
    plain_optional = ("attn_q.bias", "attn_k.bias", "attn_v.bias")

    def hparams(self, r: KeyReader) -> LlamaHParams:
        return no_experts(r, LlamaHParams(**read_hparams(r)))

    def layer_tensors(self, hp: Any, il: int) -> list[TensorSpec]:
        return block_tensors(hp, il) + qkv_bias_tensors(hp, il)

    def optional_tensors(self, hp: Any) -> list[TensorSpec]:
        return ([TensorSpec("output.bias", (hp.n_vocab,), required=False)]
                + [s for il in range(hp.n_layer) for s in fused_qkv_tensors(hp, il)])


class Qwen3(Llama):
    name = "qwen3"
    graph = Qwen3Graph

    def hparams(self, r: KeyReader) -> LlamaHParams:
        return no_experts(r, LlamaHParams(**read_hparams(r)))

    def layer_tensors(self, hp: Any, il: int) -> list[TensorSpec]:
        return block_tensors(hp, il) + [TensorSpec(f"blk.{il}.attn_{t}_norm.weight", (hp.head_dim,)) for t in "qk"]

    def optional_tensors(self, hp: Any) -> list[TensorSpec]:
        return [s for il in range(hp.n_layer) for s in qkv_bias_tensors(hp, il) + fused_qkv_tensors(hp, il)]


__all__ = ["Llama", "LlamaGraph", "LlamaHParams", "Qwen2", "Qwen3"]

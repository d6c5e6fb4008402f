"""gemma3: a dense decoder with sliding-window layers and sandwich norms.

Per block (GGUF stores Gemma's norm weights with the +1 already added)::

    h = x + post_attn_norm(attn(attn_norm(x)))    # per-head RMSNorm on Q and K, NeoX RoPE
    x = h + post_ffw_norm(geglu_ffn(ffn_norm(h)))  # down(gelu_tanh(gate(h)) * up(h))

* Input embeddings are scaled by sqrt(n_embd); the LM head is tied to them.
* Sliding-window layers attend within ``attention.sliding_window`` and use the local RoPE
  base (``rope.freq_base_swa``, 10000 when absent); the others are global with
  ``rope.freq_base``. Which layers slide: ``attention.sliding_window_pattern``, per layer
  (bools, true = sliding) or a period n (layer il slides when il % n < n - 1; 0 = all), as
  llama.cpp reads it; absent, the period is 6 (five sliding layers, then a global one).
  ``rope.scaling.*`` applies to the global layers only.
* Optional soft-capping of attention scores and final logits when the file sets it.
* Attention scale 1/sqrt(head_dim), except the 62-layer (27B) model, which was trained
  with 1/sqrt(n_embd / n_head) (its query_pre_attn_scalar; GGUF has no key for it).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from plinth import ops
from plinth.graph import HParamsError, KeyReader, PerLayer, Rope, Step, TensorSpec, embed_rows

from .llama import LlamaGraph, LlamaHParams, Qwen3Graph, Qwen3, _own, no_experts, read_hparams, rope_scaling_args

SWA_PERIOD = 6  # without attention.sliding_window_pattern: layers il with il % 6 < 5 use the sliding window


@attrs.frozen
class Gemma3HParams(LlamaHParams):
    sliding_window: PerLayer = PerLayer([], "sliding_window")  # per layer, 0 = global attention
    rope_base_local: float = 10000.0
    attn_scale: float = 0.0
    final_softcap: float = 0.0
    attn_softcap: float = 0.0


class Gemma3Graph(Qwen3Graph):  # Q/K norms and NeoX RoPE as qwen3
    def __init__(self, hp: Gemma3HParams, weights: Mapping[str, Any], backend: Any) -> None:
        super().__init__(hp, weights, backend, softcap=hp.final_softcap)
        self.attn_scale = hp.attn_scale

    def make_rope(self) -> Rope:
        hp = self.hp
        local = [w > 0 for w in hp.sliding_window]
        return Rope(hp.n_rot, [hp.rope_base_local if s else hp.rope_base for s in local], self.xp, mode="neox",
                    scaled=[not s for s in local], **rope_scaling_args(hp))

    def embed(self, batch: Any) -> Any:
        return embed_rows(self.embed_table, batch, self.xp, scale=float(self.hp.n_embd) ** 0.5)

    def fused_form(self) -> dict[str, Any] | None:
        hp = self.hp
        ok = (type(self).layer is Gemma3Graph.layer and _own(type(self), LlamaGraph, ("attention", "ffn"))
              and _own(type(self), Qwen3Graph, ("qk_norm",)) and not hp.attn_softcap)
        return {"qk_norm": True, "post_norms": True, "act": "gelu", "windows": list(hp.sliding_window)} if ok else None

    def fused_norms(self, il: int) -> tuple[Any, Any, Any, Any]:
        b = f"blk.{il}."
        return (*super().fused_norms(il)[:2], self.w[b + "post_attention_norm.weight"],
                self.w[b + "post_ffw_norm.weight"])

    def layer(self, il: int, x: Any, step: Step) -> Any:
        if self.fused is not None:
            out = self.fused.block(il, x, step)
            if out is not None:  # (the same bits as the lines below)
                return out
        hp, w, eps, b = self.hp, self.w, self.hp.norm_eps, f"blk.{il}."
        h = self.attention(il, ops.rms_norm(x, w[b + "attn_norm.weight"], eps), step,
                           window=hp.sliding_window[il], soft_cap=hp.attn_softcap or None)
        x = x + ops.rms_norm(h, w[b + "post_attention_norm.weight"], eps)
        h = self.ffn(il, ops.rms_norm(x, w[b + "ffn_norm.weight"], eps), act=ops.gelu)
        h = ops.rms_norm(h, w[b + "post_ffw_norm.weight"], eps)
        h += x
        return h


class Gemma3(Qwen3):  # qwen3's tensors (Q/K norms) plus the post-norms
    name = "gemma3"
    graph = Gemma3Graph

    def hparams(self, r: KeyReader) -> Gemma3HParams:
        kw = read_hparams(r, norm_eps=1e-6, rope_base=1_000_000.0)
        no_experts(r, LlamaHParams(**kw))
        n_layer = kw["n_layer"]
        window = r.get("attention.sliding_window", required=False, default=0)
        is_swa = [window > 0 and s for s in sliding_layers(r, n_layer)]
        head_dim = kw["head_dim"] if n_layer != 62 else kw["n_embd"] // kw["n_head"][0]  # 27B: see above
        return Gemma3HParams(
            **kw,
            sliding_window=PerLayer([window if s else 0 for s in is_swa], r.key("attention.sliding_window")),
            rope_base_local=r.get("rope.freq_base_swa", float, required=False, default=10_000.0),
            attn_scale=1.0 / float(head_dim) ** 0.5,
            final_softcap=r.get("final_logit_softcapping", float, required=False, default=0.0),
            attn_softcap=r.get("attn_logit_softcapping", float, required=False, default=0.0),
        )

    def layer_tensors(self, hp: Gemma3HParams, il: int) -> list[TensorSpec]:
        return super().layer_tensors(hp, il) + [TensorSpec(f"blk.{il}.{n}.weight", (hp.n_embd,))
                                                for n in ("post_attention_norm", "post_ffw_norm")]


def sliding_layers(r: KeyReader, n_layer: int) -> list[bool]:
    """Per layer, whether it uses the sliding window (``attention.sliding_window_pattern``, see the module)."""
    key = r.key("attention.sliding_window_pattern")
    value = r.metadata.get(key)
    if value is None:
        period = SWA_PERIOD
    else:
        value = value.tolist() if hasattr(value, "tolist") else value
        if isinstance(value, (list, tuple)):
            if len(value) != n_layer or not all(isinstance(v, (bool, int)) for v in value):
                raise HParamsError(f"{r.source}: key '{key}' must hold {n_layer} booleans (one per layer), "
                                   f"got {len(value)} values")
            return [bool(v) for v in value]
        period = r.get("attention.sliding_window_pattern", required=False)
        if period < 0:
            raise HParamsError(f"{r.source}: key '{key}' = {period}: a period must be >= 0")
    return [period == 0 or il % period < period - 1 for il in range(n_layer)]

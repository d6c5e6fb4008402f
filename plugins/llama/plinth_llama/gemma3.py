"""gemma3: a dense decoder with sliding-window layers and sandwich norms.

* Input embeddings are scaled by sqrt(n_embd).
* Each block normalises before and after attention and before and after the FFN
  (GGUF stores Gemma's norm weights with the +1 already added).
* Per-head RMSNorm on Q and K; NeoX RoPE; GeGLU FFN (tanh GELU).
* Five of every six layers attend within ``attention.sliding_window`` and use the
  local RoPE base (``rope.freq_base_swa``, 10000 when absent); every sixth layer is
  global with ``rope.freq_base``.
* Optional soft-capping of attention scores and final logits when the file sets it.
* ``rope.scaling.*`` applies to the global layers only (the local ones keep plain RoPE).
* Attention scale 1/sqrt(head_dim), except the 62-layer (27B) model, which was trained
  with 1/sqrt(n_embd / n_head) (its query_pre_attn_scalar; GGUF has no key for it).
"""

from __future__ import annotations

from typing import Any, Mapping

from plinth.hparams import KeyReader, PerLayer
from plinth.tensors import TensorSpec

from .decoder import DecoderGraph, DecoderHParams, read_common, tensor_specs

SWA_PERIOD = 6  # layers il with il % 6 < 5 use the sliding window


class Gemma3:
    name = "gemma3"

    def load_hparams(self, metadata: Mapping[str, Any], source: str) -> DecoderHParams:
        kw = read_common(metadata, source, self.name)
        r = KeyReader(metadata, source, self.name)
        n_layer = kw["n_layer"]
        window = r.get("attention.sliding_window", required=False, default=0)
        is_swa = [window > 0 and il % SWA_PERIOD < SWA_PERIOD - 1 for il in range(n_layer)]
        base_global = r.get("rope.freq_base", float, required=False, default=1_000_000.0)
        base_local = r.get("rope.freq_base_swa", float, required=False, default=10_000.0)
        kw.update(
            rope_mode="neox",
            act="gelu",
            qk_norm=True,
            post_norms=True,
            embd_scale=float(kw["n_embd"]) ** 0.5,
            norm_eps=r.get("attention.layer_norm_rms_epsilon", float, required=False, default=1e-6),
            sliding_window=PerLayer([window if s else 0 for s in is_swa], f"{self.name}.attention.sliding_window"),
            rope_base=PerLayer([base_local if s else base_global for s in is_swa], f"{self.name}.rope.freq_base"),
            final_softcap=r.get("final_logit_softcapping", float, required=False, default=0.0),
            attn_softcap=r.get("attn_logit_softcapping", float, required=False, default=0.0),
            rope_scaled=PerLayer([not s for s in is_swa], f"{self.name}.rope.scaling.type"),
        )
        if n_layer == 62:  # Gemma-3 27B
            kw["attn_scale"] = 1.0 / (kw["n_embd"] / kw["n_head"][0]) ** 0.5
        return DecoderHParams(**kw)

    def tensor_specs(self, hparams: DecoderHParams) -> list[TensorSpec]:
        return tensor_specs(hparams)

    def build(self, hparams: DecoderHParams, weights: Mapping[str, Any], backend: Any) -> DecoderGraph:
        return DecoderGraph(hparams, weights, backend)

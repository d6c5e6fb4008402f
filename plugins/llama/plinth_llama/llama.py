"""llama (SmolLM2, Llama 2/3), qwen2 and qwen3: the plain dense decoders.

* llama: RMSNorm, RoPE on interleaved pairs (the GGUF converter permutes Q/K for it),
  SwiGLU, optional tied LM head.
* qwen2: as llama with NeoX RoPE and biases on Q, K and V.
* qwen3: as llama with NeoX RoPE and a per-head RMSNorm on Q and K before RoPE.
"""

from __future__ import annotations

from typing import Any, Mapping


from plinth.tensors import TensorSpec

from .decoder import DecoderGraph, DecoderHParams, read_common, tensor_specs


class Llama:
    name = "llama"
    rope_mode = "normal"
    extra: dict[str, Any] = {}

    def load_hparams(self, metadata: Mapping[str, Any], source: str) -> DecoderHParams:
        kw = read_common(metadata, source, self.name)
        kw.update(rope_mode=self.rope_mode, **self.extra)
        return DecoderHParams(**kw)

    def tensor_specs(self, hparams: DecoderHParams) -> list[TensorSpec]:
        return tensor_specs(hparams)

    def build(self, hparams: DecoderHParams, weights: Mapping[str, Any], backend: Any) -> DecoderGraph:
        return DecoderGraph(hparams, weights, backend)


class Qwen2(Llama):
    name = "qwen2"
    rope_mode = "neox"
    extra = {"qkv_bias": True}


class Qwen3(Llama):
    name = "qwen3"
    rope_mode = "neox"
    extra = {"qk_norm": True}


__all__ = ["Llama", "Qwen2", "Qwen3"]

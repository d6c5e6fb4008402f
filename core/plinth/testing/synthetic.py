"""Tiny synthetic GGUF files for any architecture, from a few metadata keys.

The architecture's own plugin says which tensors to write (its hparams and
tensor-spec steps), so the same writer serves every plugin::

    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "qwen3", tiny_metadata("qwen3"), registry)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np


def tiny_metadata(arch: str, *, n_vocab: int = 96, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
                  n_head_kv: int = 2, n_ff: int = 96, n_ctx: int = 256, **extra: Any) -> dict[str, Any]:
    """Metadata of a tiny dense decoder; ``extra`` adds ``{arch}.KEY`` entries (dots as ``__``)."""
    md: dict[str, Any] = {
        "general.architecture": arch,
        "general.name": f"tiny-{arch}",
        f"{arch}.vocab_size": n_vocab,
        f"{arch}.embedding_length": n_embd,
        f"{arch}.block_count": n_layer,
        f"{arch}.attention.head_count": n_head,
        f"{arch}.attention.head_count_kv": n_head_kv,
        f"{arch}.feed_forward_length": n_ff,
        f"{arch}.context_length": n_ctx,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
    }
    for key, value in extra.items():
        md[f"{arch}.{key.replace('__', '.')}"] = value
    return md


def byte_vocab(eos: str = "<|end|>") -> dict[str, Any]:
    """Tokenizer metadata of a byte-level BPE vocabulary without merges: 256 byte tokens plus an end token.

    Merge it into ``tiny_metadata(..., n_vocab=257)`` to get a tiny model that
    ``Model.tokenizer`` and the generation loop can use.
    """
    from ..tokenizer.core import _BYTE_TO_CHAR

    tokens = [_BYTE_TO_CHAR[b] for b in range(256)] + [eos]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 256 + [3],
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": 256,
    }


def random_tensors(specs: Iterable[Any], seed: int = 0, scale: float = 0.2) -> dict[str, np.ndarray]:
    """Random float32 weights for ``specs``; norm weights (1-D) centred on 1."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in specs:
        shape = tuple(spec.shape)
        if len(shape) == 1 and spec.name.endswith("norm.weight"):
            out[spec.name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[spec.name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def write_gguf(path: str | Path, metadata: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
               qtypes: Mapping[str, Any] | None = None) -> Path:
    """Write ``metadata`` and ``tensors`` (numpy order); see :func:`plinth.convert.write_gguf`."""
    from ..convert import write_gguf as _write

    return _write(path, metadata, tensors, qtypes)


def write_synthetic_gguf(path: str | Path, arch: str, metadata: Mapping[str, Any], registry: Any, *,
                         seed: int = 0, scale: float = 0.2, drop: Iterable[str] = (),
                         qtypes: Mapping[str, Any] | None = None) -> Path:
    """A random model of ``arch``: the plugin declares the tensors, this writes them.

    ``drop`` leaves tensors out (to test missing-tensor errors; optional tensors
    such as a tied ``output.weight`` are written unless dropped). An architecture whose
    declaration holds alternatives (fused or separate Q/K/V) or optional extras that change
    what it computes (biases, rope factors) may define ``synthetic_tensors(hparams)``: the
    specs of its plain model, written instead of all of ``tensor_specs``.
    """
    hparams = registry.arch_hparams(arch, metadata, str(path))
    tensors = random_tensors(synthetic_specs(registry, arch, hparams), seed=seed, scale=scale)
    for name in drop:
        tensors.pop(name, None)
    return write_gguf(path, metadata, tensors, qtypes)


def synthetic_specs(registry: Any, arch: str, hparams: Any) -> list[Any]:
    """The tensor specs of ``arch``'s plain model: its ``synthetic_tensors(hparams)`` where it defines
    one (no alternative layouts, no optional extras), else every declared spec."""
    plain = getattr(registry.architecture(arch), "synthetic_tensors", None)
    if plain is not None:
        return list(plain(hparams))
    return list(registry.arch_tensors(arch, hparams))


def quantized_rows(type_name: str, n_out: int, n_in: int, seed: int = 0) -> np.ndarray:
    """A ``[n_out, row_bytes]`` uint8 tensor of GGUF type ``type_name`` (test and benchmark weights for
    the quantized kernels): gguf-py's quantizer applied to standard-normal values where it has one,
    else random blocks with O(1) f16 scales (gguf-py cannot quantize the K-quants)."""
    import gguf

    from ..gguf.constants import BLOCK_SIZES, GGMLType

    rng = np.random.default_rng(seed)
    values = rng.standard_normal((n_out, n_in)).astype(np.float32)
    try:
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])
    except NotImplementedError:
        pass
    qk, size = BLOCK_SIZES[GGMLType[type_name]]
    raw = rng.integers(0, 256, (n_out, n_in // qk * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    scales = (rng.random((blocks.shape[0], 2)) * 0.5 + 0.05).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":  # its d ends the block
        blocks[:, 208:210] = scales[:, 0:2]
    else:  # d and dmin lead the block
        blocks[:, 0:4] = scales
    return raw

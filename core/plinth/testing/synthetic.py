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


def random_blocks(type_name: str, n_out: int, n_in: int, seed: int = 0, d: float = 4e-4) -> np.ndarray:
    """A ``[n_out, row_bytes]`` uint8 tensor of GGUF type ``type_name`` made of random blocks, without the float
    values :func:`quantized_rows` starts from (a billion-parameter benchmark file in seconds): random quants
    and sub-block scales, each block's f16 ``d`` (and ``dmin``) uniform in ``[d / 2, d]`` (Q6_K: in ``[d / 40,
    d / 20]``, f16 subnormals as nearly all of a real Q6_K file's d are, its signed sub-block scales reaching
    127 where Q4_K's reach 63: the default gives values of mean magnitude ~0.07 for Q4_K and ~0.02 for Q6_K,
    a trained model's order). Any block type whose ``d`` leads the block or ends it as Q6_K's does."""
    from ..gguf.constants import BLOCK_SIZES, GGMLType

    qk, size = BLOCK_SIZES[GGMLType[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_out, n_in // qk * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    d = d / 20 if type_name == "Q6_K" else d
    scales = rng.uniform(d / 2, d, (blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":
        blocks[:, 208:210] = scales[:, 0:2]
    elif type_name in ("Q4_K", "Q5_K", "Q2_K", "Q4_1", "Q5_1"):  # d and dmin (or m) lead the block
        blocks[:, 0:4] = scales
    else:
        blocks[:, 0:2] = scales[:, 0:2]
    return raw


def q4_k_m_types(n_layer: int) -> dict[str, str]:
    """llama.cpp's Q4_K_M mix for a llama model (``llama-quant.cpp``): Q4_K throughout, Q6_K for the output
    head and for ``attn_v`` / ``ffn_down`` of the layers its ``use_more_bits`` picks (the first and last
    eighth, and every third between); tensor name -> type name (the 1-D norms stay F32)."""
    def more(i: int) -> bool:
        return i < n_layer // 8 or i >= 7 * n_layer // 8 or (i - n_layer // 8) % 3 == 2

    out = {"token_embd.weight": "Q4_K", "output.weight": "Q6_K"}
    for il in range(n_layer):
        b = f"blk.{il}."
        for t in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            out[b + t + ".weight"] = "Q4_K"
        for t in ("attn_v", "ffn_down"):
            out[b + t + ".weight"] = "Q6_K" if more(il) else "Q4_K"
    return out


def spm_vocab(n_vocab: int) -> dict[str, Any]:
    """Tokenizer metadata of a SentencePiece-style ("llama") vocabulary of ``n_vocab`` tokens: ``<unk>``,
    ``<s>``, ``</s>``, the 256 byte tokens, then made-up pieces ``▁t<i>`` (what a synthetic llama model
    needs for llama.cpp to load it)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(n_vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (n_vocab - 259)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(n_vocab - 259)],
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}


#: a ~1.1B-parameter llama shape (TinyLlama-1.1B's: hidden 2048, 22 layers, 32 query / 4 kv heads, FFN 5632)
LLAMA_1B = dict(n_vocab=32000, n_embd=2048, n_layer=22, n_head=32, n_head_kv=4, n_ff=5632, n_ctx=2048)


def write_quantized_llama(path: str | Path, types: Mapping[str, str] | None = None, *, seed: int = 0,
                          **shape: int) -> Path:
    """A random llama model in block-quantized types: ``shape`` as :func:`tiny_metadata` takes it (default
    :data:`LLAMA_1B`), ``types`` tensor name -> GGUF type name (default :func:`q4_k_m_types`, llama.cpp's
    Q4_K_M mix), blocks from :func:`random_blocks`, norms near 1, an untied head and an SPM vocabulary:
    a file both plinth and llama.cpp load, for speed comparisons on model shapes no shipped model has."""
    import gguf

    dims = dict(LLAMA_1B, **shape)
    md = tiny_metadata("llama", **dims)
    md["llama.attention.layer_norm_rms_epsilon"] = 1e-5
    md["llama.rope.dimension_count"] = dims["n_embd"] // dims["n_head"]
    md["general.file_type"] = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    md.update(spm_vocab(dims["n_vocab"]))
    types = dict(types) if types is not None else q4_k_m_types(dims["n_layer"])
    e, ff, hd = dims["n_embd"], dims["n_ff"], dims["n_embd"] // dims["n_head"]
    shapes = {"token_embd.weight": (dims["n_vocab"], e), "output.weight": (dims["n_vocab"], e)}
    for il in range(dims["n_layer"]):
        b = f"blk.{il}."
        shapes.update({b + "attn_q.weight": (e, e), b + "attn_k.weight": (dims["n_head_kv"] * hd, e),
                       b + "attn_v.weight": (dims["n_head_kv"] * hd, e), b + "attn_output.weight": (e, e),
                       b + "ffn_gate.weight": (ff, e), b + "ffn_up.weight": (ff, e), b + "ffn_down.weight": (e, ff)})
    rng = np.random.default_rng(seed)
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), "llama")
    plain = {k: v for k, v in md.items() if k != "general.architecture" and not k.startswith("tokenizer.")}
    for key, value in plain.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))
    writer.add_string("tokenizer.ggml.model", md["tokenizer.ggml.model"])
    writer.add_array("tokenizer.ggml.tokens", md["tokenizer.ggml.tokens"])
    writer.add_array("tokenizer.ggml.scores", md["tokenizer.ggml.scores"])
    writer.add_array("tokenizer.ggml.token_type", md["tokenizer.ggml.token_type"])
    for key in ("bos", "eos", "unknown"):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", md[f"tokenizer.ggml.{key}_token_id"])
    writer.add_tensor("output_norm.weight", (1.0 + 0.1 * rng.standard_normal(e)).astype(np.float32))
    for i, (name, (n_out, n_in)) in enumerate(shapes.items()):
        t = types[name]
        writer.add_tensor(name, random_blocks(t, n_out, n_in, seed=seed * 1000 + i),
                          raw_dtype=gguf.GGMLQuantizationType[t])
        if name.endswith("attn_q.weight"):
            b = name[: -len("attn_q.weight")]
            for norm in ("attn_norm", "ffn_norm"):
                writer.add_tensor(b + norm + ".weight", (1.0 + 0.1 * rng.standard_normal(e)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

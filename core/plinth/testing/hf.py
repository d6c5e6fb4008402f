"""Tiny Hugging Face-style model folders (config.json + safetensors + tokenizer.json), without torch.

Converter tests write a folder with :func:`write_hf_folder` and run the converter on it::

    folder = write_hf_folder(tmp_path / "hf", {"architectures": ["MyForCausalLM"], ...},
                             {"model.embed_tokens.weight": emb, ...})
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64",
           np.dtype(np.int32): "I32", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray], bf16: bool = False) -> Path:
    """Write ``tensors`` as one safetensors file (``bf16`` stores float32 tensors as BF16, rounded)."""
    raw: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for name, array in tensors.items():
        a = np.ascontiguousarray(array)
        if bf16 and a.dtype == np.float32:
            bits = a.view(np.uint32)
            data = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()  # round to nearest even
            raw[name] = ("BF16", a.shape, data)
        else:
            if a.dtype not in _DTYPES:
                raise ValueError(f"write_safetensors: tensor {name!r} has dtype {a.dtype}")
            raw[name] = (_DTYPES[a.dtype], a.shape, a.tobytes())
    return write_raw_safetensors(path, raw)


def write_raw_safetensors(path: str | Path, tensors: Mapping[str, tuple[str, Sequence[int], bytes]]) -> Path:
    """Write a safetensors file from ``name -> (safetensors dtype, shape, raw bytes)``, for dtypes numpy
    has no type for (F8_E4M3, F8_E8M0, packed FP4 ...): 8-byte header length, JSON header, the data."""
    header: dict[str, Any] = {}
    blobs = []
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)
    return path


def byte_bpe_tokenizer(eos: str = "<|end|>") -> dict[str, Any]:
    """A ``tokenizer.json`` body: byte-level BPE with the 256 byte tokens, no merges, and ``eos`` as id 256."""
    from ..tokenizer.core import _BYTE_TO_CHAR

    return {
        "version": "1.0",
        "added_tokens": [{"id": 256, "content": eos, "special": True}],
        "pre_tokenizer": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": {_BYTE_TO_CHAR[b]: b for b in range(256)}, "merges": []},
    }


def write_hf_folder(folder: str | Path, config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], *,
                    tokenizer: Mapping[str, Any] | None = None, bf16: bool = False) -> Path:
    """``folder`` with config.json, model.safetensors and tokenizer.json (default: :func:`byte_bpe_tokenizer`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(config), indent=1))
    write_safetensors(folder / "model.safetensors", tensors, bf16=bf16)
    (folder / "tokenizer.json").write_text(json.dumps(dict(tokenizer or byte_bpe_tokenizer())))
    return folder

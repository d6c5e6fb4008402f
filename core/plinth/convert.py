"""Shared pieces of HF-to-GGUF converters: config, safetensors reading, GGUF writing.

A converter plugin (``plinth_get_converter``) turns a Hugging Face model folder
(``config.json`` plus ``*.safetensors``) into a GGUF file. This module gives every
converter the same three tools, without torch:

* :func:`read_config` — ``config.json`` as a dict, with a clear error when absent;
* :class:`SafetensorsDir` — every tensor of the folder (single file or sharded
  with an index), read lazily from memory maps, as float32 numpy arrays;
* :func:`write_gguf` — metadata and numpy-order tensors to a GGUF file with
  gguf-py's writer, typing each value as llama.cpp expects.

``plinth convert MODEL_DIR -o OUT.gguf`` picks the converter from
``config.json``'s ``architectures[0]``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from .errors import UserError

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
# byte formats read only as raw bytes (``get(name, None)``); the caller dequantizes them
_ST_RAW = {"F8_E4M3": np.uint8, "F8_E8M0": np.uint8}


def read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"{model_dir}: no config.json; a Hugging Face model folder is expected")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None


class SafetensorsDir:
    """All tensors of a model folder's ``*.safetensors`` files, by name."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise UserError(f"{model_dir}: no .safetensors files")
        self._where: dict[str, tuple[Path, dict[str, Any], int]] = {}
        self._maps: dict[Path, np.memmap] = {}
        for f in files:
            with open(f, "rb") as fh:
                raw = fh.read(8)
                if len(raw) < 8:
                    raise UserError(f"{f}: truncated safetensors header")
                (n,) = struct.unpack("<Q", raw)
                try:
                    header = json.loads(fh.read(n))
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise UserError(f"{f}: bad safetensors header ({exc})") from None
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                self._where[name] = (f, info, 8 + n)

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][1]["shape"])

    def dtype(self, name: str) -> str:
        """The safetensors dtype string of ``name`` ("F32", "BF16", "F8_E4M3", ...)."""
        return str(self._where[name][1]["dtype"])

    def get(self, name: str, dtype: Any = np.float32) -> np.ndarray:
        """The tensor ``name`` as ``dtype`` (BF16 and F16 widened exactly)."""
        if name not in self._where:
            raise UserError(f"{self.dir}: no tensor {name!r}")
        f, info, base = self._where[name]
        mm = self._maps.get(f)
        if mm is None:
            mm = self._maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
        start, end = info["data_offsets"]
        buf = mm[base + start: base + end]
        shape = tuple(info["shape"])
        st = info["dtype"]
        if st == "BF16":
            arr = (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        elif st in _ST_DTYPES:
            arr = buf.view(_ST_DTYPES[st]).reshape(shape)
        elif st in _ST_RAW and dtype is None:
            arr = buf.view(_ST_RAW[st]).reshape(shape)
        else:
            raise UserError(f"{f}: tensor {name!r} has dtype {st}, which plinth cannot convert")
        return np.asarray(arr, dtype=dtype) if dtype is not None else arr


def write_gguf(path: str | Path, metadata: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
               qtypes: Mapping[str, Any] | None = None, *, int_types: Mapping[str, str] | None = None) -> Path:
    """Write ``metadata`` and ``tensors`` (numpy order) with gguf's writer.

    Values are typed as llama.cpp reads them: bool, uint32 (int32 when negative),
    float32, string, or arrays of those. ``int_types`` forces a key's integer type
    ("u64", "i64", "i32", "u32"; for an array key, its elements' type). Integer numpy tensors (e.g. a ``d2t`` map) are
    written with their own type; float tensors as F32 unless ``qtypes`` names a
    ``gguf.GGMLQuantizationType`` for them (quantized with gguf's quantizer).
    """
    import gguf

    path = Path(path)
    arch = str(metadata["general.architecture"])
    writer = gguf.GGUFWriter(str(path), arch)
    forced = dict(int_types or {})
    for key, value in metadata.items():
        if key == "general.architecture":
            continue
        if key in forced and isinstance(value, (list, tuple, np.ndarray)):
            sub = {"u64": gguf.GGUFValueType.UINT64, "i64": gguf.GGUFValueType.INT64,
                   "i32": gguf.GGUFValueType.INT32, "u32": gguf.GGUFValueType.UINT32}[forced[key]]
            writer.add_key_value(key, [int(v) for v in value], gguf.GGUFValueType.ARRAY, sub_type=sub)
        elif key in forced:
            adder = {"u64": writer.add_uint64, "i64": writer.add_int64, "i32": writer.add_int32,
                     "u32": writer.add_uint32}[forced[key]]
            adder(key, int(value))
        elif isinstance(value, (bool, np.bool_)):
            writer.add_bool(key, bool(value))
        elif isinstance(value, (int, np.integer)):
            value = int(value)
            writer.add_uint32(key, value) if value >= 0 else writer.add_int32(key, value)
        elif isinstance(value, (float, np.floating)):
            writer.add_float32(key, float(value))
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            items = list(value)
            if items and all(isinstance(v, (bool, np.bool_)) for v in items):
                writer.add_array(key, [bool(v) for v in items])
            elif items and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in items):
                if any(int(v) < 0 for v in items):
                    writer.add_key_value(key, [int(v) for v in items], gguf.GGUFValueType.ARRAY,
                                         sub_type=gguf.GGUFValueType.INT32)
                else:
                    writer.add_array(key, [int(v) for v in items])
            else:
                writer.add_array(key, items)
    for name, array in tensors.items():
        array = np.asarray(array)
        qtype = (qtypes or {}).get(name)
        if array.dtype.kind in "iu":
            writer.add_tensor(name, np.ascontiguousarray(array))
        elif qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            packed = gguf.quants.quantize(np.asarray(array, dtype=np.float32), qtype)
            writer.add_tensor(name, packed, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def check_converted(specs: Any, tensors: Mapping[str, np.ndarray], model_dir: str | Path, arch: str,
                    layout: str = "") -> None:
    """Converted float32 ``tensors`` against the architecture's tensor specs before they are written: every
    declared tensor present with its shape, and none the architecture does not read (refused by name;
    ``layout`` says what the architecture reads, e.g. its layer pattern)."""
    from .tensors import check_tensors, unused_tensors

    check_tensors(specs, {k: (v.shape, "F32") for k, v in tensors.items()}, f"converted {model_dir}")
    extra = unused_tensors(specs, tensors)
    if extra:
        what = f" ({layout})" if layout else ""
        raise UserError(f"{model_dir}: tensor(s) the {arch} architecture does not read{what}: {', '.join(extra)}")


def hf_architecture(config: Mapping[str, Any], model_dir: str | Path) -> str:
    archs = config.get("architectures") or []
    if not archs:
        raise UserError(f"{model_dir}/config.json has no 'architectures' entry; cannot pick a converter")
    return str(archs[0])


def convert(model_dir: str | Path, out_path: str | Path, registry: Any = None,
            options: Mapping[str, Any] | None = None) -> Path:
    """Convert an HF folder to GGUF with the converter plugin registered for its architecture."""
    from .plugins import default_registry

    registry = registry or default_registry()
    config = read_config(model_dir)
    hf_arch = hf_architecture(config, model_dir)
    conv = registry.converter(hf_arch)  # an unknown name raises, listing the known converters
    conv.convert(str(model_dir), str(out_path), dict(options or {}))
    return Path(out_path)


# ============================================================================ helpers for converter plugins


def map_names(names: Iterator[str] | list[str], table: Mapping[str, str], source: str = "") -> dict[str, str]:
    """HF tensor names -> GGUF names by a table of patterns, ``{layer}`` standing for the layer number.

    ``table`` maps an HF pattern to a GGUF pattern, e.g.
    ``{"model.layers.{layer}.self_attn.q_proj.weight": "blk.{layer}.attn_q.weight"}``. Every name
    must match one pattern: the unmatched ones are refused together, naming ``source``, so a
    converter never drops a tensor silently (leave a tensor out on purpose by mapping it to "").
    """
    import re

    compiled = [(re.compile("^" + re.escape(hf).replace(r"\{layer\}", r"(?P<layer>\d+)") + "$"), gg)
                for hf, gg in table.items()]
    out: dict[str, str] = {}
    unknown = []
    for name in names:
        for pattern, gg in compiled:
            m = pattern.match(name)
            if m:
                if gg:
                    out[name] = gg.format(**m.groupdict())
                break
        else:
            unknown.append(name)
    if unknown:
        raise UserError(f"{source or 'the model folder'}: tensor(s) with no GGUF name: {', '.join(sorted(unknown))}")
    return out


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of an HF Q or K projection [n_head * head_dim, n_in] for GGUF's "normal" RoPE.

    HF llama rotates the two halves of each head (NeoX order); llama.cpp's llama rotates adjacent
    pairs. This interleaves each head's halves, so a file with ``rope_mode="normal"`` computes what
    HF computes. Architectures that use NeoX RoPE in GGUF (qwen2, qwen3, gemma3...) skip it.
    """
    rows = w.shape[0]
    head_dim = rows // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stack_experts(st: "SafetensorsDir", pattern: str, n_expert: int) -> np.ndarray:
    """The per-expert matrices ``pattern.format(e=0..n_expert-1)`` stacked to [n_expert, n_out, n_in]
    (the GGUF ``*_exps`` layout)."""
    missing = [pattern.format(e=e) for e in range(n_expert) if pattern.format(e=e) not in st]
    if missing:
        raise UserError(f"{st.dir}: {len(missing)} of {n_expert} experts missing (first: {missing[0]})")
    return np.stack([st.get(pattern.format(e=e)) for e in range(n_expert)])


def bpe_tokenizer_metadata(model_dir: str | Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """``tokenizer.ggml.*`` keys from a folder's byte-level BPE ``tokenizer.json`` (GPT-2 style).

    Tokens are ordered by id (added tokens included, marked as control tokens); the merges are
    kept as "a b" strings; ``eos_token_id`` / ``bos_token_id`` come from ``config``. Other
    tokenizer types are refused with the type found.
    """
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{model_dir}: no tokenizer.json; plinth generate needs a tokenizer in the GGUF")
    tok = json.loads(path.read_text())
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"{path}: tokenizer model {model.get('type')!r}; only byte-level BPE is converted here")
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {t["content"]: int(t["id"]) for t in tok.get("added_tokens") or []}
    by_id = {i: t for t, i in {**vocab, **added}.items()}
    n = max(by_id) + 1
    if sorted(by_id) != list(range(n)):
        raise UserError(f"{path}: token ids are not 0..{n - 1} without gaps")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    md: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [by_id[i] for i in range(n)],
        "tokenizer.ggml.token_type": [3 if by_id[i] in added else 1 for i in range(n)],
        "tokenizer.ggml.merges": merges,
    }
    for key in ("eos", "bos"):
        if config.get(f"{key}_token_id") is not None:
            md[f"tokenizer.ggml.{key}_token_id"] = int(config[f"{key}_token_id"])
    return md


def padded_tokenizer_metadata(model_dir: str | Path, config: Mapping[str, Any], n_vocab: int
                              ) -> tuple[dict[str, Any], str]:
    """``tokenizer.ggml.*`` from the folder's byte-level BPE ``tokenizer.json`` (:func:`bpe_tokenizer_metadata`),
    the token list padded to ``n_vocab`` with unused ``[PAD{i}]`` entries as llama.cpp's converter pads it
    (its loader sizes token_embd by the token count). Without a tokenizer.json: no keys, and a note saying so."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return {}, "no tokenizer.json: the GGUF has no tokenizer (llama.cpp and plinth generate need one)"
    md = bpe_tokenizer_metadata(model_dir, config)
    tokens, types = list(md["tokenizer.ggml.tokens"]), list(md["tokenizer.ggml.token_type"])
    if n_vocab > len(tokens):
        types += [5] * (n_vocab - len(tokens))  # UNUSED
        tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"] = tokens, types
    return md, ""

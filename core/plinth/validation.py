"""The checks between the GGUF reader and an architecture plugin.

The reader (:mod:`plinth.gguf.reader`) guarantees a well-formed file: counts that
fit, nesting bounded, tensor data aligned, inside the file, non-overlapping and
sized for its type and shape. This module adds what a model file must also be
before a plugin reads it, and what the plugin's hparams must be before anything
is allocated from them:

* :func:`check_model_file`: ``general.architecture`` is a string, the tokenizer keys
  have their types, and ``{arch}.block_count`` is no larger than the number of
  tensors in the file (each layer has at least one), so a small file cannot ask
  for a million layers of specs.
* :func:`check_hparams`: the cross-field rules every attention architecture
  shares (heads divide, the rotary part fits in a head, epsilons and rope bases
  finite and positive), read from the documented hparams field names where an
  object has them. Per-key ranges live in :data:`plinth.hparams.RANGES`.

Every failure is a :class:`ModelFileError` reading ``FILE: key 'K' = V: why``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from .hparams import HParamsError

__all__ = ["ModelFileError", "check_hparams", "check_model_file", "check_tensor_types", "check_vocab"]


class ModelFileError(HParamsError):
    """A model file whose values parse but make no sense (names the file, the key and why)."""


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)) or hasattr(value, "shape"):
        return f"an array of {len(value)} values"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


#: tokenizer keys -> (what, predicate) checked on every model file
_TOKENIZER_TYPES: dict[str, tuple[str, Any]] = {
    "tokenizer.ggml.model": ("a string", lambda v: isinstance(v, str)),
    "tokenizer.ggml.pre": ("a string", lambda v: isinstance(v, str)),
    "tokenizer.chat_template": ("a string", lambda v: isinstance(v, str)),
    "tokenizer.ggml.tokens": ("an array of strings", lambda v: isinstance(v, list)),
    "tokenizer.ggml.merges": ("an array of strings", lambda v: isinstance(v, list)),
}


def check_model_file(metadata: Mapping[str, Any], n_tensors: int | None, source: str) -> str:
    """Check what every model file needs before its plugin reads it; return its architecture.

    ``n_tensors``: the file's tensor count, when the file is to be loaded (``plinth info`` also
    describes header-only files, so it passes None; the block count is then bounded only by
    :data:`plinth.hparams.MAX_LAYERS`).
    """
    arch = metadata.get("general.architecture")
    if arch is None:
        raise ModelFileError(f"{source}: no 'general.architecture' key; is this a model file?")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError(f"{source}: key 'general.architecture' = {_show(arch)}: expected a non-empty string")
    for key, (what, ok) in _TOKENIZER_TYPES.items():
        if key in metadata and not ok(metadata[key]):
            raise ModelFileError(f"{source}: key '{key}' = {_show(metadata[key])}: expected {what}")
    key = f"{arch}.block_count"
    n_layer = metadata.get(key)
    if n_tensors is not None and isinstance(n_layer, int) and not isinstance(n_layer, bool) \
            and n_layer > max(n_tensors, 1):
        raise ModelFileError(f"{source}: key '{key}' = {n_layer}: more layers than the file has tensors "
                             f"({n_tensors})")
    return arch


def _fail(source: str, key: str, value: Any, why: str) -> ModelFileError:
    return ModelFileError(f"{source}: key '{key}' = {_show(value)}: {why}")


def _layers(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_hparams(hp: Any, source: str, arch: str | None = None) -> Any:
    """Cross-field checks on an architecture's hparams (fields it does not have are skipped)."""
    arch = arch or getattr(hp, "arch", None) or "?"
    get = lambda name: getattr(hp, name, None)  # noqa: E731
    n_layer = get("n_layer")
    if isinstance(n_layer, int) and n_layer < 1:
        raise _fail(source, f"{arch}.block_count", n_layer, "a model needs at least one layer")
    n_embd = get("n_embd")
    if isinstance(n_embd, int) and n_embd < 1:
        raise _fail(source, f"{arch}.embedding_length", n_embd, "must be >= 1")
    head_dim = get("head_dim")
    if isinstance(head_dim, int) and head_dim < 0:
        raise _fail(source, f"{arch}.attention.key_length", head_dim, "must be >= 0")
    n_head, n_head_kv = get("n_head"), get("n_head_kv")
    if n_head is not None and n_head_kv is not None:
        for il, (nh, nkv) in enumerate(zip(_layers(n_head), _layers(n_head_kv))):
            if isinstance(nh, int) and isinstance(nkv, int) and nkv > 0 and nh % nkv:
                raise _fail(source, f"{arch}.attention.head_count_kv", nkv,
                            f"layer {il} has {nh} query heads, not a multiple of {nkv} KV heads")
            if isinstance(nh, int) and isinstance(nkv, int) and nh == 0 and nkv > 0:
                raise _fail(source, f"{arch}.attention.head_count", nh,
                            f"layer {il} has {nkv} KV heads but no query heads")
    n_rot = get("n_rot")
    if isinstance(n_rot, int) and isinstance(head_dim, int) and head_dim > 0:
        if n_rot > head_dim:
            raise _fail(source, f"{arch}.rope.dimension_count", n_rot, f"larger than the head size {head_dim}")
        if n_rot % 2:
            raise _fail(source, f"{arch}.rope.dimension_count", n_rot, "must be even (rotary pairs)")
    for field, key in (("norm_eps", "attention.layer_norm_rms_epsilon"), ("rope_base", "rope.freq_base"),
                       ("rope_factor", "rope.scaling.factor")):
        for v in _layers(get(field)):
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not (math.isfinite(v) and v > 0):
                raise _fail(source, f"{arch}.{key}", v, "must be finite and > 0")
    n_vocab = get("n_vocab")
    if isinstance(n_vocab, int) and n_vocab == 0:
        raise _fail(source, f"{arch}.vocab_size", n_vocab, "must be >= 1")
    return hp


def check_vocab(tokenizer: Any, n_vocab: int, source: str) -> None:
    """The tokenizer's vocabulary must match the model's embedding rows (as llama.cpp requires)."""
    n = int(getattr(tokenizer, "n_vocab", n_vocab))
    if n_vocab > 0 and n != n_vocab:
        raise ModelFileError(f"{source}: key 'tokenizer.ggml.tokens' = an array of {n} values: the model has "
                             f"n_vocab = {n_vocab} rows; the tokenizer and the weights do not belong together")



def check_tensor_types(names: Any, tensors: Mapping[str, Any], source: str) -> None:
    """Every tensor the loader will dequantize has a type plinth can dequantize (checked before any is)."""
    from .gguf.constants import GGMLType
    from .gguf.quants import DEQUANTIZERS, REFERENCE_ONLY

    plain = {GGMLType.F32, GGMLType.F16, GGMLType.BF16}
    for name in names:
        info = tensors.get(name)
        if info is None:
            continue
        try:
            gtype = GGMLType(info.ggml_type)
        except ValueError:
            gtype = None
        if gtype not in plain and gtype not in DEQUANTIZERS and gtype not in REFERENCE_ONLY:
            raise ModelFileError(f"{source}: tensor '{name}' has type {info.type_name}, which plinth cannot "
                                 f"dequantize into weights")

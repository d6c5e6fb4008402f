"""Normalisation layers: RMSNorm, LayerNorm and their per-head forms."""

from __future__ import annotations

from typing import Any

import numpy

from ._xp import F32, array_module, as_f32, compiled_ops

_NO_WEIGHT = numpy.zeros(1, dtype=numpy.float32)


def rms_norm(x: Any, weight: Any = None, eps: float = 1e-6, add_unit_offset: bool = False) -> Any:
    """RMSNorm over the last axis: x / sqrt(mean(x**2) + eps) * w.

    x: [..., n]   (e.g. [n_tokens, n_embd], or [n_tokens, n_head, head_dim] for a per-head norm)
    weight: [n] or None (no scale)
    add_unit_offset: multiply by (1 + weight) instead of weight (HF Gemma convention; GGUF
        files usually have the +1 already folded into the stored weight).
    Returns float32 with the shape of ``x``.
    """
    if (type(x) is numpy.ndarray and x.ndim == 2 and x.dtype == F32 and x.flags.c_contiguous and x.size
            and type(weight) is numpy.ndarray and weight.ndim == 1 and weight.dtype == F32
            and weight.flags.c_contiguous):
        k = compiled_ops()  # (a decode step's norms: the compiled call below with the least Python on the way)
        if k is not None:
            out = numpy.empty_like(x)
            k.rms_norm_rows(x, weight, True, bool(add_unit_offset), float(eps), out)
            return out
    xp = array_module(x)
    x = as_f32(x, xp)
    if xp is numpy and x.ndim >= 1 and x.size:
        k = compiled_ops()
        if k is not None:  # one compiled call instead of six numpy ones, for any number of rows
            # (the same arithmetic whatever the batch: a row's result never depends on it)
            x2 = numpy.ascontiguousarray(x.reshape(-1, x.shape[-1]))
            w = numpy.ascontiguousarray(as_f32(weight, xp)) if weight is not None else _NO_WEIGHT
            out = numpy.empty_like(x2)
            k.rms_norm_rows(x2, w, weight is not None, bool(add_unit_offset), float(eps), out)
            return out.reshape(x.shape)
    # the mean as numpy computes it (sum, then divide by n), in place where possible
    ms = (x * x).sum(axis=-1, keepdims=True)
    ms /= F32(x.shape[-1])
    ms += F32(eps)
    y = x * xp.reciprocal(xp.sqrt(ms, out=ms), out=ms)
    if weight is not None:
        w = as_f32(weight, xp)
        y *= (w + F32(1.0)) if add_unit_offset else w
    return y


def layer_norm(x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Any:
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * w + b.

    x: [..., n];  weight: [n] or None;  bias: [n] or None.
    Returns float32 with the shape of ``x``.
    """
    xp = array_module(x)
    x = as_f32(x, xp)
    mu = xp.mean(x, axis=-1, keepdims=True)
    d = x - mu
    var = xp.mean(d * d, axis=-1, keepdims=True)
    y = d * (F32(1.0) / xp.sqrt(var + F32(eps)))
    if weight is not None:
        y = y * as_f32(weight, xp)
    if bias is not None:
        y = y + as_f32(bias, xp)
    return y


def head_rms_norm(x: Any, weight: Any = None, eps: float = 1e-6, add_unit_offset: bool = False) -> Any:
    """Per-head RMSNorm (Qwen3 / Gemma3 q_norm, k_norm): normalise each head's vector.

    x: [n_tokens, n_head, head_dim];  weight: [head_dim] (shared by heads) or None.
    Returns [n_tokens, n_head, head_dim] float32.
    """
    return rms_norm(x, weight, eps, add_unit_offset)


def head_layer_norm(x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Any:
    """Per-head LayerNorm over head_dim.

    x: [n_tokens, n_head, head_dim];  weight, bias: [head_dim] or None.
    Returns [n_tokens, n_head, head_dim] float32.
    """
    return layer_norm(x, weight, bias, eps)

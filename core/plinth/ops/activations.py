"""Elementwise activations and (log-)softmax, computed in float32."""

from __future__ import annotations

import math
from typing import Any

import numpy

from ._xp import F32, array_module, as_f32, compiled_ops

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)


def sigmoid(x: Any) -> Any:
    """Logistic function 1 / (1 + exp(-x)). ``x``: any shape.

    exp(-x) overflows to inf for x < -88, which gives the right limit 0 (the overflow
    warning is silenced); one exp and two in-place passes, no float64 temporaries.
    """
    xp = array_module(x)
    e = _exp_neg(as_f32(x, xp), xp)
    e += F32(1.0)
    return xp.reciprocal(e, out=e)


def silu(x: Any) -> Any:
    """x * sigmoid(x) = x / (1 + exp(-x)) (a.k.a. swish). ``x``: any shape.

    A float32 host array goes through the compiled kernel (:func:`plinth.ops.compiled.silu_rows`, its own
    float32 exp: within 2 ulp, where numpy's is within 2.5) wherever the compiled kernels are on: one
    definition of a value's silu for every host path (a prompt, a decode step, the fused dense block).
    """
    if type(x) is numpy.ndarray and x.dtype == F32 and x.ndim and x.size:
        k = compiled_ops()
        if k is not None:
            x2 = numpy.ascontiguousarray(x)
            out = numpy.empty_like(x2)
            k.silu_rows(x2.reshape(-1, x2.shape[-1]), out.reshape(-1, x2.shape[-1]))
            return out
    xp = array_module(x)
    x = as_f32(x, xp)
    e = _exp_neg(x, xp)
    e += F32(1.0)
    return xp.divide(x, e, out=e)


def _exp_neg(x: Any, xp: Any) -> Any:
    """exp(-x) in a new float32 array (inf where it overflows)."""
    e = xp.negative(x)
    with numpy.errstate(over="ignore"):
        return xp.exp(e, out=e)


def gelu(x: Any, approximate: str = "tanh") -> Any:
    """GELU. ``approximate``: "tanh" (Gemma/GPT-2 form) or "none"/"erf" (exact, through :func:`erf`).
    ``x``: any shape.

    The tanh form of a float32 host array goes through the compiled kernel wherever the compiled kernels are
    on (:func:`plinth.ops.compiled.gelu_rows`: the same function written as ``x / (1 + exp(-2 c u))`` with
    the kernels' own exp), as :func:`silu` does: one definition for a prompt, a decode step and the fused
    block."""
    if approximate == "tanh" and type(x) is numpy.ndarray and x.dtype == F32 and x.ndim and x.size:
        k = compiled_ops()
        if k is not None:  # (as silu: one definition of a value's GELU for every host path)
            x2 = numpy.ascontiguousarray(x)
            out = numpy.empty_like(x2)
            k.gelu_rows(x2.reshape(-1, x2.shape[-1]), out.reshape(-1, x2.shape[-1]))
            return out
    xp = array_module(x)
    x = as_f32(x, xp)
    if approximate == "tanh":
        inner = F32(_SQRT_2_OVER_PI) * (x + F32(0.044715) * x * x * x)
        return F32(0.5) * x * (F32(1.0) + xp.tanh(inner))
    if approximate in ("none", "erf"):
        return F32(0.5) * x * (F32(1.0) + erf(x * F32(_INV_SQRT_2)))
    raise ValueError(f"gelu: unknown approximate={approximate!r}; use 'tanh' or 'none' (= 'erf')")


def gelu_erf(x: Any) -> Any:
    """Exact GELU 0.5 * x * (1 + erf(x / sqrt 2)). ``x``: any shape."""
    return gelu(x, "erf")


# erf(x) / x as a polynomial in x*x for |x| <= 1 (relative error 3.3e-9), and exp(x*x) * erfc(x) for
# 1 <= x <= 4.5 as a polynomial in u = (2 / (1 + x) - (lo + hi)) / (hi - lo), lo = 1 / 5.5, hi = 1 / 2
# (relative error 7.6e-11): least-squares fits to math.erf / math.erfc, highest power first. Past 4.5,
# erfc(x) < 2.2e-10 and erf(x) is 1 in float32.
_ERF_SMALL = (
    7.878969797032593e-05,
    -0.0008014544604171262,
    0.00518837806827335,
    -0.026853535474568875,
    0.11283567883788151,
    -0.3761262251812757,
    1.1283791641964451,
)
_ERFCX_LARGE = (
    -1.9782699762123723e-08,
    -1.0854044128232713e-08,
    4.6983231849365685e-07,
    -1.7217126778960746e-06,
    -2.97784676737189e-06,
    5.889149869512518e-05,
    -0.00015851007418486132,
    -0.0016213059848407085,
    0.01248930676552054,
    0.15411353297778196,
    0.2627059213138824,
)
_ERFCX_LO, _ERFCX_HI = 1.0 / 5.5, 0.5


def _poly(coeffs: tuple[float, ...], v: Any) -> Any:
    """``coeffs`` (highest power first) at ``v``, by Horner's rule (in ``v``'s precision)."""
    r = v * coeffs[0] + coeffs[1]
    for c in coeffs[2:]:
        r *= v
        r += c
    return r


def erf(x: Any) -> Any:
    """The error function in float32, from elementwise array operations only (numpy, cupy and the
    strict backend alike; float64 inside): within 0.55 float32 ulps of the exact value (checked
    against ``math.erf``). ``x``: any shape."""
    xp = array_module(x)
    x = as_f32(x, xp)
    x64 = x.astype(xp.float64)
    a = xp.abs(x64)
    t = x64 * x64
    small = _poly(_ERF_SMALL, t)
    small *= x64
    span = _ERFCX_HI - _ERFCX_LO
    u = (2.0 / span) / (xp.clip(a, 1.0, 4.5) + 1.0) - (_ERFCX_LO + _ERFCX_HI) / span
    tail = xp.exp(-t)
    tail *= _poly(_ERFCX_LARGE, u)  # erfc(|x|)
    big = 1.0 - tail
    return xp.where(a <= 1.0, small, xp.where(x64 < 0.0, -big, big)).astype(F32)


def relu2(x: Any) -> Any:
    """Squared ReLU max(x, 0)**2 (Nemotron / Primer). ``x``: any shape."""
    xp = array_module(x)
    r = xp.maximum(as_f32(x, xp), F32(0.0))
    return r * r


def softplus(x: Any) -> Any:
    """log(1 + exp(x)), overflow-safe. ``x``: any shape."""
    xp = array_module(x)
    x = as_f32(x, xp)
    return (xp.maximum(x, F32(0.0)) + xp.log1p(xp.exp(-xp.abs(x)))).astype(F32, copy=False)


def softmax(x: Any, axis: int = -1) -> Any:
    """Numerically stable softmax along ``axis``. ``x``: any shape.

    A slice that is entirely -inf gives zeros (not NaN).
    """
    xp = array_module(x)
    x = as_f32(x, xp)
    m = xp.max(x, axis=axis, keepdims=True)
    m = xp.where(xp.isfinite(m), m, F32(0.0))
    e = xp.exp(x - m)
    s = xp.sum(e, axis=axis, keepdims=True)
    return e / xp.where(s > 0, s, F32(1.0))


def log_softmax(x: Any, axis: int = -1) -> Any:
    """Numerically stable log-softmax along ``axis``. ``x``: any shape."""
    xp = array_module(x)
    x = as_f32(x, xp)
    m = xp.max(x, axis=axis, keepdims=True)
    m = xp.where(xp.isfinite(m), m, F32(0.0))
    shifted = x - m
    return shifted - xp.log(xp.sum(xp.exp(shifted), axis=axis, keepdims=True))


ACTIVATIONS = {
    "silu": silu,
    "swish": silu,
    "gelu": gelu,
    "gelu_tanh": gelu,
    "gelu_erf": gelu_erf,
    "relu2": relu2,
    "relu": lambda x: array_module(x).maximum(as_f32(x), F32(0.0)),
    "sigmoid": sigmoid,
    "softplus": softplus,
}


def get_activation(name: str) -> Any:
    """The activation function called ``name`` (see ``ACTIVATIONS``)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown activation {name!r}; known: {', '.join(sorted(ACTIVATIONS))}"
        ) from None

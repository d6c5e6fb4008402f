"""Elementwise activations and (log-)softmax, computed in float32."""

from __future__ import annotations

import math
from typing import Any

import numpy

from ._xp import F32, array_module, as_f32

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
    """x * sigmoid(x) = x / (1 + exp(-x)) (a.k.a. swish). ``x``: any shape."""
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
    """GELU. ``approximate``: "tanh" (Gemma/GPT-2 form) or "none"/"erf" (exact). ``x``: any shape."""
    xp = array_module(x)
    x = as_f32(x, xp)
    if approximate == "tanh":
        inner = F32(_SQRT_2_OVER_PI) * (x + F32(0.044715) * x * x * x)
        return F32(0.5) * x * (F32(1.0) + xp.tanh(inner))
    if approximate in ("none", "erf"):
        erf = _erf_fn(xp)
        return F32(0.5) * x * (F32(1.0) + erf(x * F32(_INV_SQRT_2)))
    raise ValueError(f"gelu: unknown approximate={approximate!r}; use 'tanh' or 'erf'")


def gelu_erf(x: Any) -> Any:
    """Exact GELU 0.5 * x * (1 + erf(x / sqrt 2)). ``x``: any shape."""
    return gelu(x, "erf")


def _erf_fn(xp: Any) -> Any:
    if hasattr(xp, "erf"):
        return xp.erf
    if xp.__name__ == "cupy":  # cupy keeps erf under cupyx.scipy.special
        import cupyx.scipy.special as cupy_special

        return cupy_special.erf
    try:
        from scipy.special import erf  # type: ignore
    except ImportError:
        return _erf_numpy
    return lambda v: erf(v).astype(F32, copy=False)


def _erf_numpy(x: Any) -> Any:
    """Exact erf per element via math.erf (a slow fallback used only when scipy is absent)."""
    import numpy

    x64 = numpy.asarray(x, dtype=numpy.float64)
    v = numpy.vectorize(math.erf, otypes=[numpy.float64])(x64)
    return v.astype(F32)


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

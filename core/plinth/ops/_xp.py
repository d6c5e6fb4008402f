"""Array-module helpers shared by every op (numpy on the CPU, cupy on the GPU)."""

from __future__ import annotations

import sys
from typing import Any

import numpy

F32 = numpy.float32


_MODULES: dict[type, Any] = {}


def register_array_module(array_type: type, module: Any) -> None:
    """Make :func:`array_module` answer ``module`` for arrays of ``array_type`` (a device stand-in)."""
    _MODULES[array_type] = module


def array_module(*arrays: Any) -> Any:
    """The array module (cupy, numpy, or a registered one) that owns the given arrays.

    cupy is only consulted when it is already imported, so this never imports it.
    """
    if _MODULES:
        for a in arrays:
            m = _MODULES.get(type(a))
            if m is not None:
                return m
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        for a in arrays:
            if isinstance(a, cupy.ndarray):
                return cupy
    return numpy


def as_f32(x: Any, xp: Any = None) -> Any:
    """``x`` as a float32 array of module ``xp`` (no copy when it already is one)."""
    xp = xp or array_module(x)
    return xp.asarray(x, dtype=F32)


_COMPILED: dict[str, Any] = {"mod": None}


def compiled_ops() -> Any:
    """:mod:`plinth.ops.compiled` (the host kernels for decode attention, RMSNorm and RoPE), or None where
    the compiled kernels are off (numba missing, or PLINTH_KERNELS=0)."""
    if _COMPILED["mod"] is None:
        from .. import runtime

        _COMPILED["mod"] = False
        if runtime.compiled() is not None:
            from . import compiled

            _COMPILED["mod"] = compiled
    return _COMPILED["mod"] or None

"""Compiled passes of a temperature draw over the whole vocabulary (numba), bit for bit numpy's.

A draw at temperature ``T`` over ``n`` logits is, in :mod:`plinth.sampling`'s numpy code: ``z = x / T``
(float64), ``e = exp(z - max(z))``, ``p = e / sum(e)``, ``cum = cumsum(p)``, then a search of
``cum`` for ``u * cum[-1]``. numpy's ``cumsum`` of float64 runs ~3.4 ns an element (a 49k vocabulary:
~165 us, more than half of a draw); the same sequential sum in a compiled loop takes ~1 ns. The exp and
the sum stay numpy's (its SIMD exp and its pairwise sum are what the results are made of); the passes
here do only what IEEE arithmetic fixes exactly: a conversion to float64, a division, a subtraction and
the sequential sum, in numpy's order, so a seeded draw picks the same token.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, error_model="numpy")
def tempered(x: np.ndarray, t: float, m: float, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out[i] = float64(x[i]) / t - m`` (``m``: the largest ``float64(x[i]) / t``)."""
    for i in range(x.shape[0]):
        out[i] = np.float64(x[i]) / t - m


@njit(cache=True, nogil=True, error_model="numpy")
def normalised_cumsum(e: np.ndarray, s: float, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out = cumsum(e / s)`` as numpy computes it (each quotient rounded, then added in order); ``out`` may
    be ``e``."""
    n = e.shape[0]
    if n == 0:
        return
    acc = e[0] / s
    out[0] = acc
    for i in range(1, n):
        acc += e[i] / s
        out[i] = acc


@njit(cache=True, nogil=True)
def cumsum(p: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out = numpy.cumsum(p)`` (float64, summed in order)."""
    n = p.shape[0]
    if n == 0:
        return
    acc = p[0]
    out[0] = acc
    for i in range(1, n):
        acc += p[i]
        out[i] = acc

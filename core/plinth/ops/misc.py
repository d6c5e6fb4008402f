"""Shape helpers: padding, top-k selection, row gathering."""

from __future__ import annotations

from typing import Any

import attrs

from ._xp import array_module


@attrs.frozen
class TopK:
    """values, indices: [..., k] along the chosen axis, sorted by value descending."""

    values: Any
    indices: Any


def pad(x: Any, axis: int, left: int = 0, right: int = 0, value: float = 0.0) -> Any:
    """Pad ``x`` along ``axis`` with ``left`` entries before and ``right`` after.

    x: any shape. Returns the padded array (same dtype).
    """
    xp = array_module(x)
    if left < 0 or right < 0:
        raise ValueError(f"pad: left/right must be >= 0, got {left}, {right}")
    widths = [(0, 0)] * x.ndim
    widths[axis] = (left, right)
    return xp.pad(x, widths, mode="constant", constant_values=value)


def top_k(x: Any, k: int, axis: int = -1) -> TopK:
    """The k largest entries along ``axis``, sorted descending (ties: lower index first).

    x: [..., n, ...];  returns TopK(values, indices) with ``axis`` of length k.
    """
    xp = array_module(x)
    n = x.shape[axis]
    if not 0 < k <= n:
        raise ValueError(f"top_k: k={k} must be in 1..{n}")
    if k < n:
        part = xp.argpartition(-x, k - 1, axis=axis)
        idx = xp.take(part, xp.arange(k), axis=axis)
    else:
        idx = xp.broadcast_to(
            xp.arange(n).reshape([-1 if d == (axis % x.ndim) else 1 for d in range(x.ndim)]), x.shape
        )
    vals = xp.take_along_axis(x, idx, axis=axis)
    # order by index, then stable sort by value descending: ties keep index order
    o1 = xp.argsort(idx, axis=axis)
    idx = xp.take_along_axis(idx, o1, axis=axis)
    vals = xp.take_along_axis(vals, o1, axis=axis)
    order = xp.argsort(-vals, axis=axis, kind="stable")
    return TopK(
        values=xp.take_along_axis(vals, order, axis=axis),
        indices=xp.take_along_axis(idx, order, axis=axis),
    )


def gather_rows(table: Any, ids: Any) -> Any:
    """Rows of ``table`` picked by ``ids`` (embedding lookup).

    table: [n_rows, n_cols];  ids: [...] int. Returns [..., n_cols].
    """
    xp = array_module(table)
    return xp.take(table, xp.asarray(ids), axis=0)

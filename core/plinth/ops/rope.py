"""Rotary position embeddings: frequency tables (plain, linear, YaRN, llama3 factors) and rotation.

Modes (names as in GGUF/ggml):
  * "normal": rotate interleaved pairs (x[2i], x[2i+1])  — llama-style GGUF q/k layout;
  * "neox":   rotate split halves (x[i], x[i + n_rot/2]) — GPT-NeoX / HF layout.
Dimension pair i (0 <= i < n_rot/2) turns by angle pos * inv_freq[i].
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy

from ._xp import F32, array_module, as_f32, compiled_ops


@attrs.frozen
class RopeFreqs:
    """A rotary frequency table.

    inv_freq: [n_rot // 2] float32 — angle per unit position of dimension pair i.
    mscale: factor applied to cos and sin (YaRN attention scaling; 1.0 otherwise).
    """

    inv_freq: Any
    mscale: float = 1.0

    @property
    def n_rot(self) -> int:
        return 2 * int(self.inv_freq.shape[0])


def yarn_corr_dim(n_rot: int, n_ctx_orig: int, n_rotations: float, base: float) -> float:
    """Dimension index whose wavelength fits ``n_rotations`` turns into ``n_ctx_orig`` tokens."""
    return n_rot * math.log(n_ctx_orig / (n_rotations * 2.0 * math.pi)) / (2.0 * math.log(base))


def yarn_corr_dims(n_rot: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """The [low, high] dimension range over which YaRN blends interpolation and extrapolation."""
    low = math.floor(yarn_corr_dim(n_rot, n_ctx_orig, beta_fast, base))
    high = math.ceil(yarn_corr_dim(n_rot, n_ctx_orig, beta_slow, base))
    return float(max(0, low)), float(min(n_rot - 1, high))


def rope_freqs(
    n_rot: int,
    base: float = 10000.0,
    scaling: str = "none",
    factor: float = 1.0,
    n_ctx_orig: int = 0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    ext_factor: float | None = None,
    attn_factor: float = 1.0,
    freq_factors: Any = None,
    xp: Any = numpy,
) -> RopeFreqs:
    """Build a :class:`RopeFreqs` table.

    n_rot: number of rotated dims (even; head_dim for full rotary).
    scaling: "none", "linear" (positions divided by ``factor``) or "yarn".
    factor: context extension factor (GGUF rope.scaling.factor; freq_scale = 1 / factor).
    n_ctx_orig: original training context (YaRN).
    beta_fast, beta_slow: YaRN ramp bounds in rotations.
    ext_factor: YaRN extrapolation mix (default 1.0 for "yarn", 0 otherwise).
    attn_factor: base attention magnitude scale; YaRN multiplies it by 1 + 0.1 ln(factor).
    freq_factors: [n_rot // 2] or None — per-pair divisors of the frequency (llama3 rope
        scaling / GGUF rope_freqs.weight).
    """
    if n_rot % 2:
        raise ValueError(f"rope_freqs: n_rot must be even, got {n_rot}")
    half = n_rot // 2
    i = numpy.arange(half, dtype=numpy.float64)
    theta = base ** (-2.0 * i / n_rot)
    if freq_factors is not None:
        ff = numpy.asarray(_to_numpy(freq_factors), dtype=numpy.float64).reshape(-1)
        if ff.shape[0] != half:
            raise ValueError(f"rope_freqs: freq_factors has {ff.shape[0]} entries, expected n_rot/2 = {half}")
        theta = theta / ff
    mscale = float(attn_factor)
    if scaling in ("none", None):
        pass
    elif scaling == "linear":
        theta = theta / factor
    elif scaling == "yarn":
        freq_scale = 1.0 / factor
        ext = 1.0 if ext_factor is None else float(ext_factor)
        if ext != 0.0:
            if n_ctx_orig <= 0:
                raise ValueError("rope_freqs: YaRN needs n_ctx_orig > 0 (rope.scaling.original_context_length)")
            low, high = yarn_corr_dims(n_rot, n_ctx_orig, base, beta_fast, beta_slow)
            y = (i - low) / max(0.001, high - low)  # i == i0 / 2 for pair index i
            ramp = (1.0 - numpy.clip(y, 0.0, 1.0)) * ext
            mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
        else:
            ramp = numpy.zeros_like(i)
        theta = theta * (freq_scale * (1.0 - ramp) + ramp)
    else:
        raise ValueError(f"rope_freqs: unknown scaling {scaling!r}; use 'none', 'linear' or 'yarn'")
    return RopeFreqs(inv_freq=xp.asarray(theta.astype(numpy.float32)), mscale=mscale)


def _to_numpy(a: Any) -> Any:
    return a.get() if hasattr(a, "get") and not isinstance(a, numpy.ndarray) else a


def rope_cos_sin(freqs: RopeFreqs | Any, positions: Any) -> tuple[Any, Any]:
    """cos and sin tables for the given positions.

    freqs: RopeFreqs or inv_freq [n_rot // 2];  positions: [n_tokens] (int or float).
    Returns (cos, sin), each [n_tokens, n_rot // 2] float32 (mscale folded in).
    """
    if isinstance(freqs, RopeFreqs):
        inv_freq, mscale = freqs.inv_freq, freqs.mscale
    else:
        inv_freq, mscale = freqs, 1.0
    xp = array_module(inv_freq, positions)
    ang = xp.asarray(positions, dtype=numpy.float64)[:, None] * xp.asarray(inv_freq, dtype=numpy.float64)[None, :]
    c = xp.cos(ang).astype(F32)
    s = xp.sin(ang).astype(F32)
    if mscale != 1.0:
        c *= F32(mscale)
        s *= F32(mscale)
    return c, s


class RopeCache:
    """cos/sin tables for positions 0..capacity-1, grown on demand and indexed by position.

    Cheap to keep per layer-type (one per distinct frequency table). Positions must be
    non-negative integers.
    """

    def __init__(self, freqs: RopeFreqs, capacity: int = 0) -> None:
        self.freqs = freqs
        self._cos = None
        self._sin = None
        if capacity:
            self._grow(capacity)

    def _grow(self, n: int) -> None:
        xp = array_module(self.freqs.inv_freq)
        self._cos, self._sin = rope_cos_sin(self.freqs, xp.arange(n))

    def __call__(self, positions: Any) -> tuple[Any, Any]:
        """(cos, sin), each [n_tokens, n_rot // 2], for positions: [n_tokens] int.

        Host positions (a :class:`Batch`'s) are range-checked on the host and index the
        device tables directly: no device round trip. Device positions cost one (their max).
        """
        if array_module(positions) is not numpy:  # device positions: the range check reads them back
            positions = _to_numpy(positions)
        positions = numpy.asarray(positions)
        if positions.size and int(positions.min()) < 0:
            raise ValueError("RopeCache: positions must be >= 0; use rope_cos_sin for negative positions")
        need = int(positions.max()) + 1 if positions.size else 0
        have = 0 if self._cos is None else self._cos.shape[0]
        if need > have:
            self._grow(max(need, 2 * have, 256))
        return self._cos[positions], self._sin[positions]


def apply_rope(
    x: Any,
    positions: Any = None,
    freqs: RopeFreqs | Any = None,
    mode: str = "normal",
    offset: int = 0,
    cos_sin: tuple[Any, Any] | None = None,
    inverse: bool = False,
) -> Any:
    """Rotate ``x`` by its positions (out of place).

    x: [n_tokens, n_head, head_dim]
    positions: [n_tokens] (ignored when ``cos_sin`` is given)
    freqs: RopeFreqs or inv_freq [n_rot // 2]; n_rot = 2 * len(inv_freq) <= head_dim - offset.
    mode: "normal" (interleaved pairs) or "neox" (halves), within the rotated slice.
    offset: first rotated dim; dims x[..., offset:offset+n_rot] turn, the rest pass through
        (offset = head_dim - n_rot gives "rope only the trailing n_rot dims").
    cos_sin: precomputed (cos, sin), each [n_tokens, n_rot // 2] (e.g. from RopeCache).
    inverse: rotate by the negative angle (undo a rope, e.g. on an attention output).
    Returns [n_tokens, n_head, head_dim] float32.
    """
    if cos_sin is not None and type(x) is numpy.ndarray and x.dtype == F32 and x.ndim == 3:
        cos, sin = cos_sin  # (a decode step's host rotation: the compiled call below with the least Python)
        if (type(cos) is numpy.ndarray and cos.dtype == F32 and sin.dtype == F32 and cos.shape[0] == x.shape[0]
                and mode in ("normal", "neox") and 0 <= offset and offset + 2 * cos.shape[-1] <= x.shape[-1]):
            k = compiled_ops()
            if k is not None:
                out = numpy.empty(x.shape, dtype=F32)
                k.rope_rows(x, cos, sin, offset, mode == "neox", inverse, out)
                return out
    xp = array_module(x)
    x = as_f32(x, xp)
    if cos_sin is None:
        if freqs is None or positions is None:
            raise ValueError("apply_rope: give positions and freqs, or cos_sin")
        cos_sin = rope_cos_sin(freqs, positions)
    cos, sin = cos_sin
    half = cos.shape[-1]
    n_rot = 2 * half
    hd = x.shape[-1]
    if offset < 0 or offset + n_rot > hd:
        raise ValueError(f"apply_rope: slice [{offset}, {offset + n_rot}) does not fit head_dim {hd}")
    if mode not in ("normal", "neox"):
        raise ValueError(f"apply_rope: unknown mode {mode!r}; use 'normal' or 'neox'")
    k = compiled_ops() if xp is numpy and x.ndim == 3 else None
    if k is not None and cos.dtype == F32 and sin.dtype == F32 and cos.shape[0] == x.shape[0]:
        out = numpy.empty(x.shape, dtype=F32)  # every host call, any batch: a row's result is the same
        k.rope_rows(x, cos, sin, offset, mode == "neox", inverse, out)
        return out
    c = cos[:, None, :]
    s = -sin[:, None, :] if inverse else sin[:, None, :]
    seg = x[..., offset : offset + n_rot]
    if mode == "normal":
        a = seg[..., 0::2]
        b = seg[..., 1::2]
    elif mode == "neox":
        a = seg[..., :half]
        b = seg[..., half:]
    else:
        raise ValueError(f"apply_rope: unknown mode {mode!r}; use 'normal' or 'neox'")
    ra = a * c - b * s
    rb = a * s + b * c
    if n_rot == hd:
        out = xp.empty_like(x)
    else:
        out = x.copy()
    tgt = out[..., offset : offset + n_rot]
    if mode == "normal":
        tgt[..., 0::2] = ra
        tgt[..., 1::2] = rb
    else:
        tgt[..., :half] = ra
        tgt[..., half:] = rb
    return out

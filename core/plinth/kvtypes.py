"""Storage types of the K/V cache (``--cache-type-k`` / ``--cache-type-v``) and the Hadamard rotation.

A cache row (one position's keys of one kv head, its values, an MLA latent, indexer keys) is
kept as float32, or in one of the GGUF layouts llama.cpp offers for its cache: ``f16``, ``bf16``,
``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``. The block layouts are GGUF's (per 32 values a
float16 scale, for the ``_1`` types a float16 minimum, then the quants), read bit for bit as
gguf-py's ``dequantize`` reads them and written as its ``quantize`` writes them (``tests/test_kvtypes.py``
holds them to it), except that the cache's q4_0 / q5_0 blocks take a fitted scale (:func:`_fit_scale`:
least squared error among the reference's and a few others, the same layout), so a cache row costs
the type's bytes: q8_0 34 bytes a 32 values, q4_0 18.

**Rotation.** Quantizing a row per 32 values loses most where a few values are large (outlier
channels of keys). Before a row enters a quantized cache it is multiplied by an orthonormal
Walsh-Hadamard matrix (which spreads an outlier over the block), the query is multiplied by the
same matrix (so every score ``q . k`` is unchanged), and for values the attention output is
multiplied once more (H H = I) to undo it: llama.cpp's ``attn_rot_k`` / ``attn_rot_v``.
Where: keys when the key type is quantized and the key head size is a multiple of 64, in chunks
of the largest power of two (>= 64) dividing the head size; values when the value type is
quantized and the value head size a multiple of 64, in chunks of 64. ``PLINTH_ATTN_ROT_DISABLE=1``
switches both off (llama.cpp's ``LLAMA_ATTN_ROT_DISABLE``). The matrix is the Sylvester one
llama.cpp's ``ggml_gen_hadamard`` builds (entries +-1/sqrt(n)); plinth applies it as a fast
Walsh-Hadamard transform per row (n log n adds, then one scale), the same steps for every row,
so a row's bits do not depend on its batch.
"""

from __future__ import annotations

import math
import os
from typing import Any

import attrs
import numpy as np
from numba import njit

from .errors import UserError

F32 = np.float32


@attrs.frozen
class CacheType:
    """One storage type: ``name`` (as ``-ctk`` spells it), ``code`` (the kernels' switch), values a
    block, bytes a block, whether it is a quantized (block) type."""

    name: str
    code: int
    block: int
    size: int

    @property
    def quantized(self) -> bool:
        return self.block > 1

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of ``n`` values (``n`` a multiple of the block)."""
        return n // self.block * self.size


#: the storage types, by name (the order llama.cpp lists them)
CACHE_TYPES: dict[str, CacheType] = {t.name: t for t in (
    CacheType("f32", 0, 1, 4),
    CacheType("f16", 1, 1, 2),
    CacheType("bf16", 2, 1, 2),
    CacheType("q8_0", 3, 32, 34),
    CacheType("q4_0", 4, 32, 18),
    CacheType("q4_1", 5, 32, 20),
    CacheType("q5_0", 6, 32, 22),
    CacheType("q5_1", 7, 32, 24),
)}


def cache_type(name: str | CacheType) -> CacheType:
    """The :class:`CacheType` called ``name`` (case-insensitive); anything else is refused by name."""
    if isinstance(name, CacheType):
        return name
    t = CACHE_TYPES.get(str(name).lower())
    if t is None:
        raise UserError(f"unknown cache type {name!r}: the K/V cache types are {', '.join(CACHE_TYPES)}")
    return t


def rotation_disabled() -> bool:
    """``PLINTH_ATTN_ROT_DISABLE`` set to a non-zero integer (llama.cpp reads its switch with ``atoi``)."""
    v = os.environ.get("PLINTH_ATTN_ROT_DISABLE", "").strip()
    try:
        return int(v) != 0 if v else False
    except ValueError:
        raise UserError(f"PLINTH_ATTN_ROT_DISABLE={v!r}: set it to 1 (rotation off) or 0") from None


def k_rotation(t: CacheType, head_dim: int) -> int:
    """The Hadamard size for keys of ``head_dim`` stored as ``t`` (0: none): the largest power of two
    >= 64 dividing the head size, when ``t`` is quantized and the head size a multiple of 64."""
    if not t.quantized or head_dim % 64 or rotation_disabled():
        return 0
    n = 64
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def v_rotation(t: CacheType, head_dim: int) -> int:
    """The Hadamard size for values (0: none): 64, when ``t`` is quantized and the head size a multiple of 64."""
    return 64 if t.quantized and head_dim % 64 == 0 and not rotation_disabled() else 0


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix [n, n] float32 (Sylvester order, n a power of two), entry by
    entry as ``ggml_gen_hadamard`` fills it: ``1/sqrt(n)`` at [0, 0], then blocks ``[[H, H], [H, -H]]``."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: n = {n} is not a power of two")
    h = np.empty((n, n), dtype=F32)
    h[0, 0] = F32(1.0 / float(np.sqrt(F32(n))))
    s = 1
    while s < n:
        h[s:2 * s, :s] = h[:s, :s]
        h[:s, s:2 * s] = h[:s, :s]
        h[s:2 * s, s:2 * s] = -h[:s, :s]
        s *= 2
    return h


@njit(cache=True)
def _fwht_rows(x: np.ndarray, n: int, scale: np.float32, out: np.ndarray) -> None:
    """out[r] = H_n x[r] per chunk of n values: x, out float32 [m, w] C-order, w a multiple of n."""
    m, w = x.shape
    for r in range(m):
        for c0 in range(0, w, n):
            for i in range(n):
                out[r, c0 + i] = x[r, c0 + i]
            h = 1
            while h < n:
                for j0 in range(0, n, 2 * h):
                    for j in range(c0 + j0, c0 + j0 + h):
                        a = out[r, j]
                        b = out[r, j + h]
                        out[r, j] = a + b
                        out[r, j + h] = a - b
                h *= 2
            for i in range(n):
                out[r, c0 + i] = out[r, c0 + i] * scale


def rotation_scale(n: int) -> np.float32:
    """The float32 ``1 / sqrt(n)`` a Hadamard transform of size n is scaled by (:func:`rotate`; the fused block
    takes it too, so both give the same bits)."""
    return F32(1.0 / float(np.sqrt(F32(n))))


def rotate(x: Any, n: int) -> Any:
    """``x`` [..., w] with every chunk of ``n`` values of its last axis multiplied by :func:`hadamard` (n)
    (H is symmetric and H H = I, so this also undoes itself). n = 0: ``x`` itself. Host float32 arrays
    take the compiled transform (the same steps for every row); others a matrix product."""
    if not n:
        return x
    if isinstance(x, np.ndarray):
        shape = x.shape
        a = np.ascontiguousarray(x, dtype=F32).reshape(-1, shape[-1])
        out = np.empty_like(a)
        _fwht_rows(a, n, rotation_scale(n), out)
        return out.reshape(shape)
    from .ops._xp import array_module

    xp = array_module(x)
    h = xp.asarray(hadamard(n))
    shape = x.shape
    return (x.reshape(-1, n).astype(xp.float32) @ h).reshape(shape)


# ============================================================================ float16 / bfloat16 bits


@njit(cache=True, inline="always")
def f32_to_f16(v: np.float32) -> np.uint16:
    """float32 -> float16 bits, rounding to nearest even (numpy's ``astype(float16)``)."""
    x = np.float32(v).view(np.uint32)
    sign = np.uint16((x >> np.uint32(16)) & np.uint32(0x8000))
    a = x & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x7F800000):  # inf, nan (quiet)
        return sign | np.uint16(0x7C00) | (np.uint16(0x200) if a > np.uint32(0x7F800000) else np.uint16(0))
    if a >= np.uint32(0x477FF000):  # rounds past 65504
        return sign | np.uint16(0x7C00)
    if a < np.uint32(0x38800000):  # below 2^-14: a float16 subnormal (or zero), in units of 2^-24
        f = np.uint32(a).view(np.float32) * np.float32(16777216.0)
        return sign | np.uint16(np.int64(np.rint(f)))
    h = np.uint32(((a >> np.uint32(23)) - np.uint32(112)) << np.uint32(10)) | ((a >> np.uint32(13)) & np.uint32(0x3FF))
    rem = a & np.uint32(0x1FFF)
    if rem > np.uint32(0x1000) or (rem == np.uint32(0x1000) and (h & np.uint32(1))):
        h += np.uint32(1)
    return sign | np.uint16(h)


@njit(cache=True, inline="always")
def f16_to_f32(h: np.uint16) -> np.float32:
    """float16 bits -> float32 (exact)."""
    hh = np.uint32(h)
    sign = (hh & np.uint32(0x8000)) << np.uint32(16)
    e = (hh >> np.uint32(10)) & np.uint32(0x1F)
    m = hh & np.uint32(0x3FF)
    if e == 0:
        v = np.float32(m) * np.float32(5.960464477539063e-08)  # m * 2^-24, exact
        return -v if sign else v
    if e == 31:
        bits = sign | np.uint32(0x7F800000) | (m << np.uint32(13))
    else:
        bits = sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))
    return np.uint32(bits).view(np.float32)


# ============================================================================ rows in and out


@njit(cache=True)
def _round_away(v: np.float32) -> np.float32:
    """gguf-py's ``np_roundf`` (round half away from zero) in float32 steps."""
    a = abs(v)
    fl = np.float32(math.floor(a))
    b = fl + np.float32(math.floor(np.float32(2.0) * (a - fl)))
    if v > 0:
        return b
    if v < 0:
        return -b
    return np.float32(0.0)


@njit(cache=True)
def _put_f16(out: np.ndarray, at: int, v: np.float32) -> None:
    h = f32_to_f16(v)
    out[at] = np.uint8(h & np.uint16(0xFF))
    out[at + 1] = np.uint8(h >> np.uint16(8))


@njit(cache=True)
def _get_f16(src: np.ndarray, at: int) -> np.float32:
    return f16_to_f32(np.uint16(src[at]) | (np.uint16(src[at + 1]) << np.uint16(8)))


#: a fitted q4_0 / q5_0 block scale starts from the value of largest magnitude ``mx`` over -(half + s) for
#: these s (s = 0: the reference's scale), each start also refined once by least squares (the other sign,
#: and more or finer starts, lowered the squared error of SmolLM2's rotated K / V no further)
FIT_STARTS = (-1.0, -0.5, 0.0, 0.5)


@njit(cache=True, inline="always")
def _code(v: np.float32, ide: np.float32, half: np.float32, top: np.float32) -> np.float32:
    """The signed integer (q - half) that q4_0 / q5_0 store for ``v`` at scale 1 / ``ide``, as a float32
    (q = trunc(v ide + half + 1/2) within [0, top]: the reference's steps)."""
    return min(max(np.trunc(v * ide + (half + np.float32(0.5))), np.float32(0.0)), top) - half


@njit(cache=True)
def _block_error(x: np.ndarray, x0: int, ide: np.float32, d: np.float32, half: np.float32,
                 top: np.float32) -> np.float32:
    """The squared error of a block of 32 values at ``x0`` coded with the reciprocal scale ``ide`` and
    stored with scale ``d`` (float32 steps; four running sums)."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for i in range(x0, x0 + 32, 4):
        e0 = x[i] - _code(x[i], ide, half, top) * d
        e1 = x[i + 1] - _code(x[i + 1], ide, half, top) * d
        e2 = x[i + 2] - _code(x[i + 2], ide, half, top) * d
        e3 = x[i + 3] - _code(x[i + 3], ide, half, top) * d
        a0 += e0 * e0
        a1 += e1 * e1
        a2 += e2 * e2
        a3 += e3 * e3
    return (a0 + a1) + (a2 + a3)


@njit(cache=True)
def _least_squares_scale(x: np.ndarray, x0: int, d: np.float32, half: np.float32, top: np.float32) -> np.float32:
    """The scale that fits the block best for the integers ``d`` gives it: sum(x c) / sum(c^2), c = q - half
    (0 where every c is 0)."""
    ide = np.float32(1.0) / d
    num = np.float32(0.0)
    den = np.float32(0.0)
    for i in range(x0, x0 + 32):
        c = _code(x[i], ide, half, top)
        num += x[i] * c
        den += c * c
    return num / den if den > 0 else np.float32(0.0)


@njit(cache=True)
def _fit_scale(x: np.ndarray, x0: int, mx: np.float32, half: np.float32, top: int) -> np.float32:
    """The q4_0 / q5_0 block scale of least squared error among gguf-py's (``mx``, the block's value of
    largest magnitude, over -half: s = 0 of :data:`FIT_STARTS`, coded as the reference codes it), mx / -(half
    + s) for the other s and each start refined once by least squares (as float16 stores them). The
    reference wins ties and is returned as it is (unrounded: the caller's coding then gives gguf-py's
    bytes). Deterministic per block: a row's bytes do not depend on the other rows."""
    ftop = np.float32(top)
    d_ref = mx / -half
    ref = f16_to_f32(f32_to_f16(d_ref))
    if ref == 0:
        return d_ref
    best, err = d_ref, _block_error(x, x0, np.float32(1.0) / d_ref, ref, half, ftop)
    for s in FIT_STARTS:
        d0 = ref if s == 0 else f16_to_f32(f32_to_f16(mx / -(half + np.float32(s))))
        if d0 == 0:
            continue
        if s != 0:
            e = _block_error(x, x0, np.float32(1.0) / d0, d0, half, ftop)
            if e < err:
                best, err = d0, e
        d1 = f16_to_f32(f32_to_f16(_least_squares_scale(x, x0, d0, half, ftop)))
        if d1 != 0:
            e = _block_error(x, x0, np.float32(1.0) / d1, d1, half, ftop)
            if e < err:
                best, err = d1, e
    return best


@njit(cache=True)
def encode_row(x: np.ndarray, code: int, out: np.ndarray, fit: bool = False) -> None:
    """Row ``x`` (float32 [n]) into ``out`` (uint8 [row bytes]) as type ``code`` (gguf-py's quantize, bit
    for bit: float32 steps, no fused multiply-adds). ``fit``: q4_0 / q5_0 blocks take the scale of least
    squared error (:func:`_fit_scale`) instead of the reference's, coded the same way (the same layout:
    any reader of the type decodes them); the other types are unaffected (fitting q4_1 / q5_1's scale
    and minimum by least squares cut their squared error by 10-13% on SmolLM2's rows but moved the
    KL divergence by under 1%: not worth its packing time)."""
    n = x.shape[0]
    if code == 1:
        for i in range(n):
            _put_f16(out, 2 * i, x[i])
        return
    if code == 2:
        for i in range(n):
            b = np.float32(x[i]).view(np.uint32)
            if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                b = (b & np.uint32(0xFFFF0000)) | np.uint32(64 << 16)
            r = (np.uint64(b) + np.uint64(0x7FFF + ((b >> np.uint32(16)) & np.uint32(1)))) >> np.uint64(16)
            out[2 * i] = np.uint8(r & np.uint64(0xFF))
            out[2 * i + 1] = np.uint8((r >> np.uint64(8)) & np.uint64(0xFF))
        return
    size = (34, 18, 20, 22, 24)[code - 3]
    q = np.empty(32, dtype=np.int64)
    for blk in range(n // 32):
        x0 = blk * 32
        o = blk * size
        if code == 3:  # q8_0
            amax = np.float32(0.0)
            for i in range(32):
                a = abs(x[x0 + i])
                if a > amax:
                    amax = a
            d = amax / np.float32(127.0)
            ide = np.float32(0.0) if d == 0 else np.float32(1.0) / d
            _put_f16(out, o, d)
            for i in range(32):
                out[o + 2 + i] = np.uint8(np.int64(_round_away(x[x0 + i] * ide)) & 0xFF)
            continue
        if code == 4 or code == 6:  # q4_0 / q5_0: the value of largest magnitude (the first) sets the scale
            amax = np.float32(0.0)
            mx = np.float32(0.0)
            for i in range(32):
                a = abs(x[x0 + i])
                if a > amax:
                    amax = a
                    mx = x[x0 + i]
            half = np.float32(8.0) if code == 4 else np.float32(16.0)
            top = 15 if code == 4 else 31
            d = mx / -half
            if fit:
                d = _fit_scale(x, x0, mx, half, top)
            ide = np.float32(0.0) if d == 0 else np.float32(1.0) / d
            for i in range(32):
                t = np.float32(math.trunc(x[x0 + i] * ide + (half + np.float32(0.5))))
                q[i] = min(max(np.int64(t), 0), top)
            _put_f16(out, o, d)
            o2 = o + 2
        else:  # q4_1 / q5_1
            mx = x[x0]
            mn = x[x0]
            for i in range(1, 32):
                mx = max(mx, x[x0 + i])
                mn = min(mn, x[x0 + i])
            top = 15 if code == 5 else 31
            d = (mx - mn) / np.float32(top)
            ide = np.float32(0.0) if d == 0 else np.float32(1.0) / d
            for i in range(32):
                t = np.float32(math.trunc((x[x0 + i] - mn) * ide + np.float32(0.5)))
                q[i] = min(max(np.int64(t), 0), top)
            _put_f16(out, o, d)
            _put_f16(out, o + 2, mn)
            o2 = o + 4
        if code == 6 or code == 7:  # the fifth bits, 32 of them little-endian
            qh = 0
            for i in range(32):
                qh |= ((q[i] >> 4) & 1) << i
            for i in range(4):
                out[o2 + i] = np.uint8((qh >> (8 * i)) & 0xFF)
            o2 += 4
        for i in range(16):
            out[o2 + i] = np.uint8((q[i] & 0xF) | ((q[i + 16] & 0xF) << 4))


@njit(cache=True)
def decode_row(src: np.ndarray, code: int, out: np.ndarray) -> None:
    """Row ``src`` (uint8, type ``code``) into ``out`` (float32 [n]): gguf-py's dequantize, bit for bit."""
    n = out.shape[0]
    if code == 0:  # float32 bytes (a field kept as float32 beside a typed one)
        for i in range(n):
            b = (np.uint32(src[4 * i]) | (np.uint32(src[4 * i + 1]) << np.uint32(8))
                 | (np.uint32(src[4 * i + 2]) << np.uint32(16)) | (np.uint32(src[4 * i + 3]) << np.uint32(24)))
            out[i] = np.uint32(b).view(np.float32)
        return
    if code == 1:
        for i in range(n):
            out[i] = _get_f16(src, 2 * i)
        return
    if code == 2:
        for i in range(n):
            b = (np.uint32(src[2 * i]) | (np.uint32(src[2 * i + 1]) << np.uint32(8))) << np.uint32(16)
            out[i] = np.uint32(b).view(np.float32)
        return
    size = (34, 18, 20, 22, 24)[code - 3]
    for blk in range(n // 32):
        o = blk * size
        x0 = blk * 32
        d = _get_f16(src, o)
        if code == 3:
            for i in range(32):
                out[x0 + i] = d * np.float32(np.int8(src[o + 2 + i]))
            continue
        m = np.float32(0.0)
        o2 = o + 2
        if code == 5 or code == 7:
            m = _get_f16(src, o + 2)
            o2 = o + 4
        qh = 0
        if code == 6 or code == 7:
            for i in range(4):
                qh |= np.int64(src[o2 + i]) << (8 * i)
            o2 += 4
        for i in range(16):
            b = np.int64(src[o2 + i])
            lo = b & 0xF
            hi = b >> 4
            if code == 6 or code == 7:
                lo |= ((qh >> i) & 1) << 4
                hi |= ((qh >> (i + 16)) & 1) << 4
            if code == 4:
                out[x0 + i] = d * np.float32(lo - 8)
                out[x0 + i + 16] = d * np.float32(hi - 8)
            elif code == 6:
                out[x0 + i] = d * np.float32(lo - 16)
                out[x0 + i + 16] = d * np.float32(hi - 16)
            else:
                out[x0 + i] = d * np.float32(lo) + m
                out[x0 + i + 16] = d * np.float32(hi) + m


@njit(cache=True)
def _encode_rows(x: np.ndarray, code: int, out: np.ndarray, fit: bool) -> None:
    for r in range(x.shape[0]):
        encode_row(x[r], code, out[r], fit)


@njit(cache=True)
def _decode_rows(src: np.ndarray, code: int, out: np.ndarray) -> None:
    for r in range(src.shape[0]):
        decode_row(src[r], code, out[r])


def encode(x: Any, t: CacheType | str, fit: bool = False) -> np.ndarray:
    """Float rows ``x`` [..., n] -> uint8 [..., row bytes] of type ``t`` (n a multiple of its block): gguf-py's
    quantization bit for bit, or with ``fit`` q4_0 / q5_0 blocks scaled for least squared error
    (:func:`encode_row`; what the cache stores: :meth:`Codec.encode`)."""
    t = cache_type(t)
    x = np.asarray(x)
    n = x.shape[-1]
    if n % t.block:
        raise ValueError(f"a {t.name} cache needs rows of a multiple of {t.block} values, not {n}")
    a = np.ascontiguousarray(x, dtype=F32).reshape(-1, n)
    out = np.empty((a.shape[0], t.row_bytes(n)), dtype=np.uint8)
    if t.code == 0:
        out[...] = a.view(np.uint8)
    else:
        _encode_rows(a, t.code, out, fit)
    return out.reshape(x.shape[:-1] + (out.shape[1],))


def decode(b: Any, t: CacheType | str, n: int) -> np.ndarray:
    """uint8 rows ``b`` [..., row bytes] of type ``t`` -> float32 [..., n]."""
    t = cache_type(t)
    b = np.ascontiguousarray(b, dtype=np.uint8)
    flat = b.reshape(-1, b.shape[-1])
    if t.code == 0:
        out = flat.view(F32).copy()
    else:
        out = np.empty((flat.shape[0], n), dtype=F32)
        _decode_rows(flat, t.code, out)
    return out.reshape(b.shape[:-1] + (n,))


@attrs.frozen
class Codec:
    """How one cache field is stored: the type, and the Hadamard size rows are turned by before they
    are stored (0: none). :meth:`encode` turns and packs rows [n, *shape]; :meth:`decode` unpacks and
    turns them back (what the general attention path and other readers get: the model's own space)."""

    type: CacheType
    rot: int = 0

    def alloc(self, cap: int, shape: tuple[int, ...]) -> np.ndarray:
        """Room for ``cap`` rows of ``shape``: uint8 ``[cap, *shape[:-1], row bytes]``, stored head-major (a
        view of ``[*shape[:-1], cap, row bytes]`` memory): one decode row's attention task reads one kv head's
        rows, and reading them from one contiguous run streams at the memory's rate, where rows at a stride
        of all the heads' rows left it latency-bound (SmolLM2, f16 at 4096 keys: 9.5 -> 5.5 ms of attention a
        token on 2 threads). Numpy code sees the usual axes; the kernels take the strides
        (:func:`plinth.ops.attend_q.attention_rows_q`)."""
        lead = tuple(shape[:-1])
        store = np.empty(lead + (cap, self.type.row_bytes(shape[-1])), dtype=np.uint8)
        return np.moveaxis(store, len(lead), 0)

    def encode(self, a: Any) -> np.ndarray:
        return encode(rotate(np.asarray(a, dtype=F32), self.rot), self.type, fit=True)

    def decode(self, b: np.ndarray, n: int) -> np.ndarray:
        return rotate(decode(b, self.type, n), self.rot)


@attrs.frozen
class CacheTypes:
    """The cache's storage types: ``k`` for keys (and MLA latents, indexer keys), ``v`` for values;
    ``rotate`` False switches the rotation off (else ``PLINTH_ATTN_ROT_DISABLE`` decides)."""

    k: CacheType = attrs.field(default=CACHE_TYPES["f32"], converter=cache_type)
    v: CacheType = attrs.field(default=CACHE_TYPES["f32"], converter=cache_type)
    rotate: bool = True

    @property
    def plain(self) -> bool:
        return self.k.code == 0 and self.v.code == 0

    def codec(self, role: str, shape: tuple[int, ...], always_rotate: bool = False) -> Codec | None:
        """The :class:`Codec` of a field of rows ``shape`` in role "k" or "v" (None: float32, as always).
        ``always_rotate``: rotated whenever stored in another type than float32 (DeepSeek's indexer keys,
        as llama.cpp does for them whatever the switch)."""
        t = self.k if role == "k" else self.v
        if t.code == 0:
            return None
        hd = int(shape[-1])
        if hd % t.block:
            raise UserError(f"a {t.name} cache needs head sizes that are multiples of {t.block}; this model "
                            f"has rows of {hd} values (use another --cache-type-{role})")
        if always_rotate and hd % 64 == 0:
            n = 64
            while hd % (2 * n) == 0:
                n *= 2
            return Codec(t, n)
        if not self.rotate:
            return Codec(t, 0)
        return Codec(t, k_rotation(t, hd) if role == "k" else v_rotation(t, hd))

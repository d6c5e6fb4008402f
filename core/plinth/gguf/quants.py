"""Vectorised numpy dequantizers for GGML block types.

Each dequantizer takes the stored bytes as uint8 ``[n_blocks, type_size]`` and
returns float32 ``[n_blocks, block_size]``; :func:`dequantize` handles shapes.
Results are bit-identical to gguf-py's reference (checked in tests). The table
:data:`DEQUANTIZERS` is the extension point for kernels that keep weights
quantized and dequantize inside the matmul.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import UserError
from .constants import BLOCK_SIZES, GGMLType

F32 = np.float32


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """[n, 1] float32 from the little-endian f16 at byte ``start`` of each block."""
    return blocks[:, start:start + 2].copy().view("<f2").astype(F32)


def _q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    qs = b[:, 2:18]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - np.int8(8)
    return d * q.astype(F32)


def _q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b, 0), _f16(b, 2)
    qs = b[:, 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return d * q.astype(F32) + m


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes of 32 packed bits -> [n, 32] bit values (bit j for element j)."""
    # bit j of the little-endian u32 is bit j % 8 of byte j // 8
    return np.unpackbits(qh, axis=1, bitorder="little")


def _q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    qs = b[:, 6:22]
    q = np.empty((b.shape[0], 32), np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[:, :16])
    np.right_shift(qs, 4, out=q[:, 16:])
    high = _high_bits(b[:, 2:6])
    high <<= 4
    q |= high
    q -= np.uint8(16)  # wraps to the int8 value q - 16
    return np.multiply(q.view(np.int8), d, dtype=F32)


def _q5_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b, 0), _f16(b, 2)
    qh = _high_bits(b[:, 4:8])
    qs = b[:, 8:24]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1) | (qh << 4)
    return d * q.astype(F32) + m


def _q8_0(b: np.ndarray) -> np.ndarray:
    # one fused int8 * f32 -> f32 pass over the strided quants (no int8 -> f32 temporary)
    out = np.empty((b.shape[0], 32), F32)
    np.multiply(b[:, 2:34].view(np.int8), _f16(b, 0), out=out, dtype=F32)
    return out


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs packed in 12 bytes of a Q4_K / Q5_K super-block."""
    s = scales.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty((s.shape[0], 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(F32), mn.astype(F32)


def _q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    qs = b[:, 16:144].reshape(n, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32).astype(F32)
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, 256)


def _q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48]  # [n, 32]: bit 2j and 2j+1 hold the high bits of sub-blocks 2j, 2j+1
    qs = b[:, 48:176].reshape(n, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4
    q = (low | high).astype(F32)
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, 256)


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 32)
    scales = b[:, 192:208].copy().view(np.int8).astype(F32).reshape(n, 2, 8)
    d = _f16(b, 208)
    lo = np.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
    hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    q = ((lo | (hi << 4)).astype(np.int8) - np.int8(32)).astype(F32)  # [n, 2, 4, 32]
    # element l of quarter k uses scale index (l // 16) + 2 k within its half
    s = scales.reshape(n, 2, 4, 2)[:, :, :, :, None]
    q = q.reshape(n, 2, 4, 2, 16)
    return (d.reshape(n, 1, 1, 1, 1) * s * q).reshape(n, 256)


_SHIFTS_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]


def _q2_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    scales = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).astype(F32)).reshape(n, 2, 4, 2, 1)
    ml = (dmin * (scales >> 4).astype(F32)).reshape(n, 2, 4, 2, 1)
    # half h, shift j, element l: bits 2j of qs[h*32 + l]; scale index 8h + 2j + l // 16
    q = ((b[:, 16:80].reshape(n, 2, 1, 32) >> _SHIFTS_2BIT) & 3).astype(F32).reshape(n, 2, 4, 2, 16)
    return (dl * q - ml).reshape(n, 256)


def _q3_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    hmask = b[:, 0:32].reshape(n, 1, 1, 32)
    qs = b[:, 32:96].reshape(n, 2, 1, 32)
    s = b[:, 96:108]
    d = _f16(b, 108)
    # 16 six-bit scales: low nibbles from bytes 0-7, high two bits from bytes 8-11
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)
    high = (s[:, 8:12][:, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]) & 3
    sc = ((low | (high.reshape(n, 16) << 4)).astype(np.int8) - np.int8(32)).astype(F32)
    dl = (d * sc).reshape(n, 2, 4, 2, 1)
    lo = ((qs >> _SHIFTS_2BIT) & 3).astype(np.int8)  # [n, 2, 4, 32]
    bit = (hmask >> np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1)) & 1  # bit 4h + j
    q = (lo - np.int8(4) * (np.int8(1) - bit.astype(np.int8))).astype(F32).reshape(n, 2, 4, 2, 16)
    return (dl * q).reshape(n, 256)


_FP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=F32)


def _mxfp4(b: np.ndarray) -> np.ndarray:
    e = b[:, 0].astype(np.int32)
    # E8M0 scale, halved for the doubled E2M1 table: 2^(e - 128)
    d = np.where(e == 0, F32(2.0 ** -128), np.ldexp(F32(1.0), e - 128).astype(F32))[:, None]
    qs = b[:, 1:17]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return (d * _FP4_VALUES[q]).astype(F32)


def _ue4m3(x: np.ndarray) -> np.ndarray:
    exp = ((x >> 3) & 0x0F).astype(np.int32)
    man = (x & 0x07).astype(F32)
    normal = (F32(1.0) + man / F32(8.0)) * np.ldexp(F32(1.0), exp - 7).astype(F32)
    value = np.where(exp == 0, man * F32(2.0 ** -9), normal)
    return np.where((x == 0) | (x == 0x7F), F32(0.0), value * F32(0.5)).astype(F32)


def _nvfp4(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _ue4m3(b[:, 0:4]).reshape(n, 4, 1)
    qs = b[:, 4:36].reshape(n, 4, 8)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
    return (d * _FP4_VALUES[q]).reshape(n, 64).astype(F32)


DEQUANTIZERS: dict[GGMLType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLType.Q4_0: _q4_0, GGMLType.Q4_1: _q4_1, GGMLType.Q5_0: _q5_0, GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0, GGMLType.Q4_K: _q4_k, GGMLType.Q5_K: _q5_k, GGMLType.Q6_K: _q6_k,
    GGMLType.Q2_K: _q2_k, GGMLType.Q3_K: _q3_k, GGMLType.MXFP4: _mxfp4, GGMLType.NVFP4: _nvfp4,
}

#: types read through gguf-py's reference dequantizer (slower; no native kernel yet)
REFERENCE_ONLY = (GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.TQ1_0,
                  GGMLType.TQ2_0, GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S, GGMLType.IQ3_XXS,
                  GGMLType.IQ3_S, GGMLType.IQ1_S, GGMLType.IQ1_M)


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Stored data of a tensor -> float32 array of numpy ``shape``.

    raw: what :meth:`GGUFFile.raw` returns (typed for plain types, uint8 rows for blocks).
    """
    gtype = GGMLType(ggml_type)
    if gtype == GGMLType.F32:
        return np.asarray(raw, dtype=F32).reshape(shape)
    if gtype == GGMLType.F16:
        return np.asarray(raw).view("<f2").astype(F32).reshape(shape)
    if gtype == GGMLType.BF16:
        return (np.asarray(raw).view("<u2").astype(np.uint32) << 16).view(F32).reshape(shape)
    fn = DEQUANTIZERS.get(gtype)
    block, type_size = BLOCK_SIZES[gtype]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, type_size)
    if fn is None:
        if gtype in REFERENCE_ONLY:
            import gguf

            return np.asarray(gguf.quants.dequantize(blocks.reshape(-1), gtype), dtype=F32).reshape(shape)
        raise UserError(f"tensor type {gtype.name} cannot be dequantized by plinth")
    return fn(blocks).reshape(shape)


def dequantize_rows(raw: np.ndarray, ggml_type: int, rows: np.ndarray, row_len: int) -> np.ndarray:
    """Dequantize only ``rows`` of a 2-D tensor (an embedding lookup). Returns [len(rows), row_len]."""
    gtype = GGMLType(ggml_type)
    picked = np.asarray(raw)[np.asarray(rows)]
    return dequantize(picked, gtype, (len(rows), row_len))

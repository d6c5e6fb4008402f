"""Integer dot products for the int8-activation kernels, eight weight rows at once, on weights
repacked at load; written as LLVM IR (``numba.extending.intrinsic``) with the instructions
llama.cpp's x86 kernels are built on.

:func:`repack` rewrites a weight's rows in groups of eight: per block, the eight rows' f16 scales
side by side, then their quants interleaved four bytes at a time, so that one 32-byte load holds
the same four quant bytes of all eight rows (lane i: row i). An activation's four int8 values,
broadcast to the eight lanes, meet that load in one ``vpdpbusd`` (AVX512-VNNI; ``pmaddubsw`` +
``pmaddwd`` on AVX2): eight weight rows advance four values each. A 32-value block is eight such
products into an int32 vector whose lane i is row i's exact integer sum for the block; one
conversion and one FMA with the eight rows' scales (times the activation's) add it to a float
accumulator, and the eight results land with one vector store. Against one weight row at a time
that removes the per-row float work of every block and the horizontal sums, and the unpacking of
the weight bytes is shared by every activation row of the batch.

Per block of eight rows, ``value = scale * (q - c) + offset`` with q the stored unsigned quants:

- Q4_0 c = 8, Q5_0 c = 16: the ``- c`` is exact integer arithmetic on the activation block's sum
  of quants (``xi``, per 16 values), not a float term; Q4_1 / Q5_1 offset m (times ``xsd``);
- Q8_0: with VNNI the quants plus 128 as unsigned bytes, c = 128; on AVX2 (whose ``pmaddubsw``
  would saturate on those) the sign trick, ``|w|`` against the activation with w's sign;
- Q4_K / Q5_K: scale ``d * sc_j``, offset ``-dmin * m_j`` per 32-value sub-block (the 6-bit
  scales decoded at repack into one byte each, eight rows side by side);
- Q6_K: per 16-value sub-block the integer sum of ``q - 32`` times its int8 scale, the two of a
  32-value unit added as integers, then scale d (repacked as float32: a Q6_K file's f16 d are
  nearly all subnormal, 99.8-100% in Gemma-3 270M's, and converting those in the loop made the
  product ~1.5x slower).

**Sixteen lanes.** With AVX512-VNNI the loops of :data:`WIDE_KINDS` also come in a 512-bit form
(``kernel_address(code, 16)``)
that multiplies two groups at once: a weight repacked with ``pairs`` holds groups 2t and 2t + 1 block
by block (block b of the first, then block b of the second), each field of the two is read and joined
into one vector (lane i < 8: row i of the first group, lane 8 + i: row i of the second), and every
step above runs on sixteen lanes. A lane's integer sums and float steps are those of the eight-lane
form, so the bits are too; the instruction count per weight row is lower (on Zen 4, where the
multiply pipes run both ``vpdpbusd`` and the float multiplies, a few percent on batches).

Every activation row goes through the same operations whatever the batch (its integer sums are
exact, its float steps the same ``llvm.fma`` in the same order), so a row's results do not depend
on the rows beside it; VNNI and AVX2 give the same integers, hence the same bits.

In row groups of four and eight each block's bytes are prefetched :data:`PREFETCH_BYTES` ahead into the
L1 cache (a batch is compute-bound, and the hardware prefetchers left the weights' memory latency
unhidden); Q6_K's one-row products prefetch :data:`PREFETCH_BLOCKS` blocks ahead into the L2 cache.
:func:`quantize_row` quantizes the activations (the int8 side of these products) as vector code too.

A weight whose row count is not a multiple of eight is padded with zero rows to the next group.
Arrays are not bounds-checked: callers pass whole groups. :func:`available` says whether the host
has AVX2 and F16C (else callers use the f32 kernels); :func:`has_vnni` whether the VNNI form is
compiled.
"""

from __future__ import annotations

import functools
import os

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..gguf.constants import GGMLType
from .jitcache import cfunc_address, emit_prefetch

_i8, _i16, _i32, _i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_f32 = ir.FloatType()
_v32i8 = ir.VectorType(_i8, 32)
_v16i16 = ir.VectorType(_i16, 16)
_v8i32 = ir.VectorType(_i32, 8)
_v8f = ir.VectorType(_f32, 8)


def host_features() -> dict:
    """The host CPU's features as LLVM names them (``avx2``, ``avx512vnni``, ...; empty where unknown): a copy
    of the query's answer, asked once a process (it takes ~0.2 ms, and every int8 weight asks at its repack)."""
    return dict(_host_features())


@functools.lru_cache(maxsize=1)
def _host_features() -> dict:
    try:
        import llvmlite.binding as llvm

        return dict(llvm.get_host_cpu_features())
    except Exception:  # pragma: no cover - llvmlite without host feature queries
        return {}


def available() -> bool:
    """AVX2 and F16C on the host (what the kernels of :mod:`plinth.quant.kernels_i8` need)."""
    f = host_features()
    return bool(f.get("avx2")) and bool(f.get("f16c"))


def has_vnni() -> bool:
    """AVX512-VNNI with 256-bit forms (AVX512VL) on the host: the one-instruction dot is compiled."""
    f = host_features()
    return bool(f.get("avx512vnni")) and bool(f.get("avx512vl"))


# ---------------------------------------------------------------------------------------------
# IR helpers


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _const(ty, value):
    return ir.Constant(ty, value)


def _splat(ty, n, value):
    return ir.Constant(ir.VectorType(ty, n), [value] * n)


def _mask(idx):
    idx = list(idx)
    return ir.Constant(ir.VectorType(_i32, len(idx)), idx)


def _broadcast(builder, v, n):
    """An n-vector of copies of the scalar ``v``."""
    vec = builder.insert_element(ir.Constant(ir.VectorType(v.type, n), None), v, _const(_i32, 0))
    return builder.shuffle_vector(vec, vec, _mask([0] * n))


def _load(builder, p, ty):
    v = builder.load(builder.bitcast(p, ty.as_pointer()))
    v.align = 1
    return v


def _at(builder, base, off):
    """``base`` (an i8*) plus ``off`` bytes (an int or an i64 value)."""
    return builder.gep(base, [_const(_i64, off) if isinstance(off, int) else off])


def _fma(builder, a, b, c):
    name = "llvm.fma.f32" if a.type == _f32 else f"llvm.fma.v{a.type.count}f32"
    return builder.call(_fn(builder, name, a.type, [a.type] * 3), [a, b, c])


def _psign(builder, a, b):
    """a with b's sign (a negated where b < 0, zero where b == 0)."""
    return builder.call(_fn(builder, "llvm.x86.avx2.psign.b", _v32i8, [_v32i8, _v32i8]), [a, b])


def _bits(builder, v, shift, mask):
    """(v >> shift) & mask on a vector of bytes (shift, mask: ints)."""
    n = v.type.count
    if shift:
        v = builder.lshr(v, _splat(_i8, n, shift))
    return builder.and_(v, _splat(_i8, n, mask))


_v8h = ir.VectorType(ir.HalfType(), 8)
_v8i8 = ir.VectorType(_i8, 8)


# ---------------------------------------------------------------------------------------------
# repacking (numpy, once at load)


def _scale_min_k4(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 12 scale bytes [..., 12] -> (scales, mins) [..., 8] as uint8 (6 bits each)."""
    s = sc12.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


#: kind -> (values a block, block bytes, repacked bytes of eight rows' block)
LAYOUTS = {"q4_0": (32, 18, 144), "q4_1": (32, 20, 160), "q5_0": (32, 22, 176), "q5_1": (32, 24, 192),
           "q8_0": (32, 34, 272), "q4_k": (256, 144, 1184), "q5_k": (256, 176, 1440), "q6_k": (256, 210, 1696)}

#: GGML type code -> kind, the types with an interleaved form
TYPE_CODES = {int(GGMLType[kind.upper()]): kind for kind in LAYOUTS}


def repack(raw: np.ndarray, kind: str, pairs: bool = False) -> np.ndarray:
    """uint8 ``[n_out, row_bytes]`` of type ``kind`` -> uint8 ``[ceil(n_out / 8), blocks * group_bytes]``:
    each group of eight rows, block after block, in the layout the kernels read (rows past n_out:
    zero bytes, so zero scales and zero products). ``pairs``: groups 2t and 2t + 1 (rows 2t and 2t + 1 of
    the result, one stretch of memory) hold block 0 of group 2t, block 0 of group 2t + 1, block 1 of
    each, ...: what the sixteen-lane loop reads as one stream (an odd last group stays as it is)."""
    qk, bs, gbs = LAYOUTS[kind]
    n_out = raw.shape[0]
    g = -(-n_out // 8)
    if n_out % 8:
        raw = np.concatenate([raw, np.zeros((8 * g - n_out, raw.shape[1]), np.uint8)])
    b = np.ascontiguousarray(raw).reshape(g, 8, -1, bs)  # [group, row, block, byte]
    nb = b.shape[2]

    def halves(off):  # the eight rows' f16 at off: [g, nb, 8, 2]
        return b[:, :, :, off:off + 2].transpose(0, 2, 1, 3)

    def words(off, n):  # n bytes at off, interleaved 4 bytes a row: [g, nb, n / 4, 8, 4]
        return b[:, :, :, off:off + n].reshape(g, 8, nb, n // 4, 4).transpose(0, 2, 3, 1, 4)

    def per_row_bytes(a):  # [g, 8, nb, k] -> [g, nb, k, 8]: byte j of the eight rows side by side
        return a.transpose(0, 2, 3, 1)

    if kind == "q4_0":
        fields = [halves(0), words(2, 16)]
    elif kind == "q4_1":
        fields = [halves(0), halves(2), words(4, 16)]
    elif kind == "q5_0":
        fields = [halves(0), words(2, 4), words(6, 16)]
    elif kind == "q5_1":
        fields = [halves(0), halves(2), words(4, 4), words(8, 16)]
    elif kind == "q8_0":
        fields = [halves(0), words(2, 32)]
    elif kind in ("q4_k", "q5_k"):
        sc, mn = _scale_min_k4(b[:, :, :, 4:16])
        fields = [halves(0), halves(2), per_row_bytes(sc), per_row_bytes(mn)]
        fields += [words(16, 128)] if kind == "q4_k" else [words(16, 32), words(48, 128)]
    elif kind == "q6_k":  # d as float32 (exact): real files' Q6_K d are f16 subnormals, slow to convert in the loop
        d32 = np.ascontiguousarray(b[:, :, :, 208:210]).view(np.float16).astype(np.float32).view(np.uint8)
        fields = [d32.transpose(0, 2, 1, 3), per_row_bytes(b[:, :, :, 192:208]), words(0, 128), words(128, 64)]
    else:  # pragma: no cover - LAYOUTS names the kinds
        raise ValueError(kind)
    # each field copied straight into its place (no whole-weight temporaries: they would stay in the heap)
    out = np.empty((g, nb, gbs), np.uint8)
    h = g - g % 2 if pairs else 0  # the groups that go in pairs
    paired = out[:h].reshape(h // 2, nb, 2, gbs)
    at = 0
    for f in fields:
        rest = f.shape[2:]
        width = int(np.prod(rest))
        places = [(out[h:, :, at:at + width].reshape((g - h, nb) + rest), f[h:])]
        if h:  # [pair, block, group of the pair, ...] from [pair, group of the pair, block, ...]
            places.append((paired[:, :, :, at:at + width].reshape((h // 2, nb, 2) + rest),
                           f[:h].reshape((h // 2, 2, nb) + rest).swapaxes(1, 2)))
        for dst, src in places:
            assert dst.base is out, "repack: a field's place is not a view"
            dst[...] = src
        at += width
    assert at == gbs, (kind, at)
    return out.reshape(g, nb * gbs)


# ---------------------------------------------------------------------------------------------
# unpacking in the kernel


class _Unit:
    """A 32-value unit of eight rows (sixteen in the 512-bit form): ``w`` eight <32 x i8> (<64 x i8>; lane
    i: row i's four unsigned quants for activation values 4j .. 4j+3), ``signed`` the signed quants for
    the sign trick (or None), ``parts`` (first dot, end dot, int lane scale or None, quant offset c) over
    which the integer sums go, ``scale`` / ``offset`` <8 x float> (<16 x float>; offset None when 0)."""

    __slots__ = ("w", "signed", "parts", "scale", "offset")

    def __init__(self, w, scale, offset=None, signed=None, parts=((0, 8, None, 0),)):
        self.w, self.scale, self.offset, self.signed, self.parts = w, scale, offset, signed, parts


class _Src:
    """Where a unit's weight bytes are read: one group's block (``lanes`` 8, lane i row i of the group) or
    the same block of two groups (``lanes`` 16: the second group's rows in lanes 8-15), ``ptrs`` their
    i8* addresses. :meth:`load` reads an eight-row field at a byte offset from each and joins them."""

    __slots__ = ("builder", "ptrs", "lanes")

    def __init__(self, builder, ptrs):
        self.builder, self.ptrs, self.lanes = builder, ptrs, 8 * len(ptrs)

    def load(self, off, ty):
        """The field of type ``ty`` (an eight-row vector) at byte ``off`` (an int or an i64 value), of
        every group read, joined into one vector of ``lanes / 8`` times its length."""
        b = self.builder
        vs = [_load(b, _at(b, p, off), ty) for p in self.ptrs]
        if len(vs) == 1:
            return vs[0]
        return b.shuffle_vector(vs[0], vs[1], _mask(range(2 * ty.count)))


def _vf(n):
    return ir.VectorType(_f32, n)


def _vi32(n):
    return ir.VectorType(_i32, n)


def _halves8(builder, src, off):
    """The rows' f16 at ``off`` as floats."""
    return builder.fpext(src.load(off, _v8h), _vf(src.lanes))


def _chunk(builder, src, off):
    """32 bytes of each group at ``off`` (four bytes a row)."""
    return src.load(off, _v32i8)


def _fifth_bits(builder, qh, j):
    """16 in byte t of lane i where bit 4j + t of row i's 32-bit qh is set, else 0 (Q5_0 / Q5_1)."""
    n = 4 * qh.type.count
    v = builder.lshr(qh, _splat(_i32, qh.type.count, 4 * j)) if j else qh
    v = builder.bitcast(v, ir.VectorType(_i8, n))
    v = builder.shuffle_vector(v, v, _mask([4 * (k // 4) for k in range(n)]))
    bit = builder.and_(v, ir.Constant(ir.VectorType(_i8, n), [1 << (k % 4) for k in range(n)]))
    return builder.select(builder.icmp_unsigned("!=", bit, _splat(_i8, n, 0)), _splat(_i8, n, 16),
                          _splat(_i8, n, 0))


def _fifth_bits_bitalg(builder, qh, j):
    """:func:`_fifth_bits` in one ``vpshufbitqmb`` (AVX512-BITALG): byte t of lane i takes bit 4j + t of row
    i's qh from the qword holding rows i and i ^ 1 as a mask bit, then 16 where it is set."""
    n = 4 * qh.type.count
    vb = ir.VectorType(_i8, n)
    idx = ir.Constant(vb, [32 * ((k // 4) % 2) + 4 * j + k % 4 for k in range(n)])
    mask_ty = ir.VectorType(ir.IntType(1), n)
    f = _fn(builder, f"llvm.x86.avx512.vpshufbitqmb.{8 * n}", mask_ty, [vb, vb])
    bits = builder.call(f, [builder.bitcast(qh, vb), idx])
    return builder.select(bits, _splat(_i8, n, 16), _splat(_i8, n, 0))


def _decode(builder, kind, src, vnni):
    """The one unit of the 32-value group-block at ``src`` (:class:`_Src`; the K-quants: :func:`_decode_k`)."""
    if kind in ("q4_0", "q4_1", "q5_0", "q5_1"):
        d = _halves8(builder, src, 0)
        has_m = kind in ("q4_1", "q5_1")
        off = 32 if has_m else 16
        qh = None
        if kind in ("q5_0", "q5_1"):
            qh = src.load(off, _v8i32)
            off += 32
        w = [None] * 8
        for k in range(4):
            c = _chunk(builder, src, off + 32 * k)
            w[k], w[k + 4] = _bits(builder, c, 0, 15), _bits(builder, c, 4, 15)
        if qh is not None:
            fifth = _fifth_bits_bitalg if vnni and host_features().get("avx512bitalg") else _fifth_bits
            w = [builder.or_(w[j], fifth(builder, qh, j)) for j in range(8)]
        c = {"q4_0": 8, "q5_0": 16}.get(kind, 0)
        return _Unit(w, d, _halves8(builder, src, 16) if has_m else None, parts=((0, 8, None, c),))
    if kind == "q8_0":
        d = _halves8(builder, src, 0)
        s = [_chunk(builder, src, 16 + 32 * k) for k in range(8)]
        if vnni:  # w + 128 as unsigned bytes, 128 times the activations' sum taken off as an integer
            return _Unit([builder.xor(v, _splat(_i8, v.type.count, 0x80)) for v in s], d, parts=((0, 8, None, 128),))
        return _Unit([_psign(builder, v, v) for v in s], d, signed=s)  # AVX2: pmaddubsw would saturate
    raise ValueError(kind)  # pragma: no cover


def _decode_k(builder, kind, src, t):
    """Units ``2t`` and ``2t + 1`` of Q4_K / Q5_K (the two nibbles of the same bytes), or units
    ``(h, k1)`` and ``(h, k1 + 2)`` of Q6_K (t = 2h + k1, the same low bytes again) of the K-quant
    super-block at ``src`` (:class:`_Src`), as (unit, unit index) pairs; ``t`` an i64 value (a loop of
    four turns, not eight unrolled units: that keeps the first compile short, and a pair shares its
    loads and takes constant shifts)."""
    i64 = lambda v: _const(_i64, v)  # noqa: E731

    def off(*terms):  # a byte offset from ints and (value, factor) pairs
        total = i64(sum(x for x in terms if isinstance(x, int)))
        for x in terms:
            if not isinstance(x, int):
                total = builder.add(total, builder.mul(x[0], i64(x[1])))
        return total

    L = src.lanes
    nb = 4 * L  # bytes a vector

    def shifted(v, amount, mask):  # (v >> amount) & mask on a vector of bytes, amount an i64 value
        # shifted as words, which x86 does in one instruction (a byte shift by a run-time amount
        # is widened, shifted and narrowed again); the bits a byte takes from its neighbour land
        # above ``mask`` (mask < 2 ** (8 - amount) at every call), so the bytes are the same
        sh = _broadcast(builder, builder.trunc(amount, _i16), nb // 2)
        w = builder.lshr(builder.bitcast(v, ir.VectorType(_i16, nb // 2)), sh)
        return builder.and_(builder.bitcast(w, ir.VectorType(_i8, nb)), _splat(_i8, nb, mask))

    one = i64(1)
    if kind in ("q4_k", "q5_k"):
        d, dmin = _halves8(builder, src, 0), _halves8(builder, src, 16)
        qs = 160 if kind == "q4_k" else 416
        q = [_chunk(builder, src, off(qs + 32 * k, (t, 256))) for k in range(8)]
        qh = [_chunk(builder, src, 160 + 32 * k) for k in range(8)] if kind == "q5_k" else None
        out = []
        for half in range(2):
            j = builder.add(builder.mul(t, i64(2)), i64(half))
            sc = builder.uitofp(src.load(off(32 + 8 * half, (t, 16)), _v8i8), _vf(L))
            mn = builder.uitofp(src.load(off(96 + 8 * half, (t, 16)), _v8i8), _vf(L))
            w = [_bits(builder, q[k], 4 * half, 15) for k in range(8)]
            if qh is not None:  # bit j of the qh byte of each value
                w = [builder.or_(w[k], builder.shl(shifted(qh[k], j, 1), _splat(_i8, nb, 4))) for k in range(8)]
            out.append((_Unit(w, builder.fmul(d, sc), builder.fneg(builder.fmul(dmin, mn))), j))
        return out
    if kind == "q6_k":  # unit 4h + k: values 128h + 32k ..; k = k1 + 2 kk
        d = src.load(0, _v8f)  # (the eight rows' d as float32: see repack)
        h, k1 = builder.lshr(t, one), builder.and_(t, one)
        ql0 = off(160, (h, 512), (k1, 256))
        qh0 = off(1184, (h, 256))
        ql = [_chunk(builder, src, builder.add(ql0, i64(32 * jj))) for jj in range(8)]
        qh = [_chunk(builder, src, builder.add(qh0, i64(32 * jj))) for jj in range(8)]
        out = []
        for kk in range(2):
            k = builder.add(k1, i64(2 * kk))
            hi_shift = builder.mul(k, i64(2))
            w = [builder.or_(_bits(builder, ql[jj], 4 * kk, 15),
                             builder.shl(shifted(qh[jj], hi_shift, 3), _splat(_i8, nb, 4))) for jj in range(8)]
            sub = off(0, (h, 8), (k, 2))  # the first 16-value sub-block's index
            lane = [builder.sext(src.load(off(32 + 8 * p, (sub, 8)), _v8i8), _vi32(L))
                    for p in range(2)]
            out.append((_Unit(w, d, parts=((0, 4, lane[0], 32), (4, 8, lane[1], 32))),
                        builder.add(builder.mul(h, i64(4)), k)))
        return out
    raise ValueError(kind)  # pragma: no cover


def _dot_acc(builder, acc, w, x, vnni):
    """acc + (lane k: sum_{j < 4} w[4k + j] * x[4k + j]) as <8 x i32> (<16 x i32> for 64-byte w and x, VNNI
    only); acc None: from zero."""
    if vnni:
        L = w.type.count // 4
        v = _vi32(L)
        f = _fn(builder, f"llvm.x86.avx512.vpdpbusd.{32 * L}", v, [v, v, v])
        return builder.call(f, [acc if acc is not None else _splat(_i32, L, 0), builder.bitcast(w, v),
                                builder.bitcast(x, v)])
    p16 = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _v16i16, [_v32i8, _v32i8]), [w, x])
    p = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", _v8i32, [_v16i16, _v16i16]), [p16, _splat(_i16, 16, 1)])
    return p if acc is None else builder.add(acc, p)


# ---------------------------------------------------------------------------------------------
# the group loop


class _Ptrs:
    """The arrays of a call as values in the kernel function: byte pointers, first-axis strides, n."""

    __slots__ = ("gp", "xq", "sxq", "n", "xd", "sd", "xs", "ss", "xi", "si", "out", "so")

    def __init__(self, *values):
        for k, v in zip(self.__slots__, values):
            setattr(self, k, v)


#: how far ahead of the block being multiplied its weight bytes are asked for (at least
#: PREFETCH_BLOCKS blocks): a batch's product is compute-bound from the cache but was not hiding the
#: weights' memory latency behind that compute (a 16-row SmolLM2 step -5 to -20%, k = 8 verify forwards
#: -5%, one row unchanged)
PREFETCH_BYTES = 2048
#: a one-row product's prefetch (:data:`PREFETCH_ONE_ROW`): blocks ahead, and the locality 2
#: (``prefetcht1``, into the L2 cache). Into the L1 cache (3) two blocks ahead, as a batch's, the
#: prefetches of a weight streamed from memory waited on the L1's few miss buffers: 16384 x 5632 Q6_K,
#: one activation row, one thread 9.5 -> 3.0 ms (8 -> 25 GB/s; two threads 5.5 -> 2.6 ms). A batch keeps
#: two blocks into the L1 (eight into the L2 took SmolLM2's k = 8 verify forward from 9.3-9.5 to 9.9-10.0
#: ms, though a 16384 x 5632 Q6_K product of eight rows went from 12.3 to 8.5 ms)
PREFETCH_BLOCKS = 8
PREFETCH_LOCALITY = 2
#: types whose one-row products prefetch too: Q6_K's one-row loop streamed a weight larger than the
#: L3 cache at a quarter of Q4_K's bytes a second (16384 x 5632, one thread: 13.1 -> 10.0 ms)
PREFETCH_ONE_ROW = ("q6_k",)


def _emit_group(builder, kind, R, ptrs, r0, o0, vnni, L=8):
    """IR for out[r0 + i, o0 : o0 + L] = x[r0 + i] . W[o0 : o0 + L], i < R: L = 8 one group's rows, L = 16
    those of a pair of groups (:func:`repack`'s ``pairs``: each block of the first then the same of the
    second), in one vector."""
    qk, _, gbs = LAYOUTS[kind]
    idx = r0.type
    n = ptrs.n
    xps = [_at(builder, ptrs.xq, builder.mul(builder.add(r0, _const(idx, i)), ptrs.sxq)) for i in range(R)]
    r0_bytes = builder.mul(r0, _const(idx, 4))
    xd0, xs0, xi0 = (_at(builder, a, r0_bytes) for a in (ptrs.xd, ptrs.xs, ptrs.xi))
    sd, ss, si = ptrs.sd, ptrs.ss, ptrs.si
    gp = ptrs.gp
    zero = ir.Constant(_vf(L), [0.0] * L)
    offsets = kind in ("q4_1", "q5_1", "q4_k", "q5_k")
    accs = [cgutils.alloca_once_value(builder, zero) for _ in range(R)]
    saccs = [cgutils.alloca_once_value(builder, zero) for _ in range(R)] if offsets else []
    for a in accs + saccs:
        builder.store(zero, a)

    def scalar(p, i, ty=_f32):
        return _load(builder, _at(builder, p, 4 * i), ty)

    def unit(u, iu):
        """Unit u at activation unit index iu (i64): every row's integer sums, scaled, accumulated."""
        xdp = _at(builder, xd0, builder.mul(iu, sd))
        xsp = _at(builder, xs0, builder.mul(iu, ss))
        xip = _at(builder, xi0, builder.mul(builder.mul(iu, _const(idx, 2)), si))
        xo = builder.mul(iu, _const(idx, 32))
        for i in range(R):
            total = None
            for lo, hi, lane, c in u.parts:
                chains = [None, None]
                for j in range(lo, hi):
                    xv = _broadcast(builder, _load(builder, _at(builder, xps[i], builder.add(xo, _const(idx, 4 * j))),
                                                   _i32), L)
                    xv = builder.bitcast(xv, ir.VectorType(_i8, 4 * L))
                    if u.signed is not None:
                        xv = _psign(builder, xv, u.signed[j])
                    chains[j & 1] = _dot_acc(builder, chains[j & 1], u.w[j], xv, vnni)
                isum = builder.add(chains[0], chains[1]) if chains[1] is not None else chains[0]
                if c:
                    xi = scalar(xip, i, _i32)
                    if hi - lo == 8:  # both 16-value sums of the unit
                        xi = builder.add(xi, scalar(_at(builder, xip, si), i, _i32))
                    else:
                        xi = scalar(_at(builder, xip, builder.mul(si, _const(idx, lo // 4))), i, _i32)
                    isum = builder.sub(isum, _broadcast(builder, builder.mul(xi, _const(_i32, c)), L))
                if lane is not None:
                    isum = builder.mul(isum, lane)
                total = isum if total is None else builder.add(total, isum)
            scale = builder.fmul(u.scale, _broadcast(builder, scalar(xdp, i), L))
            builder.store(_fma(builder, builder.sitofp(total, _vf(L)), scale, builder.load(accs[i])), accs[i])
            if u.offset is not None:
                builder.store(_fma(builder, u.offset, _broadcast(builder, scalar(xsp, i), L),
                                   builder.load(saccs[i])), saccs[i])

    per = qk // 32
    one_row = R < 4  # (a one-row product streams its weight: far ahead, into the L2 cache; a batch computes
    ahead = max(PREFETCH_BYTES, (PREFETCH_BLOCKS if one_row else 2) * gbs)  # on each block: near, into the L1)
    locality = PREFETCH_LOCALITY if one_row else 3
    with cgutils.for_range(builder, builder.udiv(n, _const(idx, qk))) as loop:
        at = builder.mul(loop.index, _const(idx, gbs * L // 8))  # (a pair's two groups block by block)
        blocks = [_at(builder, gp, at)] + ([_at(builder, gp, builder.add(at, _const(idx, gbs)))] if L == 16 else [])
        # (read, the locality above, data; past the group: the next one's)
        for gb in blocks:
            for line in range(-(-gbs // 64) if R >= 4 or kind in PREFETCH_ONE_ROW else 0):
                emit_prefetch(builder, _at(builder, gb, ahead + 64 * line), locality=locality)
        src = _Src(builder, blocks)
        if per == 1:
            unit(_decode(builder, kind, src, vnni), loop.index)
        else:
            with cgutils.for_range(builder, _const(idx, per // 2)) as sub:
                for u, j in _decode_k(builder, kind, src, sub.index):
                    unit(u, builder.add(builder.mul(loop.index, _const(idx, per)), j))
    for i in range(R):
        v = builder.load(accs[i])
        if offsets:
            v = builder.fadd(v, builder.load(saccs[i]))
        outp = _at(builder, ptrs.out, builder.add(builder.mul(builder.add(r0, _const(idx, i)), ptrs.so),
                                                  builder.mul(o0, _const(idx, 4))))
        st = builder.store(v, builder.bitcast(outp, _vf(L).as_pointer()))
        st.align = 4


def _emit_all(builder, kind, ptrs, o0, lo, hi, vnni, G, L=8):
    """Activation rows lo .. hi - 1: groups of G, then one group of each smaller power of two the rest holds
    (``L``: :func:`_emit_group`'s)."""
    idx = lo.type
    m = builder.sub(hi, lo)
    big = _const(idx, G)
    with cgutils.for_range(builder, builder.udiv(m, big)) as loop:
        _emit_group(builder, kind, G, ptrs, builder.add(lo, builder.mul(loop.index, big)), o0, vnni, L)
    r = cgutils.alloca_once_value(builder, builder.add(lo, builder.mul(builder.udiv(m, big), big)))
    g = G // 2
    while g:
        bit = _const(idx, g)
        with builder.if_then(builder.icmp_unsigned("!=", builder.and_(m, bit), _const(idx, 0))):
            _emit_group(builder, kind, g, ptrs, builder.load(r), o0, vnni, L)
            builder.store(builder.add(builder.load(r), bit), r)
        g //= 2


_I8P = _i8.as_pointer()
#: the kernel function's arguments: _Ptrs' fields, then o0, r_lo, r_hi
_FN_ARGS = [_I8P, _I8P, _i64, _i64, _I8P, _i64, _I8P, _i64, _I8P, _i64, _I8P, _i64, _i64, _i64, _i64]


def _kernel_fn(module, kind, vnni, G, L=8):
    """One type's loop as a function of its own in ``module`` (defined on first use, never inlined):
    LLVM optimises each type's code apart, which keeps the first compile short (one function holding
    every type's unrolled loops took twice as long). ``L`` 16: two groups a call (:func:`_emit_group`)."""
    name = f"plinth_x{L}_{kind}_{'vnni' if vnni else 'avx2'}_{G}"
    fn = cgutils.get_or_insert_function(module, ir.FunctionType(ir.VoidType(), _FN_ARGS), name)
    if fn.is_declaration:
        fn.linkage = "internal"
        fn.attributes.add("noinline")
        fn.attributes.add("nounwind")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        *vals, o0, lo, hi = fn.args
        _emit_all(b, kind, _Ptrs(*vals), o0, lo, hi, vnni, G, L)
        b.ret_void()
    return fn


def _typing(grp, xq, xdt, xsdt, xit, out):
    if not (isinstance(grp, types.Array) and grp.ndim == 1 and all(
            isinstance(a, types.Array) and a.ndim == 2 for a in (xq, xdt, xsdt, xit, out))):
        raise TypeError("groups_<type> takes a 1-D group of weight rows and 2-D activation and output arrays")
    return 8 if has_vnni() else 4


def _as_i64(builder, v):
    """An integer value widened to i64 (signed)."""
    return v if v.type == _i64 else builder.sext(v, _i64)


def _dim(builder, tup, i):
    """Item ``i`` of an array's shape or strides tuple, as i64."""
    return _as_i64(builder, cgutils.unpack_tuple(builder, tup)[i])


def _call_args(context, builder, sig, args):
    """The kernel function's argument values from the intrinsic's last nine arguments."""
    grp, xq, xd, xs, xi, out = [cgutils.create_struct_proxy(ty)(context, builder, value=v)
                                for ty, v in zip(sig.args[-9:-3], args[-9:-3])]

    def base(a):
        return builder.bitcast(a.data, _I8P)

    def stride(a):
        return _dim(builder, a.strides, 0)

    vals = [base(grp), base(xq), stride(xq), _dim(builder, xq.shape, 1), base(xd), stride(xd), base(xs), stride(xs),
            base(xi), stride(xi), base(out), stride(out)]
    return vals + [_as_i64(builder, a) for a in args[-3:]]


def make_group_dot(kind, vnni=None):
    """The intrinsic for one type alone (``vnni``: the VNNI or the AVX2 form; default: the host's)."""

    def group_dot(typingctx, grp, xq, xdt, xsdt, xit, out, o0, r_lo, r_hi):
        G = _typing(grp, xq, xdt, xsdt, xit, out)
        use_vnni = has_vnni() if vnni is None else vnni

        def codegen(context, builder, sig, args):
            builder.call(_kernel_fn(builder.module, kind, use_vnni, G), _call_args(context, builder, sig, args))
            return context.get_dummy_value()

        return types.void(grp, xq, xdt, xsdt, xit, out, o0, r_lo, r_hi), codegen

    group_dot.__name__ = f"groups_{kind}"
    return intrinsic(group_dot)


#: a compiled kernel's C signature: :data:`_FN_ARGS` with the pointers passed as integers
_KERNEL_SIG = types.void(*[types.int64] * len(_FN_ARGS))
_KERNEL_FN_TYPE = ir.FunctionType(ir.VoidType(), [_i64] * len(_FN_ARGS))


@intrinsic(prefer_literal=True)
def _kernel_body(typingctx, code, lanes, gp, xq, sxq, n, xd, sd, xs, ss, xi, si, out, so, o0, lo, hi):
    """The loop of type ``code`` over ``lanes`` weight rows a vector (literals) on :data:`_FN_ARGS` given as
    integers."""
    if not (isinstance(code, types.IntegerLiteral) and isinstance(lanes, types.IntegerLiteral)):
        return None
    kind = TYPE_CODES[code.literal_value]
    L = lanes.literal_value
    vnni = has_vnni()
    G = 8 if vnni else 4

    def codegen(context, builder, sig, args):
        vals = [builder.inttoptr(a, ty) if ty == _I8P else a for a, ty in zip(args[2:], _FN_ARGS)]
        builder.call(_kernel_fn(builder.module, kind, vnni, G, L), vals)
        return context.get_dummy_value()

    return types.void(code, lanes, *[types.int64] * len(_FN_ARGS)), codegen


#: the types whose products take the sixteen-lane loops where the host has them: the 32-value block types.
#: The K-quants' sixteen-lane loops were faster on a weight in the cache but slower in Gemma-3's forwards
#: (one-token steps +6-15%) and on the synthetic 1.1B file's weights at one row (1.6-1.95x as long, streamed
#: from memory; 1.15-1.7x with a one-row prefetch added), so those keep the eight-lane loops
WIDE_KINDS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
#: a weight of more bytes keeps the eight-lane loops: Gemma-3's 262144-row Q8_0 head (178 MB, streamed from
#: memory) took 6-12% longer at eight rows in the sixteen-lane form (the same at one row); SmolLM2's 30 MB
#: head was no slower
WIDE_MAX_BYTES = 64 << 20


def wide_available() -> bool:
    """The sixteen-lane form (:func:`kernel_address` with ``lanes=16``) runs here: AVX512-VNNI, and
    ``PLINTH_KERNEL_LANES`` not 8."""
    return has_vnni() and os.environ.get("PLINTH_KERNEL_LANES", "16").strip() != "8"


def kernel_address(code: int, lanes: int = 8) -> int:
    """The address of type ``code``'s compiled loop (a C function with :data:`_KERNEL_SIG`), compiled on
    first use and kept in numba's on-disk cache. ``lanes`` 8: one group of eight weight rows a call
    (:func:`call_group`); 16 (AVX512-VNNI only): two groups a call, in 512-bit vectors
    (:func:`call_group` on a pair of :func:`repack`'s ``pairs`` layout). Both give every output the same
    bits: a lane's integer sums and float steps are the same at either width.

    Each type is a compiled function of its own that :func:`call_group` reaches through its address,
    instead of code inlined into :func:`plinth.quant.kernels_i8.linear`: numba copies a callee's code
    into every function that calls it, and optimises and emits it again there (the product's parallel
    region, its wrapper and the function itself: three times). Apart, a type costs one compile of its
    loop, 0.2-0.5 s, and only the types a model holds are compiled (all eight in ``linear``: 7 s)."""

    if lanes not in (8, 16) or (lanes == 16 and not (has_vnni() and TYPE_CODES[code] in WIDE_KINDS)):
        raise ValueError(f"kernel_address: {lanes} lanes for {TYPE_CODES[code]} (8, or 16 with AVX512-VNNI for "
                         f"{', '.join(WIDE_KINDS)})")

    def make():
        def kernel(gp, xq, sxq, n, xd, sd, xs, ss, xi, si, out, so, o0, lo, hi):
            _kernel_body(code, lanes, gp, xq, sxq, n, xd, sd, xs, ss, xi, si, out, so, o0, lo, hi)

        # (one cache entry a type and width)
        kernel.__name__ = kernel.__qualname__ = f"kernel_{TYPE_CODES[code]}_x{lanes}"
        return kernel

    return cfunc_address(f"simd.kernel_{code}_{lanes}", _KERNEL_SIG, make)


@intrinsic
def call_group(typingctx, fn, grp, xq, xdt, xsdt, xit, out, o0, r_lo, r_hi):
    """out[r, o0 : o0 + 8] = x[r] . W[o0 : o0 + 8] for r_lo <= r < r_hi: ``grp`` one group of eight
    weight rows as :func:`repack` wrote it, multiplied by the loop at address ``fn`` (from
    :func:`kernel_address` for the weight's type); xq int8 [m, n], xdt / xsdt float32 and xit int32
    block-major (:func:`plinth.quant.kernels_i8.quantize_rows`)."""
    _typing(grp, xq, xdt, xsdt, xit, out)

    def codegen(context, builder, sig, args):
        vals = [builder.ptrtoint(v, _i64) if v.type == _I8P else v for v in _call_args(context, builder, sig, args)]
        target = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.int64), _KERNEL_FN_TYPE.as_pointer())
        builder.call(target, vals)
        return context.get_dummy_value()

    return types.void(fn, grp, xq, xdt, xsdt, xit, out, o0, r_lo, r_hi), codegen


# ---------------------------------------------------------------------------------------------
# the activations' quantization


def _reduce(builder, op, v):
    """``llvm.vector.reduce.<op>`` of an <8 x i32>."""
    return builder.call(_fn(builder, f"llvm.vector.reduce.{op}.v8i32", _i32, [_v8i32]), [v])


def _emit_quantize_row(builder, xp, xqp, n, xdp, xsp, xip, m, r):
    """IR for row ``r`` of :func:`quantize_row`: ``xp`` / ``xqp`` the row's floats and int8s, the
    block-major arrays at their bases (``m`` rows a block)."""
    i64 = lambda v: _const(_i64, v)  # noqa: E731
    f32 = lambda v: _const(_f32, v)  # noqa: E731
    with cgutils.for_range(builder, builder.udiv(n, i64(32))) as loop:
        b = loop.index
        v = [_load(builder, _at(builder, xp, builder.add(builder.mul(b, i64(128)), i64(32 * k))), _v8f)
             for k in range(4)]
        # max |x| on the bits: a finite float's magnitude orders as its bits without the sign
        mag = [builder.and_(builder.bitcast(a, _v8i32), _splat(_i32, 8, 0x7FFFFFFF)) for a in v]
        top = _reduce(builder, "smax", _smax(builder, _smax(builder, mag[0], mag[1]), _smax(builder, mag[2], mag[3])))
        d = builder.fdiv(builder.bitcast(top, _f32), f32(127.0))
        inv = builder.select(builder.fcmp_ordered("==", d, f32(0.0)), f32(0.0), builder.fdiv(f32(1.0), d))
        rint = _fn(builder, "llvm.rint.v8f32", _v8f, [_v8f])  # to nearest even, as np.rint
        q = [builder.fptosi(builder.call(rint, [builder.fmul(a, _broadcast(builder, inv, 8))]), _v8i32) for a in v]
        for k in range(4):
            st = builder.store(builder.trunc(q[k], _v8i8),
                               builder.bitcast(_at(builder, xqp, builder.add(builder.mul(b, i64(32)), i64(8 * k))),
                                               _v8i8.as_pointer()))
            st.align = 1
        halves = [_reduce(builder, "add", builder.add(q[0], q[1])), _reduce(builder, "add", builder.add(q[2], q[3]))]
        at = builder.mul(builder.add(builder.mul(b, m), r), i64(4))  # [b, r] of the block-major arrays
        for h in range(2):
            ih = builder.mul(builder.add(builder.mul(builder.add(builder.mul(b, i64(2)), i64(h)), m), r), i64(4))
            builder.store(halves[h], builder.bitcast(_at(builder, xip, ih), _i32.as_pointer()))
        builder.store(d, builder.bitcast(_at(builder, xdp, at), _f32.as_pointer()))
        s = builder.sitofp(builder.add(halves[0], halves[1]), _f32)
        builder.store(builder.fmul(d, s), builder.bitcast(_at(builder, xsp, at), _f32.as_pointer()))


def _smax(builder, a, b):
    return builder.select(builder.icmp_signed(">", a, b), a, b)


@intrinsic
def quantize_row(typingctx, x, xq, xdt, xsdt, xit, r):
    """Row ``r`` of :func:`plinth.quant.kernels_i8.quantize_rows` as vector IR: x float32 and xq
    int8 ``[m, n]`` with contiguous rows (n a multiple of 32), xdt / xsdt float32 ``[n / 32, m]``
    and xit int32 ``[n / 16, m]`` C-order. Per 32 values: ``d = max|x| / 127`` (the maximum
    taken on the magnitudes' bits, which order as the floats do), ``q = rint(x * (1 / d))`` (0
    where d is 0), the two 16-value sums of q, ``d`` and ``d * sum(q)``."""
    if not all(isinstance(a, types.Array) and a.ndim == 2 for a in (x, xq, xdt, xsdt, xit)):
        raise TypeError("quantize_row takes 2-D arrays")

    def codegen(context, builder, sig, args):
        x_, xq_, xd_, xs_, xi_ = [cgutils.create_struct_proxy(ty)(context, builder, value=v)
                                  for ty, v in zip(sig.args[:5], args[:5])]

        r = _as_i64(builder, args[5])
        xp = _at(builder, builder.bitcast(x_.data, _I8P), builder.mul(r, _dim(builder, x_.strides, 0)))
        xqp = _at(builder, builder.bitcast(xq_.data, _I8P), builder.mul(r, _dim(builder, xq_.strides, 0)))
        _emit_quantize_row(builder, xp, xqp, _dim(builder, x_.shape, 1), builder.bitcast(xd_.data, _I8P),
                           builder.bitcast(xs_.data, _I8P), builder.bitcast(xi_.data, _I8P),
                           _dim(builder, xd_.shape, 1), r)
        return context.get_dummy_value()

    return types.void(x, xq, xdt, xsdt, xit, r), codegen

"""Integer dot products over eight weight rows at once, on weights repacked at load (LLVM IR, as
:mod:`plinth.quant.simd`).

:func:`repack` rewrites a weight's rows in groups of eight: per block, the eight rows' f16 scales
side by side, then their quants interleaved four bytes at a time, so that one 32-byte load holds
the same four quant bytes of all eight rows (lane i: row i). An activation's four int8 values,
broadcast to the eight lanes, meet that load in one ``vpdpbusd`` (AVX512-VNNI; ``pmaddubsw`` +
``pmaddwd`` on AVX2): eight weight rows advance four values each. A 32-value block is eight such
products into an int32 vector whose lane i is row i's exact integer sum for the block; one
conversion and one FMA with the eight rows' scales (times the activation's) add it to a float
accumulator, and the eight results land with one vector store. Against one weight row at a time
(:mod:`plinth.quant.simd`) that removes the per-row float work of every block and the horizontal
sums, and the unpacking of the weight bytes is shared by every activation row of the batch.

Per block of eight rows, ``value = scale * (q - c) + offset`` with q the stored unsigned quants:

- Q4_0 c = 8, Q5_0 c = 16: the ``- c`` is exact integer arithmetic on the activation block's sum
  of quants (``xi``, per 16 values), not a float term; Q4_1 / Q5_1 offset m (times ``xsd``);
- Q8_0: with VNNI the quants plus 128 as unsigned bytes, c = 128; on AVX2 (whose ``pmaddubsw``
  would saturate on those) the sign trick, ``|w|`` against the activation with w's sign;
- Q4_K / Q5_K: scale ``d * sc_j``, offset ``-dmin * m_j`` per 32-value sub-block (the 6-bit
  scales decoded at repack into one byte each, eight rows side by side);
- Q6_K: per 16-value sub-block the integer sum of ``q - 32`` times its int8 scale, the two of a
  32-value unit added as integers, then scale d.

Every activation row goes through the same operations whatever the batch (its integer sums are
exact, its float steps the same ``llvm.fma`` in the same order), so a row's results do not depend
on the rows beside it; VNNI and AVX2 give the same integers, hence the same bits.

The last ``n_out % 8`` rows of a weight keep :mod:`plinth.quant.simd`'s one-row loop.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..gguf.constants import GGMLType
from .simd import (_at, _bits, _broadcast, _const, _f32, _fma, _fn, _i8, _i16, _i32, _i64, _load, _mask, _psign,
                   _splat, _v8f, _v8i32, _v16i16, _v32i8, has_vnni)

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
           "q8_0": (32, 34, 272), "q4_k": (256, 144, 1184), "q5_k": (256, 176, 1440), "q6_k": (256, 210, 1680)}

#: GGML type code -> kind, the types with an interleaved form
TYPE_CODES = {int(GGMLType[kind.upper()]): kind for kind in LAYOUTS}


def repack(raw: np.ndarray, kind: str) -> np.ndarray:
    """uint8 ``[n_out, row_bytes]`` of type ``kind`` (n_out a multiple of 8) -> uint8 ``[n_out / 8,
    blocks * group_bytes]``: each group of eight rows, block after block, in the layout the kernels read."""
    qk, bs, gbs = LAYOUTS[kind]
    n_out = raw.shape[0]
    g = n_out // 8
    b = np.ascontiguousarray(raw).reshape(g, 8, -1, bs)  # [group, row, block, byte]
    nb = b.shape[2]

    def halves(off):  # the eight rows' f16 at off: [g, nb, 16]
        return b[:, :, :, off:off + 2].transpose(0, 2, 1, 3).reshape(g, nb, 16)

    def words(off, n):  # n bytes at off, interleaved 4 bytes a row: [g, nb, 8 * n]
        return b[:, :, :, off:off + n].reshape(g, 8, nb, n // 4, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, 8 * n)

    def per_row_bytes(a):  # [g, 8, nb, k] -> [g, nb, k * 8]: byte j of the eight rows side by side
        return a.transpose(0, 2, 3, 1).reshape(g, nb, -1)

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
    elif kind == "q6_k":
        fields = [halves(208), per_row_bytes(b[:, :, :, 192:208]), words(0, 128), words(128, 64)]
    else:  # pragma: no cover - LAYOUTS names the kinds
        raise ValueError(kind)
    out = np.concatenate(fields, axis=2)
    assert out.shape[2] == gbs, (kind, out.shape)
    return out.reshape(g, nb * gbs)


# ---------------------------------------------------------------------------------------------
# unpacking in the kernel


class _Unit:
    """A 32-value unit of eight rows: ``w`` eight <32 x i8> (lane i: row i's four unsigned quants
    for activation values 4j .. 4j+3), ``signed`` the signed quants for the sign trick (or None),
    ``parts`` (first dot, end dot, int lane scale or None, quant offset c) over which the integer
    sums go, ``scale`` / ``offset`` <8 x float> (offset None when 0)."""

    __slots__ = ("w", "signed", "parts", "scale", "offset")

    def __init__(self, w, scale, offset=None, signed=None, parts=((0, 8, None, 0),)):
        self.w, self.scale, self.offset, self.signed, self.parts = w, scale, offset, signed, parts


def _halves8(builder, gb, off):
    return builder.fpext(_load(builder, _at(builder, gb, off), _v8h), _v8f)


def _chunk(builder, gb, off):
    return _load(builder, _at(builder, gb, off), _v32i8)


def _fifth_bits(builder, qh, j):
    """16 in byte t of lane i where bit 4j + t of row i's 32-bit qh is set, else 0 (Q5_0 / Q5_1)."""
    v = builder.lshr(qh, _splat(_i32, 8, 4 * j)) if j else qh
    v = builder.bitcast(v, _v32i8)
    v = builder.shuffle_vector(v, v, _mask([4 * (k // 4) for k in range(32)]))
    bit = builder.and_(v, ir.Constant(_v32i8, [1 << (k % 4) for k in range(32)]))
    return builder.select(builder.icmp_unsigned("!=", bit, _splat(_i8, 32, 0)), _splat(_i8, 32, 16),
                          _splat(_i8, 32, 0))


def _decode(builder, kind, gb, vnni):
    """The units of the group-block at ``gb`` (an i8*)."""
    if kind in ("q4_0", "q4_1", "q5_0", "q5_1"):
        d = _halves8(builder, gb, 0)
        has_m = kind in ("q4_1", "q5_1")
        off = 32 if has_m else 16
        qh = None
        if kind in ("q5_0", "q5_1"):
            qh = _load(builder, _at(builder, gb, off), _v8i32)
            off += 32
        w = [None] * 8
        for k in range(4):
            c = _chunk(builder, gb, off + 32 * k)
            w[k], w[k + 4] = _bits(builder, c, 0, 15), _bits(builder, c, 4, 15)
        if qh is not None:
            w = [builder.or_(w[j], _fifth_bits(builder, qh, j)) for j in range(8)]
        c = {"q4_0": 8, "q5_0": 16}.get(kind, 0)
        return [_Unit(w, d, _halves8(builder, gb, 16) if has_m else None, parts=((0, 8, None, c),))]
    if kind == "q8_0":
        d = _halves8(builder, gb, 0)
        s = [_chunk(builder, gb, 16 + 32 * k) for k in range(8)]
        if vnni:  # w + 128 as unsigned bytes, 128 times the activations' sum taken off as an integer
            return [_Unit([builder.xor(v, _splat(_i8, 32, 0x80)) for v in s], d, parts=((0, 8, None, 128),))]
        return [_Unit([_psign(builder, v, v) for v in s], d, signed=s)]  # AVX2: pmaddubsw would saturate
    if kind in ("q4_k", "q5_k"):
        d, dmin = _halves8(builder, gb, 0), _halves8(builder, gb, 16)
        qs = 160 if kind == "q4_k" else 416
        units = []
        for j in range(8):
            c, half = divmod(j, 2)
            sc = builder.uitofp(_load(builder, _at(builder, gb, 32 + 8 * j), _v8i8), _v8f)
            mn = builder.uitofp(_load(builder, _at(builder, gb, 96 + 8 * j), _v8i8), _v8f)
            w = [_bits(builder, _chunk(builder, gb, qs + 256 * c + 32 * k), 4 * half, 15) for k in range(8)]
            if kind == "q5_k":  # bit j of the qh byte of each value
                w = [builder.or_(w[k], builder.shl(_bits(builder, _chunk(builder, gb, 160 + 32 * k), j, 1),
                                                   _splat(_i8, 32, 4))) for k in range(8)]
            units.append(_Unit(w, builder.fmul(d, sc), builder.fneg(builder.fmul(dmin, mn))))
        return units
    if kind == "q6_k":
        d = _halves8(builder, gb, 0)
        units = []
        for h in range(2):
            for k in range(4):
                w = []
                for j in range(8):
                    ql = _chunk(builder, gb, 144 + 32 * (16 * h + 8 * (k & 1) + j))
                    qh = _chunk(builder, gb, 1168 + 32 * (8 * h + j))
                    w.append(builder.or_(_bits(builder, ql, 4 * (k >> 1), 15),
                                         builder.shl(_bits(builder, qh, 2 * k, 3), _splat(_i8, 32, 4))))
                lane = [builder.sext(_load(builder, _at(builder, gb, 16 + 8 * (8 * h + 2 * k + p)), _v8i8), _v8i32)
                        for p in range(2)]
                units.append(_Unit(w, d, parts=((0, 4, lane[0], 32), (4, 8, lane[1], 32))))
        return units
    raise ValueError(kind)  # pragma: no cover


def _dot_acc(builder, acc, w, x, vnni):
    """acc + (lane k: sum_{j < 4} w[4k + j] * x[4k + j]) as <8 x i32>; acc None: from zero."""
    if vnni:
        f = _fn(builder, "llvm.x86.avx512.vpdpbusd.256", _v8i32, [_v8i32, _v8i32, _v8i32])
        return builder.call(f, [acc if acc is not None else _splat(_i32, 8, 0), builder.bitcast(w, _v8i32),
                                builder.bitcast(x, _v8i32)])
    p16 = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _v16i16, [_v32i8, _v32i8]), [w, x])
    p = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", _v8i32, [_v16i16, _v16i16]), [p16, _splat(_i16, 16, 1)])
    return p if acc is None else builder.add(acc, p)


# ---------------------------------------------------------------------------------------------
# the group loop


def _emit_group(builder, kind, R, arrs, r0, o0, vnni):
    """IR for out[r0 + i, o0 : o0 + 8] = x[r0 + i] . W[o0 : o0 + 8], i < R."""
    qk, _, gbs = LAYOUTS[kind]
    grpa, xqa, xda, xsa, xia, outa = arrs
    idx = r0.type
    i8p = _i8.as_pointer()

    def base(a):
        return builder.bitcast(a.data, i8p)

    def stride(a):
        return cgutils.unpack_tuple(builder, a.strides)[0]

    n = cgutils.unpack_tuple(builder, xqa.shape)[1]
    xps = [_at(builder, base(xqa), builder.mul(builder.add(r0, _const(idx, i)), stride(xqa))) for i in range(R)]
    r0_bytes = builder.mul(r0, _const(idx, 4))
    xd0, xs0, xi0 = (_at(builder, base(a), r0_bytes) for a in (xda, xsa, xia))
    sd, ss, si = stride(xda), stride(xsa), stride(xia)
    gp = base(grpa)
    zero8 = ir.Constant(_v8f, [0.0] * 8)
    offsets = kind in ("q4_1", "q5_1", "q4_k", "q5_k")
    accs = [cgutils.alloca_once_value(builder, zero8) for _ in range(R)]
    saccs = [cgutils.alloca_once_value(builder, zero8) for _ in range(R)] if offsets else []
    for a in accs + saccs:
        builder.store(zero8, a)

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
                                                   _i32), 8)
                    xv = builder.bitcast(xv, _v32i8)
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
                    isum = builder.sub(isum, _broadcast(builder, builder.mul(xi, _const(_i32, c)), 8))
                if lane is not None:
                    isum = builder.mul(isum, lane)
                total = isum if total is None else builder.add(total, isum)
            scale = builder.fmul(u.scale, _broadcast(builder, scalar(xdp, i), 8))
            builder.store(_fma(builder, builder.sitofp(total, _v8f), scale, builder.load(accs[i])), accs[i])
            if u.offset is not None:
                builder.store(_fma(builder, u.offset, _broadcast(builder, scalar(xsp, i), 8),
                                   builder.load(saccs[i])), saccs[i])

    per = qk // 32
    with cgutils.for_range(builder, builder.udiv(n, _const(idx, qk))) as loop:
        units = _decode(builder, kind, _at(builder, gp, builder.mul(loop.index, _const(idx, gbs))), vnni)
        for j, u in enumerate(units):
            unit(u, builder.add(builder.mul(loop.index, _const(idx, per)), _const(idx, j)))
    for i in range(R):
        v = builder.load(accs[i])
        if offsets:
            v = builder.fadd(v, builder.load(saccs[i]))
        outp = _at(builder, base(outa), builder.add(builder.mul(builder.add(r0, _const(idx, i)), stride(outa)),
                                                    builder.mul(o0, _const(idx, 4))))
        st = builder.store(v, builder.bitcast(outp, _v8f.as_pointer()))
        st.align = 4


def _emit_all(builder, kind, arrs, o0, lo, hi, vnni, G):
    """Activation rows lo .. hi - 1: groups of G, then one group of each smaller power of two the rest holds."""
    idx = lo.type
    m = builder.sub(hi, lo)
    big = _const(idx, G)
    with cgutils.for_range(builder, builder.udiv(m, big)) as loop:
        _emit_group(builder, kind, G, arrs, builder.add(lo, builder.mul(loop.index, big)), o0, vnni)
    r = cgutils.alloca_once_value(builder, builder.add(lo, builder.mul(builder.udiv(m, big), big)))
    g = G // 2
    while g:
        bit = _const(idx, g)
        with builder.if_then(builder.icmp_unsigned("!=", builder.and_(m, bit), _const(idx, 0))):
            _emit_group(builder, kind, g, arrs, builder.load(r), o0, vnni)
            builder.store(builder.add(builder.load(r), bit), r)
        g //= 2


def _typing(grp, xq, xdt, xsdt, xit, out):
    if not (isinstance(grp, types.Array) and grp.ndim == 1 and all(
            isinstance(a, types.Array) and a.ndim == 2 for a in (xq, xdt, xsdt, xit, out))):
        raise TypeError("groups_<type> takes a 1-D group of weight rows and 2-D activation and output arrays")
    return 8 if has_vnni() else 4


def _args(context, builder, sig, args):
    arrs = [cgutils.create_struct_proxy(ty)(context, builder, value=v) for ty, v in zip(sig.args[-9:-3], args[-9:-3])]
    idx = cgutils.unpack_tuple(builder, arrs[1].shape)[0].type
    return arrs, [a if a.type == idx else builder.sext(a, idx) for a in args[-3:]]


def make_group_dot(kind, vnni=None):
    """The intrinsic for one type alone (``vnni``: the VNNI or the AVX2 form; default: the host's)."""

    def group_dot(typingctx, grp, xq, xdt, xsdt, xit, out, o0, r_lo, r_hi):
        G = _typing(grp, xq, xdt, xsdt, xit, out)
        use_vnni = has_vnni() if vnni is None else vnni

        def codegen(context, builder, sig, args):
            arrs, (ov, lo, hi) = _args(context, builder, sig, args)
            _emit_all(builder, kind, arrs, ov, lo, hi, use_vnni, G)
            return context.get_dummy_value()

        return types.void(grp, xq, xdt, xsdt, xit, out, o0, r_lo, r_hi), codegen

    group_dot.__name__ = f"groups_{kind}"
    return intrinsic(group_dot)


@intrinsic
def groups_any(typingctx, t, grp, xq, xdt, xsdt, xit, out, o0, r_lo, r_hi):
    """out[r, o0 : o0 + 8] = x[r] . W[o0 : o0 + 8] for r_lo <= r < r_hi: ``grp`` one group of eight
    weight rows of GGML type ``t`` (one of :data:`TYPE_CODES`) as :func:`repack` wrote it; xq int8
    [m, n], xdt / xsdt float32 and xit int32 block-major (:func:`plinth.quant.kernels_i8.quantize_rows`)."""
    G = _typing(grp, xq, xdt, xsdt, xit, out)
    vnni = has_vnni()

    def codegen(context, builder, sig, args):
        arrs, (ov, lo, hi) = _args(context, builder, sig, args)
        code = context.cast(builder, args[0], sig.args[0], types.int64)
        end = builder.append_basic_block("groups_any.end")
        switch = builder.switch(code, end)
        for c, kind in TYPE_CODES.items():
            block = builder.append_basic_block(f"groups_any.{kind}")
            switch.add_case(_const(_i64, c), block)
            builder.position_at_end(block)
            _emit_all(builder, kind, arrs, ov, lo, hi, vnni, G)
            builder.branch(end)
        builder.position_at_end(end)
        return context.get_dummy_value()

    return types.void(t, grp, xq, xdt, xsdt, xit, out, o0, r_lo, r_hi), codegen

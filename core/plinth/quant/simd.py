"""Integer dot products for the int8-activation kernels, written as LLVM IR (``numba.extending.intrinsic``).

These are the instructions llama.cpp's x86 kernels are built on. With AVX512-VNNI (``vpdpbusd`` on
256-bit vectors) one instruction multiplies 32 unsigned weight bytes by 32 signed activation bytes
and adds each four neighbours into 8 int32 lanes; on AVX2 ``pmaddubsw`` (pairs into int16) and
``pmaddwd`` against ones (pairs of those into int32) do the same in two. A weight block's quants,
unpacked in registers, meet an activation block quantized to int8, so 32 multiply-adds take a
handful of instructions where f32 lanes take four FMAs plus the dequantization.

:func:`rows_any` (a switch on the GGML type code over Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K
and Q6_K; ``_make_rows_dot(kind)`` builds one type's alone): one weight row against the
activation rows, in groups of eight rows (four where the CPU lacks AVX512's 32 vector
registers), then one group of each smaller power of two that the rest holds. Per 32-value unit
(a block, or a K-quant sub-block) the weight quants are unpacked once for the group; each row's
integer product goes to float in its 8 lanes and is scaled and accumulated there, in two
accumulators (even and odd units, so consecutive units do not wait on one another), with one
horizontal sum per row at the end. The per-row scale factors of a group (weight scale times
activation scale) and the offset terms (weight min times activation sum) are computed as one
8-lane vector for the group, from activation scales stored block-major (one or two rows of a
type without offsets take each row's scale as a scalar product instead: the same IEEE product).

Every row goes through the same IEEE operations in the same order whether it comes alone or in a
group (explicit ``llvm.fma``, no reassociation), so a row's result does not depend on the batch
it is in: the scheduler's batched steps and a verify batch give a lone decode's results bit for
bit. VNNI and AVX2 compute the same integers (no saturation is reachable, below), so the two
paths agree exactly too.

Signed weights (Q8_0, and Q6_K's ``q - 32``) use the ``psign`` trick: |w| as the unsigned operand
and the activation with w's sign moved onto it. Saturation of ``pmaddubsw`` (AVX2): a pair is at
most 2 * 31 * 127 (5-bit quants), 2 * 32 * 127 (Q6_K) or 2 * 128 * 127 = 32512 (Q8_0) < 32767.

Arrays are not bounds-checked: callers pass whole rows. :func:`available` says whether the host
has AVX2 and F16C (else callers use the f32 kernels); :func:`has_vnni` whether the VNNI form is
compiled.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..gguf.constants import GGMLType

_i8, _i16, _i32, _i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_f32 = ir.FloatType()
_v32i8 = ir.VectorType(_i8, 32)
_v16i8 = ir.VectorType(_i8, 16)
_v16i16 = ir.VectorType(_i16, 16)
_v8i32 = ir.VectorType(_i32, 8)
_v8f = ir.VectorType(_f32, 8)
_v4f = ir.VectorType(_f32, 4)


def _features() -> dict:
    try:
        import llvmlite.binding as llvm

        return dict(llvm.get_host_cpu_features())
    except Exception:  # pragma: no cover - llvmlite without host feature queries
        return {}


def available() -> bool:
    """AVX2 and F16C on the host (what the kernels of :mod:`plinth.quant.kernels_i8` need)."""
    f = _features()
    return bool(f.get("avx2")) and bool(f.get("f16c"))


def has_vnni() -> bool:
    """AVX512-VNNI with 256-bit forms (AVX512VL) on the host: the one-instruction dot is compiled."""
    f = _features()
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


def _half(builder, base, off):
    """The IEEE half at byte ``off`` of ``base``, as float32."""
    return builder.fpext(_load(builder, _at(builder, base, off), ir.HalfType()), _f32)


def _byte(builder, base, off):
    """The unsigned byte at ``off`` as i32."""
    return builder.zext(_load(builder, _at(builder, base, off), _i8), _i32)


def _fma(builder, a, b, c):
    name = "llvm.fma.f32" if a.type == _f32 else f"llvm.fma.v{a.type.count}f32"
    return builder.call(_fn(builder, name, a.type, [a.type] * 3), [a, b, c])


def _dot(builder, w, x, vnni):
    """<8 x i32>: lane k is sum_{j < 4} w[4k + j] * x[4k + j], w unsigned bytes, x signed bytes."""
    if vnni:
        f = _fn(builder, "llvm.x86.avx512.vpdpbusd.256", _v8i32, [_v8i32, _v8i32, _v8i32])
        return builder.call(f, [_splat(_i32, 8, 0), builder.bitcast(w, _v8i32), builder.bitcast(x, _v8i32)])
    p16 = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _v16i16, [_v32i8, _v32i8]), [w, x])
    return builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", _v8i32, [_v16i16, _v16i16]), [p16, _splat(_i16, 16, 1)])


def _psign(builder, a, b):
    """a with b's sign (a negated where b < 0, zero where b == 0)."""
    return builder.call(_fn(builder, "llvm.x86.avx2.psign.b", _v32i8, [_v32i8, _v32i8]), [a, b])


def _nibbles(builder, p):
    """The 32 4-bit quants of the 16 bytes at ``p``: low nibbles first, then high (Q4_0 .. Q5_1)."""
    qb = _load(builder, p, _v16i8)
    lo = builder.and_(qb, _splat(_i8, 16, 15))
    hi = builder.lshr(qb, _splat(_i8, 16, 4))
    return builder.shuffle_vector(lo, hi, _mask(range(32)))


def _fifth_bit(builder, qh):
    """16 where bit j of the i32 ``qh`` is set, else 0 (Q5_0 / Q5_1)."""
    h4 = builder.bitcast(qh, ir.VectorType(_i8, 4))
    hb = builder.shuffle_vector(h4, h4, _mask([j // 8 for j in range(32)]))
    bit = builder.and_(hb, ir.Constant(_v32i8, [1 << (j % 8) for j in range(32)]))
    return builder.select(builder.icmp_unsigned("!=", bit, _splat(_i8, 32, 0)), _splat(_i8, 32, 16),
                          _splat(_i8, 32, 0))


def _bits(builder, v, shift, mask):
    """(v >> shift) & mask on 32 bytes (shift, mask: ints)."""
    if shift:
        v = builder.lshr(v, _splat(_i8, 32, shift))
    return builder.and_(v, _splat(_i8, 32, mask))


# ---------------------------------------------------------------------------------------------
# the weight types: per 32-value unit, the unsigned quants (or |w| of signed ones), the scale,
# the offset (value = scale * q + offset, offset None when 0) and an int lane scale (Q6_K)


class _Unit:
    __slots__ = ("w", "signed", "scale", "offset", "lanes")

    def __init__(self, w, scale, offset=None, signed=None, lanes=None):
        self.w, self.scale, self.offset, self.signed, self.lanes = w, scale, offset, signed, lanes


def _units_32(kind):
    """Decoder of a 32-value block type: block pointer -> [one _Unit]."""

    def decode(builder, b):
        d = _half(builder, b, 0)
        if kind == "q8_0":
            wv = _load(builder, _at(builder, b, 2), _v32i8)
            return [_Unit(_psign(builder, wv, wv), d, signed=wv)]
        qoff, moff, hoff, shift = {"q4_0": (2, None, None, -8.0), "q4_1": (4, 2, None, 0.0),
                                   "q5_0": (6, None, 2, -16.0), "q5_1": (8, 2, 4, 0.0)}[kind]
        w = _nibbles(builder, _at(builder, b, qoff))
        if hoff is not None:
            w = builder.or_(w, _fifth_bit(builder, _load(builder, _at(builder, b, hoff), _i32)))
        offset = _half(builder, b, moff) if moff is not None else builder.fmul(d, _const(_f32, shift))
        return [_Unit(w, d, offset)]

    return decode


def _k_scale_min(builder, b, j):
    """Sub-block j's 6-bit scale and min of a Q4_K / Q5_K super-block (12 bytes at b + 4), as float."""
    s = lambda k: _byte(builder, b, 4 + k)  # noqa: E731
    c63, c15 = _const(_i32, 63), _const(_i32, 15)
    if j < 4:
        sc, mn = builder.and_(s(j), c63), builder.and_(s(j + 4), c63)
    else:
        hi_s = builder.shl(builder.lshr(s(j - 4), _const(_i32, 6)), _const(_i32, 4))
        hi_m = builder.shl(builder.lshr(s(j), _const(_i32, 6)), _const(_i32, 4))
        sc = builder.or_(builder.and_(s(j + 4), c15), hi_s)
        mn = builder.or_(builder.lshr(s(j + 4), _const(_i32, 4)), hi_m)
    return builder.uitofp(sc, _f32), builder.uitofp(mn, _f32)


def _units_k45(five):
    """Q4_K (144 bytes) / Q5_K (176): 8 sub-blocks of 32, value = d * sc_j * q - dmin * m_j."""

    def decode(builder, b):
        d, dmin = _half(builder, b, 0), _half(builder, b, 2)
        qs = 48 if five else 16
        qh = _load(builder, _at(builder, b, 16), _v32i8) if five else None
        units = []
        for c in range(4):
            q = _load(builder, _at(builder, b, qs + 32 * c), _v32i8)
            for half in range(2):
                j = 2 * c + half
                w = _bits(builder, q, 4 * half, 15)
                if five:
                    w = builder.or_(w, builder.shl(_bits(builder, qh, j, 1), _splat(_i8, 32, 4)))
                sc, mn = _k_scale_min(builder, b, j)
                units.append(_Unit(w, builder.fmul(d, sc), builder.fneg(builder.fmul(dmin, mn))))
        return units

    return decode


def _units_q6k(builder, b):
    """Q6_K (210 bytes): 16 sub-blocks of 16, value = d * sc * (q - 32); a unit is two sub-blocks
    (int lane scales: lanes 0-3 hold values 0-15, lanes 4-7 values 16-31)."""
    d = _half(builder, b, 208)
    units = []
    for h in range(2):
        qh = _load(builder, _at(builder, b, 128 + 32 * h), _v32i8)
        for k in range(4):
            ql = _load(builder, _at(builder, b, 64 * h + 32 * (k & 1)), _v32i8)
            q = builder.or_(_bits(builder, ql, 4 * (k >> 1), 15), builder.shl(_bits(builder, qh, 2 * k, 3),
                                                                                 _splat(_i8, 32, 4)))
            w = builder.sub(q, _splat(_i8, 32, 32))
            sa, sb = [builder.sext(_load(builder, _at(builder, b, 192 + 8 * h + 2 * k + i), _i8), _i32)
                      for i in range(2)]
            lanes = builder.shuffle_vector(builder.insert_element(builder.insert_element(
                ir.Constant(ir.VectorType(_i32, 2), None), sa, _const(_i32, 0)), sb, _const(_i32, 1)),
                ir.Constant(ir.VectorType(_i32, 2), None), _mask([0, 0, 0, 0, 1, 1, 1, 1]))
            units.append(_Unit(_psign(builder, w, w), d, signed=w, lanes=lanes))
    return units


#: type -> (values per block, block bytes, decoder)
_TYPES = {"q4_0": (32, 18, _units_32("q4_0")), "q4_1": (32, 20, _units_32("q4_1")),
          "q5_0": (32, 22, _units_32("q5_0")), "q5_1": (32, 24, _units_32("q5_1")),
          "q8_0": (32, 34, _units_32("q8_0")), "q4_k": (256, 144, _units_k45(False)),
          "q5_k": (256, 176, _units_k45(True)), "q6_k": (256, 210, _units_q6k)}


# ---------------------------------------------------------------------------------------------
# the row loop


def _emit_rows(builder, kind, R, arrs, r0, o, vnni):
    """IR for out[r0 + i, o] = x[r0 + i] . W[o], i < R (R = 4, 2 or 1)."""
    qk, bs, decode = _TYPES[kind]
    rowa, xqa, xda, xsa, outa = arrs
    idx = r0.type
    i8p = _i8.as_pointer()

    def base(a):
        return builder.bitcast(a.data, i8p)

    def stride(a):
        return cgutils.unpack_tuple(builder, a.strides)[0]

    n = cgutils.unpack_tuple(builder, xqa.shape)[1]
    xps = [_at(builder, base(xqa), builder.mul(builder.add(r0, _const(idx, i)), stride(xqa))) for i in range(R)]
    r0_bytes = builder.mul(r0, _const(idx, 4))
    xd0 = _at(builder, base(xda), r0_bytes)
    xs0 = _at(builder, base(xsa), r0_bytes)
    sd, ss = stride(xda), stride(xsa)
    rowp = base(rowa)
    zero8 = ir.Constant(_v8f, [0.0] * 8)
    faccs = [[cgutils.alloca_once_value(builder, zero8) for _ in range(2)] for _ in range(R)]
    sacc = cgutils.alloca_once_value(builder, ir.Constant(_v8f, [0.0] * 8))
    for a in faccs:
        for p in a:
            builder.store(zero8, p)
    builder.store(zero8, sacc)

    def lanes8(p):  # R consecutive floats at p as an 8-vector (the lanes past R zero)
        if R in (8, 4):
            v = _load(builder, p, ir.VectorType(_f32, R))
            return v if R == 8 else builder.shuffle_vector(v, ir.Constant(_v4f, [0.0] * 4), _mask(range(8)))
        v = zero8
        for i in range(R):
            v = builder.insert_element(v, _load(builder, _at(builder, p, 4 * i), _f32), _const(_i32, i))
        return v

    def unit(u, iu, par):
        """Unit ``u`` (a _Unit) at activation block index iu (an i64 value), into accumulator par."""
        xdp = _at(builder, xd0, builder.mul(iu, sd))
        if R <= 2 and u.offset is None:
            # one or two rows of a type without offsets (Q8_0, Q6_K): each row's scale as a scalar
            # product and a broadcast (the same IEEE product as the vector lane below; measured faster
            # there, slower for the types whose offset term keeps the vector form)
            row_scale = [_broadcast(builder, builder.fmul(u.scale, _load(builder, _at(builder, xdp, 4 * i), _f32)),
                                    8) for i in range(R)]
        else:
            scales = builder.fmul(_broadcast(builder, u.scale, 8), lanes8(xdp))
            row_scale = [builder.shuffle_vector(scales, scales, _mask([i] * 8)) for i in range(R)]
        xo = builder.mul(iu, _const(idx, 32))
        for i in range(R):
            xv = _load(builder, _at(builder, xps[i], xo), _v32i8)
            if u.signed is not None:
                xv = _psign(builder, xv, u.signed)
            p = _dot(builder, u.w, xv, vnni)
            if u.lanes is not None:
                p = builder.mul(p, u.lanes)
            pf = builder.sitofp(p, _v8f)
            acc = faccs[i][par]
            builder.store(_fma(builder, pf, row_scale[i], builder.load(acc)), acc)
        if u.offset is not None:
            xs = lanes8(_at(builder, xs0, builder.mul(iu, ss)))
            builder.store(_fma(builder, _broadcast(builder, u.offset, 8), xs, builder.load(sacc)), sacc)

    per = qk // 32  # units a block
    if per == 1:  # blocks in pairs (even block -> accumulator 0, odd -> 1), then an odd one left
        nb = builder.udiv(n, _const(idx, 32))
        with cgutils.for_range(builder, builder.udiv(nb, _const(idx, 2))) as loop:
            for par in range(2):
                ib = builder.add(builder.mul(loop.index, _const(idx, 2)), _const(idx, par))
                unit(decode(builder, _at(builder, rowp, builder.mul(ib, _const(idx, bs))))[0], ib, par)
        with builder.if_then(builder.icmp_unsigned("==", builder.and_(nb, _const(idx, 1)), _const(idx, 1))):
            ib = builder.sub(nb, _const(idx, 1))
            unit(decode(builder, _at(builder, rowp, builder.mul(ib, _const(idx, bs))))[0], ib, 0)
    else:
        with cgutils.for_range(builder, builder.udiv(n, _const(idx, qk))) as loop:
            units = decode(builder, _at(builder, rowp, builder.mul(loop.index, _const(idx, bs))))
            for j, u in enumerate(units):
                unit(u, builder.add(builder.mul(loop.index, _const(idx, per)), _const(idx, j)), j & 1)
    red = _fn(builder, "llvm.vector.reduce.fadd.v8f32", _f32, [_f32, _v8f])
    s = builder.load(sacc)
    for i in range(R):
        v = builder.fadd(builder.load(faccs[i][0]), builder.load(faccs[i][1]))
        total = builder.fadd(builder.call(red, [_const(_f32, 0.0), v]), builder.extract_element(s, _const(_i32, i)))
        outp = _at(builder, base(outa), builder.add(builder.mul(builder.add(r0, _const(idx, i)), stride(outa)),
                                                    builder.mul(o, _const(idx, 4))))
        builder.store(total, builder.bitcast(outp, _f32.as_pointer()))


def _emit_all_rows(builder, kind, arrs, ov, lo, hi, vnni, G):
    """Rows lo .. hi - 1: groups of G rows, then one group of each smaller power of two the rest holds."""
    idx = lo.type
    m = builder.sub(hi, lo)
    big = _const(idx, G)
    with cgutils.for_range(builder, builder.udiv(m, big)) as loop:
        _emit_rows(builder, kind, G, arrs, builder.add(lo, builder.mul(loop.index, big)), ov, vnni)
    r = cgutils.alloca_once_value(builder, builder.add(lo, builder.mul(builder.udiv(m, big), big)))
    g = G // 2
    while g:
        bit = _const(idx, g)
        with builder.if_then(builder.icmp_unsigned("!=", builder.and_(m, bit), _const(idx, 0))):
            _emit_rows(builder, kind, g, arrs, builder.load(r), ov, vnni)
            builder.store(builder.add(builder.load(r), bit), r)
        g //= 2


def _rows_typing(row, xq, xdt, xsdt, out):
    if not (isinstance(row, types.Array) and row.ndim == 1 and all(
            isinstance(a, types.Array) and a.ndim == 2 for a in (xq, xdt, xsdt, out))):
        raise TypeError("rows_<type> takes a 1-D weight row and 2-D activation and output arrays")
    return 8 if has_vnni() else 4  # rows a group: 8 x 2 accumulators need AVX512's 32 vector registers


def _rows_args(context, builder, sig, args):
    """The five arrays' proxies and (o, r_lo, r_hi) as intp, from the last eight arguments."""
    arrs = [cgutils.create_struct_proxy(ty)(context, builder, value=v) for ty, v in zip(sig.args[-8:-3], args[-8:-3])]
    idx = cgutils.unpack_tuple(builder, arrs[1].shape)[0].type
    return arrs, [a if a.type == idx else builder.sext(a, idx) for a in args[-3:]]


def _make_rows_dot(kind, vnni=None):
    """The intrinsic for the activation rows against one weight row of type ``kind`` (``vnni``: the
    VNNI form or the AVX2 one; default: what the host has)."""

    def rows_dot(typingctx, row, xq, xdt, xsdt, out, o, r_lo, r_hi):
        G = _rows_typing(row, xq, xdt, xsdt, out)
        use_vnni = has_vnni() if vnni is None else vnni

        def codegen(context, builder, sig, args):
            arrs, (ov, lo, hi) = _rows_args(context, builder, sig, args)
            _emit_all_rows(builder, kind, arrs, ov, lo, hi, use_vnni, G)
            return context.get_dummy_value()

        return types.void(row, xq, xdt, xsdt, out, o, r_lo, r_hi), codegen

    rows_dot.__name__ = f"rows_{kind}"
    rows_dot.__doc__ = (f"out[r, o] = x[r] . W[o] for the activation rows r_lo <= r < r_hi: one {kind.upper()} "
                        "weight row ``row`` (uint8) against int8 activation rows xq [m, n] with their per-32 "
                        "scales xdt and scaled sums xsdt = xd * sum(xq), both block-major [n / 32, m].")
    return intrinsic(rows_dot)


#: GGML type code -> kind, the types :func:`rows_any` computes
TYPE_CODES = {int(GGMLType[kind.upper()]): kind for kind in _TYPES}


@intrinsic
def rows_any(typingctx, t, row, xq, xdt, xsdt, out, o, r_lo, r_hi):
    """``rows_<type>`` for the weight row's GGML type code ``t`` (one of :data:`TYPE_CODES`; any other
    leaves out alone): one switch, each type's loop compiled once."""
    G = _rows_typing(row, xq, xdt, xsdt, out)
    vnni = has_vnni()

    def codegen(context, builder, sig, args):
        arrs, (ov, lo, hi) = _rows_args(context, builder, sig, args)
        code = context.cast(builder, args[0], sig.args[0], types.int64)
        end = builder.append_basic_block("rows_any.end")
        switch = builder.switch(code, end)
        for c, kind in TYPE_CODES.items():
            block = builder.append_basic_block(f"rows_any.{kind}")
            switch.add_case(_const(_i64, c), block)
            builder.position_at_end(block)
            _emit_all_rows(builder, kind, arrs, ov, lo, hi, vnni, G)
            builder.branch(end)
        builder.position_at_end(end)
        return context.get_dummy_value()

    return types.void(t, row, xq, xdt, xsdt, out, o, r_lo, r_hi), codegen

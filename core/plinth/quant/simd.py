"""AVX2 integer dot products for numba kernels, written as LLVM IR (``numba.extending.intrinsic``).

These are the instructions llama.cpp's x86 kernels are built on: ``pmaddubsw`` multiplies 32
unsigned bytes by 32 signed bytes and adds neighbouring pairs into 16 int16 lanes, ``pmaddwd``
against ones widens and pairs them into 8 int32 lanes. A weight block's quants (unpacked in
registers) meet an activation block quantized to int8, so 32 multiply-adds take a handful of
instructions where f32 lanes take four FMAs plus the dequantization.

Two kinds of intrinsic:

- ``rows_<type>`` for the 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): the loops over
  the activation rows (in groups of four, then two, then one) and a weight row's blocks. Each block
  is unpacked once; the int32 products go to float in their 8 lanes and accumulate there, one
  horizontal sum per row at the end (the shape of llama.cpp's ``ggml_vec_dot_*_q8_0`` loops).
- ``dot_bits_rows1/4`` / ``dot_bits_halves_rows1/4`` for the K-quant sub-blocks (one 32-value
  block unpacked once, dotted with one or four activation rows: per row its int32 sum or two
  16-value half sums), which the numba code around them scales.

Arrays are passed with element offsets and not bounds-checked: callers index whole blocks.
Saturation: ``pmaddubsw`` saturates int16 pair sums; with unsigned weights below 64 and int8
activations in [-127, 127] a pair is at most 2 * 63 * 127 = 16002, and the signed Q8_0 path
multiplies |w| <= 128 by the sign-moved activation, at most 2 * 128 * 127 = 32512 < 32767.

:func:`available` says whether the host CPU has AVX2 (and F16C); callers fall back to the f32
kernels where it does not.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_i8, _i16, _i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_v32i8 = ir.VectorType(_i8, 32)
_v16i8 = ir.VectorType(_i8, 16)
_v16i16 = ir.VectorType(_i16, 16)
_v8i32 = ir.VectorType(_i32, 8)
_v4i32 = ir.VectorType(_i32, 4)


def available() -> bool:
    """AVX2 and F16C on the host (what the kernels of :mod:`plinth.quant.kernels_i8` use)."""
    try:
        import llvmlite.binding as llvm

        feats = llvm.get_host_cpu_features()
        return bool(feats.get("avx2")) and bool(feats.get("f16c"))
    except Exception:  # pragma: no cover - llvmlite without host feature queries
        return False


def _ptr(context, builder, arrty, arr, off, vecty):
    """Pointer to element ``off`` of a 1-D contiguous array, cast to ``vecty*``."""
    a = cgutils.create_struct_proxy(arrty)(context, builder, value=arr)
    p = builder.gep(a.data, [off])
    return builder.bitcast(p, vecty.as_pointer())


def _load(builder, p):
    v = builder.load(p)
    v.align = 1
    return v


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _splat(ty, n, value):
    return ir.Constant(ir.VectorType(ty, n), [value] * n)


def _mask(idx):
    idx = list(idx)
    return ir.Constant(ir.VectorType(_i32, len(idx)), idx)


def _madd32(builder, w, x):
    """<8 x i32> pair sums of 32 unsigned w bytes times 32 signed x bytes."""
    p16 = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _v16i16, [_v32i8, _v32i8]), [w, x])
    return builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", _v8i32, [_v16i16, _v16i16]),
                        [p16, _splat(_i16, 16, 1)])


def _hsum(builder, v, lanes):
    """Sum of ``lanes`` consecutive int32 lanes of an <8 x i32>, starting at lane 0 or 4."""
    return builder.call(_fn(builder, "llvm.vector.reduce.add.v4i32", _i32, [_v4i32]), [v]) if lanes == 4 else \
        builder.call(_fn(builder, "llvm.vector.reduce.add.v8i32", _i32, [_v8i32]), [v])


def _halves(builder, v):
    lo = builder.shuffle_vector(v, v, _mask([0, 1, 2, 3]))
    hi = builder.shuffle_vector(v, v, _mask([4, 5, 6, 7]))
    return _hsum(builder, lo, 4), _hsum(builder, hi, 4)


def _nibbles(builder, p):
    """The 32 4-bit quants of 16 bytes at ``p`` (<16 x i8>*): low nibbles first, then high."""
    qb = _load(builder, p)
    lo = builder.and_(qb, _splat(_i8, 16, 15))
    hi = builder.lshr(qb, _splat(_i8, 16, 4))
    return builder.shuffle_vector(lo, hi, _mask(range(32)))


def _add_fifth_bit(builder, w, qh):
    """w | 16 where bit j of the i32 ``qh`` is set (Q5_0/Q5_1)."""
    h4 = builder.bitcast(qh, ir.VectorType(_i8, 4))
    hb = builder.shuffle_vector(h4, h4, _mask([j // 8 for j in range(32)]))
    bit = builder.and_(hb, ir.Constant(_v32i8, [1 << (j % 8) for j in range(32)]))
    set_ = builder.icmp_unsigned("!=", bit, _splat(_i8, 32, 0))
    return builder.or_(w, builder.select(set_, _splat(_i8, 32, 16), _splat(_i8, 32, 0)))


def _check(*tys):
    for t in tys:
        if isinstance(t, types.Array) and t.ndim != 1:
            raise TypeError("simd intrinsics take 1-D arrays")


def _splat_var(builder, v, n):
    """An i8 vector of n copies of the integer ``v``."""
    b = builder.trunc(v, _i8) if v.type.width > 8 else v
    vec = builder.insert_element(ir.Constant(ir.VectorType(_i8, n), None), b, ir.Constant(_i32, 0))
    return builder.shuffle_vector(vec, vec, _mask([0] * n))


def _bits_w(context, builder, sig, args):
    """32 unsigned quants ((lo >> lo_shift) & 15) | (((hi >> hi_shift) & hi_mask) << 4) (args 0..6)."""
    la, loff, lsh, ha, hoff, hsh, hmask = args[:7]
    lb = _load(builder, _ptr(context, builder, sig.args[0], la, loff, _v32i8))
    w = builder.and_(builder.lshr(lb, _splat_var(builder, lsh, 32)), _splat(_i8, 32, 15))
    hb = _load(builder, _ptr(context, builder, sig.args[3], ha, hoff, _v32i8))
    h = builder.and_(builder.lshr(hb, _splat_var(builder, hsh, 32)), _splat_var(builder, hmask, 32))
    return builder.or_(w, builder.shl(h, _splat(_i8, 32, 4)))


def _x_rows(context, builder, arrty, arr, r0, xo, n):
    """<32 x i8> at column ``xo`` of rows r0 .. r0 + n - 1 of a 2-D C int8 array."""
    a = cgutils.create_struct_proxy(arrty)(context, builder, value=arr)
    base = builder.bitcast(a.data, _i8.as_pointer())
    stride = cgutils.unpack_tuple(builder, a.strides)[0]
    rows = []
    for i in range(n):
        off = builder.add(builder.mul(builder.add(r0, ir.Constant(r0.type, i)), stride), xo)
        rows.append(_load(builder, builder.bitcast(builder.gep(base, [off]), _v32i8.as_pointer())))
    return rows


def _make_bits_dot(n_rows, halves):
    """The K-quant sub-block dot for ``n_rows`` activation rows of a 2-D int8 array: the 32 quants
    are unpacked once; per row the int32 sum (or its two 16-value half sums, Q6_K)."""

    def dot(typingctx, lo, lo_o, lo_shift, hi, hi_o, hi_shift, hi_mask, xq, r0, xo):
        _check(lo, hi)

        def codegen(context, builder, sig, args):
            w = _bits_w(context, builder, sig, args)
            r0v = args[8]
            xov = args[9] if args[9].type == r0v.type else builder.sext(args[9], r0v.type)
            sums = []
            for xv in _x_rows(context, builder, sig.args[7], args[7], r0v, xov, n_rows):
                p = _madd32(builder, w, xv)
                sums += list(_halves(builder, p)) if halves else [_hsum(builder, p, 8)]
            return context.make_tuple(builder, sig.return_type, sums)

        n_out = n_rows * (2 if halves else 1)
        return types.UniTuple(types.int32, n_out)(lo, lo_o, lo_shift, hi, hi_o, hi_shift, hi_mask, xq, r0, xo), codegen

    dot.__name__ = f"dot_bits{'_halves' if halves else ''}_rows{n_rows}"
    dot.__doc__ = (f"Per activation row r0 .. r0 + {n_rows - 1} of the 2-D int8 ``xq``: sum_j (((lo[lo_o+j] >> "
                   "lo_shift) & 15) | (((hi[hi_o+j] >> hi_shift) & hi_mask) << 4)) * xq[r, xo+j], j < 32"
                   + (", as the sums over j < 16 and 16 <= j < 32 (Q6_K, hi_mask 3)." if halves else
                      " (Q4_K: hi_mask 0, Q5_K: hi_mask 1)."))
    return intrinsic(dot)


dot_bits_rows1 = _make_bits_dot(1, False)
dot_bits_rows4 = _make_bits_dot(4, False)
dot_bits_halves_rows1 = _make_bits_dot(1, True)
dot_bits_halves_rows4 = _make_bits_dot(4, True)


@intrinsic
def half_at(typingctx, row, off):
    """The IEEE half stored at byte ``off`` of the uint8 array ``row``, as float32."""
    _check(row)

    def codegen(context, builder, sig, args):
        a = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0])
        return _half_at(builder, a.data, args[1])

    return types.float32(row, off), codegen


# ---------------------------------------------------------------------------------------------
# Whole-row dots for the 32-value block types: the loop over blocks is IR too, so the integer
# products go to float in their 8 lanes and accumulate there (one horizontal sum per row, as
# llama.cpp's ggml_vec_dot_*_q8_0 loops do). The offset and min terms come from the activation
# block sums as a scalar.

#: type -> (block bytes, offset of the quants, offset of the min (or None), offset of qh (or None),
#: value offset folded into the scalar term (-8 for Q4_0: value = d * (q - 8)))
_ROW_TYPES = {"q4_0": (18, 2, None, None, -8.0), "q4_1": (20, 4, 2, None, 0.0),
              "q5_0": (22, 6, None, 2, -16.0), "q5_1": (24, 8, 2, 4, 0.0), "q8_0": (34, 2, None, None, 0.0)}


def _half_at(builder, base, off):
    off = ir.Constant(ir.IntType(64), off) if isinstance(off, int) else off
    p = builder.bitcast(builder.gep(base, [off]), ir.HalfType().as_pointer())
    v = builder.load(p)
    v.align = 1
    return builder.fpext(v, ir.FloatType())


def _emit_rows(builder, kind, R, arrs, r0v, ov):
    """IR for out[r0 + i, o] = x[r0 + i] . W[o], i < R: the loop over the weight row's blocks, each
    block unpacked once for the R activation rows."""
    bs, qoff, moff, hoff, shift = _ROW_TYPES[kind]
    f32 = ir.FloatType()
    v8f = ir.VectorType(f32, 8)
    fast = ("contract",)  # no reassociation: every row sums its blocks in order, alone or in a group
    i8p = _i8.as_pointer()
    rowp = arrs[0].data
    idx = r0v.type

    def row_ptrs(a, ty):  # pointer to row r0 + i of a 2-D C array, for i < R
        base = builder.bitcast(a.data, i8p)
        stride = cgutils.unpack_tuple(builder, a.strides)[0]
        return [builder.bitcast(builder.gep(base, [builder.mul(builder.add(r0v, ir.Constant(idx, i)), stride)]),
                                ty.as_pointer()) for i in range(R)]

    xps = row_ptrs(arrs[1], _i8)
    xdps = row_ptrs(arrs[2], f32)
    xsps = row_ptrs(arrs[3], f32)
    outps = row_ptrs(arrs[4], f32)
    nb = builder.udiv(cgutils.unpack_tuple(builder, arrs[1].shape)[1], ir.Constant(idx, 32))
    zero = ir.Constant(v8f, [0.0] * 8)
    # one accumulator a row, the same operations for a row whether it comes alone or in a group:
    # a row's result does not depend on the batch it is in
    faccs = [cgutils.alloca_once_value(builder, zero) for _ in range(R)]
    saccs = [cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0)) for _ in range(R)]
    for i in range(R):
        builder.store(zero, faccs[i])
        builder.store(ir.Constant(f32, 0.0), saccs[i])

    def block(ib):
        b = builder.gep(rowp, [builder.mul(ib, ir.Constant(idx, bs))])
        d = _half_at(builder, b, 0)
        mn = _half_at(builder, b, moff) if moff is not None else None
        wp = builder.gep(b, [ir.Constant(idx, qoff)])
        if kind == "q8_0":
            wv = _load(builder, builder.bitcast(wp, _v32i8.as_pointer()))
            sign = _fn(builder, "llvm.x86.avx2.psign.b", _v32i8, [_v32i8, _v32i8])
            w = builder.call(sign, [wv, wv])
        else:
            w = _nibbles(builder, builder.bitcast(wp, _v16i8.as_pointer()))
            if hoff is not None:
                hp = builder.bitcast(builder.gep(b, [ir.Constant(idx, hoff)]), _i32.as_pointer())
                w = _add_fifth_bit(builder, w, _load(builder, hp))
        if moff is None and shift:  # shift * d, the same for every row
            kd = builder.fmul(d, ir.Constant(f32, shift), flags=fast)
        for i in range(R):
            xv = _load(builder, builder.bitcast(builder.gep(xps[i], [builder.mul(ib, ir.Constant(idx, 32))]),
                                                _v32i8.as_pointer()))
            if kind == "q8_0":
                xv = builder.call(sign, [xv, wv])
            pf = builder.sitofp(_madd32(builder, w, xv), v8f)
            scale = builder.fmul(d, builder.load(builder.gep(xdps[i], [ib])), flags=fast)
            sv = builder.insert_element(ir.Constant(v8f, None), scale, ir.Constant(_i32, 0))
            sv = builder.shuffle_vector(sv, sv, _mask([0] * 8))
            facc = faccs[i]
            builder.store(builder.fadd(builder.load(facc), builder.fmul(pf, sv, flags=fast), flags=fast), facc)
            if moff is not None or shift:  # + m * xd * sum(xq), or + shift * d * xd * sum(xq)
                xsd = builder.load(builder.gep(xsps[i], [ib]))
                k = mn if moff is not None else kd
                builder.store(builder.fadd(builder.load(saccs[i]), builder.fmul(k, xsd, flags=fast), flags=fast),
                              saccs[i])

    with cgutils.for_range(builder, nb) as loop:
        block(loop.index)
    red = _fn(builder, "llvm.vector.reduce.fadd.v8f32", f32, [f32, v8f])
    for i in range(R):
        v = builder.load(faccs[i])
        total = builder.fadd(builder.call(red, [ir.Constant(f32, 0.0), v]), builder.load(saccs[i]), flags=fast)
        builder.store(total, builder.gep(outps[i], [ov]))


def _make_rows_dot(kind):
    """The intrinsic for every activation row against one weight row of type ``kind``."""

    def rows_dot(typingctx, row, xq, xd, xsd, out, o):
        _check(row)

        def codegen(context, builder, sig, args):
            rowa, xqa, xda, xsa, outa, ov = args
            arrs = [cgutils.create_struct_proxy(ty)(context, builder, value=v)
                    for ty, v in zip(sig.args[:5], (rowa, xqa, xda, xsa, outa))]
            m = cgutils.unpack_tuple(builder, arrs[1].shape)[0]
            idx = m.type
            # rows in groups of four, then a pair, then one: r0 = 4 g, then 4 (m // 4), ...
            four = ir.Constant(idx, 4)
            with cgutils.for_range(builder, builder.udiv(m, four)) as loop:
                _emit_rows(builder, kind, 4, arrs, builder.mul(loop.index, four), ov)
            r = builder.mul(builder.udiv(m, four), four)
            left = builder.sub(m, r)
            with builder.if_then(builder.icmp_unsigned(">=", left, ir.Constant(idx, 2))):
                _emit_rows(builder, kind, 2, arrs, r, ov)
            with builder.if_then(builder.icmp_unsigned("==", builder.and_(left, ir.Constant(idx, 1)),
                                                       ir.Constant(idx, 1))):
                _emit_rows(builder, kind, 1, arrs, builder.sub(m, ir.Constant(idx, 1)), ov)
            return context.get_dummy_value()

        return types.void(row, xq, xd, xsd, out, o), codegen

    rows_dot.__name__ = f"rows_{kind}"
    rows_dot.__doc__ = (f"out[r, o] = x[r] . W[o] for every activation row r: one {kind.upper()} weight row "
                        "``row`` (uint8) against int8 activation rows xq (2-D, with per-32 scales xd and "
                        "xsd = xd * sum(xq)); four rows to an unpacked block, then two, then one.")
    return intrinsic(rows_dot)


rows_q4_0 = _make_rows_dot("q4_0")
rows_q4_1 = _make_rows_dot("q4_1")
rows_q5_0 = _make_rows_dot("q5_0")
rows_q5_1 = _make_rows_dot("q5_1")
rows_q8_0 = _make_rows_dot("q8_0")

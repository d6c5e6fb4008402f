"""Decode / verify attention over a typed K/V cache (:mod:`plinth.kvtypes`: f16, bf16, q8_0, q4_0, q4_1,
q5_0, q5_1, or float32 beside a typed field), as LLVM IR on float vectors: the vector kernel of
:mod:`plinth.ops.attend_simd` with its keys and values read from the stored blocks.

The keys go W at a time as there (W = 16 floats with AVX-512, else 8): each block of W key rows is
unpacked once into a float block of the call's scratch (W rows of the head size, in the L1 cache),
and every query head of the call scores it with the same fused multiply-adds and transposing
reduction as the float32 kernel; the values of a block of W keys are unpacked once into a second
scratch block and summed into the outputs as there. Unpacking is gguf-py's dequantization, value for
value (a W-wide chunk of a block: its integers widened, offset, converted, times the block's f16
scale, plus its f16 minimum for q4_1 / q5_1; f16 and bf16 widened), so the result is, bit for bit,
the float32 kernel's over the dequantized rows (``tests/test_attend_qsimd.py``), and a row's bits do
not depend on the batch for the same reasons: every key runs the same steps wherever it falls (the
last, partial block is unpacked into the same scratch block, its unused rows zero), and the caller
drops a row's trailing masked keys first.

A value block whose keys have weight 0 for every query head of the call is not unpacked (its sums
would add nothing: the float32 kernel skips such keys one by one). For the float row types the rows
of the key (and value) block two blocks ahead are prefetched into the L2 cache
(:data:`plinth.ops.attend_simd.PREFETCH_BLOCKS`): a hint, no arithmetic changes.

Conditions (the caller keeps the plain kernel of :mod:`plinth.ops.attend_q` otherwise): head sizes
multiples of W (keys) and 4W (values), no soft-cap.
"""

from __future__ import annotations

import math

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .attend_simd import (PREFETCH_BLOCKS, PREFETCH_LOCALITY, _F32P, _U8P, _bcast, _bcast_i64, _c64, _f32, _fma,
                          _i32, _i64, _softmax_rows, _splat, _transpose_sum, _vec, _vload, _vstore, lanes)
from .attend_simd import prefetch_ahead as _prefetch_ahead
from .attend_simd import prefetch_first as _prefetch_first

_i8, _i16 = ir.IntType(8), ir.IntType(16)
_half = ir.HalfType()

#: the type codes the kernel unpacks (plinth.kvtypes.CACHE_TYPES: f32 0, f16 1, bf16 2, q8_0 3, q4_0 4,
#: q4_1 5, q5_0 6, q5_1 7) and, for the block types, their bytes a block of 32 values
CODES = (0, 1, 2, 3, 4, 5, 6, 7)
_BLOCK_BYTES = {3: 34, 4: 18, 5: 20, 6: 22, 7: 24}


@njit(cache=True)
def scratch_floats(n_kv: int, n_q: int, hd: int, hd_v: int, W: int) -> int:
    """Floats of scratch the typed kernel needs (a numba function: the task sizes it)."""
    return n_q * (-(-n_kv // W) * W + hd_v + W) + W * max(hd, hd_v)


def _ivec(bits, W):
    return ir.VectorType(ir.IntType(bits), W)


def _iconst(bits, W, value):
    return ir.Constant(_ivec(bits, W), [value] * W)


def _load_as(b, p, t, align=1):
    v = b.load(b.bitcast(p, t.as_pointer()))
    v.align = align
    return v


def _scalar_half(b, p):
    """The f16 at byte address p as a float (exact)."""
    return b.fpext(_load_as(b, p, _half), _f32)


def _nibbles(b, qs, r, W):
    """The 4-bit values r .. r + W - 1 of a block (r a multiple of W) as W i32 lanes: values 0..15 are the low
    nibbles of the block's 16 bytes at ``qs``, 16..31 the high ones (gguf-py's order)."""
    raw = _load_as(b, b.gep(qs, [_c64(r % 16)]), _ivec(8, W))
    if r >= 16:
        raw = b.lshr(raw, _iconst(8, W, 4))
    return b.zext(b.and_(raw, _iconst(8, W, 15)), _ivec(32, W))


def _fifth_bits(b, qh_at, r, W):
    """Bit 4 of the 5-bit values r .. r + W - 1 (q5_0 / q5_1): bit (r + lane) of the block's 32-bit qh at
    ``qh_at``, shifted to 16."""
    qh = _load_as(b, qh_at, ir.IntType(32))
    qv = b.shuffle_vector(b.insert_element(ir.Constant(_ivec(32, W), None), qh, ir.Constant(_i32, 0)),
                          ir.Constant(_ivec(32, W), None), ir.Constant(_ivec(32, W), [0] * W))
    bit = b.and_(b.lshr(qv, ir.Constant(_ivec(32, W), list(range(r, r + W)))), _iconst(32, W, 1))
    return b.shl(bit, _iconst(32, W, 4))


def _chunk(b, code, row, off, W):
    """Values off .. off + W - 1 (off a multiple of W) of the stored float row (f32, f16, bf16) at byte address
    ``row`` of type ``code``, as a float vector."""
    vt = _vec(W)
    if code == 0:
        return _load_as(b, b.gep(row, [b.mul(off, _c64(4))]), vt)
    if code == 1:
        return b.fpext(_load_as(b, b.gep(row, [b.mul(off, _c64(2))]), ir.VectorType(_half, W)), vt)
    h = _load_as(b, b.gep(row, [b.mul(off, _c64(2))]), _ivec(16, W))
    return b.bitcast(b.shl(b.zext(h, _ivec(32, W)), _iconst(32, W, 16)), vt)


def _block_chunk(b, code, base, d, r, W):
    """Values r .. r + W - 1 (r a multiple of W below 32) of the 32-value block at byte address ``base`` of
    type ``code`` (its scale ``d`` broadcast), as a float vector, each as gguf-py's dequantization computes
    it: the integer times d (plus the block's minimum for q4_1 / q5_1)."""
    vt = _vec(W)
    if code == 3:
        q = b.sext(_load_as(b, b.gep(base, [_c64(2 + r)]), _ivec(8, W)), _ivec(32, W))
        return b.fmul(d, b.sitofp(q, vt))
    if code == 4:
        q = b.sub(_nibbles(b, b.gep(base, [_c64(2)]), r, W), _iconst(32, W, 8))
        return b.fmul(d, b.sitofp(q, vt))
    if code == 5:
        m = _bcast(b, _scalar_half(b, b.gep(base, [_c64(2)])), W)
        q = _nibbles(b, b.gep(base, [_c64(4)]), r, W)
        return b.fadd(b.fmul(d, b.sitofp(q, vt)), m)
    if code == 6:
        q = b.or_(_nibbles(b, b.gep(base, [_c64(6)]), r, W), _fifth_bits(b, b.gep(base, [_c64(2)]), r, W))
        return b.fmul(d, b.sitofp(b.sub(q, _iconst(32, W, 16)), vt))
    if code == 7:
        m = _bcast(b, _scalar_half(b, b.gep(base, [_c64(2)])), W)
        q = b.or_(_nibbles(b, b.gep(base, [_c64(8)]), r, W), _fifth_bits(b, b.gep(base, [_c64(4)]), r, W))
        return b.fadd(b.fmul(d, b.sitofp(q, vt)), m)
    raise ValueError(f"attend_qsimd: no cache type code {code}")


def _unpack_fn(module, W):
    """``plinth_unpack_W(src, stride, n_rows, n, code, dst)``: rows i < n_rows of type ``code`` (row i at byte
    address src + i * stride) unpacked into dst + i * n floats (n a multiple of W)."""
    name = f"plinth_unpack_rows_{W}"
    fn = cgutils.get_or_insert_function(module, ir.FunctionType(ir.VoidType(), [_U8P, _i64, _i64, _i64, _i64,
                                                                                  _F32P]), name)
    if not fn.is_declaration:
        return fn
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    fn.attributes.add("nounwind")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    src, stride, n_rows, n, code, dst = fn.args
    done = fn.append_basic_block("done")
    sw = b.switch(code, done)
    for c in CODES:
        blk = fn.append_basic_block(f"code{c}")
        sw.add_case(ir.Constant(_i64, c), blk)
        b.position_at_end(blk)
        with cgutils.for_range(b, n_rows) as i:
            row = b.gep(src, [b.mul(i.index, stride)])
            out = b.gep(dst, [b.mul(i.index, n)])
            if c < 3:
                with cgutils.for_range(b, b.udiv(n, _c64(W))) as ch:
                    off = b.mul(ch.index, _c64(W))
                    _vstore(b, _chunk(b, c, row, off, W), b.gep(out, [off]))
            else:  # a block at a time: its scale read once, its 32 // W chunks unrolled
                with cgutils.for_range(b, b.udiv(n, _c64(32))) as bi:
                    base = b.gep(row, [b.mul(bi.index, _c64(_BLOCK_BYTES[c]))])
                    d = _bcast(b, _scalar_half(b, base), W)
                    for r in range(0, 32, W):
                        _vstore(b, _block_chunk(b, c, base, d, r, W),
                                b.gep(out, [b.add(b.mul(bi.index, _c64(32)), _c64(r))]))
        b.branch(done)
    b.position_at_end(done)
    b.ret_void()
    return fn


_ARGS = [_F32P, _i64, _i64, _U8P, _U8P, _i64, _i64, _i64, _i64, _i64, _f32, _F32P, _F32P, _F32P, _i64, _i64, _i64,
         _i64, _i64]


def _rows_fn(module, W):
    """``plinth_attend_typed_W(q, n_q, q_stride, k, v, n_kv, k_stride, v_stride, hd, hd_v, scale, bias, scratch,
    out, out_stride, kcode, vcode, kbytes, vbytes)``: :mod:`plinth.ops.attend_simd`'s ``plinth_attend_W`` with k
    and v the byte addresses of stored rows of types ``kcode`` / ``vcode``, ``kbytes`` / ``vbytes`` bytes each
    (k_stride, v_stride: bytes between consecutive keys / values); ``scratch`` :func:`scratch_floats` floats."""
    name = f"plinth_attend_typed_{W}"
    fn = cgutils.get_or_insert_function(module, ir.FunctionType(ir.VoidType(), _ARGS), name)
    if not fn.is_declaration:
        return fn
    unpack = _unpack_fn(module, W)
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    fn.attributes.add("nounwind")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    qp, n_q, qs, kp, vp, n_kv, ks, vs, hd, hd_v, scale, bp, sp, op, os_, kcode, vcode, krb, vrb = fn.args
    Wc = _c64(W)
    vt = _vec(W)
    ninf = _splat(W, -math.inf)
    zero = _splat(W, 0.0)
    n_full = b.udiv(n_kv, Wc)
    rest = b.sub(n_kv, b.mul(n_full, Wc))
    nb = b.udiv(b.add(n_kv, _c64(W - 1)), Wc)
    srow = b.mul(nb, Wc)  # scratch: per query its scores (srow floats); per query its output sums (hd_v);
    o_at = b.gep(sp, [b.mul(n_q, srow)])  # per query its 1 / denominator (W floats, lane 0); the unpacked
    inv_at = b.gep(o_at, [b.mul(n_q, hd_v)])  # block of keys (W x hd), later of values (W x hd_v): one
    kpad = b.gep(inv_at, [b.mul(n_q, Wc)])  # block, so that it stays in the L1 cache with large heads
    vpad = kpad
    accs = [cgutils.alloca_once_value(b, zero) for _ in range(W)]
    sv = cgutils.alloca_once(b, vt)
    btail = cgutils.alloca_once(b, vt)  # the last keys' bias, zero-padded
    has_bias = b.icmp_unsigned("!=", b.ptrtoint(bp, _i64), _c64(0))
    lane_idx = ir.Constant(ir.VectorType(_i64, W), list(range(W)))

    def scores(blk, bias_at):
        """Every query's scores of keys blk*W .. blk*W + W - 1 (unpacked in kpad), their bias (where there
        is one) at ``bias_at``: the float32 kernel's steps."""
        j0 = b.mul(blk, Wc)
        valid = b.icmp_signed("<", b.add(_bcast_i64(b, j0, W), lane_idx), _bcast_i64(b, n_kv, W))
        with cgutils.for_range(b, n_q) as qi:
            qrow = b.gep(qp, [b.mul(qi.index, qs)])
            for a in accs:
                b.store(zero, a)
            with cgutils.for_range(b, b.udiv(hd, Wc)) as c:
                off = b.mul(c.index, Wc)
                qc = _vload(b, b.gep(qrow, [off]), W)
                for i, a in enumerate(accs):
                    kc = _vload(b, b.gep(kpad, [b.add(b.mul(_c64(i), hd), off)]), W)
                    b.store(_fma(b, qc, kc, b.load(a)), a)
            b.store(b.fmul(_transpose_sum(b, [b.load(a) for a in accs], W), _bcast(b, scale, W)), sv)
            with b.if_then(has_bias):
                b.store(b.fadd(b.load(sv), _vload(b, bias_at, W)), sv)
            _vstore(b, b.select(valid, b.load(sv), ninf), b.gep(sp, [b.add(b.mul(qi.index, srow), j0)]))

    def prefetch_first(base, stride, rb, code):
        """The rows of the first PREFETCH_BLOCKS blocks (float row types only: ``code`` < 3)."""
        with b.if_then(b.icmp_unsigned("<", code, _c64(3))):
            _prefetch_first(b, W, n_kv, base, stride, rb, PREFETCH_BLOCKS, PREFETCH_LOCALITY)

    def prefetch_ahead(base, stride, rb, code, j0):
        """The rows of the block PREFETCH_BLOCKS ahead of the one at key j0 (float row types only)."""
        with b.if_then(b.icmp_unsigned("<", code, _c64(3))):
            _prefetch_ahead(b, W, n_kv, base, stride, rb, j0, PREFETCH_BLOCKS, PREFETCH_LOCALITY)

    prefetch_first(kp, ks, krb, kcode)
    with cgutils.for_range(b, n_full) as blk:
        j0 = b.mul(blk.index, Wc)
        prefetch_ahead(kp, ks, krb, kcode, j0)
        b.call(unpack, [b.gep(kp, [b.mul(j0, ks)]), ks, Wc, hd, kcode, kpad])
        scores(blk.index, b.gep(bp, [j0]))
    with b.if_then(b.icmp_unsigned("!=", rest, _c64(0))):  # the last keys, unpacked into a zero-padded block
        j0 = b.mul(n_full, Wc)
        b.store(zero, btail)
        tail = b.bitcast(btail, _F32P)
        b.call(unpack, [b.gep(kp, [b.mul(j0, ks)]), ks, rest, hd, kcode, kpad])
        with cgutils.for_range(b, b.sub(Wc, rest)) as i:
            dst = b.gep(kpad, [b.mul(b.add(rest, i.index), hd)])
            with cgutils.for_range(b, b.udiv(hd, Wc)) as c:
                _vstore(b, zero, b.gep(dst, [b.mul(c.index, Wc)]))
        with b.if_then(has_bias):
            with cgutils.for_range(b, rest) as i:
                b.store(b.load(b.gep(bp, [b.add(j0, i.index)])), b.gep(tail, [i.index]))
        scores(n_full, tail)

    prefetch_first(vp, vs, vrb, vcode)
    _softmax_rows(b, W, Wc, vt, n_q, nb, sp, srow, inv_at, o_at, hd_v)
    outs = [[cgutils.alloca_once(b, vt) for _ in range(4)] for _ in range(2)]

    def value_sums(j0, j1, qis, off):
        """Keys j0 .. j1 - 1 (their values unpacked in vpad) into the output sums of the queries ``qis``
        (one or two), value lanes off .. off + 4W: the float32 kernel's steps."""
        prows = [b.gep(sp, [b.mul(qi, srow)]) for qi in qis]
        orows = [b.gep(o_at, [b.mul(qi, hd_v)]) for qi in qis]
        for o4, orow in zip(outs, orows):
            for i, o in enumerate(o4):
                b.store(_vload(b, b.gep(orow, [b.add(off, _c64(i * W))]), W), o)
        with cgutils.for_range(b, b.sub(j1, j0)) as jj:
            j = b.add(j0, jj.index)
            ps = [b.load(b.gep(prow, [j])) for prow in prows]
            nz = [b.fcmp_unordered("!=", pj, ir.Constant(_f32, 0.0)) for pj in ps]
            with b.if_then(nz[0] if len(nz) == 1 else b.or_(nz[0], nz[1])):
                row = b.gep(vpad, [b.add(b.mul(jj.index, hd_v), off)])
                vals = [_vload(b, b.gep(row, [_c64(i * W)]), W) for i in range(4)]
                for pj, o4 in zip(ps, outs):
                    pv = _bcast(b, pj, W)
                    for o, val in zip(o4, vals):
                        b.store(_fma(b, pv, val, b.load(o)), o)
        for o4, orow in zip(outs, orows):
            for i, o in enumerate(o4):
                _vstore(b, b.load(o), b.gep(orow, [b.add(off, _c64(i * W))]))

    live = cgutils.alloca_once(b, ir.IntType(1))
    with cgutils.for_range(b, nb) as blk:  # value sums, a block of W keys at a time for all the queries
        j0 = b.mul(blk.index, Wc)
        j1 = b.select(b.icmp_unsigned("<", blk.index, n_full), b.add(j0, Wc), n_kv)
        prefetch_ahead(vp, vs, vrb, vcode, j0)
        b.store(ir.Constant(ir.IntType(1), 0), live)
        with cgutils.for_range(b, n_q) as qi:  # any weight of the block not 0 (the unused lanes hold 0)
            pv = _vload(b, b.gep(sp, [b.add(b.mul(qi.index, srow), j0)]), W)
            nzv = b.fcmp_unordered("!=", pv, zero)
            anyz = b.icmp_unsigned("!=", b.bitcast(nzv, ir.IntType(W)), ir.Constant(ir.IntType(W), 0))
            b.store(b.or_(b.load(live), anyz), live)
        with b.if_then(b.load(live)):
            b.call(unpack, [b.gep(vp, [b.mul(j0, vs)]), vs, b.sub(j1, j0), hd_v, vcode, vpad])
            with cgutils.for_range(b, b.udiv(hd_v, _c64(4 * W))) as c:
                off = b.mul(c.index, _c64(4 * W))
                with cgutils.for_range(b, b.udiv(n_q, _c64(2))) as qp2:
                    q0 = b.mul(qp2.index, _c64(2))
                    value_sums(j0, j1, [q0, b.add(q0, _c64(1))], off)
                with b.if_then(b.icmp_unsigned("!=", b.urem(n_q, _c64(2)), _c64(0))):
                    value_sums(j0, j1, [b.sub(n_q, _c64(1))], off)
    with cgutils.for_range(b, n_q) as qi:
        invb = _bcast(b, b.load(b.gep(inv_at, [b.mul(qi.index, Wc)])), W)
        orow = b.gep(o_at, [b.mul(qi.index, hd_v)])
        out_row = b.gep(op, [b.mul(qi.index, os_)])
        with cgutils.for_range(b, b.udiv(hd_v, Wc)) as c:
            off = b.mul(c.index, Wc)
            _vstore(b, b.fmul(_vload(b, b.gep(orow, [off]), W), invb), b.gep(out_row, [off]))
    b.ret_void()
    return fn


def make_attend(W: int):
    """The intrinsic for W float lanes (``attend_rows_typed`` is the host's; tests build the other)."""

    def attend(typingctx, q, n_q, q_stride, k, v, n_kv, k_stride, v_stride, hd, hd_v, scale, bias, scratch, out,
               out_stride, kcode, vcode, kbytes, vbytes):
        i64 = types.int64
        sig = types.void(i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, types.float32, i64, i64, i64, i64, i64,
                         i64, i64, i64)

        def codegen(context, builder, signature, args):
            vals = [context.cast(builder, a, t, st) for a, t, st in zip(args, signature.args, sig.args)]
            for i in (0, 11, 12, 13):
                vals[i] = builder.inttoptr(vals[i], _F32P)
            for i in (3, 4):
                vals[i] = builder.inttoptr(vals[i], _U8P)
            builder.call(_rows_fn(builder.module, W), vals)
            return context.get_dummy_value()

        return sig, codegen

    attend.__name__ = f"attend_rows_typed_{W}"
    return intrinsic(attend)


#: ``attend_rows_typed(q, n_q, q_stride, k, v, n_kv, k_stride, v_stride, hd, hd_v, scale, bias, scratch, out,
#: out_stride, kcode, vcode, kbytes, vbytes)`` from numba (:func:`_rows_fn` with the host's lanes): q, bias,
#: scratch and out int64 data addresses of float32 memory (``bias`` 0 for none), k and v of the stored rows'
#: bytes, strides of q / out in floats and of k / v in bytes, kbytes / vbytes the bytes of one stored key /
#: value row (what the prefetches cover), scale a float32, the rest int64
attend_rows_typed = make_attend(lanes())

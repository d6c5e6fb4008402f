"""Decode / verify attention for the query heads of one row that share a kv head, as LLVM IR on
float vectors (``numba.extending.intrinsic``), for :func:`plinth.ops.compiled.attention_groups`.

A loop over the keys that takes one dot product at a time spends most of its time in each
product's horizontal sum (a chain of shuffles and adds per key). Here the keys go W at a time
(W = 16 floats with AVX-512, else 8): W accumulators, one per key, each a W-lane vector summed
over the head's W-wide chunks with fused multiply-adds; then one transposing reduction turns the
W vectors into one vector of W scores (log2 W levels of two shuffles and an add; the same tree
for every key). Softmax takes a vector exp (below), the value sum four W-wide chunks of the
output at a time, each a chain over the keys, for two query heads at once (one read of each value
row). The query heads of the call read each block of keys and values in turn, from the L1 cache.
The rows of the key (and value) block :data:`F32_PREFETCH_BLOCKS` ahead are prefetched, a hint
that changes no arithmetic: a server step's 16 sequences' rows come from memory, and without it the
loop waited on each line in turn.

Every key's score goes through the same operations wherever it falls (the last, partial block of
keys is copied into a zero-padded scratch block first, so it takes the same path), the denominator
is a lane-wise sum plus a fixed tree, and keys whose weight is exactly 0 (masked, -inf) are skipped
in the value sum. One thing does depend on where a row's key blocks end: the kernel is compiled under
its caller's fast-math flags, which let LLVM reassociate the denominator's loop over the blocks, so
its bits follow the loop's trip count. Each query therefore runs its maximum and its sum over its own
blocks only (``row_keys``: several rows of a sequence share a call, each with its key count), and the
caller (:func:`plinth.ops.compiled._vector_task`) gives each row the count it has alone (its trailing
masked keys, a verify batch's later rows, left out); the keys past a row's own that another row of the
call sees weigh exactly 0 for it. With that a row's result does not depend on the other rows, and a
verify row gives the bits its decode step would (``tests/test_lossless_kernels.py``).

``exp`` (arguments <= 0 here: scores minus their maximum): ``x = n ln2 + r`` with n rounded to
nearest, |r| <= ln2 / 2, ``2^n`` built in the exponent bits and ``e^r`` a degree-7 Taylor
polynomial (truncation under 1e-8 relative); below -87.3 the result is 0 (f32 normals end there),
-inf included.

Conditions (the caller falls back to its plain loop otherwise): head size a multiple of W, value
head size a multiple of 4W, no soft-cap.
"""

from __future__ import annotations

import math

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..quant.jitcache import emit_prefetch
from ..quant.simd import host_features

_i32, _i64 = ir.IntType(32), ir.IntType(64)
_f32 = ir.FloatType()
_F32P = _f32.as_pointer()
_U8P = ir.IntType(8).as_pointer()

#: where the attention kernels' prefetches send the rows (:func:`plinth.quant.jitcache.emit_prefetch`'s locality):
#: the L2 cache. Into the L1 they waited on its few miss buffers: 16 sequences x 110 keys x 30 layers read from
#: memory (a server step's attention, float32, 2 threads) 5.6-7.5 ms into the L1 against 4.0-4.4 into the L2;
#: one row at 4000 keys, f16, 10.3-10.8 against 9.9-10.3 ms
PREFETCH_LOCALITY = 2

#: the typed kernel's (:mod:`plinth.ops.attend_qsimd`) float row types (f16, bf16, f32): blocks of W keys (and
#: values) ahead whose rows a task prefetches (SmolLM2, f16, 4096 keys, 2 threads, a head-major cache: 30 layers
#: 5.3-5.6 ms with it, 5.7-7.7 without; one block ahead 10.4-10.8 ms at 4000 keys against two's 9.6-10.4); its
#: block types are compute-bound and skip it (q8_0 6.0 ms with, 5.6 without)
PREFETCH_BLOCKS = 2

#: this float32 kernel's: one block ahead. The same 16 sequences x 110 keys x 30 layers: 5.4-6.6 ms without a
#: prefetch, 4.0-4.4 one block ahead, 4.5-4.6 two; a server-shaped 16-row SmolLM2 step 18.0-18.6 -> 16.9-17.8 ms,
#: one row at 4000 keys 15.3 -> 14.1-14.7 ms (two blocks: 13.6-14.4)
F32_PREFETCH_BLOCKS = 1


def _prefetch_rows(b, src, stride, n_rows, rb, locality):
    """Prefetch (read, ``locality`` as :func:`plinth.quant.jitcache.emit_prefetch` takes it) the cache lines from
    row 0 (at byte address ``src``, an ``i8*``) to the end of row n_rows - 1 (at src + (n_rows - 1) * stride
    bytes, ``rb`` bytes long): the rows themselves where they are contiguous (a head-major cache). A hint: no
    arithmetic changes."""
    span = b.add(b.mul(b.sub(n_rows, _c64(1)), stride), rb)
    with cgutils.for_range(b, b.udiv(b.add(span, _c64(63)), _c64(64))) as ln:
        emit_prefetch(b, b.gep(src, [b.mul(ln.index, _c64(64))]), locality=locality)
    emit_prefetch(b, b.gep(src, [b.sub(span, _c64(1))]), locality=locality)  # (a span that starts mid-line)


def prefetch_first(b, W, n_kv, base, stride, rb, blocks, locality):
    """Prefetch the rows of the first ``blocks`` blocks of W keys (or values) at ``base`` (``i8*``, ``stride``
    bytes between rows, ``rb`` bytes a row; n_kv rows in all)."""
    ahead = _c64(blocks * W)
    with b.if_then(b.icmp_unsigned("!=", n_kv, _c64(0))):
        _prefetch_rows(b, base, stride, b.select(b.icmp_unsigned("<", n_kv, ahead), n_kv, ahead), rb, locality)


def prefetch_ahead(b, W, n_kv, base, stride, rb, j0, blocks, locality):
    """Prefetch the rows of the block ``blocks`` blocks ahead of the one at row j0 (those of them below n_kv):
    called once a block after :func:`prefetch_first`, it keeps that many blocks in flight ahead of the
    arithmetic."""
    ja = b.add(j0, _c64(blocks * W))
    with b.if_then(b.icmp_unsigned("<", ja, n_kv)):
        nr = b.sub(n_kv, ja)
        nr = b.select(b.icmp_unsigned("<", nr, _c64(W)), nr, _c64(W))
        _prefetch_rows(b, b.gep(base, [b.mul(ja, stride)]), stride, nr, rb, locality)


def lanes() -> int:
    """W: 16 with AVX-512 on the host, else 8."""
    return 16 if host_features().get("avx512f") else 8


def _c64(v):
    return ir.Constant(_i64, v)


def _vec(W):
    return ir.VectorType(_f32, W)


def _splat(W, value):
    return ir.Constant(_vec(W), [value] * W)


def _bcast(b, v, W):
    vec = b.insert_element(ir.Constant(_vec(W), None), v, ir.Constant(_i32, 0))
    return b.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_i32, W), [0] * W))


def _fn(b, name, ret, args):
    return cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, args), name)


def _fma(b, x, y, z):
    t = x.type
    return b.call(_fn(b, f"llvm.fma.v{t.count}f32", t, [t, t, t]), [x, y, z])


def _vload(b, p, W):
    v = b.load(b.bitcast(p, _vec(W).as_pointer()))
    v.align = 4
    return v


def _vstore(b, v, p):
    s = b.store(v, b.bitcast(p, v.type.as_pointer()))
    s.align = 4


def _mask(idx):
    return ir.Constant(ir.VectorType(_i32, len(idx)), list(idx))


def _transpose_sum(b, vs, W):
    """W vectors of W partial sums (vs[k]: key k's partials) -> one vector, lane k = key k's total:
    log2 W levels, each pairing adjacent vectors; at a level of K keys x P partials a vector, two
    shuffles take the low and the high halves of each key's partials and one add sums them."""
    cur, K, P = list(vs), 1, W
    while len(cur) > 1:
        h = P // 2
        lo = [s * P + p for s in range(K) for p in range(h)]
        lo += [W + s * P + p for s in range(K) for p in range(h)]
        hi = [i + h for i in lo]
        cur = [b.fadd(b.shuffle_vector(cur[i], cur[i + 1], _mask(lo)), b.shuffle_vector(cur[i], cur[i + 1], _mask(hi)))
               for i in range(0, len(cur), 2)]
        K, P = 2 * K, h
    return cur[0]


def _hreduce(b, v, W, op):
    """A fixed tree over the W lanes of v with ``op`` (halves combined lane-wise): lane 0 of the result."""
    n = W
    while n > 1:
        n //= 2
        v = op(v, b.shuffle_vector(v, v, _mask([i + n if i < n else i for i in range(W)])))
    return b.extract_element(v, ir.Constant(_i32, 0))


def _exp(b, x, W):
    """e^x lane-wise for x <= 0 (see the module docstring)."""
    vt = _vec(W)
    it = ir.VectorType(_i32, W)
    small = b.fcmp_ordered("<", x, _splat(W, -87.3))
    xc = b.select(small, _splat(W, -87.3), x)
    t = b.fmul(xc, _splat(W, 1.0 / math.log(2.0)))
    n = b.call(_fn(b, f"llvm.nearbyint.v{W}f32", vt, [vt]), [t])
    r = _fma(b, n, _splat(W, -0.693145751953125), xc)  # ln2 split: hi (exact times n) and lo
    r = _fma(b, n, _splat(W, -1.428606765330187e-06), r)
    p = _splat(W, 1.0 / 5040.0)
    for c in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = _fma(b, p, r, _splat(W, c))
    e = b.shl(b.add(b.fptosi(n, it), ir.Constant(it, [127] * W)), ir.Constant(it, [23] * W))
    y = b.fmul(p, b.bitcast(e, vt))
    return b.select(small, _splat(W, 0.0), y)


_ARGS = [_F32P, _i64, _i64, _F32P, _F32P, _i64, _i64, _i64, _i64, _i64, _f32, _F32P, _F32P, _F32P, _i64, _i64, _i64,
         _i64, _i64, _i64.as_pointer()]


@njit(cache=True)
def scratch_floats(n_kv: int, n_q: int, hd: int, hd_v: int, W: int) -> int:
    """Floats of scratch :func:`attend_rows` needs (a numba function: the kernels' callers size it)."""
    return n_q * (-(-n_kv // W) * W + hd_v + W) + W * hd + 8 * n_q


def _softmax_rows(b, W, Wc, vt, n_q, nb, sp, srow, inv_at, o_at, hd_v, blocks_of=None):
    """Each query row's softmax weights in place of its scores (``nb`` vectors of ``W`` at ``sp + q * srow``):
    the row's maximum, exp(score - max) and their sum; 1 / sum (0 for a row that sees no key) at
    ``inv_at + q * W``; the row's ``hd_v`` output sums zeroed. ``blocks_of(qi)``: where a query sees fewer
    blocks than ``nb`` (a row of a chunk whose later rows see more keys), its maximum and sum go over its own
    blocks only, as when it runs alone (the sum's loop may be reassociated by the fast-math flags the kernel is
    compiled under, so its trip count decides its bits), and the weights of the blocks past them are zeros.
    Shared by the float32 and typed-cache kernels."""
    zero = _splat(W, 0.0)
    ninf = _splat(W, -math.inf)

    def vmax(x, y):
        return b.select(b.fcmp_ordered(">", x, y), x, y)

    mxv = cgutils.alloca_once(b, vt)
    den = cgutils.alloca_once(b, vt)
    with cgutils.for_range(b, n_q) as qi:
        srow_at = b.gep(sp, [b.mul(qi.index, srow)])
        nbq = nb if blocks_of is None else blocks_of(qi.index)
        b.store(ninf, mxv)
        with cgutils.for_range(b, nbq) as blk:
            b.store(vmax(_vload(b, b.gep(srow_at, [b.mul(blk.index, Wc)]), W), b.load(mxv)), mxv)
        mx = _hreduce(b, b.load(mxv), W, vmax)
        seen = b.fcmp_ordered("!=", mx, ir.Constant(_f32, -math.inf))  # else: sees no key, output 0
        mxb = _bcast(b, b.select(seen, mx, ir.Constant(_f32, 0.0)), W)
        b.store(zero, den)
        with cgutils.for_range(b, nbq) as blk:
            p_at = b.gep(srow_at, [b.mul(blk.index, Wc)])
            p = _exp(b, b.fsub(_vload(b, p_at, W), mxb), W)
            _vstore(b, p, p_at)
            b.store(b.fadd(b.load(den), p), den)
        if blocks_of is not None:
            with cgutils.for_range(b, b.sub(nb, nbq)) as blk:
                _vstore(b, zero, b.gep(srow_at, [b.mul(b.add(nbq, blk.index), Wc)]))
        total = _hreduce(b, b.load(den), W, b.fadd)
        inv = b.select(seen, b.fdiv(ir.Constant(_f32, 1.0), total), ir.Constant(_f32, 0.0))
        b.store(inv, b.gep(inv_at, [b.mul(qi.index, Wc)]))
        with cgutils.for_range(b, b.udiv(hd_v, Wc)) as c:
            _vstore(b, zero, b.gep(o_at, [b.add(b.mul(qi.index, hd_v), b.mul(c.index, Wc))]))


def _rows_fn(module, W):
    """``plinth_attend_W(q, n_q, q_stride, k, v, n_kv, k_stride, v_stride, hd, hd_v, scale, bias, scratch,
    out, out_stride, per_row, q_row_stride, out_row_stride, bias_stride, row_keys)``: n_q query vectors against
    the same keys and values (strides in floats between consecutive keys / values), in rows of ``per_row``
    queries: query i = per_row * a + c at q + a * q_row_stride + c * q_stride, its output at out + a *
    out_row_stride + c * out_stride, its bias (n_kv floats; null: none) at bias + a * bias_stride, the keys it
    sees ``row_keys[a]`` (int64; null: all n_kv) -- the query heads of one token that share a kv head, over
    several tokens of a sequence, each with its own mask; ``scratch`` :func:`scratch_floats` floats. Each
    key block is read once for all the queries (they take it from the L1 cache in turn), and a query's
    arithmetic is the one it gets alone with its own key count, whatever the other queries are: the keys
    past its own are masked for it (their weights exactly 0) and its softmax runs over its own blocks."""
    name = f"plinth_attend_{W}"
    fn = cgutils.get_or_insert_function(module, ir.FunctionType(ir.VoidType(), _ARGS), name)
    if not fn.is_declaration:
        return fn
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    fn.attributes.add("nounwind")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    qp, n_q, qs, kp, vp, n_kv, ks, vs, hd, hd_v, scale, bp, sp, op, os_, per_row, qrs, ors, bs, nrp = fn.args
    Wc = _c64(W)
    vt = _vec(W)
    ninf = _splat(W, -math.inf)
    zero = _splat(W, 0.0)
    n_full = b.udiv(n_kv, Wc)
    rest = b.sub(n_kv, b.mul(n_full, Wc))
    nb = b.udiv(b.add(n_kv, _c64(W - 1)), Wc)
    srow = b.mul(nb, Wc)  # scratch: per query its scores (srow floats), then its output sums (hd_v), then
    o_at = b.gep(sp, [b.mul(n_q, srow)])  # its 1 / denominator (W floats, lane 0); then the padded key block
    inv_at = b.gep(o_at, [b.mul(n_q, hd_v)])
    pad = b.gep(inv_at, [b.mul(n_q, Wc)])
    # then per query the float offsets of its vector, its output and its bias row, and its key count (four i64)
    offs = b.bitcast(b.gep(pad, [b.mul(Wc, hd)]), _i64.as_pointer())
    has_rows = b.icmp_unsigned("!=", b.ptrtoint(nrp, _i64), _c64(0))
    with cgutils.for_range(b, n_q) as qi:
        a_, c_ = b.udiv(qi.index, per_row), b.urem(qi.index, per_row)
        nk = cgutils.alloca_once_value(b, n_kv)
        with b.if_then(has_rows):
            b.store(b.load(b.gep(nrp, [a_])), nk)
        vals = [b.add(b.mul(a_, row_stride), b.mul(c_, stride)) for row_stride, stride in ((qrs, qs), (ors, os_),
                                                                                            (bs, _c64(0)))]
        for f, val in enumerate(vals + [b.load(nk)]):
            st = b.store(val, b.gep(offs, [b.add(b.mul(qi.index, _c64(4)), _c64(f))]))
            st.align = 4

    def qoff(qi, f):  # query qi's offset f (0: its vector, 1: its output, 2: its bias row, in floats; 3: its keys)
        v = b.load(b.gep(offs, [b.add(b.mul(qi, _c64(4)), _c64(f))]))
        v.align = 4
        return v

    accs = [cgutils.alloca_once_value(b, zero) for _ in range(W)]
    sv = cgutils.alloca_once(b, vt)
    btail = cgutils.alloca_once(b, vt)  # the last keys' bias, zero-padded
    has_bias = b.icmp_unsigned("!=", b.ptrtoint(bp, _i64), _c64(0))
    lane_idx = ir.Constant(ir.VectorType(_i64, W), list(range(W)))
    kbp, vbp = b.bitcast(kp, _U8P), b.bitcast(vp, _U8P)  # (the prefetches' byte addresses and sizes)
    ksb, vsb, krb, vrb = b.mul(ks, _c64(4)), b.mul(vs, _c64(4)), b.mul(hd, _c64(4)), b.mul(hd_v, _c64(4))

    def scores(blk, base, stride, tail):
        """Every query's scores of keys blk*W .. blk*W + W - 1 read from ``base`` (key i at base + i *
        stride), their bias (where there is one) from the query's bias row (``tail``: the last ``rest``
        keys, the bias copied into a zero-padded block first)."""
        j0 = b.mul(blk, Wc)
        lanes_at = b.add(_bcast_i64(b, j0, W), lane_idx)
        with cgutils.for_range(b, n_q) as qi:
            valid = b.icmp_signed("<", lanes_at, _bcast_i64(b, qoff(qi.index, 3), W))
            qrow = b.gep(qp, [qoff(qi.index, 0)])
            for a in accs:
                b.store(zero, a)
            with cgutils.for_range(b, b.udiv(hd, Wc)) as c:
                off = b.mul(c.index, Wc)
                qc = _vload(b, b.gep(qrow, [off]), W)
                for i, a in enumerate(accs):
                    kc = _vload(b, b.gep(base, [b.add(b.mul(_c64(i), stride), off)]), W)
                    b.store(_fma(b, qc, kc, b.load(a)), a)
            b.store(b.fmul(_transpose_sum(b, [b.load(a) for a in accs], W), _bcast(b, scale, W)), sv)
            with b.if_then(has_bias):
                bias_at = b.gep(bp, [b.add(qoff(qi.index, 2), j0)])
                if tail:
                    b.store(zero, btail)
                    with cgutils.for_range(b, rest) as i:
                        b.store(b.load(b.gep(bias_at, [i.index])), b.gep(b.bitcast(btail, _F32P), [i.index]))
                    bias_at = b.bitcast(btail, _F32P)
                b.store(b.fadd(b.load(sv), _vload(b, bias_at, W)), sv)
            _vstore(b, b.select(valid, b.load(sv), ninf), b.gep(sp, [b.add(b.mul(qi.index, srow), j0)]))

    pf = (F32_PREFETCH_BLOCKS, PREFETCH_LOCALITY)
    prefetch_first(b, W, n_kv, kbp, ksb, krb, *pf)
    with cgutils.for_range(b, n_full) as blk:
        j0 = b.mul(blk.index, Wc)
        prefetch_ahead(b, W, n_kv, kbp, ksb, krb, j0, *pf)
        scores(blk.index, b.gep(kp, [b.mul(j0, ks)]), ks, False)
    with b.if_then(b.icmp_unsigned("!=", rest, _c64(0))):  # the last keys, copied into a zero-padded block
        j0 = b.mul(n_full, Wc)
        with cgutils.for_range(b, Wc) as i:
            dst = b.gep(pad, [b.mul(i.index, hd)])
            live = b.icmp_unsigned("<", i.index, rest)
            with cgutils.for_range(b, b.udiv(hd, Wc)) as c:
                off = b.mul(c.index, Wc)
                with b.if_else(live) as (then, otherwise):
                    with then:
                        _vstore(b, _vload(b, b.gep(kp, [b.add(b.mul(b.add(j0, i.index), ks), off)]), W),
                                b.gep(dst, [off]))
                    with otherwise:
                        _vstore(b, zero, b.gep(dst, [off]))
        scores(n_full, pad, hd, True)

    prefetch_first(b, W, n_kv, vbp, vsb, vrb, *pf)
    _softmax_rows(b, W, Wc, vt, n_q, nb, sp, srow, inv_at, o_at, hd_v,
                  lambda qi: b.udiv(b.add(qoff(qi, 3), _c64(W - 1)), Wc))
    outs = [[cgutils.alloca_once(b, vt) for _ in range(4)] for _ in range(2)]

    def value_sums(j0, j1, qis, off):
        """Keys j0 .. j1 - 1 into the output sums of the queries ``qis`` (one or two: a pair shares the
        value loads; each query's sums are the same chain over the keys either way), value lanes off ..
        off + 4W."""
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
                row = b.gep(vp, [b.add(b.mul(j, vs), off)])
                vals = [_vload(b, b.gep(row, [_c64(i * W)]), W) for i in range(4)]
                for pj, o4 in zip(ps, outs):  # (a weight of 0 beside a non-zero one: fma(0, v, o) is o)
                    pv = _bcast(b, pj, W)
                    for o, val in zip(o4, vals):
                        b.store(_fma(b, pv, val, b.load(o)), o)
        for o4, orow in zip(outs, orows):
            for i, o in enumerate(o4):
                _vstore(b, b.load(o), b.gep(orow, [b.add(off, _c64(i * W))]))

    with cgutils.for_range(b, nb) as blk:  # value sums, a block of W keys at a time for all the queries
        j0 = b.mul(blk.index, Wc)
        j1 = b.select(b.icmp_unsigned("<", blk.index, n_full), b.add(j0, Wc), n_kv)
        prefetch_ahead(b, W, n_kv, vbp, vsb, vrb, j0, *pf)
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
        out_row = b.gep(op, [qoff(qi.index, 1)])
        with cgutils.for_range(b, b.udiv(hd_v, Wc)) as c:
            off = b.mul(c.index, Wc)
            _vstore(b, b.fmul(_vload(b, b.gep(orow, [off]), W), invb), b.gep(out_row, [off]))
    b.ret_void()
    return fn


def _bcast_i64(b, v, W):
    vec = b.insert_element(ir.Constant(ir.VectorType(_i64, W), None), v, ir.Constant(_i32, 0))
    return b.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_i32, W), [0] * W))


def make_attend(W: int):
    """The intrinsic for W float lanes (``attend_rows`` is the host's; tests build the other)."""

    def attend(typingctx, q, n_q, q_stride, k, v, n_kv, k_stride, v_stride, hd, hd_v, scale, bias, scratch, out,
               out_stride, per_row, q_row_stride, out_row_stride, bias_stride, row_keys):
        i64 = types.int64
        sig = types.void(i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, types.float32, i64, i64, i64, i64, i64, i64,
                         i64, i64, i64)

        def codegen(context, builder, signature, args):
            vals = [context.cast(builder, a, t, st) for a, t, st in zip(args, signature.args, sig.args)]
            for i in (0, 3, 4, 11, 12, 13):
                vals[i] = builder.inttoptr(vals[i], _F32P)
            vals[19] = builder.inttoptr(vals[19], _i64.as_pointer())
            builder.call(_rows_fn(builder.module, W), vals)
            return context.get_dummy_value()

        return sig, codegen

    attend.__name__ = f"attend_rows_{W}"
    return intrinsic(attend)


#: ``attend_rows(q, n_q, q_stride, k, v, n_kv, k_stride, v_stride, hd, hd_v, scale, bias, scratch, out,
#: out_stride, per_row, q_row_stride, out_row_stride, bias_stride, row_keys)`` from numba (:func:`_rows_fn`
#: with the host's lanes): every pointer an int64 data address, of float32 memory but ``row_keys``' (int64;
#: ``bias`` and ``row_keys`` 0 for none), scale a float32, the rest int64
attend_rows = make_attend(lanes())

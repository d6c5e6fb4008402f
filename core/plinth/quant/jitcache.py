"""Numba's on-disk cache, and compiled functions called by address.

Numba's on-disk cache keys a compiled function on its own source file's contents only. The
kernels here also inline LLVM IR written in other modules (:mod:`plinth.quant.simd`,
:mod:`plinth.ops.attend_simd`, the intrinsics below): an edit there would otherwise run the old
code from the cache. :func:`drop_stale` removes a module's cached functions when the files it
depends on changed.

The kernels' inner loops are compiled as C functions of their own (numba ``cfunc``) and the
parallel regions call them by address (:func:`address_call`): numba would otherwise compile a
callee's code again inside each function that holds it. That took the first compile of every
kernel from 19-24 s to 10-11 s on the 2-core test machine (``docs/performance.md``)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any, Callable

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def drop_stale(dispatcher: Any, deps: list[Path]) -> None:
    """Remove the cached compiled functions of ``dispatcher``'s module (every ``<module>.*.nbi`` /
    ``.nbc`` beside its cache) when the files ``deps`` differ from the ones they were compiled
    with (a digest stamp in the cache folder records them)."""
    h = hashlib.sha256()
    for p in deps:
        h.update(Path(p).read_bytes())
    digest = h.hexdigest()
    try:
        where = Path(dispatcher._cache._cache_path)
        stem = Path(dispatcher.py_func.__code__.co_filename).stem
        stamp = where / f"{stem}.deps-digest"
        if stamp.is_file() and stamp.read_text() == digest:
            return
        for f in where.glob(f"{stem}.*.nb[ic]"):
            f.unlink(missing_ok=True)
        tmp = stamp.with_suffix(f".{os.getpid()}")
        tmp.write_text(digest)
        tmp.replace(stamp)
    except (AttributeError, OSError):  # no cache (read-only tree, numba internals moved): compile as usual
        pass


_cfuncs: dict[str, Any] = {}
_cfuncs_lock = threading.Lock()


def cfunc_address(key: str, sig: Any, make: Callable[[], Callable[..., None]], **options: Any) -> int:
    """The address of ``make()`` compiled as a numba ``cfunc`` with ``sig`` and ``options``: once a process
    (under ``key``), and from numba's on-disk cache after the first process on a machine. The cache is keyed
    on the function's name and the values its closure holds, so those must be the same in every process
    (plain numbers and strings, not objects)."""
    fn = _cfuncs.get(key)
    if fn is not None:  # (called on every attention call: no lock once compiled)
        return fn.address
    with _cfuncs_lock:
        fn = _cfuncs.get(key)
        if fn is None:
            from numba import cfunc

            fn = _cfuncs[key] = cfunc(sig, cache=True, **options)(make())
        return fn.address


def address_call(sig: Any, name: str) -> Any:
    """An intrinsic ``f(address, *args)`` that calls the C function at the int64 ``address`` (a numba
    ``cfunc``'s ``.address``) with ``args`` cast to ``sig``'s argument types.

    Numba copies a callee's code into each function that calls it and optimises and emits it again
    there; a parallel region's body is compiled as a function of its own, then its wrapper, then the
    caller, so a kernel called inside a ``prange`` costs three compiles of its code. Compiled once as a
    ``cfunc`` and reached through its address (a runtime argument: addresses differ per process, the
    cached code must not hold one), it costs one."""
    fnty = ir.FunctionType(ir.VoidType(), [_llvm_type(t) for t in sig.args])

    def call(typingctx, address, *args):
        if len(args) != len(sig.args):
            raise TypeError(f"{name}: {len(sig.args)} arguments after the address, got {len(args)}")
        star = types.StarArgTuple.from_types(args)

        def codegen(context, builder, call_sig, values):
            target = builder.inttoptr(context.cast(builder, values[0], call_sig.args[0], types.int64),
                                      fnty.as_pointer())
            given = cgutils.unpack_tuple(builder, values[1], len(args))
            builder.call(target, [context.cast(builder, v, t, want) for v, t, want in zip(given, args, sig.args)])
            return context.get_dummy_value()

        return types.void(address, star), codegen

    call.__name__ = name
    return intrinsic(call)


def pointer_to(dtype: Any, name: str) -> Any:
    """An intrinsic ``f(address)``: the integer ``address`` as a numba pointer to ``dtype`` (for ``numba.carray``)."""

    def at(typingctx, addr):
        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], _llvm_type(dtype).as_pointer())

        return types.CPointer(dtype)(types.int64), codegen

    at.__name__ = name
    return intrinsic(at)


def emit_prefetch(builder: ir.IRBuilder, ptr: ir.Value, *, write: bool = False, locality: int = 3) -> None:
    """Emit a prefetch of the cache line holding the byte at ``ptr`` (an ``i8*``): ``llvm.prefetch`` with
    read / write, ``locality`` 0-3 (3: the L1 cache, 2: the L2), data cache. A hint: no value changes."""
    i32 = ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]),
                                        "llvm.prefetch.p0")
    builder.call(fn, [ptr] + [ir.Constant(i32, a) for a in (int(write), locality, 1)])


@intrinsic
def prefetch_write(typingctx, addr):
    """``prefetch_write(address)``: ask for the cache line at the integer ``address`` in the L1 cache, for
    writing (:func:`emit_prefetch`)."""
    def codegen(context, builder, sig, args):
        emit_prefetch(builder, builder.inttoptr(args[0], ir.IntType(8).as_pointer()), write=True)
        return context.get_dummy_value()

    return types.void(types.int64), codegen


def _pow2_half(upper: bool) -> Any:
    def pow2(typingctx, n):
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            k = builder.fptosi(args[0], i32)
            e = builder.ashr(k, ir.Constant(i32, 1))
            if upper:
                e = builder.sub(k, e)
            return builder.bitcast(builder.shl(builder.add(e, ir.Constant(i32, 127)), ir.Constant(i32, 23)), ir.FloatType())

        return types.float32(types.float32), codegen

    pow2.__name__ = "f32_pow2_hi" if upper else "f32_pow2_lo"
    return intrinsic(pow2)


#: ``f32_pow2_lo(n)`` / ``f32_pow2_hi(n)`` for a float32 ``n`` holding an integer k in [-252, 254]: 2 ** (k >> 1) and
#: 2 ** (k - (k >> 1)) as float32 (their exponent bits built in int32; their product is 2 ** k without overflowing
#: one exponent field). In IR because numba widens int32 arithmetic to int64, which made a vector loop over
#: :func:`plinth.ops.compiled.exp_f32` widen every lane to 64 bits and back
f32_pow2_lo = _pow2_half(False)
f32_pow2_hi = _pow2_half(True)


def _llvm_type(t: Any) -> ir.Type:
    if t == types.float32:
        return ir.FloatType()
    if t == types.float64:
        return ir.DoubleType()
    if isinstance(t, types.Integer):
        return ir.IntType(t.bitwidth)
    raise TypeError(f"jitcache: type {t} (integers and floats only)")


#: an integer data address as a pointer to float32 / int64 / uint8 / uint16 (the kernels' ``carray`` views)
f32_at = pointer_to(types.float32, "f32_at")
i64_at = pointer_to(types.int64, "i64_at")
u8_at = pointer_to(types.uint8, "u8_at")
u16_at = pointer_to(types.uint16, "u16_at")

"""A strict stand-in for a device array module: numpy underneath, cupy's rules on top.

Device discipline is checked on every CPU test run with this module. Its arrays
(:class:`StrictArray`) live "on the device" and follow the rules cupy enforces:

* a host ``numpy.ndarray`` is refused inside device ops (ufuncs and operators,
  ``where``, ``concatenate``/``stack``, ``matmul``, reductions...), as cupy raises
  ``TypeError: Unsupported type <class 'numpy.ndarray'>``; move it first with
  ``xp.asarray`` (a host-to-device copy, which is allowed and not counted);
* ``array[...] = host_array`` is refused (cupy raises for a slice target and
  silently copies for a fancy-index target; plinth code must not depend on which);
* ``numpy.asarray(device_array)`` raises, as cupy's implicit conversion does;
* host index arrays (numpy int or bool arrays, lists) are accepted as indices,
  as cupy copies them to the device.

Every device-to-host transfer is a **host round trip** and is counted in
:data:`transfers`: ``float()``/``int()``/``bool()``/``complex()``, ``.item()``,
``.tolist()``, ``.get()``, ``xp.asnumpy()``, ``repr()``, and the ops whose
output size depends on the data (``nonzero``, ``argwhere``, ``flatnonzero``,
``unique``, boolean-mask indexing, one-argument ``where``), which cupy must
synchronise on. A reduction over a whole array returns a 0-d device array, as
in cupy, so reading it back is counted too.

Use it through the backend (``load_model(..., backend="strict",
registry=plinth.testing.make_registry(...))``, or :class:`StrictBackend` given
to a graph builder) and measure with :func:`count_transfers`::

    with count_transfers() as n:
        ctx.decode([tok])
    assert n.count <= 1, n.sites
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from types import ModuleType
from typing import Any, Iterator, Mapping

import numpy
from numpy.lib.mixins import NDArrayOperatorsMixin

__all__ = [
    "StrictArray",
    "StrictBackend",
    "TransferCounter",
    "count_transfers",
    "module",
    "to_host",
    "transfers",
]


class TransferCounter:
    """Counts device-to-host transfers; ``sites`` keeps where each one came from (file:line, what)."""

    def __init__(self) -> None:
        self.count = 0
        self.sites: list[str] = []

    def record(self, what: str) -> None:
        self.count += 1
        if len(self.sites) < 1000:
            self.sites.append(f"{_caller()}: {what}")

    def reset(self) -> None:
        self.count = 0
        self.sites.clear()


def _caller() -> str:
    """The innermost frame outside this module (where the transfer was asked for)."""
    for frame in reversed(traceback.extract_stack(limit=12)[:-2]):
        if frame.filename != __file__:
            return f"{frame.filename.rsplit('/', 3)[-1] if '/' in frame.filename else frame.filename}:{frame.lineno}"
    return "?"


#: the process-wide counter every strict array reports to
transfers = TransferCounter()
_counters: list[TransferCounter] = [transfers]


def _record(what: str) -> None:
    for c in _counters:
        c.record(what)


@contextlib.contextmanager
def count_transfers() -> Iterator[TransferCounter]:
    """Count the host round trips made inside the ``with`` block (nesting is fine)."""
    c = TransferCounter()
    _counters.append(c)
    try:
        yield c
    finally:
        _counters.remove(c)


class HostArrayError(TypeError):
    """A host numpy array reached a device op (cupy raises TypeError here too)."""


def _refuse(value: Any, where: str) -> None:
    raise HostArrayError(
        f"strict device arrays: a host numpy array {getattr(value, 'shape', '')} reached {where}; "
        "cupy refuses that. Move it to the device first with xp.asarray(...)")


def _dev(value: Any, where: str) -> Any:
    """The numpy array under a device operand; host arrays are refused, scalars pass."""
    if isinstance(value, StrictArray):
        return value._a
    if isinstance(value, numpy.ndarray):
        _refuse(value, where)
    if isinstance(value, (list, tuple)):
        return type(value)(_dev(v, where) for v in value)
    return value


def _wrap(value: Any) -> Any:
    """Results back on the device: arrays and numpy scalars become StrictArrays (cupy returns 0-d arrays)."""
    if isinstance(value, numpy.ndarray):
        return StrictArray(value)
    if isinstance(value, numpy.generic):
        return StrictArray(numpy.asarray(value))
    if isinstance(value, tuple):
        return tuple(_wrap(v) for v in value)
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


def _index(key: Any) -> Any:
    """An index for a device array: device or host int/bool arrays, slices, ints (as cupy accepts)."""
    if isinstance(key, tuple):
        return tuple(_index(k) for k in key)
    if isinstance(key, StrictArray):
        if key._a.dtype == bool:
            _record("boolean-mask index (its size is read on the host)")
        return key._a
    if isinstance(key, numpy.ndarray) and key.dtype == bool:
        _record("boolean-mask index (its size is read on the host)")
    return key


# array methods that read the data back to the host
_SYNC_METHODS = {"item": ".item()", "tolist": ".tolist()", "nonzero": ".nonzero()"}


class StrictArray(NDArrayOperatorsMixin):
    """A device array of the strict module (a numpy array underneath).

    Operators and numpy ufuncs run on the device and refuse host arrays;
    reading values back to the host is counted in :data:`transfers`.
    """

    __slots__ = ("_a",)
    __array_priority__ = 100

    def __init__(self, a: numpy.ndarray) -> None:
        self._a = a

    # ------------------------------------------------------------------ numpy protocols

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        where = f"{ufunc.__name__}" + ("" if method == "__call__" else f".{method}")
        args = [_dev(x, where) for x in inputs]
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(_dev(o, where + " out=") for o in out)
        if "where" in kwargs:
            kwargs["where"] = _dev(kwargs["where"], where + " where=")
        return _wrap(getattr(ufunc, method)(*args, **kwargs))

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        # numpy.f(device arrays) runs the device version, as cupy's __array_function__ does
        name = func.__name__
        if getattr(numpy, name, None) is not func:
            raise TypeError(f"strict device arrays: numpy function {func.__module__}.{name} is not supported")
        return getattr(module, name)(*args, **kwargs)

    def __array__(self, dtype: Any = None, copy: Any = None) -> numpy.ndarray:
        raise TypeError("strict device arrays: implicit conversion to a NumPy array is not allowed "
                        "(cupy refuses it too); use .get() or backend.to_numpy() explicitly")

    # ------------------------------------------------------------------ host round trips

    def get(self) -> numpy.ndarray:
        """A host copy (one device-to-host transfer)."""
        _record(".get()")
        return self._a.copy()

    def __bool__(self) -> bool:
        _record("bool()")
        return bool(self._a)

    def __int__(self) -> int:
        _record("int()")
        return int(self._a)

    def __float__(self) -> float:
        _record("float()")
        return float(self._a)

    def __complex__(self) -> complex:
        _record("complex()")
        return complex(self._a)

    def __repr__(self) -> str:
        _record("repr()")
        return "strict." + repr(self._a)

    __str__ = __repr__

    # ------------------------------------------------------------------ indexing

    def __getitem__(self, key: Any) -> "StrictArray":
        return _wrap(self._a[_index(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, StrictArray):
            value = value._a
        elif isinstance(value, (numpy.ndarray, list, tuple)):
            _refuse(numpy.asarray(value), "an item assignment (array[...] = host value)")
        self._a[_index(key)] = value

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Iterator["StrictArray"]:
        for row in self._a:
            yield _wrap(row)

    __hash__ = None  # type: ignore[assignment]

    # ------------------------------------------------------------------ attributes and methods

    @property
    def shape(self) -> tuple[int, ...]:
        return self._a.shape

    @property
    def dtype(self) -> Any:
        return self._a.dtype

    @property
    def ndim(self) -> int:
        return self._a.ndim

    @property
    def size(self) -> int:
        return self._a.size

    @property
    def nbytes(self) -> int:
        return self._a.nbytes

    @property
    def T(self) -> "StrictArray":
        return StrictArray(self._a.T)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # no __array_interface__ / __array_struct__: no silent host view
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if not callable(attr):
            return _wrap(attr) if isinstance(attr, numpy.ndarray) else attr
        what = _SYNC_METHODS.get(name)

        def method(*args: Any, **kwargs: Any) -> Any:
            if what:
                _record(what)
            where = f"StrictArray.{name}"
            args = tuple(_dev(a, where) for a in args)
            kwargs = {k: _dev(v, where) for k, v in kwargs.items()}
            result = attr(*args, **kwargs)
            return result if name in ("item", "tolist") else _wrap(result)

        return method


# --------------------------------------------------------------------------- the module

# functions that take host data and put it on the device (host-to-device copies are fine)
_FROM_HOST = {"asarray", "array", "asanyarray"}
# functions whose output size depends on the data: cupy reads a count back to the host
_SYNCING = {"nonzero", "argwhere", "flatnonzero", "unique", "count_nonzero_host", "extract", "compress"}
# functions that accept a host index array (cupy copies it to the device)
_HOST_INDEX_ARG = {"take": 1}


class StrictModule(ModuleType):
    """The strict array module: numpy's names, with device rules (see the module docstring)."""

    ndarray = StrictArray

    def __init__(self, name: str, base: ModuleType) -> None:
        super().__init__(name)
        self._base = base

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(self._base, name)
        if isinstance(attr, ModuleType):
            if attr.__name__ in ("numpy.linalg", "numpy.fft"):
                sub = StrictModule(f"{self.__name__}.{name}", attr)
                setattr(self, name, sub)
                return sub
            raise AttributeError(f"strict array module: numpy.{name} has no device counterpart here")
        if isinstance(attr, type) or not callable(attr):
            return attr  # dtypes, constants (inf, newaxis), errstate...
        fn = _make_function(name, attr)
        setattr(self, name, fn)  # cache
        return fn

    def asnumpy(self, a: Any) -> numpy.ndarray:
        """A host copy of a device array (one device-to-host transfer)."""
        if isinstance(a, StrictArray):
            _record("asnumpy()")
            return a._a.copy()
        return numpy.asarray(a)


def _make_function(name: str, fn: Any) -> Any:
    if name in _FROM_HOST:
        def from_host(a: Any, dtype: Any = None, **kwargs: Any) -> StrictArray:
            if isinstance(a, StrictArray):  # already on the device: no copy unless the dtype changes
                return StrictArray(numpy.array(a._a, dtype=dtype) if name == "array" else
                                   numpy.asarray(a._a, dtype=dtype))
            if isinstance(a, (list, tuple)) and any(isinstance(x, StrictArray) for x in a):
                raise TypeError(f"strict device arrays: xp.{name} of a list holding device arrays; use xp.stack")
            return StrictArray(numpy.array(a, dtype=dtype))  # a host-to-device copy

        from_host.__name__ = name
        return from_host

    host_index = _HOST_INDEX_ARG.get(name)

    def device_fn(*args: Any, **kwargs: Any) -> Any:
        where = f"xp.{name}"
        if name in _SYNCING or (name == "where" and len(args) + len(kwargs) == 1):
            _record(f"xp.{name} (its output size is read on the host)")
        conv = []
        for i, a in enumerate(args):
            if i == host_index and isinstance(a, numpy.ndarray):
                conv.append(a)
            else:
                conv.append(_dev(a, where))
        kw = {k: _dev(v, where) for k, v in kwargs.items()}
        return _wrap(fn(*conv, **kw))

    device_fn.__name__ = name
    return device_fn


#: the strict array module (``backend.xp`` of :class:`StrictBackend`)
module = StrictModule("plinth.testing.strict.xp", numpy)


def _register() -> None:
    from ..ops._xp import register_array_module

    register_array_module(StrictArray, module)


_register()


class StrictBackend:
    """The strict backend: the same interface as :class:`plinth.backend.NumpyBackend`, on strict arrays.

    ``to_numpy`` is a counted device-to-host transfer, as ``cupy.asnumpy`` is.
    """

    name = "strict"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.xp = module
        self.options = dict(options or {})

    def asarray(self, array: Any, dtype: Any = None) -> Any:
        return self.xp.asarray(array, dtype=dtype)

    def to_numpy(self, array: Any) -> Any:
        return self.xp.asnumpy(array)

    def synchronize(self) -> None:
        """Nothing to wait for: strict arrays compute eagerly."""


def to_host(array: Any) -> numpy.ndarray:
    """A host numpy copy of a numpy, strict or cupy array (``.get()`` on a device array: one transfer)."""
    if isinstance(array, numpy.ndarray):
        return array
    if hasattr(array, "get") and not isinstance(array, (dict, Mapping)):
        return array.get()
    return numpy.asarray(array)


def is_strict(array: Any) -> bool:
    """Whether ``array`` is a strict device array."""
    return isinstance(array, StrictArray)


sys.modules.setdefault("plinth.testing.strict.xp", module)

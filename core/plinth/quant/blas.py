"""OpenBLAS's thread count, switched between the kernels' turns and BLAS's turns.

The int8 kernels run in numba's OpenMP pool, whose threads spin for a moment after each
parallel region; OpenBLAS's threads do the same after a multi-threaded product. A decode step
alternates hundreds of kernel products with small BLAS products (attention over a few rows),
so two pools would keep waking into each other's spin and halve both. :func:`use` sets
OpenBLAS to one thread while the kernels have the cores (decode and verify batches) and back
to the kernel thread count for prompt batches, where BLAS does the heavy products.

The library is the OpenBLAS numpy loaded (found in ``/proc/self/maps``: numpy's bundled
``scipy_openblas`` or a system one); where none is found (another BLAS, not Linux) this does
nothing.
"""

from __future__ import annotations

import ctypes
from typing import Any

_state: dict[str, Any] = {"lib": None, "set": None, "current": None}
_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "openblas_set_num_threads")


def _setter() -> Any:
    if _state["lib"] is None:
        _state["lib"] = False
        try:
            import numpy  # noqa: F401  (loads the BLAS)

            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
        except OSError:
            paths = set()
        for path in sorted(paths):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for name in _SETTERS:
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.argtypes = [ctypes.c_int]
                    fn.restype = None
                    _state["lib"], _state["set"] = lib, fn
                    break
            if _state["set"] is not None:
                break
    return _state["set"]


def use(n: int) -> None:
    """OpenBLAS threads = n (no call when it already is)."""
    if _state["current"] == n:
        return
    fn = _setter()
    _state["current"] = n
    if fn is not None:
        fn(int(n))


"""Compute backends: numpy (CPU) and cupy (GPU).

Architecture code is written once against ``backend.xp`` (the array module) and
the functions of :mod:`plinth.ops`; a backend only decides where arrays live.
"""

from __future__ import annotations

from typing import Any, Mapping


class NumpyBackend:
    """The CPU backend: numpy arrays, float32 compute."""

    name = "numpy"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        import numpy

        from .heap import keep_freed_memory

        self.xp = numpy
        self.options = dict(options or {})
        keep_freed_memory()  # host temporaries reused, not page-faulted in again every forward

    def asarray(self, array: Any, dtype: Any = None) -> Any:
        return self.xp.asarray(array, dtype=dtype)

    def to_numpy(self, array: Any) -> Any:
        return self.xp.asarray(array)


class CupyBackend(NumpyBackend):
    """The GPU backend: cupy arrays on the current CUDA device."""

    name = "cupy"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        try:
            import cupy
        except ImportError as exc:
            raise RuntimeError(
                "the cupy backend needs cupy: install it with `pip install 'plinth[cuda]'`"
            ) from exc
        try:
            n_devices = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # cudaErrorInsufficientDriver and friends
            raise RuntimeError(f"the cupy backend found no usable CUDA device: {exc}") from exc
        if n_devices == 0:
            raise RuntimeError("the cupy backend found no CUDA device")
        self.xp = cupy
        self.options = dict(options or {})

    def to_numpy(self, array: Any) -> Any:
        return self.xp.asnumpy(array)

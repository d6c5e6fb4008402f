"""The kernel runtime: whether the compiled (numba) kernels load, and how many threads they run.

The lowest layer of the compute: :mod:`plinth.quant` (quantized products) and :mod:`plinth.ops`
(the compiled host ops) both ask here, and this module imports neither at load time (the kernel
modules are imported on first use).

Threads: ``PLINTH_THREADS`` (or :func:`set_threads`, the ``--threads`` option) sets the kernel
threads; default the physical cores this process may run on. ``PLINTH_KERNELS=0`` turns the compiled
kernels off (numpy fallbacks), ``PLINTH_INT8=0`` the int8-activation kernels. On Linux the OpenMP wait
settings of :data:`OMP_WAIT` are set where the environment names none of them (docs/performance.md, "Threads").
"""

from __future__ import annotations

import os
import sys
from typing import Any

_state: dict[str, Any] = {"kernels": None, "i8": None, "threads": None, "note": None}


def compiled() -> Any:
    """The compiled kernel module, or None (numba missing or unusable: numpy fallback, noted once)."""
    if _state["kernels"] is None:
        _state["kernels"] = _load_kernels()
    return _state["kernels"] or None


def compiled_i8() -> Any:
    """The int8-activation kernel module, or None (kernels off, ``PLINTH_INT8=0``, or no AVX2/F16C)."""
    if compiled() is None:
        return None
    if _state["i8"] is None:
        _state["i8"] = _load_i8()
    return _state["i8"] or None


def _load_i8() -> Any:
    text = os.environ.get("PLINTH_INT8", "1")
    if text not in ("0", "1"):
        from .errors import UserError

        raise UserError(f"PLINTH_INT8={text!r}: 1 (int8 activations where the CPU has AVX2) or 0 (f32 activations)")
    if text == "0":
        return False
    from .quant import simd

    if not simd.available():
        _note("this CPU lacks AVX2/F16C: quantized weights use the f32-activation kernels (slower)")
        return False
    from .quant import kernels_i8

    return kernels_i8


def _load_kernels() -> Any:
    if os.environ.get("PLINTH_KERNELS", "1") == "0":
        _note("PLINTH_KERNELS=0: quantized weights are multiplied through numpy tiles (slow)")
        return False
    try:
        # OpenMP's pool: a parallel region starts in microseconds (the workqueue layer takes ~50 us, which
        # a decode step of ~200 products cannot afford). Its threads spin a while after each region, so
        # only decode-sized products run in parallel regions; prompt tiles dequantize on the calling
        # thread while BLAS has the cores.
        os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", "omp tbb workqueue")
        omp_wait_defaults(os.environ)
        from .quant import kernels as k
    except ImportError as exc:
        _note(f"numba is not importable ({exc}); quantized weights use numpy tiles (slow): pip install numba")
        return False
    if not _cache_warm(k):
        print("plinth: compiling the quantized-weight kernels (once per machine, about 10-15 s)...",
              file=sys.stderr, flush=True)
    _state["kernels"] = k
    set_threads(_state["threads"] or default_threads())
    return k


#: the OpenMP wait settings plinth asks for on Linux where the environment names none (read once, when the OpenMP
#: runtime loads). GNU libgomp (numba's OpenMP layer on Linux): idle pool threads spin 300000 rounds after a
#: parallel region, then sleep (libgomp's own count), and keep spinning that long where several threads have
#: started pools; by default libgomp cuts the spin to 100 rounds as soon as its pools hold more threads than
#: there are cores (a forward from a second thread: every product of a step then waits for a sleeping thread;
#: SmolLM2 decode steps 10.1-11.3 ms against 5.1-5.3 ms with these, 4.5-4.8 ms from a lone thread either way).
#: OMP_WAIT_POLICY=active alone spins 30 billion rounds: idle pools never sleep. LLVM's / Intel's runtime (where
#: libgomp.so is theirs) reads active as spin forever unless KMP_BLOCKTIME is set: 200 ms is its default.
OMP_WAIT = {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "300000", "KMP_BLOCKTIME": "200"}


def omp_wait_defaults(env: Any, platform: str = sys.platform) -> None:
    """Set :data:`OMP_WAIT` in ``env`` (a mapping: ``os.environ``) on Linux where it holds none of those settings:
    a user's ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``KMP_BLOCKTIME`` is kept, and the others not added
    beside it. Elsewhere (another OpenMP runtime, not measured) nothing is set."""
    if platform.startswith("linux") and not any(k in env for k in OMP_WAIT):
        env.update(OMP_WAIT)


def _note(msg: str) -> None:
    if _state["note"] != msg:
        _state["note"] = msg
        print(f"plinth: {msg}", file=sys.stderr)


def default_threads() -> int:
    """PLINTH_THREADS, else the physical cores among the CPUs this process may run on (SMT
    siblings share one core's SIMD units, which the kernels keep busy)."""
    env = os.environ.get("PLINTH_THREADS")
    if env:
        return parse_threads(env, "PLINTH_THREADS")
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)
    return max(1, physical_cores(cpus))


def physical_cores(cpus: list[int], sysfs: str = "/sys/devices/system/cpu") -> int:
    """How many distinct cores the logical ``cpus`` sit on (by their SMT sibling lists in sysfs);
    the number of CPUs where sysfs does not say."""
    cores = set()
    for c in cpus:
        try:
            with open(f"{sysfs}/cpu{c}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            return len(cpus)
    return len(cores)


def parse_threads(value: Any, where: str) -> int:
    from .errors import UserError

    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise UserError(f"{where}: thread count must be a positive integer, got {value!r}")
    return n


def set_threads(n: int) -> None:
    """Kernel threads (numba) and the BLAS threads used by prompt tiles."""
    n = int(n)
    _state["threads"] = n
    if _state["kernels"]:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


def threads() -> int:
    return int(_state["threads"] or default_threads())


def blas_threads() -> int:
    """OpenBLAS threads for prompt tiles: the kernel threads, or fewer where OPENBLAS_NUM_THREADS says so."""
    env = os.environ.get("OPENBLAS_NUM_THREADS", "")
    return min(threads(), int(env)) if env.isdigit() and int(env) > 0 else threads()


def _cache_warm(k: Any) -> bool:
    """Whether numba's on-disk cache already holds the kernels (else the first call compiles)."""
    from pathlib import Path

    dirs = [Path(k.__file__).parent / "__pycache__"]
    if os.environ.get("NUMBA_CACHE_DIR"):
        dirs.append(Path(os.environ["NUMBA_CACHE_DIR"]))
    return any(all(any(d.rglob(f"{name}-*.nbi")) for name in ("kernels_i8.linear", "simd.kernel_*",
                                                               "kernels.dequantize_fast_serial"))
               for d in dirs if d.is_dir())

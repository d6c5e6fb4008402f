"""Keep freed memory in the process heap instead of handing it back to the kernel (glibc).

A forward on the host makes and frees array temporaries of a few hundred KiB to tens of MiB
(activations of a prompt batch, GELU's intermediate terms, attention scores). With glibc's
defaults the larger ones are mapped fresh and unmapped on free, and the heap's top is trimmed
whenever enough of it is free, so the next forward pays a page fault for every 4 KiB it
writes again: on Gemma-3-270M's 128-token prompt that was a fifth of the prefill (GELU alone
took 3x its time). :func:`keep_freed_memory` raises glibc's mmap and trim thresholds once per
process, so freed temporaries stay mapped and are reused. The cost is that memory freed after a
peak is kept for the process (up to ``TRIM_BYTES`` above what is in use) rather than returned.

``PLINTH_MALLOC=0`` leaves the allocator's settings alone. Elsewhere than glibc (musl, macOS,
Windows) this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

#: allocations below this come from the heap (glibc's ceiling for the setting on 64-bit)
MMAP_BYTES = 32 << 20
#: free memory at the heap's top kept before trimming
TRIM_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_state: dict[str, Any] = {"done": None}


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); True where that was done."""
    if _state["done"] is None:
        _state["done"] = _apply()
    return bool(_state["done"])


def _apply() -> bool:
    if os.environ.get("PLINTH_MALLOC", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))

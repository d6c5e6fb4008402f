"""Numba's on-disk cache keys a compiled function on its own source file's contents only. The
kernels here also inline LLVM IR written in other modules (:mod:`plinth.quant.simd`,
:mod:`plinth.ops.attend_simd`): an edit there would otherwise run the old code from the cache.
:func:`drop_stale` removes a module's cached functions when the files it depends on changed."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any


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

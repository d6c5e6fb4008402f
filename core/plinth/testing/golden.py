"""Golden reference files: writing and reading them, and the plinth model they are compared with.

A bundled plugin's ``tests/golden/make_golden.py`` draws a tiny random model per case, computes
the reference's record (:func:`plinth.testing.reference.reference_record`) and writes it with
:func:`write_golden_files`; its tests read a record with :func:`plinth.testing.load_golden`
(``prompt_i``, ``logits_i``, ``greedy_i``) or :func:`load_golden_rows` (records that keep only
some logit rows, ``rows_i``) and compare with the case converted by plinth's own converter
(:func:`convert_and_load`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np


def load_golden_rows(path: str | Path) -> tuple[dict[str, Any], list[tuple[list[int], np.ndarray, np.ndarray,
                                                                          list[int]]]]:
    """A golden record that keeps some logit rows: its ``info`` JSON and, per prompt i, (``prompt_i``,
    ``rows_i``, ``logits_i`` (those rows), ``greedy_i``)."""
    with np.load(path) as z:
        rec = {k: z[k] for k in z.files}
    n = sum(k.startswith("prompt_") for k in rec)
    runs = [(rec[f"prompt_{i}"].astype(np.int64).tolist(), rec[f"rows_{i}"].astype(np.int64), rec[f"logits_{i}"],
             rec[f"greedy_{i}"].astype(np.int64).tolist()) for i in range(n)]
    return json.loads(str(rec["info"])), runs


def write_golden_files(folder: str | Path, cases: Iterable[str], record: Callable[[str, Path], dict[str, Any]],
                       say: Callable[[str], Any] = print) -> list[Path]:
    """``folder/<case>.npz`` for each case: ``record(case, tmp)`` (``tmp``: a scratch folder for the case's
    checkpoint, removed afterwards) saved compressed. Returns the paths written."""
    folder = Path(folder)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            rec = record(case, Path(tmp))
            path = folder / f"{case}.npz"
            np.savez_compressed(path, **rec)
            say(f"{case}: wrote {path}")
            written.append(path)
    return written


def convert_and_load(folder: str | Path, out: str | Path, registry: Any, backend: str = "numpy") -> Any:
    """The checkpoint ``folder`` converted by plinth's converter into ``out`` and loaded with ``registry``
    (on ``backend``)."""
    from ..convert import convert
    from ..model import load_model

    convert(folder, out, registry=registry)
    return load_model(out, registry=registry, backend=backend)

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


def plinth_models(golden: Any, tmp: str | Path) -> dict[str, Any]:
    """Every case of a ``make_golden.py`` module (its ``CASES``) converted and loaded through its plugin,
    ``golden.plinth_model(case, tmp, registry)`` with one ``golden.registry()``."""
    reg = golden.registry()
    return {case: golden.plinth_model(case, Path(tmp), reg) for case in sorted(golden.CASES)}


def assert_record_is_case(info: dict[str, Any], runs: list[tuple[Any, ...]], golden: Any, case: str, *,
                          keys: tuple[str, ...] = ("seed", "prompt_seed"), config: Any = None) -> None:
    """A golden record (``info``, ``runs`` as the loaders give them) was made from ``golden.CASES[case]`` as it
    stands: the same ``keys`` (seeds ...), the same ``config`` (default: the case's), prompts of
    ``golden.PROMPT_LENGTHS`` tokens that are ``golden.prompts(case)``."""
    c = golden.CASES[case]
    assert tuple(info[k] for k in keys) == tuple(c[k] for k in keys)
    assert info["config"] == json.loads(json.dumps(c["config"] if config is None else config))
    assert [len(run[0]) for run in runs] == list(golden.PROMPT_LENGTHS)
    assert [run[0] for run in runs] == golden.prompts(case)


def random_prompts(seed: int, n_vocab: int, lengths: Iterable[int]) -> list[list[int]]:
    """One prompt of each length, tokens drawn uniformly from ``n_vocab`` by numpy's generator of ``seed``
    (the prompts of a golden case)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_vocab, n).tolist() for n in lengths]

"""Mutated GGUF files (fixed seed): each ends in a named error or a correct load.

Never a traceback, an unnamed error, a silent garbage load (moved bytes, non-finite
logits), a hang over 10 s or more than 1 GB allocated (see ``tests/fuzz_gguf.py``).
The default run mutates ~200 files in well under a minute; ``make test-fuzz``
(marker ``fuzz``) runs 600 with another seed.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from plinth.testing import load_module

pytest.importorskip("gguf")
fuzz = load_module(Path(__file__).with_name("fuzz_gguf.py"), "fuzz_gguf")


def _check(results):
    outcomes = collections.Counter(r["outcome"] for r in results)
    bad = [f"{r['outcome']}: {r['kind']}: {r['message']}" for r in results if r["outcome"] in fuzz.FAILURES]
    assert not bad, "\n".join(bad)
    assert outcomes["named error"] > len(results) // 2  # the mutations do damage
    assert results[0]["kind"] == "unchanged" and results[0]["outcome"] == "loaded"
    assert max(r["peak"] for r in results) < fuzz.MEMORY_LIMIT


def test_mutated_files_fail_named_or_load_correctly(tmp_path):
    cases = fuzz.make_cases(tmp_path, 200, seed=0)
    _check(fuzz.run_all(cases, cases[0][1]))


@pytest.mark.fuzz
@pytest.mark.slow
def test_long_mutation_run(tmp_path, request):
    if "fuzz" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in: make test-fuzz (pytest -m fuzz)")
    cases = fuzz.make_cases(tmp_path, 600, seed=1)
    results = fuzz.run_all(cases, cases[0][1])
    print("\n" + fuzz.table(results))
    _check(results)

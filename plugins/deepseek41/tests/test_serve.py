"""DeepSeek V4 / V4.1 targets in the server's continuous-batching scheduler (in process, no HTTP).

Several requests share one multi-sequence cache (the compressed streams and windows of every
sequence side by side); each must produce exactly what a lone greedy run produces, plain and
speculative (rollback by cut or snapshot as the cache plans it), and a prompt kept in the prompt
cache (rows copied with seq_cp) gives the same tokens with no prefill. The cache is empty afterwards.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plinth.generate import Generator
from plinth.sampling import SamplerConfig
from plinth.serve.scheduler import Scheduler
from plinth.speculative.engine import SpecConfig
from plinth.speculative.ngram import NgramDrafter
from plinth.testing import load_module
from plinth.testing.drafters import RandomDrafter
from plinth.testing.scheduling import run_requests

HERE = Path(__file__).resolve().parent
golden = load_module(HERE / "golden" / "make_golden.py")
g41 = load_module(HERE / "golden" / "make_golden41.py")
GREEDY = SamplerConfig(temperature=0.0)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return golden.plinth_model("flash", tmp_path_factory.mktemp("ds4-serve"), vocab=True)


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    return g41.plinth_model("engram_hc2", tmp_path_factory.mktemp("ds41-serve"), vocab=True)


def prompts():
    p = golden.prompts("flash")
    return [p[1], p[2][:13], (p[1] * 4)[:25], p[2][20:31]]


def run(sched: Scheduler, specs: list[tuple[list[int], int]]) -> list[list[int]]:
    return run_requests(sched, [dict(prompt_ids=p, max_tokens=n) for p, n in specs])


@pytest.mark.parametrize("which, drafter", [("v4", None), ("v4", "random"), ("v41", "ngram")])
def test_batched_requests_equal_lone_runs(which, drafter, request):
    m = request.getfixturevalue(which)
    drafters = {None: [], "ngram": [NgramDrafter(n_draft=4)],
                "random": [RandomDrafter(m.n_vocab, length=3, seed=1)]}[drafter]
    sched = Scheduler(m, drafters=drafters, spec=SpecConfig(n_max=4), max_batch=3, prefill_chunk=9, prompt_cache=2)
    sched.start()
    try:
        specs = [(p, 8) for p in prompts()]
        got = run(sched, specs)
        for (p, n), toks in zip(specs, got):
            assert toks == Generator(m).generate(p, n), p
        again = run(sched, specs[2:])  # the two kept prompts (LRU of 2): rows copied back, no prefill
        assert again == got[2:]
        if not drafters:  # (a speculative scheduler bypasses the prompt cache)
            assert sched.metrics.prompt_cache_hits >= 1
        assert sched.cache_tokens() == 0
    finally:
        sched.stop()

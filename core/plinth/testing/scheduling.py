"""Drive a :class:`plinth.serve.scheduler.Scheduler` from a test: submit requests together, wait for them.

``run_requests(sched, [dict(prompt_ids=p, max_tokens=12), ...])`` submits every request while holding the
scheduler's lock (so that they all join its first step, the batch the test means to exercise), waits
(bounded) until each has finished, checks that each ended by "stop" or "length", and returns each
request's generated token ids in order. A spec is :class:`~plinth.serve.request.Request`'s keywords
without ``emit``; ``sampling`` defaults to greedy. The scheduler must be started (or be started by the
caller right after: the requests wait in its queue).
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence


def run_requests(sched: Any, specs: Sequence[Mapping[str, Any]], *, timeout: float = 120.0) -> list[list[int]]:
    """Submit ``specs`` to ``sched`` at once; each request's token ids, once all have finished."""
    from plinth.sampling import SamplerConfig
    from plinth.serve.request import Event, Request

    out: list[list[int]] = [[] for _ in specs]
    reasons: list[str | None] = [None] * len(specs)
    errors: list[str | None] = [None] * len(specs)
    finished = threading.Semaphore(0)

    def emitter(i: int):
        def emit(ev: Event) -> None:
            out[i].extend(t.token for t in ev.tokens)
            if ev.finish is not None:
                reasons[i], errors[i] = ev.finish, ev.error
                finished.release()
        return emit

    reqs = [Request(**{"sampling": SamplerConfig(temperature=0.0), **spec}, emit=emitter(i))
            for i, spec in enumerate(specs)]
    with sched._cond:  # hold the loop so that all requests join the first step together
        for r in reqs:
            sched.submit(r)
    for n in range(len(reqs)):
        if not finished.acquire(timeout=timeout):
            raise AssertionError(f"{len(reqs) - n} of {len(reqs)} requests did not finish in {timeout:g} s")
    bad = [(i, r, e) for i, (r, e) in enumerate(zip(reasons, errors)) if r not in ("stop", "length")]
    assert not bad, f"requests that did not end by stop or length (index, finish, error): {bad}"
    return out


__all__ = ["run_requests"]

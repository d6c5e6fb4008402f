"""``/metrics``: the server's counters in the Prometheus text exposition format (version 0.0.4)."""

from __future__ import annotations

import collections
import time
from typing import Any

import attrs
import numpy as np

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@attrs.define
class Metrics:
    """Counters the /metrics endpoint reads (written by the scheduler thread only)."""

    requests_finished: collections.Counter = attrs.field(factory=collections.Counter)  # finish reason -> n
    tokens_in: int = 0
    tokens_out: int = 0
    steps: int = 0
    forward_s: float = 0.0
    ttft: collections.deque = attrs.field(factory=lambda: collections.deque(maxlen=1024))  # recent times to first token
    itl: collections.deque = attrs.field(factory=lambda: collections.deque(maxlen=4096))  # recent inter-token latencies
    ttft_sum: float = 0.0
    ttft_count: int = 0
    prompt_cache_hits: int = 0
    prompt_cache_misses: int = 0
    spec: dict[str, list[int]] = attrs.field(factory=dict)  # drafter -> [drafts, drafted, accepted]
    recent: collections.deque = attrs.field(factory=lambda: collections.deque(maxlen=4096))  # (time, n_out)

    def observe_ttft(self, s: float) -> None:
        self.ttft_sum += s
        self.ttft_count += 1
        self.ttft.append(s)

    def observe_itl(self, s: float) -> None:
        self.itl.append(s)  # (a bounded deque: the oldest goes, no list shifted a token)

    def decode_tps(self, window: float = 10.0) -> float:
        now = time.perf_counter()
        n = sum(k for t, k in list(self.recent) if now - t <= window)
        return n / window


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values)
    return {q: float(np.quantile(a, float(q))) for q in ("0.5", "0.9", "0.99")}


def render_metrics(server: Any) -> str:
    sched = server.scheduler
    m = sched.metrics
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{labels} {value:.9g}")

    metric("plinth_requests_total", "counter", "HTTP generation requests by endpoint and status code",
           [(f'{{endpoint="{e}",code="{c}"}}', n) for (e, c), n in sorted(server.requests.items())])
    metric("plinth_requests_finished_total", "counter", "Generation requests ended, by reason",
           [(f'{{reason="{r}"}}', n) for r, n in sorted(m.requests_finished.items())])
    metric("plinth_prompt_tokens_total", "counter", "Prompt tokens admitted", [("", m.tokens_in)])
    metric("plinth_generated_tokens_total", "counter", "Tokens generated", [("", m.tokens_out)])
    metric("plinth_queue_depth", "gauge", "Requests waiting for a place in the batch", [("", sched.queue_depth)])
    metric("plinth_queue_bound", "gauge", "Requests that may wait before 429", [("", sched.max_queue)])
    metric("plinth_active_requests", "gauge", "Requests in the running batch", [("", sched.n_active)])
    metric("plinth_kv_cache_tokens", "gauge", "Rows held in the KV cache, all sequences", [("", sched.cache_tokens())])
    n_prompts, n_prompt_tokens = sched.prompt_cache_usage()
    metric("plinth_prompt_cache_hits_total", "counter", "Requests whose whole prompt was reused (no prefill)",
           [("", m.prompt_cache_hits)])
    metric("plinth_prompt_cache_misses_total", "counter", "Requests looked up in the prompt cache and prefilled",
           [("", m.prompt_cache_misses)])
    metric("plinth_prompt_cache_prompts", "gauge", "Prompts kept by the prompt cache", [("", n_prompts)])
    metric("plinth_prompt_cache_tokens", "gauge", "Prompt tokens kept by the prompt cache (cache rows beside "
           "plinth_kv_cache_tokens)", [("", n_prompt_tokens)])
    metric("plinth_steps_total", "counter", "Batched forward steps", [("", m.steps)])
    metric("plinth_forward_seconds_total", "counter", "Time spent in batched forwards", [("", m.forward_s)])
    metric("plinth_decode_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s",
           [("", m.decode_tps())])
    ttft = list(m.ttft)
    buckets = [(f'{{le="{b}"}}', sum(1 for t in ttft if t <= b)) for b in TTFT_BUCKETS]
    lines.append("# HELP plinth_time_to_first_token_seconds Time from request to its first token "
                 "(buckets over the last 1024 requests)")
    lines.append("# TYPE plinth_time_to_first_token_seconds histogram")
    for labels, n in buckets + [('{le="+Inf"}', len(ttft))]:
        lines.append(f"plinth_time_to_first_token_seconds_bucket{labels} {n}")
    lines.append(f"plinth_time_to_first_token_seconds_sum {m.ttft_sum:.9g}")
    lines.append(f"plinth_time_to_first_token_seconds_count {m.ttft_count}")
    metric("plinth_inter_token_latency_seconds", "summary", "Time between tokens of one request (recent)",
           [(f'{{quantile="{q}"}}', v) for q, v in _quantiles(list(m.itl)).items()])
    spec = dict(m.spec)
    metric("plinth_spec_drafts_total", "counter", "Verify steps that carried a draft, per drafter",
           [(f'{{drafter="{d}"}}', r[0]) for d, r in sorted(spec.items())])
    metric("plinth_spec_drafted_tokens_total", "counter", "Drafted tokens, per drafter",
           [(f'{{drafter="{d}"}}', r[1]) for d, r in sorted(spec.items())])
    metric("plinth_spec_accepted_tokens_total", "counter", "Drafted tokens accepted, per drafter",
           [(f'{{drafter="{d}"}}', r[2]) for d, r in sorted(spec.items())])
    metric("plinth_spec_acceptance_rate", "gauge", "Accepted / drafted tokens, per drafter",
           [(f'{{drafter="{d}"}}', r[2] / r[1] if r[1] else 0.0) for d, r in sorted(spec.items())])
    metric("plinth_spec_tau", "gauge", "Mean acceptance length (1 + accepted / drafts), per drafter",
           [(f'{{drafter="{d}"}}', 1.0 + r[2] / r[0] if r[0] else 1.0) for d, r in sorted(spec.items())])
    policy = getattr(sched, "policy", None)
    if server.spec_names and policy is not None:
        metric("plinth_spec_policy_decisions_total", "counter", f"Decode steps of speculative sequences by the "
               f"drafting policy's decision ({policy.mode}): drafted (expected to pay), probed (drafted to measure "
               "again), skipped (a plain step)", [(f'{{decision="{d}"}}', n) for d, n in sorted(policy.counts.items())])
    return "\n".join(lines) + "\n"

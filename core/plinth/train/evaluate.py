"""A drafter on held-out prompts: tau, acceptance per draft position, speed-up against plain decoding, and
whether the output is byte-identical, in one run (``plinth bench --spec``, ``benchmarks/bench_drafter.py``).

Prompts come from :func:`plinth.train.prompts.eval_prompts` (subjects the training set never holds), rendered
with the model's chat template (raw text where it has none) and decoded greedily at batch 1: plain, then speculative, prompt after prompt,
so that load from other jobs falls on both alike.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import attrs

KINDS = ("chat", "code", "summarise")


@attrs.define
class KindResult:
    kind: str
    label: str
    n: int  # prompts
    tokens: int  # plain tokens generated
    tau: float  # 1 + accepted / drafts
    per_pos: list[float]  # acceptance rate of draft position 1, 2, ...
    plain_tps: float  # 0 when plain runs were skipped
    spec_tps: float
    speedup: float  # total plain time / total speculative time (0 without plain runs)
    same: int  # prompts whose speculative output equals the plain one (token ids and text)
    policy: dict[str, int] = attrs.field(factory=dict)  # --spec-policy auto's decisions over the prompts ({}: always)

    def line(self) -> str:
        pos = " ".join(f"{x:.2f}" for x in self.per_pos) or "-"
        plain = (f"plain {self.plain_tps:.1f} tok/s, spec {self.spec_tps:.1f} tok/s, speed-up {self.speedup:.2f}x | "
                 f"identical {self.same}/{self.n}" if self.plain_tps else f"spec {self.spec_tps:.1f} tok/s")
        steps = (" | policy " + ", ".join(f"{k} {v}" for k, v in self.policy.items())) if self.policy else ""
        return (f"{self.kind:10s} {self.label:8s} tau {self.tau:.2f} | per position {pos} | {plain} "
                f"({self.tokens} tokens){steps}")


def run_prompts(model: Any, texts: Sequence[str], make_spec: Callable[[], Any], max_tokens: int, *,
                kind: str = "", label: str = "", plain: bool = True,
                clock: Callable[[], float] = time.perf_counter) -> KindResult:
    """Decode every prompt text plainly (unless ``plain`` is false) and with a fresh speculative generator from
    ``make_spec`` (greedy both), and sum up."""
    from ..generate import Generator
    from .prompts import prompt_ids

    tok = model.tokenizer
    plain_t = spec_t = 0.0
    n_plain = n_spec = drafts = accepted = same = 0
    per_pos: list[int] = []
    policy: dict[str, int] = {}
    spec = make_spec()
    for text in texts:
        ids = prompt_ids(tok, text)
        a = None
        if plain:
            g = Generator(model)
            t0 = clock()
            a = g.generate(ids, max_tokens)
            plain_t += clock() - t0
        t0 = clock()
        b = spec.generate(ids, max_tokens)
        spec_t += clock() - t0
        a = b if a is None else a
        st = spec.stats
        n_plain += len(a)
        n_spec += len(b)
        same += int(a == b and tok.decode(a) == tok.decode(b))
        drafts += st.n_drafts
        accepted += st.n_accepted
        for k, v in getattr(st, "policy", {}).items():
            policy[k] = policy.get(k, 0) + v
        for k, v in enumerate(st.accepted_per_pos):
            if k >= len(per_pos):
                per_pos.append(0)
            per_pos[k] += v
    return KindResult(kind=kind, label=label, n=len(texts), tokens=n_plain,
                      tau=1.0 + accepted / drafts if drafts else 1.0,
                      per_pos=[v / drafts if drafts else 0.0 for v in per_pos],
                      plain_tps=n_plain / plain_t if plain and plain_t else 0.0,
                      spec_tps=n_spec / spec_t if spec_t else 0.0,
                      speedup=plain_t / spec_t if plain and spec_t else 0.0, same=same, policy=policy)


def held_out(kind: str, n: int) -> list[str]:
    """``n`` held-out prompt texts of ``kind`` (chat, code or summarise)."""
    from ..errors import UserError
    from .prompts import eval_prompts

    if kind not in KINDS:
        raise UserError(f"prompt kind {kind!r}: expected one of {', '.join(KINDS)}")
    return [p.text for p in eval_prompts(kind, n)]

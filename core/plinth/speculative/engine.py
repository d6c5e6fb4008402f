"""The speculative decoding loop: draft -> one target forward -> verify -> accept / roll back.

One step for a sequence whose last committed token ``t`` sits at position ``n``:

1. the first drafter (in the order given) that proposes a non-empty draft after
   the ``n_max`` / ``p_min`` / ``n_min`` controls drafts ``d_1..d_k``;
2. the target runs ``[t, d_1..d_k]`` at positions ``n..n+k`` in one forward
   (with the feature taps the drafters asked for);
3. the verifier keeps ``a`` drafts and gives the next token;
4. every drafter sees the batch (``process``); the target drops rows past
   ``n + a`` — a KV crop, or for recurrent targets a restore of the snapshot
   taken before step 2 and a replay of the ``a + 1`` kept rows; every drafter is
   told ``accept(seq, a)``.

With no draft the step is a plain one-token decode, so speculation never costs
correctness: with the ``greedy`` rule the output equals greedy decoding, with
``rejection`` it has the distribution of plain sampling. Steps 2-4 and the choice of
rule are :mod:`.step`'s, shared with the server's scheduler.

``SpecConfig.synthetic_accept`` replaces step 3 by a draw (each drafted position
kept with that probability, in order): the cost of drafting and verifying is
real but the text is not the model's. It measures how fast a drafter of that
quality would make the engine; never use it for output.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Sequence

import attrs
import numpy as np

from ..batch import Batch
from ..errors import UserError
from ..generate import GenerationStats, Generator
from ..sampling import Sampler, SamplerConfig
from .base import Draft, TargetOutput, check_compatible, target_kv_views
from .policy import POLICIES, LengthPolicy
from .step import Unseen, decide, defer_chunk, make_step_verifier, rollback, target_batch


def _nonneg_int(_inst: Any, attr: Any, value: int) -> None:
    if value < 0:
        raise ValueError(f"{attr.name} must be >= 0, got {value}")


@attrs.frozen
class SpecConfig:
    """Controls of speculative decoding.

    n_max: longest draft per step (clamped to each drafter's own limit).
    n_min: a draft shorter than this is dropped (the step decodes one token).
    p_min: a draft is cut at its first token whose probability / confidence is below it.
    verifier: "greedy", "rejection", another registered verifier, or "auto"
        (greedy at temperature 0, rejection otherwise).
    synthetic_accept: None, or a per-position acceptance rate in [0, 1] for
        benchmarking the verify path (output is then not the model's).
    seed: seed of the verifier's random draws (rejection, synthetic).
    policy: "always" (every drafter asked every step for up to ``n_max`` tokens) or "auto"
        (:mod:`.policy`: the length expected to give the most tokens a second, none where no
        draft is expected to beat a plain step; ``--spec-policy``, the CLI's default).
    """

    n_max: int = attrs.field(default=16, converter=int, validator=_nonneg_int)
    n_min: int = attrs.field(default=0, converter=int, validator=_nonneg_int)
    p_min: float = attrs.field(default=0.0, converter=float)
    verifier: str = "auto"
    synthetic_accept: float | None = None
    seed: int | None = 0
    policy: str = "always"

    def __attrs_post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"p_min must be in [0, 1], got {self.p_min}")
        if self.synthetic_accept is not None and not 0.0 <= self.synthetic_accept <= 1.0:
            raise ValueError(f"synthetic_accept must be in [0, 1], got {self.synthetic_accept}")


@attrs.define
class SpecStats(GenerationStats):
    """Generation stats plus the speculative metrics (vLLM's definitions).

    n_drafts: verify steps that carried a draft; n_drafted: drafted tokens;
    n_accepted: drafted tokens kept (the bonus/correction token is not counted).
    acceptance_rate = n_accepted / n_drafted; tau (mean acceptance length) =
    1 + n_accepted / n_drafts; per-position rate k = accepted_per_pos[k] / n_drafts;
    histogram: accepted length -> number of drafts.
    """

    n_steps: int = 0
    n_drafts: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    accepted_per_pos: list[int] = attrs.field(factory=list)
    histogram: dict[int, int] = attrs.field(factory=dict)
    by_drafter: dict[str, list[int]] = attrs.field(factory=dict)  # name -> [drafts, drafted, accepted]
    draft_s: float = 0.0
    verify_s: float = 0.0
    rollback_s: float = 0.0
    synthetic: bool = False
    # name -> extra figures a drafter reports through an optional ``figures() -> dict[str, float]``
    drafter_figures: dict[str, dict[str, float]] = attrs.field(factory=dict)
    # ``--spec-policy auto``: the drafters' decisions this generation (drafted / probed / skipped), else {}
    policy: dict[str, int] = attrs.field(factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def tau(self) -> float:
        return 1.0 + self.n_accepted / self.n_drafts if self.n_drafts else 1.0

    @property
    def per_position(self) -> list[float]:
        return [a / self.n_drafts if self.n_drafts else 0.0 for a in self.accepted_per_pos]

    def record(self, drafter: str, k: int, a: int) -> None:
        self.n_drafts += 1
        self.n_drafted += k
        self.n_accepted += a
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos.extend([0] * (k - len(self.accepted_per_pos)))
        for i in range(a):
            self.accepted_per_pos[i] += 1
        self.histogram[a] = self.histogram.get(a, 0) + 1
        row = self.by_drafter.setdefault(drafter, [0, 0, 0])
        row[0] += 1
        row[1] += k
        row[2] += a

    def as_dict(self) -> dict[str, Any]:
        return {
            "n_prompt": self.n_prompt, "n_generated": self.n_generated, "stop_reason": self.stop_reason,
            "prompt_s": self.prompt_s, "decode_s": self.decode_s, "draft_s": self.draft_s,
            "verify_s": self.verify_s, "rollback_s": self.rollback_s, "n_steps": self.n_steps,
            "n_drafts": self.n_drafts, "n_drafted": self.n_drafted, "n_accepted": self.n_accepted,
            "acceptance_rate": self.acceptance_rate, "tau": self.tau, "per_position": self.per_position,
            "histogram": dict(sorted(self.histogram.items())), "by_drafter": dict(self.by_drafter),
            "synthetic": self.synthetic, "drafter_figures": dict(self.drafter_figures), "policy": dict(self.policy),
        }

    def summary(self) -> str:
        hist = " ".join(f"{k}:{v}" for k, v in sorted(self.histogram.items()))
        per = " ".join(f"{r:.2f}" for r in self.per_position[:8])
        note = " (SYNTHETIC acceptance: output is not the model's)" if self.synthetic else ""
        return (super().summary() + "\n"
                f"speculative{note}: {self.n_drafts} drafts in {self.n_steps} steps, {self.n_accepted}/"
                f"{self.n_drafted} drafted tokens accepted (rate {self.acceptance_rate:.3f}), tau {self.tau:.2f}; "
                f"per position [{per}]; accepted-length histogram {{{hist}}}; time draft {self.draft_s:.2f} s, "
                f"verify {self.verify_s:.2f} s, rollback {self.rollback_s:.2f} s"
                + "".join(f"\n{name}: " + ", ".join(f"{k} {v:.3g}" for k, v in figs.items())
                          for name, figs in self.drafter_figures.items())
                + ("\nspec policy auto: " + ", ".join(f"{k} {v}" for k, v in self.policy.items()) if self.policy else ""))


def drafter_names(spec: str | None, registry: Any) -> list[str]:
    """The drafter names of a comma-separated ``--spec`` value, each checked against ``registry`` (an unknown
    or ambiguous name raises :class:`plinth.plugins.PluginError` listing the available drafters)."""
    names = [n.strip() for n in (spec or "").split(",") if n.strip()]
    for n in names:
        if n not in registry.names("drafters") or ("drafters", n) in registry.conflicts():
            registry.owner("drafters", n)
    return names


def propose(drafters: Sequence[Any], requirements: Sequence[Any], config: SpecConfig, seq: int,
            history: list[int], pos: int, n_max: int, policy: LengthPolicy | None = None,
            before: Callable[[int], None] | None = None) -> tuple[int, Draft]:
    """One draft for ``seq``: the first drafter's non-empty draft after ``config``'s controls.

    Returns (index of the drafter, its draft), or (-1, an empty draft) when none drafts. The
    speculative loop and the server's batched scheduler both draft through it; the loop's ``policy``
    sets each drafter's length (0: the drafter is not asked), and ``before(i)`` runs before drafter ``i`` is
    asked (the loop and the scheduler show it the rows kept for it then).
    """
    for i, (drafter, req) in enumerate(zip(drafters, requirements)):
        n = min(n_max, req.max_draft) if req.max_draft is not None else n_max
        if n > 0 and policy is not None:
            n = policy.length(i, n)
        if n <= 0:
            continue
        if before is not None:
            before(i)
        d = drafter.draft(seq, n, history=history, pos=pos)
        if d is None:
            continue
        if not isinstance(d, Draft):  # a plain sequence of token ids is accepted too
            d = Draft(tokens=tuple(int(t) for t in d))
        if not len(d):
            continue
        d = d.truncated(n)
        if config.p_min > 0.0:
            conf = d.confidence()
            if conf is not None:
                low = np.nonzero(conf < config.p_min)[0]
                if low.size:
                    d = d.truncated(int(low[0]))
        if len(d) and policy is not None:
            d = d.truncated(policy.cut(i, len(d)))
        if len(d) == 0 or len(d) < config.n_min:
            continue
        return i, d
    return -1, Draft()


class SpeculativeGenerator(Generator):
    """A :class:`Generator` whose decode steps verify drafts in one target forward.

    drafters: drafter objects (:class:`plinth.speculative.base.BaseDrafter`
    shape), in priority order: the first to propose a draft drafts the step;
    all of them see every target batch.
    """

    def __init__(self, model: Any, drafters: Sequence[Any], *, config: SpecConfig | None = None,
                 sampler: Sampler | SamplerConfig | None = None, registry: Any = None) -> None:
        if isinstance(sampler, SamplerConfig):
            sampler = Sampler(sampler)
        super().__init__(model, sampler)
        self.config = config or SpecConfig()
        self.drafters = list(drafters)
        self.requirements = [check_compatible(model, d) for d in self.drafters]
        self.names = [str(getattr(d, "name", type(d).__name__)) for d in self.drafters]
        self.verifier = make_step_verifier(self.config.verifier, self.sampler.config.temperature, registry)
        self.rng = np.random.default_rng(self.config.seed)
        self.taps = tuple(sorted({int(t) for r in self.requirements for t in r.taps}))
        self.policy = LengthPolicy(self.config.policy)  # (its measurements carry over from one generation to the next)
        self.unseen = Unseen(len(self.drafters))  # rows kept for the drafters (--spec-policy auto)
        self.deferred_s = 0.0  # seconds the drafters spent on deferred rows (not a draft's own cost)
        self.context: Any = None
        self.seq = 0

    def _new_stats(self, n_prompt: int) -> SpecStats:
        return SpecStats(n_prompt=n_prompt, synthetic=self.config.synthetic_accept is not None)

    # ------------------------------------------------------------------ pieces

    def _show(self, kind: str, batch: Batch, out: Any, only: int = -1) -> None:
        """Hand one target forward to every drafter (``process``), or to drafter ``only``."""
        if not self.drafters:
            return
        has_embd = batch.is_embd is not None and bool(np.any(batch.is_embd))
        rows = np.nonzero(batch.seq_ids == self.seq)[0]
        for i, (drafter, req) in enumerate(zip(self.drafters, self.requirements)):
            if only >= 0 and i != only:
                continue
            feats = {t: out.features[t] for t in req.taps if t in out.features}
            drafter.process(TargetOutput(seq=self.seq, phase=kind, tokens=batch.tokens[rows],
                                         positions=batch.positions[rows], features=feats,
                                         has_embeddings=has_embd, logits=out.logits,
                                         kv=target_kv_views(self.context.cache, req, self.seq)))

    def _defer(self, batch: Batch, out: Any, n: int, skip: int = -1) -> None:
        """Keep the first ``n`` rows of a forward for the drafters (all but ``skip``) instead of showing them now
        (``--spec-policy auto``: the prompt, a step's kept rows); each sees them before it next drafts
        (:class:`.step.Unseen`)."""
        if not self.drafters:
            return
        for i in self.unseen.add(defer_chunk(batch, out, 0, n, self.taps), skip):
            self._show_deferred(i)

    def _show_deferred(self, i: int = -1) -> None:
        """Hand drafter ``i`` (-1: every drafter) the rows kept for it, as kept rows."""
        t0 = time.perf_counter()
        self.unseen.show(i, self.drafters, self.requirements, self.seq, self.context.cache)
        self.deferred_s += time.perf_counter() - t0

    def _draft(self, history: list[int], pos: int, n_max: int) -> tuple[int, Draft]:
        """The first drafter's non-empty draft after the controls; (-1, empty) when none drafts."""
        return propose(self.drafters, self.requirements, self.config, self.seq, history, pos, n_max, self.policy,
                       before=self._show_deferred)

    def _drop_after_eog(self, ctx: Any, history: list[int], step: tuple[Any, int, int] | None) -> None:
        """An accepted draft ran past an end-of-generation token: drop the target rows after it.

        Plain decoding would have stopped there, holding exactly ``history`` in its cache.
        """
        n = len(history)
        if ctx.cache.next_position(self.seq) <= n:
            return
        snap, last, pos = step if step is not None else (None, 0, 0)
        if snap is not None:
            ctx.cache.restore(snap)
            ctx.forward(Batch.from_tokens(history[pos:], start=pos, seq=self.seq, output="none"))
        elif ctx.cache.can_cut(self.seq, n):
            ctx.cache.seq_rm(self.seq, n)

    # ------------------------------------------------------------------ loop

    def tokens(self, prompt_ids: Sequence[int], max_tokens: int = 128) -> Iterator[int]:
        model, cfg = self.model, self.config
        prompt_ids, max_tokens = self._check_prompt(prompt_ids, max_tokens)
        self.sampler.n_prompt = len(prompt_ids)  # (frequency / presence penalties count the output only)
        self.grammar = self.constraint.start() if self.constraint is not None else None
        if self.grammar is not None and cfg.synthetic_accept is not None:
            raise UserError("synthetic acceptance (a benchmark of the verify path) cannot follow a grammar")
        seq = self.seq
        ctx = self.context = model.new_context(taps=self.taps)
        stats = self.stats = self._new_stats(len(prompt_ids))
        history = list(prompt_ids)
        self.tokens_out = []
        for d in self.drafters:
            d.begin(seq, list(prompt_ids))
        t_start = time.perf_counter()
        decisions = dict(self.policy.counts)
        try:
            t0 = time.perf_counter()
            batch = Batch.from_tokens(prompt_ids, start=0, seq=seq, output="last")
            out = ctx.forward(batch)
            self.unseen = Unseen(len(self.drafters))
            if self.policy.mode == "auto":
                self._defer(batch, out, len(prompt_ids))  # (shown before the first draft: never, if none pays)
            else:
                self._show("prefill", batch, out)  # the drafters' share of the prompt counts as prompt time
            stats.prompt_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            token = self._choose(np.asarray(model.backend.to_numpy(out.logits[-1])), history)
            stats.sample_s += time.perf_counter() - t1
            pending = [token]  # tokens decided but not yet yielded (the last one not yet run)
            step: tuple[Any, int, int] | None = None  # (snapshot, last token, its position) of the last step
            asked_last = False  # whether the last step called a drafter
            while True:
                # emit what the last step decided, stopping at end of generation or the budget
                for t in pending:
                    done = self._record(t, history, max_tokens)
                    if done is None:
                        self._drop_after_eog(ctx, history, step)
                        return
                    yield t
                    if done:
                        return
                last = history[-1]
                pos = ctx.cache.next_position(seq)
                # a step emits at most k + 1 tokens and fills positions pos..pos+k
                n_max = min(cfg.n_max, max_tokens - stats.n_generated - 1, model.n_ctx - pos - 1)
                t0 = time.perf_counter()
                self.policy.tick()
                flushed = self.deferred_s
                who, draft = self._draft(history, pos, n_max) if n_max > 0 else (-1, Draft())
                t_draft = time.perf_counter() - t0
                t_call = t_draft - (self.deferred_s - flushed)
                k = len(draft)
                t0 = time.perf_counter()
                batch, snap = target_batch(ctx, seq, last, draft, pos)
                out = ctx.forward(batch)
                logits = np.asarray(model.backend.to_numpy(out.logits))
                if k or not (self.policy.asked or asked_last):  # (a plain step's forward just after a drafter's
                    self.policy.observe_forward(k + 1, time.perf_counter() - t0)  # call reads weights it evicted)
                asked_last = self.policy.asked
                if cfg.synthetic_accept is not None and k:
                    a = 0
                    while a < k and self.rng.random() < cfg.synthetic_accept:
                        a += 1
                    nxt = int(np.argmax(logits[a])) if self.sampler.config.greedy else \
                        self.sampler.token(logits[a], history + list(draft.tokens[:a]))
                else:
                    a, nxt = decide(self.verifier, self.sampler, draft, logits, history, self.rng, self.grammar)
                stats.verify_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                flushed = self.deferred_s
                if self.policy.mode == "auto":  # (the drafter that drafted sees its rows now; the others the kept
                    if k:  # rows before they next draft)
                        self._show("verify", batch, out, only=who)
                    self._defer(batch, out, a + 1, skip=who if k else -1)
                else:
                    self._show_deferred()
                    self._show("verify", batch, out)
                t_show = time.perf_counter() - t0
                t_draft += t_show
                if k:  # a draft's cost: the drafter's call and the drafters' work on its rows (not the deferred rows)
                    self.policy.observe_draft(who, t_call, t_show - (self.deferred_s - flushed))
                stats.draft_s += t_draft
                t0 = time.perf_counter()
                if a < k:
                    rollback(ctx, seq, pos, [last, *draft.tokens[:a]], snap)
                for d in self.drafters:
                    d.accept(seq, a)
                stats.rollback_s += time.perf_counter() - t0
                step = (snap, last, pos)
                stats.n_steps += 1
                if k:
                    stats.record(self.names[who], k, a)
                    self.policy.record(who, k, a)
                pending = [*draft.tokens[:a], nxt]
        finally:
            stats.decode_s = stats.draft_s + stats.verify_s + stats.rollback_s
            stats.wall_s = time.perf_counter() - t_start
            if self.policy.mode == "auto":
                stats.policy = {k: v - decisions[k] for k, v in self.policy.counts.items()}
            for name, d in zip(self.names, self.drafters):
                figures = getattr(d, "figures", None)
                if figures is not None:
                    stats.drafter_figures[name] = dict(figures())
            for d in self.drafters:
                end = getattr(d, "end", None)
                if end is not None:
                    end(seq)

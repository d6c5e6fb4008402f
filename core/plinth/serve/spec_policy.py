"""When a sequence in the server's batch drafts: only where a draft is expected to pay.

A drafted step of a sequence costs its ``k`` verify rows in the shared forward, the drafter's own call and
the verification; it gains the drafted tokens the target keeps. With one sequence the forward is mostly
the weights' read and extra rows are cheap; with many, every row costs about as much as a sequence's own
decode row, so the same draft that pays alone loses in a full batch. And a drafter whose tokens are
rarely kept loses everywhere.

:class:`DraftPolicy` (``--spec-policy auto``, the default) decides per sequence and step from what the
server measures as it runs:

* the **step's cost**: a straight-line fit of the forward's time against its rows (``a + b * rows``,
  recent steps weighing more), so ``b`` is what one more row costs now; the drafter's time a call and the
  verification's time a row, as moving averages;
* the **acceptance by draft position** over all sequences (of the drafts that reached position ``j``, the
  share that kept it: ``E_k`` kept tokens expected of a draft of ``k``), and how each sequence's drafts fared
  against it (a moving ratio; a new sequence starts at 1);
* the **step's rate**: tokens a second of recent steps.

A sequence drafts when, at the length ``k`` with the most expected kept tokens per second of the extra
cost, ``ratio * E_k / (k * (b + verify) + draft)``, that figure is above the step's rate by a margin
(:attr:`DraftPolicy.margin`, 1.25: the estimates err towards drafting): the draft then raises the
throughput of the batch. It drafts that length (a probe drafts the longest allowed). Otherwise
it decodes plainly this step (exactly as a request without a drafter does: its sampler's own draw). So that the estimates do not freeze, a sequence that is not drafting is
probed now and then: one probe a step at most over the batch, after 16 steps, then after twice as many
each time a probe confirms the decision, back to 16 once a probe pays. Before anything is measured (a new
server), the first drafts are such probes too: one sequence at a time, not the whole batch at once.

The decision never changes what greedy decoding produces (a verified draft keeps exactly the target's own
tokens; a plain step is the target's own token). A sampled request keeps its distribution either way;
with a seed, its tokens depend on which steps drafted (as they already depend on the drafts kept), so
``--spec-policy always`` gives the solo speculative loop's draws.

``always``: every speculative sequence drafts every step (the solo loop's behaviour).
"""

from __future__ import annotations

import attrs

from ..speculative.policy import Acceptance, StepCost, _ema, check_mode


@attrs.define
class SeqDraftState:
    """One sequence's acceptance estimate and probe schedule."""

    accepted: float | None = None  # moving average of drafted tokens kept a draft (None: no draft yet)
    drafts: int = 0
    ratio: float | None = None  # moving average of its kept tokens over what the batch's curve expected


@attrs.define
class DraftPolicy:
    """The per-sequence drafting decision of a server's batch (module docstring)."""

    mode: str = attrs.field(default="auto", validator=check_mode)
    weight: float = 0.25  # of the newest observation in every moving average
    probe_min: int = 16
    probe_max: int = 1024
    #: how far a draft's expected rate must beat the step's: the fit's ``b`` is an average, and in a full batch
    #: measured steps show the first verify rows costing more than it (a 16-sequence SmolLM2 step on two
    #: cores: +1.3-1.6 ms for one row, ~1 ms a row after), while a sequence's recent acceptance overstates its
    #: next draft's; without it, ``ngram`` drafted at 16 HTTP clients for 0.77x plain throughput
    margin: float = 1.25
    cost: StepCost = attrs.field(factory=StepCost)
    draft_s: float | None = None  # the drafter's seconds a call
    verify_s: float | None = None  # verification's seconds a verified row (beyond a plain step's)
    accepted: float | None = None  # drafted tokens kept a draft, over all sequences
    step_s: float | None = None  # a decode step's seconds, the whole step
    step_tokens: float | None = None  # tokens a decode step gives
    curve: Acceptance = attrs.field(factory=lambda: Acceptance(decay=0.99))  # kept by draft position, all sequences
    probe_every: int = 16
    next_probe: int = 0  # the step at which the next probe may run
    step: int = 0
    #: decisions so far: "drafted" (the estimate said it pays), "probed" (a probe), "skipped"
    counts: dict[str, int] = attrs.field(factory=lambda: {"drafted": 0, "probed": 0, "skipped": 0})

    # ------------------------------------------------------------------ observations

    def observe_forward(self, rows: int, seconds: float) -> None:
        self.cost.observe(rows, seconds)

    def tick(self) -> None:
        """A scheduler step begins."""
        self.step += 1

    def observe_step(self, seconds: float, tokens: int) -> None:
        """A whole step (forward and host work) of decoding sequences gave ``tokens``."""
        if tokens > 0:
            self.step_s = _ema(self.step_s, seconds, self.weight)
            self.step_tokens = _ema(self.step_tokens, float(tokens), self.weight)

    def observe_draft(self, seconds: float) -> None:
        self.draft_s = _ema(self.draft_s, seconds, self.weight)

    def observe_verify(self, seconds: float, rows: int) -> None:
        self.verify_s = _ema(self.verify_s, seconds / max(rows, 1), self.weight)

    def record(self, state: SeqDraftState, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens of which ``accepted`` were kept."""
        if drafted <= 0:
            return
        state.accepted = _ema(state.accepted, float(accepted), self.weight)
        state.drafts += 1
        self.accepted = _ema(self.accepted, float(accepted), self.weight)
        expected = self.curve.expected(drafted)[-1] if self.curve.drafts else 0.0
        if expected > 0.0:
            state.ratio = _ema(state.ratio, accepted / expected, self.weight)
        self.curve.record(drafted, accepted)

    # ------------------------------------------------------------------ decision

    def best_length(self, state: SeqDraftState, k: int) -> tuple[int, float] | None:
        """The draft length up to ``k`` with the most kept tokens a second of the extra cost it adds, and that
        figure: the batch's acceptance by position (:class:`plinth.speculative.policy.Acceptance`), scaled by
        how this sequence's drafts fared against it; without that curve, the sequence's (or the batch's) mean kept
        tokens a draft, at ``k`` (None before any draft or cost)."""
        b = self.cost.per_row()
        if b is None:
            return None
        extra = lambda j: max(j * (b + (self.verify_s or 0.0)) + (self.draft_s or 0.0), 1e-12)  # noqa: E731
        if not self.curve.drafts:
            acc = state.accepted if state.accepted is not None else self.accepted
            return None if acc is None else (k, acc / extra(k))
        scale = state.ratio if state.ratio is not None else 1.0
        best = (0, 0.0)
        for j, e in enumerate(self.curve.expected(k), start=1):
            if scale * e / extra(j) > best[1]:
                best = (j, scale * e / extra(j))
        return best

    def pays(self, state: SeqDraftState, k: int) -> bool | None:
        """Whether a draft of up to ``k`` tokens by this sequence is expected to raise the step's throughput (at
        its :meth:`best_length`; None: nothing measured yet to tell)."""
        if self.step_s is None or not self.step_tokens:
            return None
        rate = self.step_tokens / max(self.step_s, 1e-9)
        best = self.best_length(state, k)
        if best is None:
            return None
        return best[0] > 0 and best[1] > self.margin * rate

    def length(self, state: SeqDraftState, k: int, decision: str) -> int:
        """How many tokens a step decided ``decision`` drafts: its :meth:`best_length` where drafting pays, all
        ``k`` for a probe (every position measured) and under ``always``."""
        if self.mode == "always" or decision != "drafted":
            return k
        best = self.best_length(state, k)
        return best[0] if best is not None and best[0] > 0 else k

    def decide(self, state: SeqDraftState, k: int) -> str:
        """This step's decision for a sequence that may draft ``k`` tokens: "drafted" (expected to pay),
        "probed" (not expected to pay, or nothing measured yet: drafted to measure) or "skipped" (a plain step);
        counted in :attr:`counts`."""
        if self.mode == "always":
            decision = "drafted"
        else:
            if self.pays(state, k):
                decision = "drafted"
            elif self.step >= self.next_probe:  # one probe now and then over the whole batch (also the first
                # drafts, before anything is measured: one sequence at a time, not the whole batch at once)
                decision = "probed"
                self.next_probe = self.step + self.probe_every
            else:
                decision = "skipped"
        self.counts[decision] += 1
        return decision

    def undrafted(self, decision: str) -> None:
        """The drafter proposed nothing at a step decided ``decision``: a probe that measured nothing leaves
        the next step free to probe again."""
        if decision == "probed":
            self.next_probe = self.step + 1

    def probed(self, state: SeqDraftState, k: int) -> None:
        """After a probe's draft was recorded: probe less often while drafting still does not pay."""
        if self.pays(state, k):
            self.probe_every = self.probe_min
        else:
            self.probe_every = min(2 * self.probe_every, self.probe_max)
        self.next_probe = self.step + self.probe_every

"""How long a draft the solo speculative loop asks for: the length expected to give the most tokens a second.

A drafted step of ``k`` tokens costs a forward over ``k + 1`` rows and the drafter's own call; it gives
``1 + E_k`` tokens, ``E_k`` the drafted tokens the target keeps. A plain step costs a one-row forward and
gives one token. On a CPU the extra rows are far from free (SmolLM2 on two cores: a 9-row forward ~1.8x a
one-row one) and a block drafter's call costs a good part of a plain step, so a drafter whose first token is
kept one time in three makes decoding slower, and even a good one pays only up to some length.

:class:`LengthPolicy` (``--spec-policy auto``) measures as the loop runs:

* the **forward's time by its rows**: a moving average per row count; a count not seen yet is taken to cost
  what the largest count below it did, so a length that may pay is tried once and its cost learnt. A plain
  step's forward right after a drafter's call is not counted: it reads weights the drafter's own evicted from
  the caches, and counting it would make plain decoding look slower than it is;
* each drafter's **call time**, and the drafters' work on a drafted step's rows (moving averages; ``D`` their
  sum);
* each drafter's **acceptance by draft position**: of the drafts that reached position ``j``, the share that
  had it kept (``r_j``; decayed counts, recent drafts weighing more). ``E_k = sum_j prod_{i <= j} r_i``.

Before drafting it asks each drafter for the length ``k`` that maximises ``(1 + E_k) / (T(k + 1) + D)``;
where no length beats the plain step's ``1 / T(1)`` the drafter is not asked (its call is saved), except for
a probe now and then (after 16 steps, then twice as long each time a probe confirms it, back to 16 once one
pays), which drafts the longest allowed length so every position keeps being measured. A drafter that has
not drafted yet drafts the longest length (its first draft is a probe). The measurements and the probe
schedule carry over from one generation to the next (a probe per short answer would cost more than it tells).
A drafter whose call costs next to nothing (under 5% of a plain step: ``ngram``) is asked every step and its
draft cut afterwards (:meth:`LengthPolicy.cut`, with its call already paid). Plain decoding is measured again
now and then too: where the loop has drafted for 16 steps in a row (then twice as long each time), two plain
steps (a plain probe, :meth:`LengthPolicy.tick`).

The choice never changes greedy output (a verified draft keeps exactly the target's own tokens; a plain
step is the target's own token). Sampled output keeps its distribution; with a seed its exact tokens follow
the steps that drafted. ``always``: every drafter asked every step at the longest length (``n_max``).
"""

from __future__ import annotations

import attrs

POLICIES = ("auto", "always")


def check_mode(_inst: object, _attr: object, value: str) -> None:
    """attrs validator of a policy's ``mode`` (the solo loop's and the server's)."""
    if value not in POLICIES:
        raise ValueError(f"spec policy {value!r}: one of {', '.join(POLICIES)}")


def _ema(old: float | None, new: float, w: float) -> float:
    return new if old is None else (1.0 - w) * old + w * new


@attrs.define
class StepCost:
    """The forward's time against its rows, ``a + b * rows``, fitted by least squares over recent steps
    (each older step weighing ``decay`` times less): the server's batches, whose rows vary step to step."""

    decay: float = 0.97
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        x, y = float(rows), float(seconds)
        self.n = d * self.n + 1.0
        self.sx = d * self.sx + x
        self.sy = d * self.sy + y
        self.sxx = d * self.sxx + x * x
        self.sxy = d * self.sxy + x * y

    def per_row(self) -> float | None:
        """``b``, the seconds one more row adds (None before any step), never less than the step's time split
        as if its fixed part were worth 4 rows (a CPU decode step's weight read; an overestimate on
        accelerators, where rows are cheaper, errs toward not drafting). That split is also the answer where
        the recent steps had (nearly) the same rows and the fit is undetermined. (A server's full batch varies
        its rows by a few at most, and a few noisy steps then fit a slope far below what a row costs: 0.4 ms
        against ~1 ms measured on SmolLM2 at 16 sequences, and ``ngram`` drafted there at a loss.)"""
        if self.n <= 0.0:
            return None
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        floor = my / (mx + FIXED_ROWS)
        if var > 0.25:
            b = (self.sxy / self.n - mx * my) / var
            return min(max(b, floor), my / max(mx, 1.0))
        return floor


FIXED_ROWS = 4.0  # a forward's fixed part, in rows, where nothing tells it apart


@attrs.define
class RowTimes:
    """A forward's seconds by its row count: a moving average per count, interpolated between counts.

    The one-row time stands for plain decoding, which runs undisturbed; a plain step among drafted ones runs
    slower (the drafter's calls evict the target's weights from the caches and let the thread pool idle), so
    that average follows a faster step at the usual weight and a slower one eight times more slowly (a plain
    probe's faster step is taken at once: ``faster_at_once``, :meth:`LengthPolicy.observe_forward`)."""

    weight: float = 0.2
    times: dict[int, float] = attrs.field(factory=dict)

    def observe(self, rows: int, seconds: float, faster_at_once: bool = False) -> None:
        """A ``rows``-row forward took ``seconds``; ``faster_at_once``: a time below the average replaces it."""
        old = self.times.get(rows)
        w = self.weight
        if rows == 1 and old is not None and seconds > old:
            w = self.weight / 8  # (above)
        elif faster_at_once and old is not None and seconds < old:
            w = 1.0
        self.times[rows] = _ema(old, seconds, w)

    def at(self, rows: int, optimistic: bool = False) -> float | None:
        """The expected seconds of a ``rows``-row forward (None before any forward). ``optimistic``: a count
        not seen yet costs what the largest count below it did (the policy then tries it and learns its time;
        the kernels' row tiles make the curve a staircase that interpolation would hide)."""
        t = self.times
        if not t:
            return None
        if rows in t:
            return t[rows]
        known = sorted(t)
        if optimistic:
            lower = [r for r in known if r < rows]
            return t[lower[-1]] if lower else t[known[0]]
        if len(known) == 1:
            r0 = known[0]
            return t[r0] * (rows + FIXED_ROWS) / (r0 + FIXED_ROWS)
        lo = [r for r in known if r < rows]
        hi = [r for r in known if r > rows]
        r0, r1 = (lo[-1], hi[0]) if lo and hi else ((known[-2], known[-1]) if lo else (known[0], known[1]))
        slope = max((t[r1] - t[r0]) / (r1 - r0), 0.0)
        return max(t[r0] + slope * (rows - r0), 0.0)


@attrs.define
class Acceptance:
    """One drafter's kept drafts by position: decayed counts of drafts that reached position j (1-based: the
    j-th drafted token was judged) and of those that kept it."""

    decay: float = 0.98
    reached: list[float] = attrs.field(factory=list)
    kept: list[float] = attrs.field(factory=list)
    drafts: int = 0

    def record(self, k: int, a: int) -> None:
        """A draft of ``k`` tokens of which the first ``a`` were kept (position a + 1 was the first rejected)."""
        judged = min(a + 1, k)
        while len(self.reached) < k:
            self.reached.append(0.0)
            self.kept.append(0.0)
        for j in range(len(self.reached)):
            self.reached[j] *= self.decay
            self.kept[j] *= self.decay
        for j in range(judged):
            self.reached[j] += 1.0
            self.kept[j] += 1.0 if j < a else 0.0
        self.drafts += 1

    def expected(self, k: int) -> list[float]:
        """``E_1..E_k``: expected kept tokens of a draft of each length (a position never judged is taken
        to keep what the last judged one kept, or nothing before any)."""
        out, p, e, r = [], 1.0, 0.0, 0.0
        for j in range(k):
            if j < len(self.reached) and self.reached[j] > 0.5:
                r = self.kept[j] / self.reached[j]
            p *= r
            e += p
            out.append(e)
        return out


@attrs.define
class LengthPolicy:
    """The solo loop's draft length, per drafter and step (module docstring)."""

    mode: str = attrs.field(default="auto", validator=check_mode)
    weight: float = 0.2
    probe_min: int = 16
    probe_max: int = 256
    cheap: float = 0.05  # a drafter whose call costs less than this share of a plain step is always asked
    forward: RowTimes = attrs.field(factory=RowTimes)
    call_s: dict[int, float] = attrs.field(factory=dict)  # a drafter's call
    show_s: dict[int, float] = attrs.field(factory=dict)  # the drafters' work on a drafted step's rows
    accept: dict[int, Acceptance] = attrs.field(factory=dict)
    probe_every: dict[int, int] = attrs.field(factory=dict)
    next_probe: dict[int, int] = attrs.field(factory=dict)
    probing: set[int] = attrs.field(factory=set)
    warm: set[int] = attrs.field(factory=set)  # drafters whose first call was seen
    asked: bool = False  # whether a drafter whose call is not cheap was asked this step
    step: int = 0
    last_plain: int = 0  # the step of the last one-row forward counted
    plain_every: int = 16  # steps without one before a plain probe
    plain_until: int = 0  # steps before this one decode plainly (a plain probe)
    #: decisions so far: "drafted" (expected to pay), "probed", "skipped" (not asked, or its draft dropped)
    counts: dict[str, int] = attrs.field(factory=lambda: {"drafted": 0, "probed": 0, "skipped": 0})

    def tick(self) -> None:
        """A step begins. Where no one-row forward was counted for ``plain_every`` steps (the loop drafted each
        of them), or none yet after the first steps, the next two steps decode plainly: a plain probe, which
        measures plain decoding again (the first plain step after a drafter's call is not counted). Without it
        a one-row time measured slow once, early, would keep the loop drafting where plain decoding is faster."""
        self.step += 1
        self.probing.clear()
        self.asked = False
        if self.mode == "auto" and self.step >= self.plain_until:
            unknown = self.forward.at(1) is None and self.step > 2
            if unknown or self.step - self.last_plain >= self.plain_every:
                self.plain_until = self.step + 2

    def best(self, i: int, n_max: int, sunk: bool = False) -> tuple[int, float, float]:
        """(the length with the most expected tokens a second for drafter ``i``, that rate, the plain step's
        rate); length 0 where nothing is measured yet. ``sunk``: the drafter's call is already paid."""
        acc, plain = self.accept.get(i), self.forward.at(1)
        if acc is None or not acc.drafts or plain is None or i not in self.call_s:
            return 0, 0.0, 0.0
        extra = self.show_s[i] + (0.0 if sunk else self.call_s[i])
        best_k, best_rate = 0, 0.0
        for k, e in enumerate(acc.expected(n_max), start=1):
            rate = (1.0 + e) / max(self.forward.at(k + 1, optimistic=True) + extra, 1e-9)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate, 1.0 / max(plain, 1e-9)

    def _probe_due(self, i: int) -> bool:
        return self.step >= self.next_probe.get(i, 0)

    def length(self, i: int, n_max: int) -> int:
        """How many tokens to ask drafter ``i`` for this step (0: do not ask it)."""
        if self.mode == "always" or n_max <= 0:
            self.asked = self.asked or n_max > 0
            return n_max
        if self.step < self.plain_until:
            self.counts["skipped"] += 1
            return 0
        plain = self.forward.at(1)
        if i in self.call_s and plain is not None and self.call_s[i] < self.cheap * plain:
            return n_max  # (a cheap drafter: asked, its draft cut to length; its call evicts nothing)
        if i not in self.call_s or plain is None or self._probe_due(i):
            self.asked = True
            return n_max  # (cut to length once drafted)
        k, rate, plain_rate = self.best(i, n_max)
        if k and rate > plain_rate:
            self.asked = True
            return k
        self.counts["skipped"] += 1
        return 0

    def cut(self, i: int, k: int) -> int:
        """The length to verify of drafter ``i``'s draft of ``k`` tokens (0: decode plainly instead)."""
        if self.mode == "always":
            self.counts["drafted"] += 1
            return k
        best, rate, plain = self.best(i, k, sunk=True)
        if best and rate > plain:
            self.counts["drafted"] += 1
            return best
        if self._probe_due(i):
            self.counts["probed"] += 1
            self.probing.add(i)
            return k
        self.counts["skipped"] += 1
        return 0

    def observe_forward(self, rows: int, seconds: float) -> None:
        """A target forward of ``rows`` rows took ``seconds`` (the loop leaves out a plain step's forward just
        after a costly drafter's call). A one-row forward counted in a plain probe replaces a slower estimate at
        once and spaces the next probe twice as far (up to ``probe_max`` steps); one counted otherwise (the loop
        is decoding plainly) resets that."""
        probe = rows == 1 and self.step < self.plain_until
        # (a probe's faster plain step is taken at once: the estimate it corrects kept the loop drafting, so no
        # other step would correct it)
        self.forward.observe(rows, seconds, faster_at_once=probe)
        if rows == 1:
            self.plain_every = min(2 * self.plain_every, self.probe_max) if probe else self.probe_min
            self.plain_until = 0
            self.last_plain = self.step

    def observe_draft(self, i: int, call_s: float, show_s: float) -> None:
        """Drafter ``i``'s call took ``call_s``; the drafters' work on the drafted step's rows ``show_s``. A
        drafter's first call is not counted (it loads its compiled kernels: tens of milliseconds, once)."""
        if i not in self.warm:
            self.warm.add(i)
            return
        self.call_s[i] = _ema(self.call_s.get(i), call_s, self.weight)
        self.show_s[i] = _ema(self.show_s.get(i), show_s, self.weight)

    def record(self, i: int, k: int, a: int) -> None:
        """Drafter ``i``'s draft of ``k`` tokens kept ``a``; a probe's outcome sets when the next one runs."""
        if k <= 0:
            return
        self.accept.setdefault(i, Acceptance()).record(k, a)
        if i in self.probing or i not in self.next_probe:
            bk, rate, plain = self.best(i, k)
            every = self.probe_every.get(i, self.probe_min)
            every = self.probe_min if bk and rate > plain else min(2 * every, self.probe_max)
            self.probe_every[i] = every
            self.next_probe[i] = self.step + every

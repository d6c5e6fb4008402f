"""The solo loop's ``--spec-policy auto`` (plinth.speculative.policy): the draft length expected to give the most
tokens a second, no draft where none pays, deferred rows shown before the next draft, output unchanged."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pytest

from plinth.generate import Generator
from plinth.speculative.base import BaseDrafter, Draft, DrafterRequirements
from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
from plinth.speculative.policy import Acceptance, LengthPolicy, RowTimes
from plinth.testing.drafters import OracleDrafter, RandomDrafter

PROMPTS = [list(b"abcabcabc hello hello"), list(b"the cat sat on the mat; the cat"), list(b"0123 0123 01")]


def fixed_costs(policy: LengthPolicy, per_row: float = 0.2, call: float = 0.0, show: float = 0.0,
                n: int = 17) -> None:
    """Forward times 1 + per_row * (rows - 1) and the drafter's costs, frozen (no later observation moves them)."""
    policy.weight = 0.0
    policy.forward = RowTimes(weight=0.0, times={r: 1.0 + per_row * (r - 1) for r in range(1, n + 1)})
    policy.call_s = {0: call, 1: call}
    policy.show_s = {0: show, 1: show}


def test_acceptance_and_row_times():
    acc = Acceptance(decay=1.0)
    for a in (0, 1, 2, 3):  # drafts of 4: position 1 kept 3 of 4, position 2 kept 2 of 3 reached, ...
        acc.record(4, a)
    assert acc.reached[:4] == [4, 3, 2, 1] and acc.kept[:4] == [3, 2, 1, 0]
    e = acc.expected(6)
    r1, r2, r3 = 3 / 4, 2 / 3, 1 / 2
    np.testing.assert_allclose(e[:3], [r1, r1 + r1 * r2, r1 + r1 * r2 + r1 * r2 * r3])
    assert e[3] == e[4] == e[5] == pytest.approx(e[2])  # position 4 kept nothing: later ones add nothing
    t = RowTimes()
    assert t.at(1) is None
    t.observe(1, 5.0)
    assert t.at(6) == pytest.approx(5.0 * 10 / 5)  # one count known: its fixed part taken as 4 rows
    t.observe(9, 9.0)
    assert t.at(5) == pytest.approx(7.0) and t.at(13) == pytest.approx(11.0) and t.at(9) == 9.0
    assert t.at(5, optimistic=True) == 5.0 and t.at(12, optimistic=True) == 9.0  # not seen: the count below's
    t.observe(1, 10.0)  # the one-row time (plain decoding's) follows a slower step eight times more slowly
    assert t.at(1) == pytest.approx(5.0 + 0.025 * 5.0)
    t.observe(1, 4.0)
    assert t.at(1) == pytest.approx(0.8 * 5.125 + 0.2 * 4.0)
    t.observe(9, 19.0)
    assert t.at(9) == pytest.approx(0.8 * 9.0 + 0.2 * 19.0)


def test_length_is_the_best_rate_and_none_where_plain_wins():
    p = LengthPolicy("auto")
    fixed_costs(p, per_row=0.1)
    for _ in range(40):
        p.record(0, 8, 8)  # every drafted token kept
    k, rate, plain = p.best(0, 8)
    assert k == 8 and rate == pytest.approx(9 / 1.8) and plain == 1.0
    assert p.length(0, 8) == 8 and p.cut(0, 8) == 8
    q = LengthPolicy("auto")
    fixed_costs(q, per_row=0.1)
    for _ in range(40):
        q.record(0, 8, 1)  # position 1 always kept, position 2 never: one token is the best draft
    assert q.best(0, 8)[0] == 1 and q.cut(0, 8) == 1
    bad = LengthPolicy("auto")
    fixed_costs(bad, per_row=0.5, call=0.5)
    bad.step = 5
    for _ in range(40):
        bad.record(0, 4, 0)
    bad.next_probe = {0: 100}
    assert bad.length(0, 8) == 0  # an expensive drafter that never pays is not even asked
    assert bad.counts["skipped"] == 1
    bad.step = 100
    assert bad.length(0, 8) == 8 and bad.cut(0, 8) == 8 and bad.counts["probed"] == 1  # a probe is due
    assert LengthPolicy("always").length(0, 8) == 8
    with pytest.raises(ValueError, match="spec policy 'sometimes'"):
        LengthPolicy("sometimes")
    with pytest.raises(ValueError, match="policy must be one of auto, always"):
        SpecConfig(policy="sometimes")


def test_cheap_drafters_are_asked_and_their_drafts_cut():
    """A drafter whose call costs nothing is always asked; a draft that would not pay is dropped (unless a probe
    is due, which verifies it whole)."""
    p = LengthPolicy("auto")
    fixed_costs(p, per_row=0.5)
    for _ in range(40):
        p.record(0, 4, 0)
    p.next_probe = {0: 50}
    p.step = 10
    assert p.length(0, 8) == 8
    assert p.cut(0, 3) == 0 and p.counts["skipped"] == 1
    p.step = 50
    assert p.cut(0, 3) == 3 and 0 in p.probing
    every = p.probe_every[0]
    p.record(0, 3, 0)
    assert p.next_probe[0] == 50 + 2 * every  # the probe confirmed it: the next one twice as late


def test_plain_probes_measure_plain_decoding_again():
    """A loop that drafts every step still measures plain decoding now and then (two plain steps after 16
    drafted ones, then twice as late), and a probe's faster plain step replaces a slow early estimate at once:
    one slow plain step at the start must not keep the loop drafting where plain decoding is faster."""
    p = LengthPolicy("auto")
    p.forward = RowTimes(times={1: 3.0, 2: 1.4})  # the one-row time measured slow once, early
    p.call_s, p.show_s = {0: 0.1}, {0: 0.0}
    for _ in range(10):
        p.record(0, 1, 1)  # one-token drafts, one in four kept
        for _ in range(3):
            p.record(0, 1, 0)
    p.next_probe = {0: 10 ** 6}
    asked = []
    for _ in range(16):
        p.tick()
        asked.append(p.length(0, 1))
    assert asked == [1] * 15 + [0], "drafting pays on the slow estimate; the 16th step is a plain probe"
    assert p.step < p.plain_until
    p.tick()
    assert p.length(0, 1) == 0, "a plain probe is two steps (the first after a drafter's call is not counted)"
    p.observe_forward(1, 1.0)
    assert p.forward.at(1) == 1.0 and p.plain_every == 32 and p.plain_until == 0
    p.tick()
    assert p.length(0, 1) == 0, "measured again, plain decoding (1.0 s a token) beats a draft (~1.25 / 1.5 s)"
    q = LengthPolicy("auto")  # no one-row forward measured at all: a plain probe after the first steps
    q.tick()
    q.tick()
    assert q.length(0, 4) == 4
    q.tick()
    assert q.length(0, 4) == 0 and q.step < q.plain_until


class RowsSeen(BaseDrafter):
    """Checks that before every draft it has been shown exactly the sequence's committed rows, in order, with
    their tokens; ``own_rows``: that the only verify rows it is shown are its own drafts' (its non-empty drafts:
    ``drafted``)."""

    name = "rows-seen"

    def __init__(self, inner: BaseDrafter, taps: Sequence[int] = (1,), own_rows: bool = False) -> None:
        self.inner = inner
        self.taps = tuple(taps)
        self.own_rows = own_rows
        self.known: list[int] = []
        self.tokens: dict[int, int] = {}
        self.pending: list[int] = []
        self.drafts = 0
        self.drafted = 0
        self.mine = False  # whether its last draft is the one being verified

    def requirements(self) -> DrafterRequirements:
        return DrafterRequirements(taps=self.taps, max_draft=self.inner.requirements().max_draft)

    def begin(self, seq: int, prompt_ids: Sequence[int]) -> None:
        self.known, self.pending, self.tokens, self.mine = [], [], {}, False
        self.inner.begin(seq, prompt_ids)

    def process(self, out: Any) -> None:
        pos = [int(p) for p in out.positions]
        for t in self.taps:
            assert out.features[t].shape[0] == len(pos)
        self.tokens.update(zip(pos, (int(t) for t in out.tokens)))
        if out.phase == "verify":
            assert self.mine or not self.own_rows, "shown the verify rows of another drafter's draft"
            self.pending = pos
        else:
            self.known += pos

    def accept(self, seq: int, n_accepted: int) -> None:
        self.known += self.pending[:n_accepted + 1]
        self.pending, self.mine = [], False
        self.inner.accept(seq, n_accepted)

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        assert self.known == list(range(pos)), (self.known[-5:], pos)
        assert [self.tokens[p] for p in range(pos)] == list(history[:pos])
        self.drafts += 1
        d = self.inner.draft(seq, n_max, history=history, pos=pos)
        self.mine = bool(len(d))
        self.drafted += self.mine
        return d


class EveryThird(OracleDrafter):
    """The oracle's draft where the position is a multiple of 3, none elsewhere."""

    name = "every-third"

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        return super().draft(seq, n_max, history=history, pos=pos) if pos % 3 == 0 else Draft()


@pytest.mark.parametrize("good", [True, False])
def test_auto_keeps_the_output_and_drafts_where_it_pays(byte_llama, good):
    plain = [Generator(byte_llama).generate(p, 40) for p in PROMPTS]
    inner = OracleDrafter(byte_llama, horizon=64, n_draft=8) if good else RandomDrafter(byte_llama.n_vocab, length=8, seed=3)
    drafter = RowsSeen(inner)
    gen = SpeculativeGenerator(byte_llama, [drafter], config=SpecConfig(n_max=8, policy="auto"))
    fixed_costs(gen.policy, per_row=0.15, call=0.2)
    outs = [gen.generate(p, 40) for p in PROMPTS]
    assert outs == plain
    counts = gen.policy.counts
    if good:
        assert counts["skipped"] == 0 and counts["drafted"] >= 12
        assert gen.stats.n_steps <= 8  # (40 tokens in drafts of 8 kept whole)
    else:
        # a probe per generation and the first draft; every other step decodes plainly, its row deferred and
        # shown before the next draft (RowsSeen checks the rows it saw)
        assert counts["drafted"] == 0 and counts["probed"] <= 2 * len(PROMPTS)
        assert counts["skipped"] >= 90
        assert gen.stats.policy["skipped"] >= 30  # this generation's decisions, in its stats


def test_always_drafts_every_step(byte_llama):
    drafter = RowsSeen(RandomDrafter(byte_llama.n_vocab, length=4, seed=1))
    gen = SpeculativeGenerator(byte_llama, [drafter], config=SpecConfig(n_max=4))
    out = gen.generate(PROMPTS[0], 20)
    assert out == Generator(byte_llama).generate(PROMPTS[0], 20)
    assert drafter.drafts == gen.stats.n_steps - 1 and gen.stats.policy == {}  # (the last step has no budget left)


def test_a_drafted_steps_rows_go_to_its_drafter_now_and_to_the_others_before_they_draft(byte_llama):
    """``auto`` with two drafters: a step's verify rows are shown at once only to the drafter that drafted it (its
    work on them is that draft's cost); the other sees the kept rows, with every earlier row, just before it next
    drafts (with ``ngram,dspark``, an n-gram draft used to pay for DSpark's layers over its rows). Output equals
    plain decoding."""
    plain = [Generator(byte_llama).generate(p, 40) for p in PROMPTS]
    first = RowsSeen(EveryThird(byte_llama, horizon=64, n_draft=4), own_rows=True)
    second = RowsSeen(OracleDrafter(byte_llama, horizon=64, n_draft=4), own_rows=True)
    gen = SpeculativeGenerator(byte_llama, [first, second], config=SpecConfig(n_max=4, policy="auto"))
    fixed_costs(gen.policy, per_row=0.15, call=0.2)
    gen.policy.call_s[0] = 0.0  # (the first is cheap: asked every step, as ngram is)
    outs = [gen.generate(p, 40) for p in PROMPTS]
    assert outs == plain
    assert first.drafted >= 5 and second.drafted >= 5
    assert second.drafts == second.drafted  # (asked only where the first had nothing: each time it drafted)

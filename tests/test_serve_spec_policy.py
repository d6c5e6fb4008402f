"""The server's drafting policy (plinth.serve.spec_policy): a sequence drafts only where the draft is
expected to raise the batch's throughput.

Unit tests of the cost model and the decision on measured figures, then a real HTTP server (in process, on
127.0.0.1) with 16 concurrent greedy requests and a drafter that is always wrong: drafting stops (the
decisions in /metrics) and every reply equals a lone plain run.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Sequence

import plinth
import pytest
from plinth.generate import Generator, TextStream
from plinth.serve.spec_policy import DraftPolicy, SeqDraftState, StepCost
from plinth.speculative.base import Draft
from plinth.speculative.engine import SpecConfig
from plinth.testing import byte_vocab, make_registry, tiny_metadata, write_synthetic_gguf
from plinth.testing.drafters import OracleDrafter
from plinth.testing.scheduling import run_requests

# ---------------------------------------------------------------- the cost model and the decision


def test_step_cost_fits_the_forward_against_its_rows():
    c = StepCost()
    assert c.per_row() is None
    for rows in (1, 9, 16, 4, 24, 2):
        c.observe(rows, 0.006 + 0.0015 * rows)
    assert c.per_row() == pytest.approx(0.0015, rel=1e-6)
    flat = StepCost()  # every step the same rows: the fixed part counted as 4 rows
    for _ in range(5):
        flat.observe(16, 0.030)
    assert flat.per_row() == pytest.approx(0.030 / 20)
    noisy = StepCost()  # a slope below zero: the step's time split over its rows and 4 more
    for rows, s in ((1, 0.010), (16, 0.002), (1, 0.011), (16, 0.001)):
        noisy.observe(rows, s)
    assert noisy.per_row() == pytest.approx(noisy.sy / noisy.n / (noisy.sx / noisy.n + 4))
    full = StepCost()  # a full batch: rows 16-18, a noisy slope far below what a row costs -> the split
    for rows, s in ((16, 0.023), (17, 0.022), (16, 0.024), (18, 0.0235), (16, 0.0228), (17, 0.0231)):
        full.observe(rows, s)
    assert full.per_row() == pytest.approx(full.sy / full.n / (full.sx / full.n + 4)) and full.per_row() > 0.001
    steep = StepCost()  # never more than the step's time a row
    for rows, s in ((1, 0.001), (4, 0.060), (1, 0.001), (4, 0.061)):
        steep.observe(rows, s)
    assert steep.per_row() == pytest.approx(steep.sy / steep.n / (steep.sx / steep.n))


def measured(rows: int, *, step_s: float, draft_s: float = 0.002) -> DraftPolicy:
    """A policy that has seen forwards of a + b * rows (a 6 ms, b 1.5 ms) and steps of ``rows`` tokens."""
    p = DraftPolicy()
    for r in (1, 8, 16, 2, 24):
        p.observe_forward(r, 0.006 + 0.0015 * r)
    for _ in range(20):
        p.observe_step(step_s, rows)
    p.observe_draft(draft_s)
    p.observe_verify(0.0001, 8)
    return p


def test_a_draft_must_beat_the_steps_rate_by_the_margin():
    """The estimates err towards drafting (the first verify rows cost more than the fit's b; a sequence's recent
    acceptance overstates its next draft's): a draft pays only above the step's rate times ``margin``."""

    class Fixed(DraftPolicy):
        def best_length(self, state, k):
            return 1, self.rate_of_draft

    for factor, pays in ((1.1, False), (1.3, True)):
        p = Fixed()
        for _ in range(20):
            p.observe_step(0.030, 16)
        Fixed.rate_of_draft = factor * 16 / 0.030
        assert p.margin == 1.25 and p.pays(SeqDraftState(), 4) is pays


def test_a_good_drafter_drafts_alone_and_not_in_a_full_batch():
    good = SeqDraftState(accepted=3.0, drafts=5)  # 3 of 7 drafted tokens kept a draft
    alone = measured(1, step_s=0.0075)  # 133 tok/s: a draft of 7 costs 12.7 ms for 3 tokens (236 tok/s)
    assert alone.pays(good, 7) is True
    assert alone.decide(good, 7) == "drafted"
    full = measured(16, step_s=0.030)  # 533 tok/s: the same draft loses
    assert full.pays(good, 7) is False
    decisions = [full.decide(good, 7) for _ in range(3) if not full.tick()]
    assert decisions[0] == "probed" and decisions[1:] == ["skipped", "skipped"]
    assert full.counts == {"drafted": 0, "probed": 1, "skipped": 2}


def test_the_drafted_length_follows_the_acceptance_by_position():
    """With the batch's acceptance by position known, a drafting sequence drafts the length with the most kept tokens
    a second of the extra cost, scaled by how its own drafts fared; a probe drafts the longest allowed."""
    alone = measured(1, step_s=0.0075)
    s = SeqDraftState()
    for _ in range(30):  # the first drafted token always kept, the second never: one token is the length that pays
        alone.record(s, 7, 1)
    assert alone.best_length(s, 7)[0] == 1
    assert alone.decide(s, 7) == "drafted" and alone.length(s, 7, "drafted") == 1
    assert alone.length(s, 7, "probed") == 7 and DraftPolicy("always").length(s, 7, "drafted") == 7
    weak = SeqDraftState(ratio=0.05)  # a sequence whose drafts keep a twentieth of what the batch's do
    assert alone.pays(weak, 7) is False and alone.pays(SeqDraftState(), 7) is True
    long = measured(1, step_s=0.0075)
    t = SeqDraftState()
    for _ in range(30):
        long.record(t, 7, 7)
    assert long.best_length(t, 7)[0] == 7 and t.ratio == pytest.approx(1.0)


def test_a_poor_drafter_does_not_draft_even_alone():
    poor = SeqDraftState(accepted=0.05, drafts=5)
    assert measured(1, step_s=0.0075).pays(poor, 7) is False
    never = SeqDraftState(accepted=0.0, drafts=5)  # nothing kept never pays, even if a row were free
    free = DraftPolicy()
    free.observe_forward(1, 0.0)
    free.observe_step(0.001, 1)
    assert free.pays(never, 7) is False


def test_nothing_measured_probes_one_sequence_and_new_sequences_start_from_the_batchs_acceptance():
    p = DraftPolicy()
    s = SeqDraftState()
    p.tick()
    assert p.pays(s, 7) is None and [p.decide(SeqDraftState(), 7) for _ in range(16)] == ["probed"] + ["skipped"] * 15
    p = measured(16, step_s=0.030)
    p.record(SeqDraftState(), 7, 0)  # another sequence's drafts were all rejected
    assert p.pays(SeqDraftState(), 7) is False
    p.record(s, 7, 7)
    assert s.accepted == 7.0 and s.drafts == 1


def test_probes_back_off_while_drafting_does_not_pay_and_reset_once_it_does():
    p = measured(1, step_s=0.0075)
    s = SeqDraftState(accepted=0.0, drafts=1)
    probes = []
    for step in range(400):
        p.tick()
        if p.decide(s, 7) == "probed":
            probes.append(p.step)
            p.record(s, 7, 0)
            p.probed(s, 7)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == [32, 64, 128, 256][:len(gaps)] and len(gaps) >= 3  # (each failed probe doubles the wait)
    # a probe that pays: back to the shortest interval, and the sequence drafts again
    while p.decide(s, 7) != "probed":
        p.tick()
    for _ in range(4):
        p.record(s, 7, 7)
    p.probed(s, 7)
    assert p.probe_every == p.probe_min
    assert p.decide(s, 7) == "drafted"


def test_always_drafts_every_step_and_a_bad_mode_is_refused():
    p = measured(16, step_s=0.030, draft_s=1.0)
    s = SeqDraftState(accepted=0.0, drafts=3)
    always = DraftPolicy("always")
    always.cost, always.step_s, always.step_tokens = p.cost, p.step_s, p.step_tokens
    assert [always.decide(s, 7) for _ in range(3)] == ["drafted"] * 3
    with pytest.raises(ValueError, match="spec policy 'sometimes'"):
        DraftPolicy("sometimes")


# ---------------------------------------------------------------- a server, 16 clients, a drafter always wrong


class WrongDrafter(OracleDrafter):
    """Drafts the target's greedy continuation with every token changed: never accepted."""

    name = "wrong"

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        right = super().draft(seq, n_max, history=history, pos=pos)
        return Draft(tokens=tuple((t + 1) % self.model.n_vocab for t in right.tokens))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from plinth_llama.plugin import plugin

    registry = make_registry(plugin)
    md = tiny_metadata("llama", n_vocab=257, n_ctx=512) | byte_vocab()
    path = write_synthetic_gguf(tmp_path_factory.mktemp("policy") / "tiny.gguf", "llama", md, registry, seed=4)
    return plinth.load_model(path, registry=registry)


def test_sixteen_clients_with_a_drafter_always_wrong_stop_drafting_and_equal_plain_runs(tiny):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("starlette")
    uvicorn = pytest.importorskip("uvicorn")
    from plinth.serve.app import Server, build_app
    from plinth.serve.scheduler import Scheduler
    from plinth.testing.server import free_port

    drafter = WrongDrafter(tiny, horizon=64, n_draft=6)
    sched = Scheduler(tiny, drafters=[drafter], spec=SpecConfig(n_max=6), max_batch=16)
    assert sched.policy.mode == "auto"
    app = build_app(Server(tiny, sched, "tiny", spec_names=("wrong",)))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + i % 5)] for i in range(16)]

        def complete(p: list[int]) -> str:
            r = httpx.post(url + "/v1/completions", timeout=120, json={"model": "tiny", "prompt": p, "max_tokens": 40, "temperature": 0})
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        with cf.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(complete, prompts))
        metrics = httpx.get(url + "/metrics", timeout=30).text
    finally:
        server.should_exit = True
        thread.join(30)
    for p, text in zip(prompts, got):
        stream = TextStream(tiny.tokenizer)
        solo = "".join(stream.feed(t) for t in Generator(tiny).generate(p, 40)) + stream.finish()
        assert text == solo
    counts = {}
    for line in metrics.splitlines():
        if line.startswith("plinth_spec_policy_decisions_total{"):
            counts[line.split('"')[1]] = float(line.split()[-1])
    assert set(counts) == {"drafted", "probed", "skipped"}, metrics
    total = sum(counts.values())
    assert total >= 16 * 30
    assert counts["skipped"] >= 0.85 * total, counts  # drafting stopped after the first measured steps
    assert counts["drafted"] + counts["probed"] <= 0.15 * total
    drafted_tokens = [float(x.split()[-1]) for x in metrics.splitlines()
                      if x.startswith('plinth_spec_accepted_tokens_total{drafter="wrong"}')]
    assert drafted_tokens == [0.0]  # (never accepted: the outputs are the target's own tokens)


# ---------------------------------------------------------------- plain steps' rows reach the drafters before a draft


class CoverageDrafter(OracleDrafter):
    """An oracle that checks, at every draft, that it was shown every row before the draft's position (the
    prompt's and each generated token's features), and records the phases and row counts it was shown."""

    name = "coverage"

    def __init__(self, model, taps) -> None:
        super().__init__(model, horizon=200, n_draft=4, taps=taps)
        self.seen: dict[int, set[int]] = {}
        self.shown: list[tuple[str, int]] = []
        self.gaps: list[tuple[int, int]] = []

    def begin(self, seq, prompt_ids) -> None:
        super().begin(seq, prompt_ids)
        self.seen[seq] = set()

    def process(self, target_output) -> None:
        super().process(target_output)
        self.seen[target_output.seq].update(int(p) for p in target_output.positions)
        self.shown.append((target_output.phase, len(target_output.positions)))

    def draft(self, seq, n_max, *, history, pos) -> Draft:
        missing = set(range(pos)) - self.seen[seq]
        if missing:
            self.gaps.append((seq, min(missing)))
        return super().draft(seq, n_max, history=history, pos=pos)


class NeverPays(DraftPolicy):
    """A policy for which no draft is expected to pay (it still probes)."""

    def pays(self, state, k):
        return False


def run_greedy(sched, prompts, n):
    return run_requests(sched, [dict(prompt_ids=p, max_tokens=n) for p in prompts])


PROMPTS = [[5, 6, 7], [9, 9, 9, 9, 1], [200, 3], [40, 41, 42, 43, 44, 45]]


def served_as_plain(sched, model, prompts, n):
    """Run ``prompts`` greedily through ``sched`` (started and stopped here): each reply equals a lone plain run."""
    sched.start()
    try:
        got = run_greedy(sched, prompts, n)
    finally:
        sched.stop()
    for p, toks in zip(prompts, got):
        assert toks == Generator(model).generate(p, n)


def test_the_rows_of_skipped_steps_reach_the_drafter_before_its_next_draft(tiny):
    """Steps the policy skips are plain; their rows go to the drafters together before the sequence's next
    draft (a probe here) or every 64 rows, so a drafter never drafts without every earlier row's features.
    Greedy output equals lone plain runs."""
    from plinth.serve.scheduler import Scheduler

    drafter = CoverageDrafter(tiny, taps=(0, 1))
    sched = Scheduler(tiny, drafters=[drafter], spec=SpecConfig(n_max=4), max_batch=4)
    sched.policy = NeverPays(probe_max=32)  # plain steps and probes only
    sched.defer_bytes = 64 * (2 * 4 * int(tiny.hparams.n_embd) + 16)  # 64 rows of two taps
    served_as_plain(sched, tiny, PROMPTS, 150)
    assert drafter.gaps == []
    counts = sched.policy.counts
    assert counts["drafted"] == 0 and 4 <= counts["probed"] and counts["skipped"] > 10 * counts["probed"]
    assert {phase for phase, _ in drafter.shown} == {"prefill", "verify"}  # (deferred rows come as kept rows)
    assert max(n for phase, n in drafter.shown if phase == "prefill") == 64  # (shown once they fill defer_bytes)


def test_a_speculative_request_reuses_a_prompt_kept_with_its_drafters_rows(tiny):
    """Under ``auto`` a speculative request's prompt is kept in the prompt cache with the rows its drafters are
    to be shown; a later speculative request with the same prompt skips its prefill, its drafters still see
    every row before they draft, and the output equals a lone plain run."""
    from plinth.serve.scheduler import Scheduler

    drafter = CoverageDrafter(tiny, taps=(0, 1))
    sched = Scheduler(tiny, drafters=[drafter], spec=SpecConfig(n_max=4), max_batch=4)
    sched.policy = NeverPays(probe_min=4, probe_max=4, probe_every=4)
    sched.start()
    try:
        prompts = [[5, 6, 7, 8, 9, 10], [60, 61, 62, 63]]
        first = run_greedy(sched, prompts, 30)
        hits = sched.metrics.prompt_cache_hits
        again = run_greedy(sched, prompts, 30)
    finally:
        sched.stop()
    assert hits == 0 and sched.metrics.prompt_cache_hits == 2
    for p, a, b in zip(prompts, first, again):
        assert a == b == Generator(tiny).generate(p, 30)
    assert drafter.gaps == [] and sched.policy.counts["probed"] >= 4


def test_a_block_drafter_behind_skipped_steps_stays_lossless(tmp_path):
    """A real block drafter (a random DFlash draft on a tiny target) whose draft cache is filled by deferred
    rows between probes: greedy output equals plain decoding."""
    pytest.importorskip("plinth_dflash")
    from plinth_dflash.drafter import make_dflash
    from plinth_dflash.testkit import tiny_target, write_tiny_draft
    from plinth.serve.scheduler import Scheduler

    model = tiny_target(tmp_path / "t.gguf", "qwen3", seed=5)
    hp = model.hparams
    path = write_tiny_draft(tmp_path / "d.gguf", "dflash", n_embd=int(hp.n_embd), n_vocab=model.n_vocab, n_layer=1,
                            n_head=4, n_head_kv=2, head_dim=16, n_ff=96, taps=sorted({0, int(hp.n_layer) - 1}),
                            block_size=6, mask_token=0, scale=0.3, seed=2)
    sched = Scheduler(model, drafters=[make_dflash(model, {"draft": str(path)})], spec=SpecConfig(n_max=5),
                      max_batch=3)
    sched.policy = NeverPays(probe_min=3, probe_max=6, probe_every=3)  # probe often: many flushes of deferred rows
    served_as_plain(sched, model, [list(b"Hello there"), list(b"abcabcabcabc"), list(b"1 2 3 1 2 3")], 60)
    assert sched.policy.counts["probed"] >= 10 and sched.metrics.spec["dflash"][0] >= 10


class AlwaysPays(DraftPolicy):
    """A policy for which every draft is expected to pay."""

    def pays(self, state, k):
        return True


class OwnRows(CoverageDrafter):
    """A coverage oracle that also checks that the only verify rows it is shown are its own drafts' (a drafter
    that did not draft a step sees its kept rows before its own next draft); ``every``: it drafts only where
    the position is a multiple of it."""

    def __init__(self, model, taps, every: int = 1) -> None:
        super().__init__(model, taps)
        self.every = every
        self.mine: dict[int, bool] = {}
        self.drafted = 0
        self.others: list[int] = []  # positions of verify rows of another drafter's drafts it was shown

    def process(self, target_output) -> None:
        if target_output.phase == "verify" and not self.mine.get(target_output.seq):
            self.others.append(int(target_output.positions[0]))
        super().process(target_output)

    def draft(self, seq, n_max, *, history, pos) -> Draft:
        d = super().draft(seq, n_max, history=history, pos=pos) if pos % self.every == 0 else Draft()
        self.mine[seq] = bool(len(d))
        self.drafted += bool(len(d))
        return d

    def accept(self, seq, n_accepted) -> None:
        super().accept(seq, n_accepted)
        self.mine[seq] = False


def test_a_drafted_steps_rows_go_to_its_drafter_now_and_to_the_others_before_they_draft(tiny):
    """Two drafters under ``auto``: a step's verify rows go at once only to the drafter that drafted it; the
    other is shown the kept rows before its own next draft (so an n-gram draft does not pay for DSpark's layers
    over its rows). Greedy output equals lone plain runs."""
    from plinth.serve.scheduler import Scheduler

    first, second = OwnRows(tiny, taps=(0, 1), every=3), OwnRows(tiny, taps=(1,))
    sched = Scheduler(tiny, drafters=[first, second], spec=SpecConfig(n_max=4), max_batch=4)
    sched.policy = AlwaysPays()
    served_as_plain(sched, tiny, PROMPTS, 60)
    assert first.drafted >= 8 and second.drafted >= 8
    assert first.gaps == second.gaps == [] and first.others == second.others == []

"""The continuous-batching scheduler of `plinth serve`, in process (no HTTP).

Several requests run together through one multi-sequence cache and must each produce
exactly what a solo run produces: plain greedy vs :class:`Generator`, speculative
(oracle, random and prompt-lookup drafters; a KV target and a recurrent target) vs
greedy decoding, and seeded sampling with rejection verification vs the solo
:class:`SpeculativeGenerator` with the same seed. Cancelled and finished requests
leave the cache empty; the queue bound raises :class:`QueueFull`.
"""

from __future__ import annotations

import threading

import numpy as np
import plinth
import pytest
from plinth.generate import Generator
from plinth.sampling import Sampler, SamplerConfig
from plinth.serve.scheduler import Event, QueueFull, Request, Scheduler
from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
from plinth.speculative.ngram import NgramDrafter
from plinth.testing import byte_vocab, make_registry, tiny_metadata, write_synthetic_gguf
from plinth.testing.drafters import OracleDrafter, RandomDrafter
from plinth.testing.recurrent import recurrent_plugin, write_toy_recurrent
from plinth.testing.scheduling import run_requests

PROMPTS = [b"Hello there", b"abcabcabcabc", b"The sea is the sea is", b"1 2 3 1 2 3 1 2", b"x", b"plinth serves"]
TIMEOUT = 60


@pytest.fixture(scope="module")
def registry():
    from plinth_llama.plugin import plugin

    return make_registry(plugin, recurrent_plugin())


@pytest.fixture(scope="module")
def tiny(registry, tmp_path_factory):
    md = tiny_metadata("llama", n_vocab=257, n_ctx=512) | byte_vocab()
    path = write_synthetic_gguf(tmp_path_factory.mktemp("sched") / "tiny.gguf", "llama", md, registry, seed=4)
    return plinth.load_model(path, registry=registry)


@pytest.fixture(scope="module")
def recurrent(registry, tmp_path_factory):
    return plinth.load_model(write_toy_recurrent(tmp_path_factory.mktemp("sched") / "rec.gguf", seed=3),
                             registry=registry)


def ids(prompt: bytes) -> list[int]:
    return list(prompt)  # the byte vocabulary: token id = byte


def run(sched: Scheduler, specs: list[tuple[list[int], int, SamplerConfig]]) -> list[list[int]]:
    """Submit every request at once, run them to the end, return each one's token ids."""
    return run_requests(sched, [dict(prompt_ids=p, max_tokens=n, sampling=s) for p, n, s in specs], timeout=TIMEOUT)


@pytest.fixture
def started():
    scheds: list[Scheduler] = []

    def make(*args, **kw) -> Scheduler:
        s = Scheduler(*args, **kw)
        s.start()
        scheds.append(s)
        return s

    yield make
    for s in scheds:
        s.stop()


GREEDY = SamplerConfig(temperature=0.0)


def test_batched_greedy_equals_solo(tiny, started):
    sched = started(tiny, max_batch=4, prefill_chunk=7)  # more requests than places; prompts in chunks
    specs = [(ids(p), 20 + 3 * i, GREEDY) for i, p in enumerate(PROMPTS)]
    got = run(sched, specs)
    for (p, n, _), toks in zip(specs, got):
        assert toks == Generator(tiny).generate(p, n)
    assert sched.cache_tokens() == 0 and sched.cache_seqs() == 0
    assert sched.metrics.steps < sum(n for _, n, _ in specs)  # rows of several requests shared steps


def test_a_prompt_that_fits_the_budget_is_not_split(tiny):
    """With the budget partly taken, a prompt that fits a whole step waits for one instead of being
    cut (a lone run prefills it in one piece); a prompt longer than the budget is still chunked."""
    sched = Scheduler(tiny, max_batch=4, prefill_chunk=16)
    a, b, c = [1] * 10, [2] * 12, [3] * 40
    reqs = [Request(prompt_ids=p, max_tokens=2, sampling=GREEDY, emit=lambda ev: None) for p in (a, b, c)]
    for r in reqs:
        sched.submit(r)
    prefilled = []
    with sched._cond:
        sched._admit()
    for _ in range(5):
        sched._step()
        prefilled.append([r.n_prefilled for r in reqs])
    # step 1: a whole (10); b (12) does not fit the 6 left and waits, and c behind it
    # step 2: b whole (12) and 4 of c's 40 (longer than any step: chunked); then c 16 a step
    assert prefilled[:4] == [[10, 0, 0], [10, 12, 4], [10, 12, 20], [10, 12, 36]]
    assert prefilled[4] == [10, 12, 40]


@pytest.mark.parametrize("policy", ["always", "auto"])
@pytest.mark.parametrize("model_name", ["tiny", "recurrent"])
@pytest.mark.parametrize("drafter_name", ["oracle", "random", "ngram"])
def test_batched_speculative_greedy_equals_solo(model_name, drafter_name, policy, request, started):
    """(``auto``: the drafting policy decides which steps draft, the others are plain steps.)"""
    model = request.getfixturevalue(model_name)
    drafter = {"oracle": lambda: OracleDrafter(model, horizon=64, n_draft=5),
               "random": lambda: RandomDrafter(model.n_vocab, length=3, seed=1),
               "ngram": lambda: NgramDrafter(n_draft=4)}[drafter_name]()
    sched = started(model, drafters=[drafter], spec=SpecConfig(n_max=5), max_batch=6, spec_policy=policy)
    specs = [(ids(p), 24, GREEDY) for p in PROMPTS]
    got = run(sched, specs)
    for (p, n, _), toks in zip(specs, got):
        assert toks == Generator(model).generate(p, n), (drafter_name, p)
    assert sched.cache_tokens() == 0
    if policy == "always":
        drafts, drafted, accepted = sched.metrics.spec[drafter.name]
        assert drafts > 0
        if drafter_name == "oracle":
            assert accepted == drafted  # every greedy draft of the oracle is kept


def test_seeded_sampling_with_rejection_equals_solo_speculative(tiny, started):
    """(Under the drafting policy ``always``: a seeded sampled request's tokens follow the steps that drafted,
    and the solo loop drafts every step.)"""
    cfg = SpecConfig(n_max=4, seed=None)
    sched = started(tiny, drafters=[NgramDrafter(n_draft=4, n_match_min=1)], spec=cfg, max_batch=6,
                    spec_policy="always")
    specs = [(ids(p), 30, SamplerConfig(temperature=0.8, top_p=0.95, seed=10 + i)) for i, p in enumerate(PROMPTS)]
    got = run(sched, specs)
    for (p, n, s), toks in zip(specs, got):
        solo = SpeculativeGenerator(tiny, [NgramDrafter(n_draft=4, n_match_min=1)],
                                    config=SpecConfig(n_max=4, seed=s.seed), sampler=Sampler(s))
        assert toks == solo.generate(p, n)
    assert sched.metrics.spec["ngram"][0] > 0


def test_seeded_plain_sampling_equals_generator(tiny, started):
    sched = started(tiny, max_batch=3)
    specs = [(ids(p), 25, SamplerConfig(temperature=1.1, top_k=40, seed=i)) for i, p in enumerate(PROMPTS)]
    got = run(sched, specs)
    for (p, n, s), toks in zip(specs, got):
        assert toks == Generator(tiny, Sampler(s)).generate(p, n)


def test_cancel_frees_rows_and_queue_bound(tiny):
    sched = Scheduler(tiny, max_batch=1, max_queue=1)  # not started: steps are driven here
    events: list[Event] = []
    a = Request(prompt_ids=ids(b"Hello"), max_tokens=100, sampling=GREEDY, emit=events.append)
    b = Request(prompt_ids=ids(b"World"), max_tokens=100, sampling=GREEDY, emit=events.append)
    sched.submit(a)
    sched.submit(b)  # a takes the free place, b waits
    with pytest.raises(QueueFull):
        sched.submit(Request(prompt_ids=[1], max_tokens=1, sampling=GREEDY, emit=events.append))
    with sched._cond:
        sched._admit()
    for _ in range(3):
        sched._step()
    assert sched.cache_tokens() == len(b"Hello") + 2 and sched.n_active == 1
    sched.cancel(a)
    sched._reap()
    assert sched.cache_tokens() == 0 and sched.cache_seqs() == 0
    assert events[-1].finish == "cancelled"
    with sched._cond:
        sched._admit()  # b gets the freed place
    assert sched.n_active == 1 and sched.queue_depth == 0
    sched.cancel(b)
    sched._reap()
    assert sched.cache_tokens() == 0 and sched.metrics.requests_finished["cancelled"] == 2


def drive(sched: Scheduler, req: Request, max_steps: int = 100) -> None:
    """Run ``req`` alone to its end on an unstarted scheduler (steps driven here, bounded)."""
    sched.submit(req)
    with sched._cond:
        sched._admit()
    for _ in range(max_steps):
        if not sched.n_active:
            return
        sched._step()
    raise AssertionError("the request did not finish")


def test_stop_strings_hold_back_a_partial_match(tiny):
    sched = Scheduler(tiny, max_batch=2)
    events: list[Event] = []
    drive(sched, Request(prompt_ids=ids(b"Hello there"), max_tokens=60, sampling=GREEDY, emit=events.append))
    full = "".join(e.text for e in events)
    at = next(i for i in range(3, len(full) - 1) if all(33 <= ord(c) < 127 for c in full[i:i + 2]))
    stop = full[at:at + 2]
    want = full[:full.find(stop)]
    events = []
    drive(sched, Request(prompt_ids=ids(b"Hello there"), max_tokens=60, sampling=GREEDY, emit=events.append,
                         stop=("never seen", stop)))
    sent = ""
    for e in events:
        sent += e.text
        assert want.startswith(sent)  # never a part of the stop string, even for a moment
    assert sent == want and events[-1].finish == "stop"
    assert sched.cache_tokens() == 0


def test_log_probs_are_those_of_the_logits(tiny):
    sched = Scheduler(tiny, max_batch=1)
    events: list[Event] = []
    prompt = ids(b"Hello")
    drive(sched, Request(prompt_ids=prompt, max_tokens=3, sampling=GREEDY, emit=events.append, logprobs=2))
    infos = [t for e in events for t in e.tokens]
    history = list(prompt)
    for info in infos:
        logits = tiny.logits(history)[-1].astype(np.float64)
        lp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        assert info.token == int(np.argmax(lp))
        assert info.logprob == pytest.approx(lp[info.token], abs=1e-4)
        assert [i for i, _ in info.top] == list(np.argsort(-lp)[:2])
        history.append(info.token)


@pytest.mark.parametrize("model_name", ["tiny", "recurrent"])
def test_prompt_cache_reuses_whole_prompts_exactly(model_name, request, started):
    """A request whose prompt tokens equal a kept prompt's copies its rows (recurrent states included)
    and samples its first token from the kept logits: the tokens a solo run gives, greedy and seeded,
    with fewer forwards; the least recently used prompt leaves at the entry bound; the kept rows are
    not counted as the requests' (cache_tokens returns to 0)."""
    model = request.getfixturevalue(model_name)
    sched = started(model, max_batch=3, prompt_cache=2)
    first = [(ids(p), 12, GREEDY) for p in PROMPTS[:3]]
    assert run(sched, first) == [Generator(model).generate(p, n) for p, n, _ in first]
    assert (sched.metrics.prompt_cache_hits, sched.metrics.prompt_cache_misses) == (0, 3)
    assert sched.prompt_cache_usage() == (2, sum(len(p) for p, _, _ in first[1:]))  # the first one left
    rows = []
    forward = sched.ctx.forward
    sched.ctx.forward = lambda batch, **kw: (rows.append(batch.n_rows), forward(batch, **kw))[1]
    seeded = SamplerConfig(temperature=0.9, top_k=30, seed=5)
    again = [(ids(PROMPTS[1]), 12, GREEDY), (ids(PROMPTS[2]), 15, seeded), (ids(PROMPTS[0]), 12, GREEDY)]
    got = run(sched, again)
    assert got == [Generator(model, Sampler(s)).generate(p, n) for p, n, s in again]
    assert (sched.metrics.prompt_cache_hits, sched.metrics.prompt_cache_misses) == (2, 4)
    # rows run: the one prompt not kept, and one row for every token after each request's first
    assert sum(rows) == len(PROMPTS[0]) + sum(n - 1 for _, n, _ in again)
    assert sched.cache_tokens() == 0 and sched.cache_seqs() == 0
    assert sched.prompt_cache_usage()[0] == 2


def test_prompt_cache_token_bound_and_speculative_bypass(tiny, started):
    """The token bound evicts the oldest prompts; speculative requests under the drafting policy ``always``
    neither use nor fill the cache (their drafters read the prompt's features as it is prefilled), under
    ``auto`` they keep and reuse prompts with the rows their drafters are to be shown; 0 turns it off."""
    sched = started(tiny, max_batch=2, prompt_cache=8, prompt_cache_tokens=15)
    a, b = ids(b"Hello there"), ids(b"plinth serves")  # 11 and 13 tokens: one at a time fits
    run(sched, [(a, 4, GREEDY)])
    run(sched, [(b, 4, GREEDY)])
    assert sched.prompt_cache_usage() == (1, len(b))
    assert run(sched, [(b, 6, GREEDY)]) == [Generator(tiny).generate(b, 6)]
    assert sched.metrics.prompt_cache_hits == 1
    spec = started(tiny, max_batch=2, drafters=[NgramDrafter()], spec=SpecConfig(n_max=3), spec_policy="always")
    run(spec, [(a, 6, GREEDY)])
    run(spec, [(a, 6, GREEDY)])
    assert spec.prompt_cache_usage() == (0, 0) and spec.metrics.prompt_cache_hits == 0
    auto = started(tiny, max_batch=2, drafters=[NgramDrafter()], spec=SpecConfig(n_max=3))
    assert run(auto, [(a, 6, GREEDY)]) == run(auto, [(a, 6, GREEDY)]) == [Generator(tiny).generate(a, 6)]
    assert auto.prompt_cache_usage() == (1, len(a)) and auto.metrics.prompt_cache_hits == 1
    off = started(tiny, max_batch=2, prompt_cache=0)
    run(off, [(a, 4, GREEDY)])
    run(off, [(a, 4, GREEDY)])
    assert off.prompt_cache_usage() == (0, 0) and off.metrics.prompt_cache_misses == 0


def test_a_first_token_decided_before_the_forward_is_sent_before_it(tiny):
    """A request whose prompt is cached takes its first token from the kept logits while its step is
    planned; the events emitted so far are sent (``send_events``: the HTTP app's event loop writes them)
    before that step's forward, not held until after it: one forward less of time to first token."""
    sched = Scheduler(tiny, max_batch=2, prompt_cache=2)
    log: list = []
    real = sched.ctx.forward

    def forward(batch, *a, **kw):
        log.append("forward")
        return real(batch, *a, **kw)

    sched.ctx.forward = forward
    sched.send_events = lambda: log.append("send")
    prompt = ids(b"Hello there")

    def request():
        return Request(prompt_ids=prompt, max_tokens=3, sampling=GREEDY,
                       emit=lambda ev: log.append(("event", len(ev.tokens), ev.finish)))

    drive(sched, request())
    assert log[:3] == ["send", "forward", ("event", 1, None)]  # (a prefill: its token comes from the forward)
    log.clear()
    drive(sched, request())
    assert sched.metrics.prompt_cache_hits == 1
    assert log[:3] == [("event", 1, None), "send", "forward"]


def test_prepare_runs_on_the_scheduler_thread(tiny, started, monkeypatch):
    """The warm-up forward runs on the thread that runs every later forward (the compiled kernels'
    OpenMP team belongs to the launching thread: a team the main thread started first makes the
    scheduler's forwards 2-2.5x slower), with the configured kernel threads, and start() returns
    after it."""
    import numba
    from plinth import quant

    seen = []
    monkeypatch.setattr(tiny, "prepare", lambda: seen.append((threading.current_thread().name,
                                                              numba.get_num_threads())) or 0.0)
    threads = quant.threads()
    quant.set_threads(1)  # --threads 1: the scheduler thread runs one kernel thread too (numba's count is per thread)
    try:
        sched = started(tiny, max_batch=2, prepare=True)
    finally:
        quant.set_threads(threads)
    assert seen == [("plinth-scheduler", 1)]
    assert run(sched, [(ids(b"Hello"), 3, GREEDY)]) == [Generator(tiny).generate(ids(b"Hello"), 3)]


def test_few_row_attention_path_equals_the_general_one(tiny, monkeypatch):
    """plinth.graph.attend's path for few rows a sequence (rows written by one compiled call, the
    kernel reading the cache in place) gives the general path's logits bit for bit: several
    sequences of different lengths, one and several rows each, in the same forward."""
    from plinth import graph
    from plinth.graph import Batch

    def run() -> np.ndarray:
        ctx = tiny.new_context()
        for s, p in enumerate(PROMPTS[:3]):
            ctx.forward(Batch.from_tokens(ids(p), start=0, seq=s, output="last"))
        parts = [Batch.from_tokens(ids(b"ab"[:n]), start=len(PROMPTS[s]), seq=s, output="all")
                 for s, n in enumerate((1, 2, 1))]
        out = ctx.forward(Batch.concat(parts))
        return np.asarray(out.logits)

    fast = run()
    calls = []
    monkeypatch.setattr(graph, "_rows_path", lambda *a: calls.append(1) and False)
    general = run()
    assert calls and np.array_equal(fast, general)


def test_mailbox_wakes_the_loop_once_a_burst_and_settles_after_the_streams():
    """The HTTP app's bridge from the scheduler thread: a burst of events posted from another thread
    reaches each request's queue in order with one wake-up of the loop, and ``settle`` returns once
    the coroutines those events woke have run (a stream has written its chunk by then). Once a thread
    has settled, its posts wait for its next ``settle`` (no wake-up beside its step); another
    thread's post still wakes the loop at once."""
    import asyncio

    from plinth.serve.app import Mailbox

    async def main():
        loop = asyncio.get_running_loop()
        box = Mailbox(loop)
        wakeups = []
        real = loop.call_soon_threadsafe

        def counting(cb, *args):
            wakeups.append(cb)
            return real(cb, *args)

        loop.call_soon_threadsafe = counting
        queues = [asyncio.Queue() for _ in range(4)]
        seen = [[] for _ in queues]

        async def stream(i):  # what a streaming response does with its queue
            while True:
                ev = await queues[i].get()
                seen[i].append(ev.text)
                if ev.finish is not None:
                    return

        def drains():
            return sum(getattr(w, "__name__", "") == "_drain" for w in wakeups)

        tasks = [asyncio.create_task(stream(i)) for i in range(4)]
        await asyncio.sleep(0)
        after, held = [], []

        def scheduler_thread():
            for step in range(3):
                before = drains()
                for i in range(4):
                    box.post(queues[i], Event(text=f"{i}.{step}", finish="stop" if step == 2 else None))
                held.append(drains() - before)  # wake-ups the step's posts made themselves
                box.settle(timeout=5.0)
                after.append([len(s) for s in seen])  # what the streams had taken when settle returned

        t = threading.Thread(target=scheduler_thread)
        t.start()
        await asyncio.gather(*tasks)
        await asyncio.to_thread(t.join)
        # a post from a thread that does not settle (here the loop's own) is not held
        other = asyncio.Queue()
        n0 = drains()
        box.post(other, Event(text="x"))
        got = await asyncio.wait_for(other.get(), 5.0)
        return wakeups, seen, after, held, (drains() - n0, got.text)

    wakeups, seen, after, held, lone = asyncio.run(main())
    assert seen == [[f"{i}.{s}" for s in range(3)] for i in range(4)]
    assert after == [[1] * 4, [2] * 4, [3] * 4]
    drains = [w for w in wakeups if getattr(w, "__name__", "") == "_drain"]
    # the first step's posts (before the thread first settled) wake the loop themselves: once for the burst
    # (a thread switch forced in the middle of it, on a loaded machine, can split it); the later steps' wait
    # for their settle, which wakes the loop once
    assert 1 <= held[0] <= 4 and held[1:] == [0, 0]
    assert 3 <= len(drains) - 1 <= 6
    assert lone == (1, "x")


# ---------------------------------------------------------------------------- the shared step, its parts


def test_greedy_rule_at_temperature_above_zero_is_refused_alike_in_both_loops(tiny):
    """One rule (plinth.speculative.step): 'greedy' verification of a sampled request is refused by the
    solo loop and by the scheduler alike, never switched to another rule."""
    from plinth.speculative.step import GreedyNeedsTemperatureZero

    hot = SamplerConfig(temperature=0.7, seed=1)
    with pytest.raises(GreedyNeedsTemperatureZero, match="rejection"):
        SpeculativeGenerator(tiny, [NgramDrafter()], config=SpecConfig(verifier="greedy"), sampler=Sampler(hot))
    sched = Scheduler(tiny, drafters=[NgramDrafter()], spec=SpecConfig(verifier="greedy"))
    with pytest.raises(GreedyNeedsTemperatureZero, match="rejection"):
        sched.submit(Request(prompt_ids=[1, 2], max_tokens=2, sampling=hot, emit=lambda ev: None))
    # the same request without speculation, or at temperature 0, is taken
    sched.submit(Request(prompt_ids=[1, 2], max_tokens=2, sampling=hot, emit=lambda ev: None, speculative=False))
    sched.submit(Request(prompt_ids=[1, 2], max_tokens=2, sampling=GREEDY, emit=lambda ev: None))
    assert sched.queue_depth == 2


def test_greedy_verification_keeps_the_samplers_own_choice_with_a_penalty(tiny, started):
    """The greedy rule compares drafts with the sampler's choice (its logit transforms included), so a
    repetition penalty gives the bits of plain penalised decoding in the server and the solo loop."""
    pen = SamplerConfig(temperature=0.0, repetition_penalty=1.3)
    sched = started(tiny, drafters=[OracleDrafter(tiny, horizon=64, n_draft=4)], spec=SpecConfig(n_max=4))
    specs = [(ids(p), 20, pen) for p in PROMPTS[:3]]
    got = run(sched, specs)
    for (p, n, s), toks in zip(specs, got):
        plain = Generator(tiny, Sampler(s)).generate(p, n)
        assert toks == plain
        solo = SpeculativeGenerator(tiny, [OracleDrafter(tiny, horizon=64, n_draft=4)], config=SpecConfig(n_max=4),
                                    sampler=Sampler(s))
        assert solo.generate(p, n) == plain


def test_followers_share_the_leaders_prefill(tiny):
    """The choices of one request (n > 1): followers copy the leader's rows and last logits, no prefill of
    their own, and give what a lone run gives (greedy: the same tokens; seeded: each its own seed's)."""
    sched = Scheduler(tiny, max_batch=4, prompt_cache=0)
    out: dict[int, list[int]] = {0: [], 1: [], 2: []}
    prompt = ids(b"The sea is the sea is")
    cfgs = [GREEDY, SamplerConfig(temperature=0.9, seed=5), SamplerConfig(temperature=0.9, seed=6)]
    lead = Request(prompt_ids=prompt, max_tokens=12, sampling=cfgs[0], emit=lambda ev: out[0].extend(
        t.token for t in ev.tokens), followed=True)
    reqs = [lead] + [Request(prompt_ids=prompt, max_tokens=12, sampling=c, leader=lead,
                             emit=lambda ev, i=i: out[i].extend(t.token for t in ev.tokens))
                     for i, c in enumerate(cfgs[1:], 1)]
    for r in reqs:
        sched.submit(r)
    with sched._cond:
        sched._admit()
    sched._step()  # the leader's prefill; the followers copy its rows at its end (no rows of their own)
    assert [r.n_prefilled for r in reqs] == [len(prompt)] * 3 and sched.metrics.steps == 1
    for _ in range(40):
        if not sched.n_active:
            break
        sched._step()
    assert sched.metrics.tokens_in == 3 * len(prompt)
    for i, c in enumerate(cfgs):
        assert out[i] == Generator(tiny, Sampler(c)).generate(prompt, 12)
    assert sched.cache_tokens() == 0


def test_prompt_logprobs_are_those_of_the_prompt_rows(tiny):
    events: list[Event] = []
    sched = Scheduler(tiny, prefill_chunk=5)  # the prompt in chunks
    prompt = ids(b"Hello there, sea")
    drive(sched, Request(prompt_ids=prompt, max_tokens=3, sampling=GREEDY, emit=events.append, prompt_logprobs=2))
    infos = events[0].prompt
    assert [t.token for t in infos] == prompt and infos[0].logprob is None
    logits = tiny.logits(prompt)
    from plinth.serve.emission import log_softmax

    for j in range(1, len(prompt)):
        lp = log_softmax(logits[j - 1])
        assert infos[j].logprob == pytest.approx(lp[prompt[j]], abs=1e-4)
        assert [i for i, _ in infos[j].top] == list(np.argsort(-lp, kind="stable")[:2])
    assert all(e.prompt is None for e in events[1:])


def test_text_never_ends_mid_character(tiny):
    """max_tokens cutting a multi-byte character: the server's and plinth generate's text end before it."""
    from plinth.generate import TextStream

    euro = list("€".encode())  # three byte tokens
    out = TextStream(tiny.tokenizer)
    text = "".join(out.feed(t) for t in [ord("a")] + euro[:2]) + out.finish()
    assert text == "a"
    out = TextStream(tiny.tokenizer, stop=["b€"])
    assert "".join(out.feed(t) for t in [ord("a"), ord("b")] + euro) == "a" and out.stopped


def test_generator_decodes_token_ids_without_a_tokenizer(registry, tmp_path):
    """A tokenizer-less file: Generator greedy-decodes from token ids (to max_tokens: no end token)."""
    md = tiny_metadata("llama", n_vocab=257, n_ctx=64)
    path = write_synthetic_gguf(tmp_path / "notok.gguf", "llama", md, registry, seed=4)
    bare = plinth.load_model(path, registry=registry)
    assert "tokenizer.ggml.model" not in bare.metadata
    gen = Generator(bare)
    toks = gen.generate([1, 2, 3], 10)
    assert len(toks) == 10 and gen.stats.stop_reason == "max tokens"
    ref = [1, 2, 3]
    for _ in range(10):
        ref.append(int(np.argmax(bare.logits(ref)[-1])))
    assert toks == ref[3:]
    with pytest.raises(Exception, match="tokenizer"):
        list(gen.stream([1, 2, 3], 2))


def test_followers_of_a_leader_that_ends_at_once(tiny):
    """A leader that ends with its first token (max_tokens 1) frees its rows in the step that prefilled it:
    the followers admitted with it copy the rows before that, and one admitted later prefills itself."""
    sched = Scheduler(tiny, max_batch=2, prompt_cache=0)
    prompt = ids(b"Hello there")
    out: dict[int, list[int]] = {0: [], 1: [], 2: []}
    lead = Request(prompt_ids=prompt, max_tokens=1, sampling=GREEDY, followed=True,
                   emit=lambda ev: out[0].extend(t.token for t in ev.tokens))
    reqs = [lead] + [Request(prompt_ids=prompt, max_tokens=6, sampling=GREEDY, leader=lead,
                             emit=lambda ev, i=i: out[i].extend(t.token for t in ev.tokens)) for i in (1, 2)]
    for r in reqs:
        sched.submit(r)
    with sched._cond:
        sched._admit()  # the leader and one follower; the other waits for a free place
    for _ in range(40):
        with sched._cond:
            sched._admit()
        if not sched.n_active and not sched.queue_depth:
            break
        sched._step()
    want = Generator(tiny).generate(prompt, 6)
    assert out == {0: want[:1], 1: want, 2: want}
    assert sched.cache_tokens() == 0

"""Continuous batching: one thread runs every admitted request through shared forwards.

Each step builds one :class:`~plinth.batch.Batch` holding, for every active request,

* a chunk of its prompt while it is prefilling (the chunks of all prefilling requests
  share a per-step token budget, ``prefill_chunk``, lowered where needed so that a step never
  passes the kernels' row bound ``plinth.quant.KERNEL_MAX_ROWS``; a prompt that fits the budget
  is never split, it waits a step instead), or
* one row — its last decided token — while it decodes, or ``[last, d_1..d_k]`` when a
  drafter proposed ``d_1..d_k`` for it (speculative decoding, verified in the same forward; which
  steps of a request draft is the drafting policy's choice, :mod:`.spec_policy`),

runs one :meth:`Context.forward` over it, then samples / verifies each request's rows with
that request's own sampler and random state. A request leaves the batch on an
end-of-generation token, its token budget, the context limit, a stop string or a
cancel (client gone), and its cache rows are freed at once. New requests wait in a bounded
queue and join the running batch at the next step.

A prompt seen recently is not prefilled again (:mod:`.prompt_cache`, ``prompt_cache`` entries); a
speculative request's drafters read its prompt's features, so under the ``auto`` drafting policy its prompt
is kept with them (and reused only from such an entry), under ``always`` it always prefills. The choices of
one request (``n`` > 1) share one prefill: the followers copy the leader's rows and last logits.

The parts: :mod:`.request` (what a request is), :mod:`.prompt_cache`, the speculative step
(:mod:`plinth.speculative.step`, shared with the solo loop: the verification rule, the decision
over a step's rows, the rollback), :mod:`.emission` (tokens to text and events) and this loop,
which plans each step, runs it and hands each request's rows to those parts.

Greedy output equals a solo :class:`plinth.generate.Generator` run: a request's rows see
only its own cache (the sequence id keeps them apart), and verification keeps exactly the
tokens greedy decoding would have produced.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from ..batch import Batch
from ..errors import UserError
from ..generate import TextStream
from ..sampling import Sampler
from ..speculative.base import Draft, TargetOutput, check_compatible, target_kv_views
from ..speculative.engine import SpecConfig, SpecStats, propose
from ..speculative.step import (Unseen, decide, defer_chunk, make_step_verifier, rollback,
                               target_batch, verifier_name)
from .emission import Emitter, log_softmax, token_info
from .metrics import Metrics
from .prompt_cache import PromptCache
from .request import Event, QueueFull, Request, ShuttingDown, TokenInfo
from .spec_policy import DraftPolicy, SeqDraftState

__all__ = ["Event", "Metrics", "QueueFull", "Request", "Scheduler", "ShuttingDown", "TokenInfo", "log_softmax"]


class Scheduler:
    """Owns one context (one multi-sequence KV cache) and the thread that steps it.

    model: a loaded :class:`plinth.model.Model`.
    drafters: drafter objects shared by all requests (each keeps per-sequence state);
        empty for no speculation.
    max_batch: sequences decoding together (and cache sequences in use) at most.
    max_queue: requests waiting for a place at most, beyond those the batch can take now; one
        more raises :class:`QueueFull`.
    prefill_chunk: prompt tokens run per step over all prefilling requests.
    prompt_cache: whole prompts kept for reuse at most (0: none); their cache rows stay in the
        context under sequence ids past ``max_batch``, the least recently used one goes first.
    prompt_cache_tokens: prompt tokens kept over all of them at most.
    spec_policy: when a speculative sequence drafts: "auto" (where a draft is expected to raise the
        batch's throughput, :mod:`.spec_policy`) or "always".
    prepare: run :meth:`plinth.model.Model.prepare` (the weights' one-time repacking) on the
        scheduler thread when it starts; :meth:`start` returns once it is done. It belongs on this
        thread: the compiled kernels' OpenMP threads belong to the thread that starts them, and
        once another thread (the main one) has started its own, every forward launched from here
        is 2-2.5x slower (libgomp stops spinning its idle threads when it manages more threads
        than there are cores; measured on SmolLM2 decode steps, 6 ms -> 13-16 ms).
    """

    def __init__(self, model: Any, *, drafters: Sequence[Any] = (), spec: SpecConfig | None = None,
                 max_batch: int = 16, max_queue: int = 64, prefill_chunk: int = 256, registry: Any = None,
                 prompt_cache: int = 32, prompt_cache_tokens: int = 16384, prepare: bool = False,
                 spec_policy: str = "auto") -> None:
        self.model = model
        self.tokenizer = model.tokenizer
        self.drafters = list(drafters)
        self.requirements = [check_compatible(model, d) for d in self.drafters]
        self.drafter_names = [str(getattr(d, "name", type(d).__name__)) for d in self.drafters]
        self.spec = spec or SpecConfig()
        self.policy = DraftPolicy(spec_policy)
        caps = [r.max_draft for r in self.requirements]
        #: the longest draft a step can carry (the drafters' own limits under n_max): the policy's cost of a draft
        self._draft_cap = self.spec.n_max if not caps or None in caps else min(self.spec.n_max, max(caps))
        self.registry = registry
        taps = sorted({int(t) for r in self.requirements for t in r.taps})
        self._taps = taps
        #: the most bytes of rows a request keeps for its drafters before showing them (:meth:`_defer`)
        self.defer_bytes = 8 << 20
        self._deferred_s = 0.0  # seconds the drafters spent on kept rows (not a draft's own cost)
        self.ctx = model.new_context(taps=taps)
        self.max_batch = int(max_batch)
        self.max_queue = int(max_queue)
        self.prefill_chunk = int(prefill_chunk)
        from .. import quant

        most = self.max_batch * (1 + (self.spec.n_max if self.drafters else 0))
        if 0 < quant.KERNEL_MAX_ROWS < most + 1:
            raise UserError(f"a step of {self.max_batch} sequences (max_batch) with drafts of up to "
                            f"{self.spec.n_max} tokens holds up to {most} rows, and a row keeps a lone run's "
                            f"bits only in steps of at most {quant.KERNEL_MAX_ROWS} rows: lower --max-batch or "
                            "--spec-n-max")
        self.metrics = Metrics()
        self._waiting: collections.deque[Request] = collections.deque()
        self._active: list[Request] = []
        self._free = list(range(self.max_batch))
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._cache_usage = (0, 0)
        self.prepare = bool(prepare)
        self.prompt_cache = PromptCache(self.ctx.cache, self.max_batch, prompt_cache, prompt_cache_tokens)
        self.emitter = Emitter(self.tokenizer, model.n_ctx, self.metrics, self._finish)
        self._calls: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = collections.deque()
        #: called on the scheduler thread to have the events emitted so far sent (the HTTP app lets its event
        #: loop write them there and waits for it: :class:`plinth.serve.app.Mailbox`): after each step; before a
        #: step's forward, so that a first token its planning decided (a cached prompt's, a shared prompt's
        #: follower's) is not held behind the forward; and once more after the requests still running at
        #: shutdown are ended
        self.send_events: Callable[[], None] | None = None

    # ------------------------------------------------------------------ public

    def start(self) -> None:
        """Start the scheduler thread (and, with ``prepare``, wait for its warm-up forward)."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="plinth-scheduler", daemon=True)
        self._thread.start()
        ready.wait()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, req: Request) -> None:
        """Queue ``req``; raises :class:`QueueFull` past the bound, and
        :class:`plinth.speculative.step.GreedyNeedsTemperatureZero` for a sampled speculative request
        under the greedy rule (:mod:`plinth.speculative.step`)."""
        if req.speculative and self.drafters:
            verifier_name(self.spec.verifier, req.sampling.temperature)
        with self._cond:
            if self._stop:
                raise ShuttingDown("the server is shutting down")
            # the waiting requests fill the free places first; beyond those at most max_queue wait
            if len(self._waiting) >= len(self._free) + self.max_queue:
                raise QueueFull(f"{self.max_batch - len(self._free)} requests are running and "
                                f"{len(self._waiting)} waiting (the bound is {self.max_queue})")
            self._waiting.append(req)
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the scheduler thread between two steps (work on the model, such as an
        embeddings forward, belongs on the thread whose kernel threads run every forward); its result
        or exception comes back through the future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stop:
                raise ShuttingDown("the server is shutting down")
            self._calls.append((fn, fut))
            self._cond.notify_all()
        return fut

    def cancel(self, req: Request) -> None:
        """Ask for ``req`` to end (its client went away); its rows are freed at the next step."""
        req.cancelled = True
        with self._cond:
            self._cond.notify_all()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def n_active(self) -> int:
        return len(self._active)

    def cache_tokens(self) -> int:
        """Rows held in the KV cache over all sequences (0 when idle), as of the last step or finish."""
        return self._cache_usage[0]

    def cache_seqs(self) -> int:
        """Sequences holding cache rows, as of the last step or finish."""
        return self._cache_usage[1]

    def prompt_cache_usage(self) -> tuple[int, int]:
        """(prompts, tokens) held by the prompt cache."""
        return len(self.prompt_cache), self.prompt_cache.n_tokens

    def _note_cache(self) -> None:
        """Record the cache's size for other threads (only the scheduler thread reads the cache itself):
        the requests' sequences, not the prompt cache's parked ones."""
        cache = self.ctx.cache
        seqs = [s for s in cache.seqs() if s < self.max_batch]
        self._cache_usage = (int(sum(cache.n_cached(s) for s in seqs)), len(seqs))

    # ------------------------------------------------------------------ prefill shortcuts

    def _reuse_prompt(self, req: Request) -> bool:
        """A request whose whole prompt is cached: its rows copied in and its first token sampled from the
        kept logits (no forward). False: not cached (or not eligible)."""
        if (not self.prompt_cache.size or (req.speculative and self.policy.mode != "auto") or req.n_prefilled
                or req.prompt_looked_up or req.prompt_logprobs is not None):
            return False
        req.prompt_looked_up = True
        hit = self.prompt_cache.restore(req.prompt_ids, req.seq, drafted=req.speculative)
        if hit is None:
            self.metrics.prompt_cache_misses += 1
            return False
        self.metrics.prompt_cache_hits += 1
        lg, rows = hit
        if req.speculative:  # (its drafters see the prompt's rows before its first draft, as after a prefill)
            req.unseen.put(rows)
        req.n_prefilled = len(req.prompt_ids)
        self._first_token(req, lg)
        return True

    def _follow(self, req: Request) -> bool | None:
        """A request sharing its leader's prompt: True once it took the leader's rows and logits (its
        first token sampled, no forward), None while the leader is still prefilling (it waits), False
        when it must prefill itself (the leader ended without a prefill)."""
        lead = req.leader
        if lead is None or req.n_prefilled:
            return False
        if lead.done:  # (its rows are gone: this one prefills the prompt itself)
            req.leader = None
            return False
        if lead.prompt_logits is not None:
            self.ctx.cache.seq_cp(lead.seq, req.seq)
            req.n_prefilled = len(req.prompt_ids)
            req.prompt_infos = list(lead.prompt_infos)
            self._first_token(req, lead.prompt_logits)
            return True
        return None

    def _first_token(self, req: Request, lg: Any) -> None:
        """Sample and send ``req``'s first token from the logits ``lg`` of its last prompt token."""
        self.emitter.emit(req, [(self._choose(req, lg), lg)])

    @staticmethod
    def _choose(req: Request, lg: Any) -> int:
        """``req``'s sampler's token from one logits row, under its grammar (whose state then takes it)."""
        token = req.sampler.token(lg, req.history, req.constraint)
        if req.constraint is not None:
            req.constraint.advance(token)
        return token

    def _prefilled(self, req: Request, lg: Any) -> None:
        """``req``'s prompt is in the cache and ``lg`` are its last token's logits."""
        if req.followed:  # the followers admitted so far copy the rows now, before this one can end
            req.prompt_logits = np.array(lg, dtype=np.float32, copy=True)
            for f in list(self._active):
                if f.leader is req and f.prefilling and not f.done:
                    self._follow(f)
        if req.prompt_logprobs is None:
            if not req.speculative:
                self.prompt_cache.keep(req.prompt_ids, req.seq, lg)
            elif self.policy.mode == "auto":
                rows = req.unseen.common()
                if rows is not None and sum(len(c[0]) for c in rows) == len(req.prompt_ids):
                    # (every prompt row still deferred: what a later request's drafters are to be shown)
                    self.prompt_cache.keep(req.prompt_ids, req.seq, lg, drafter_rows=tuple(rows))
        self._first_token(req, lg)

    # ------------------------------------------------------------------ loop

    def _run(self, ready: threading.Event | None = None) -> None:
        try:
            from .. import quant

            if quant.compiled() is not None:  # numba's thread count is per thread: --threads, here too
                quant.set_threads(quant.threads())
            if self.prepare:
                self.model.prepare()
        finally:
            if ready is not None:
                ready.set()
        while True:
            with self._cond:
                while not self._stop and not self._active and not self._waiting and not self._calls:
                    self._cond.wait(1.0)
                if self._stop:
                    break
                self._admit()
                calls, self._calls = list(self._calls), collections.deque()
            for fn, fut in calls:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # (handed to the caller)
                        fut.set_exception(exc)
            self._reap()
            if self._active:
                try:
                    self._step()
                except Exception as exc:  # a failed forward ends the requests it carried
                    self.ctx.cache.rollback_pending()
                    for req in list(self._active):
                        self._finish(req, "error", error=f"{type(exc).__name__}: {exc}")
            if self.send_events is not None:
                self.send_events()
        for req in list(self._active) + list(self._waiting):
            self._finish(req, "cancelled", error="the server is shutting down")
        if self.send_events is not None:
            self.send_events()
        with self._cond:
            calls, self._calls = list(self._calls), collections.deque()
        for _, fut in calls:
            fut.cancel()

    def _admit(self) -> None:
        """Move waiting requests into free sequences (called with the lock held)."""
        while self._waiting and self._free:
            req = self._waiting.popleft()
            if req.cancelled:
                req.done = True
                self.metrics.requests_finished["cancelled"] += 1
                req.emit(Event(finish="cancelled"))
                continue
            req.seq = self._free.pop(0)
            req.history = list(req.prompt_ids)
            req.sampler = Sampler(req.sampling, n_prompt=len(req.prompt_ids))
            req.rng = np.random.default_rng(req.sampling.seed)
            req.text = TextStream(self.tokenizer, req.stop)
            req.stats = SpecStats(n_prompt=len(req.prompt_ids))
            # (a follower of a shared prompt never runs it, so its drafters could not read it)
            use_spec = req.speculative and bool(self.drafters) and req.leader is None
            req.speculative = use_spec
            if use_spec:
                req.verifier = make_step_verifier(self.spec.verifier, req.sampling.temperature, self.registry)
                req.draft_state = SeqDraftState()
                req.unseen = Unseen(len(self.drafters), self.defer_bytes)
                for d in self.drafters:
                    d.begin(req.seq, list(req.prompt_ids))
            self.metrics.tokens_in += len(req.prompt_ids)
            self._active.append(req)

    def _reap(self) -> None:
        for req in list(self._active):
            if req.cancelled:
                self._finish(req, "cancelled")

    def _step(self) -> None:
        model, cache = self.model, self.ctx.cache
        parts: list[Batch] = []
        plan: list[tuple[Request, str, int, Any]] = []  # (request, kind, first row, detail)
        row = 0
        t_step = time.perf_counter()
        self.policy.tick()
        budget = self._prefill_budget()
        for req in list(self._active):
            if req.prefilling and req.leader is not None:
                took = self._follow(req)
                if took is None or (took and req.done):
                    continue
            if req.prefilling and self._reuse_prompt(req) and req.done:  # (a hit decodes in this step)
                continue
            if req.prefilling:
                left = len(req.prompt_ids) - req.n_prefilled
                # a prompt that fits the budget waits for a step with room for all of it rather than
                # being split, as a lone run prefills it in one piece. (On the host kernels a split would
                # give the same bits, each row's result not depending on the rows beside it, up to
                # plinth.quant.KERNEL_MAX_ROWS prompt tokens; a recurrent layer's long scan and a device
                # backend are not row-invariant.) Prompts behind it wait too (first come, first
                # prefilled); the first prefilling request of a step always goes, in chunks if it is
                # longer than the budget
                if budget > 0 and left > budget and budget < self.prefill_chunk and left <= self.prefill_chunk:
                    budget = 0
                if budget <= 0:
                    continue
                n = min(budget, left)
                budget -= n
                start = req.n_prefilled
                last = start + n == len(req.prompt_ids)
                every = req.prompt_logprobs is not None  # (every prompt row's logits)
                b = Batch.from_tokens(req.prompt_ids[start:start + n], start=start, seq=req.seq,
                                      output="all" if every else "last" if last else "none")
                plan.append((req, "prefill", row, n))
            else:
                pos = cache.next_position(req.seq)
                n_max = min(self.spec.n_max, req.max_tokens - req.n_generated - 1, model.n_ctx - pos - 1)
                who, draft, decision = -1, Draft(), ""
                if req.speculative and n_max > 0:
                    decision = self.policy.decide(req.draft_state, min(n_max, self._draft_cap))
                    if decision != "skipped":
                        t0, shown = time.perf_counter(), self._deferred_s
                        n = self.policy.length(req.draft_state, min(n_max, self._draft_cap), decision)
                        who, draft = propose(self.drafters, self.requirements, self.spec, req.seq, req.history,
                                             pos, n, before=lambda i, req=req: self._show_deferred(req, i))
                        dt = time.perf_counter() - t0 - (self._deferred_s - shown)  # (not the kept rows' showing)
                        req.stats.draft_s += dt
                        if len(draft):
                            self.policy.observe_draft(dt)
                        else:
                            self.policy.undrafted(decision)
                b, snap = target_batch(self.ctx, req.seq, req.history[-1], draft, pos)
                plan.append((req, "decode", row, (pos, who, draft, snap, decision)))
            parts.append(b)
            row += b.n_rows
        if not parts:
            return
        batch = parts[0] if len(parts) == 1 else Batch.concat(parts)
        if self.send_events is not None:  # (a first token decided above is sent before the forward, not after it)
            self.send_events()
        t0 = time.perf_counter()
        out = self.ctx.forward(batch)
        logits = np.asarray(model.backend.to_numpy(out.logits)) if out.logits is not None else None
        forward_s = time.perf_counter() - t0
        self.metrics.forward_s += forward_s
        self.metrics.steps += 1
        decoding_only = all(kind == "decode" for _, kind, _, _ in plan)
        if decoding_only:
            self.policy.observe_forward(batch.n_rows, forward_s)
        where = {int(r): i for i, r in enumerate(np.asarray(out.rows))}
        n_out_before = self.metrics.tokens_out
        for req, kind, first, detail in plan:
            if req.done:
                continue
            if kind == "prefill":
                n = detail
                if req.speculative and self.policy.mode == "auto":
                    self._defer(req, batch, out, first, n)
                else:
                    self._show(req, "prefill", batch, out, first, n, where)
                if req.prompt_logprobs is not None:
                    self._prompt_infos(req, logits, where, first, n)
                req.n_prefilled += n
                if not req.prefilling:
                    self._prefilled(req, logits[where[first + n - 1]])
            else:
                self._verify(req, batch, out, logits, where, first, *detail)
        now = time.perf_counter()
        self.metrics.recent.append((now, self.metrics.tokens_out - n_out_before))
        if decoding_only:
            self.policy.observe_step(now - t_step, self.metrics.tokens_out - n_out_before)
        self._note_cache()

    def _prompt_infos(self, req: Request, logits: np.ndarray, where: dict[int, int], first: int, n: int) -> None:
        """The log-probabilities of ``req``'s prompt tokens a prefill chunk of ``n`` rows predicts (row
        ``i`` predicts the token after it; the prompt's first token has none)."""
        start = req.n_prefilled
        if start == 0:
            req.prompt_infos.append(TokenInfo(req.prompt_ids[0]))
        for i in range(n):
            p = start + i + 1
            if p < len(req.prompt_ids):
                req.prompt_infos.append(token_info(req.prompt_ids[p], logits[where[first + i]], req.prompt_logprobs))

    def _prefill_budget(self) -> int:
        """Prompt rows this step may take: ``prefill_chunk``, less where the decode and verify rows leave
        fewer under the kernels' row bound (``plinth.quant.KERNEL_MAX_ROWS``): past it a product goes
        through dequantized tiles, and a row's bits would depend on the step (docs/performance.md)."""
        from .. import quant

        cap = quant.KERNEL_MAX_ROWS
        if cap <= 0:
            return self.prefill_chunk
        decoding = sum(1 + (self.spec.n_max if self.drafters and r.speculative else 0)
                       for r in self._active if not r.prefilling)
        return min(self.prefill_chunk, cap - decoding)

    def _show(self, req: Request, kind: str, batch: Batch, out: Any, first: int, n: int,
              where: dict[int, int], only: int = -1) -> None:
        """Hand ``req``'s rows of this forward to every drafter (``process``), or to drafter ``only``, with their
        logits."""
        if not req.speculative:
            return
        rows = slice(first, first + n)
        mine = [where[r] for r in range(first, first + n) if r in where]
        logits = out.logits[mine] if mine and out.logits is not None else None
        for i, (drafter, r) in enumerate(zip(self.drafters, self.requirements)):
            if only >= 0 and i != only:
                continue
            feats = {t: out.features[t][rows] for t in r.taps if t in out.features}
            drafter.process(TargetOutput(seq=req.seq, phase=kind, tokens=batch.tokens[rows],
                                         positions=batch.positions[rows], features=feats,
                                         has_embeddings=False, logits=logits,
                                         kv=target_kv_views(self.ctx.cache, r, req.seq)))

    def _defer(self, req: Request, batch: Batch, out: Any, first: int, n: int = 1, skip: int = -1) -> None:
        """Keep ``n`` rows of ``req`` from this step (tokens, positions and the taps' features) for its drafters
        (all but ``skip``) instead of showing them now (``--spec-policy auto``): its prompt's rows, those of its
        plain steps, a drafted step's kept rows for the drafters that did not draft it. Each drafter sees them
        together before it next drafts for the request (one ``process`` call instead of one a step: a DSpark
        drafter's layers over one row cost a plain step a good part of its time, and a request that never
        drafts never pays for its prompt's either), or once they hold :attr:`defer_bytes`
        (:class:`plinth.speculative.step.Unseen`)."""
        for i in req.unseen.add(defer_chunk(batch, out, first, n, self._taps), skip):
            self._show_deferred(req, i)

    def _show_deferred(self, req: Request, i: int = -1) -> None:
        """Hand drafter ``i`` (-1: every drafter) the rows of ``req`` kept for it (:meth:`_defer`), as kept rows
        (phase "prefill")."""
        t0 = time.perf_counter()
        req.unseen.show(i, self.drafters, self.requirements, req.seq, self.ctx.cache)
        self._deferred_s += time.perf_counter() - t0

    def _verify(self, req: Request, batch: Batch, out: Any, logits: np.ndarray, where: dict[int, int],
                first: int, pos: int, who: int, draft: Draft, snap: Any, decision: str = "") -> None:
        """Decide ``req``'s next tokens from its rows: a plain sample, or (speculative) a verified draft.

        A speculative request goes through its verifier even without a draft, as the solo
        speculative loop does, so a seeded request draws the same random numbers in both; except in a
        step the drafting policy skipped, which is a plain step (its sampler's own draw, as a request
        without a drafter makes), the drafters only shown the row.
        """
        k = len(draft)
        if not req.speculative or decision == "skipped":
            lg0 = logits[where[first]]  # (a view: the step's logits are not written again)
            req.stats.n_steps += 1
            token = self._choose(req, lg0)
            if req.speculative:
                self._defer(req, batch, out, first)
            self.emitter.emit(req, [(token, lg0)])
            return
        lg = logits[[where[first + i] for i in range(k + 1)]]
        t0 = time.perf_counter()
        a, nxt = decide(req.verifier, req.sampler, draft, lg, req.history, req.rng, req.constraint)
        dt = time.perf_counter() - t0
        req.stats.verify_s += dt
        if k:
            self.policy.observe_verify(dt, k + 1)
            self.policy.record(req.draft_state, k, a)
            if decision == "probed":
                self.policy.probed(req.draft_state, min(k, self._draft_cap))
        if self.policy.mode == "auto":  # (the drafter that drafted sees its rows now, the others the kept rows
            if k:  # before they next draft)
                self._show(req, "verify", batch, out, first, k + 1, where, only=who)
            self._defer(req, batch, out, first, a + 1, skip=who if k else -1)
        else:
            self._show(req, "verify", batch, out, first, k + 1, where)
        t0 = time.perf_counter()
        if a < k:
            rollback(self.ctx, req.seq, pos, [req.history[-1], *draft.tokens[:a]], snap)
        for d in self.drafters:
            d.accept(req.seq, a)
        req.stats.rollback_s += time.perf_counter() - t0
        if k:
            req.stats.record(self.drafter_names[who], k, a)
            row = self.metrics.spec.setdefault(self.drafter_names[who], [0, 0, 0])
            row[0] += 1
            row[1] += k
            row[2] += a
        req.stats.n_steps += 1
        self.emitter.emit(req, [(t, lg[i]) for i, t in enumerate(draft.tokens[:a])] + [(nxt, lg[a])])

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End ``req``: free its sequence (cache rows, drafter state) and send the last event."""
        if req.done:
            return
        req.done = True
        # counted before the rows are freed: a client that sees the cache empty sees the count too
        self.metrics.requests_finished[reason] += 1
        if req in self._active:
            self._active.remove(req)
        if req.seq >= 0:
            self.ctx.cache.clear(req.seq)
            self._note_cache()
            if req.speculative:
                for d in self.drafters:
                    end = getattr(d, "end", None)
                    if end is not None:
                        end(req.seq)
            with self._cond:
                self._free.append(req.seq)
                self._free.sort()
        req.stats.stop_reason = req.stats.stop_reason or reason
        stats = req.stats.as_dict()
        if req.t_first is not None:
            stats["ttft_s"] = req.t_first - req.t_submit
            if req.t_last is not None and req.n_generated > 1:
                stats["decode_tps"] = (req.n_generated - 1) / max(req.t_last - req.t_first, 1e-9)
        req.emit(Event(finish=reason, error=error, stats=stats))

"""Drafters and checks for testing speculative decoding, and any drafter plugin.

* :class:`OracleDrafter` proposes the target's own greedy continuation
  (acceptance 1.0 under greedy verification): it exercises long accepts.
* :class:`RandomDrafter` proposes random tokens (acceptance near 0), optionally
  with a random distribution ``q`` it really samples from: it exercises
  rejections, corrections and rollback.
* :func:`check_drafter_contract` is the test a drafter plugin runs against a
  target: greedy output identical with and without the drafter, metrics
  consistent, and the target's cache after speculation identical to the cache
  of plain decoding.
* :func:`check_one_line_refusal`: a drafter that cannot run on a target says so
  in one line that names it (never a numpy error from deep inside a product).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..speculative.base import BaseDrafter, Draft, DrafterRequirements
from .strict import to_host


class OracleDrafter(BaseDrafter):
    """Drafts what the target will greedily produce (computed once per sequence by plain decoding)."""

    name = "oracle"

    def __init__(self, model: Any, horizon: int = 128, n_draft: int = 16, taps: Sequence[int] = ()) -> None:
        self.model = model
        self.horizon = horizon
        self.n_draft = n_draft
        self.taps = tuple(taps)
        self.continuation: dict[int, list[int]] = {}
        self.prompt_len: dict[int, int] = {}
        self.seen_phases: list[str] = []
        self.accepted: list[int] = []

    def requirements(self) -> DrafterRequirements:
        return DrafterRequirements(taps=self.taps, max_draft=self.n_draft)

    def begin(self, seq: int, prompt_ids: Sequence[int]) -> None:
        from ..generate import Generator

        self.continuation[seq] = Generator(self.model).generate(list(prompt_ids), self.horizon)
        self.prompt_len[seq] = len(prompt_ids)

    def process(self, target_output: Any) -> None:
        self.seen_phases.append(target_output.phase)
        for t in self.taps:
            if t not in target_output.features:
                raise AssertionError(f"tap {t} missing from the target output")

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        g = len(history) - self.prompt_len[seq]  # generated so far: the next is continuation[g]
        return Draft(tokens=tuple(self.continuation[seq][g: g + n_max]))

    def accept(self, seq: int, n_accepted: int) -> None:
        self.accepted.append(n_accepted)


class RandomDrafter(BaseDrafter):
    """Random drafts of ``length`` tokens; with ``with_probs`` each is sampled from a random q it returns."""

    name = "random"

    def __init__(self, n_vocab: int, length: int = 4, seed: int = 0, with_probs: bool = False,
                 concentration: float = 0.3) -> None:
        self.n_vocab = n_vocab
        self.length = length
        self.rng = np.random.default_rng(seed)
        self.with_probs = with_probs
        self.concentration = concentration

    def requirements(self) -> DrafterRequirements:
        return DrafterRequirements(max_draft=self.length)

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        n = min(n_max, self.length)
        if not self.with_probs:
            return Draft(tokens=tuple(int(t) for t in self.rng.integers(0, self.n_vocab, n)))
        q = self.rng.dirichlet(np.full(self.n_vocab, self.concentration), size=n)
        toks = tuple(int(self.rng.choice(self.n_vocab, p=row)) for row in q)
        return Draft(tokens=toks, probs=q)


class RecordedDrafter(BaseDrafter):
    """Wraps a drafter and records ``(drafted, accepted)`` per verify step in ``steps``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = f"recorded-{inner.name}"
        self.steps: list[tuple[int, int]] = []
        self._k = 0

    def requirements(self) -> DrafterRequirements:
        return self.inner.requirements()

    def begin(self, seq: int, prompt_ids: Sequence[int]) -> None:
        self.inner.begin(seq, prompt_ids)

    def process(self, target_output: Any) -> None:
        self.inner.process(target_output)

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Any:
        d = self.inner.draft(seq, n_max, history=history, pos=pos)
        self._k = len(d) if d is not None else 0
        return d

    def accept(self, seq: int, n_accepted: int) -> None:
        if self._k:
            self.steps.append((self._k, n_accepted))
        self.inner.accept(seq, n_accepted)


class FaultyOracleDrafter(OracleDrafter):
    """The target's own continuation with one token wrong, at a position that moves every step
    (position len(draft) = no error): every accept length occurs."""

    name = "faulty-oracle"

    def __init__(self, model: Any, **kw: Any) -> None:
        super().__init__(model, **kw)
        self.step = 0

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        toks = list(super().draft(seq, n_max, history=history, pos=pos).tokens)
        if toks:
            j = self.step % (len(toks) + 1)
            if j < len(toks):
                toks[j] = (toks[j] + 1) % self.model.n_vocab
        self.step += 1
        return Draft(tokens=tuple(toks))


def assert_caches_equal(a: Any, b: Any, seq: int = 0, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Two caches hold the same positions and, layer by layer and kind by kind, the same arrays for ``seq``.

    Every cache kind is compared (K/V, latents, indexer keys, compressed blocks and raw windows,
    recurrent states). Values agree when ``|x - y| <= atol + rtol * max|y|`` (per tensor): a
    verify batch and single-token decode round differently, more so in models with large
    activations.
    """
    pa, pb = a.positions(seq), b.positions(seq)
    if not np.array_equal(pa, pb):
        raise AssertionError(f"cached positions differ: {pa.tolist()} vs {pb.tolist()}")
    if a.next_position(seq) != b.next_position(seq):
        raise AssertionError(f"next positions differ: {a.next_position(seq)} vs {b.next_position(seq)}")
    for layer in range(a.n_layer):
        kinds_a = {k.kind: k for k in a.layers[layer] if k.holds(seq)}
        kinds_b = {k.kind: k for k in b.layers[layer] if k.holds(seq)}
        if sorted(kinds_a) != sorted(kinds_b):
            raise AssertionError(f"layer {layer}: one cache holds {sorted(kinds_a)}, the other {sorted(kinds_b)}")
        for name, ka in kinds_a.items():
            xs, ys = ka.contents(seq), kinds_b[name].contents(seq)
            if len(xs) != len(ys):
                raise AssertionError(f"layer {layer} {name}: {len(xs)} vs {len(ys)} arrays")
            for i, (x, y) in enumerate(zip(xs, ys)):
                if tuple(x.shape) != tuple(y.shape):
                    raise AssertionError(f"layer {layer} {name} part {i}: shapes {tuple(x.shape)} vs {tuple(y.shape)}")
                _close(f"layer {layer} {name} part {i}", x, y, atol, rtol)


def _close(what: str, x: Any, y: Any, atol: float, rtol: float) -> None:
    x, y = to_host(x), to_host(y)
    if not x.size:
        return
    d = float(np.abs(x - y).max())
    bound = atol + rtol * float(np.abs(y).max())
    if d > bound:
        raise AssertionError(f"{what} differs by {d:.3g} (> {bound:.3g})")


def check_drafter_contract(model: Any, make_drafter: Callable[[], Any], prompts: Sequence[Sequence[int]], *,
                           max_tokens: int = 24, n_max: int = 4, atol: float = 1e-5,
                           rtol: float = 1e-5, verifier: str = "greedy") -> list[Any]:
    """Run the drafter contract on ``model``; raise AssertionError on a violation; return the stats.

    For each prompt: greedy output with the drafter (verified by ``verifier``: "greedy", or
    "rejection", which at temperature 0 must reproduce greedy decoding too) equals greedy
    output without it;
    the metrics add up; the target's cache afterwards equals the cache of plain
    decoding of the same tokens (rolled-back rows leave no trace).
    """
    from ..generate import Generator
    from ..speculative.engine import SpecConfig, SpeculativeGenerator

    all_stats = []
    for prompt in prompts:
        prompt = list(prompt)
        plain = Generator(model).generate(prompt, max_tokens)
        gen = SpeculativeGenerator(model, [make_drafter()], config=SpecConfig(n_max=n_max, verifier=verifier))
        spec = gen.generate(prompt, max_tokens)
        if spec != plain:
            i = next((j for j, (x, y) in enumerate(zip(spec, plain)) if x != y), min(len(spec), len(plain)))
            raise AssertionError(f"greedy output differs with the drafter at token {i}: "
                                 f"{spec[i:i + 8]} vs plain {plain[i:i + 8]} (prompt {prompt[:8]}...)")
        st = gen.stats
        if not 0 <= st.n_accepted <= st.n_drafted:
            raise AssertionError(f"accepted {st.n_accepted} outside 0..drafted {st.n_drafted}")
        if sum(st.histogram.values()) != st.n_drafts or sum(st.accepted_per_pos) != st.n_accepted:
            raise AssertionError("histogram / per-position counts do not add up to the totals")
        if st.n_drafts and abs(st.tau - (1 + st.n_accepted / st.n_drafts)) > 1e-12:
            raise AssertionError("tau is not 1 + accepted / drafts")
        if st.n_generated != len(spec):
            raise AssertionError(f"n_generated {st.n_generated} != {len(spec)} tokens returned")
        # the cache after speculation equals plain decoding's: the prompt and every output token
        # but the last (which plain decoding never runs), or all of them after an end-of-generation stop
        ref = model.new_context(taps=gen.taps)
        ref.decode(prompt)
        ran = spec if st.stop_reason == "end of generation token" else spec[:-1]
        for t in ran:
            ref.decode([t])
        assert_caches_equal(gen.context.cache, ref.cache, atol=atol, rtol=rtol)
        all_stats.append(st)
    return all_stats


def check_one_line_refusal(make: Callable[[], Any], match: str, name: str) -> str:
    """``make()`` (building a drafter for a target, or its first ``process``) must raise a
    :class:`plinth.errors.UserError` of one line that names ``name`` (the draft file or drafter) and matches
    the regular expression ``match``. Returns the message."""
    import re

    from ..errors import UserError

    try:
        make()
    except UserError as e:
        msg = str(e)
    except Exception as e:  # noqa: BLE001 - the point: anything else is the failure
        raise AssertionError(f"expected a one-line UserError matching {match!r}, got {type(e).__name__}: {e}") from e
    else:
        raise AssertionError(f"expected a UserError matching {match!r}; nothing was raised")
    assert "\n" not in msg, f"the refusal spans lines: {msg!r}"
    assert name in msg, f"the refusal does not name {name!r}: {msg!r}"
    assert re.search(match, msg), f"the refusal {msg!r} does not match {match!r}"
    return msg


"""Verification rules: which drafted tokens the target keeps, and the token that follows.

Both rules see the drafted tokens ``d_1..d_k``, the drafter's distributions
``q`` ([k, n_vocab], or None for a deterministic drafter: one-hot q) and the
target's distributions ``p`` ([k + 1, n_vocab]: row i is the target's
distribution for the token after ``d_1..d_i``, already through the sampler's
filters), and return a :class:`VerifyResult`.

* ``greedy`` keeps the longest prefix with ``d_i == argmax p_i`` and then emits
  ``argmax p_a``: the output equals greedy decoding.
* ``rejection`` (Leviathan et al. 2023; Chen et al. 2023) accepts ``d_i`` with
  probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection it emits a
  token drawn from ``max(0, p_i - q_i)`` renormalised; when everything is
  accepted it draws the bonus token from ``p_k``. Every emitted token is then
  distributed exactly as plain sampling from ``p`` would draw it.

:func:`verify_draft` is the step a decode loop calls: it builds ``p`` from the target's logits rows
through the request's sampler (logit bias, penalties, filters) and, for a request with a grammar,
through its mask: row ``i`` is masked by the grammar's state after ``d_1..d_i``, so a drafted token
the grammar forbids has probability 0 and is rejected, and the output equals constrained plain
decoding. The greedy rule walks the rows in order (row ``i`` is needed only when ``d_1..d_i`` were
kept); other rules get every row up to the first forbidden draft, the grammar's state advanced over
the draft and rolled back to what was kept.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import numpy as np


@attrs.frozen
class VerifyResult:
    """``n_accepted`` drafted tokens kept, then ``next_token`` (the correction or the bonus)."""

    n_accepted: int
    next_token: int


class GreedyVerifier:
    """Accept the longest prefix equal to the target's argmax; lossless w.r.t. greedy decoding."""

    name = "greedy"

    def __init__(self, options: Any = None) -> None:
        self.options = dict(options or {})

    def verify(self, draft_tokens: Sequence[int], draft_probs: Any, target_probs: Any, rng: Any) -> VerifyResult:
        target = np.asarray(target_probs)
        best = target.argmax(axis=-1) if target.ndim == 2 else np.asarray(target, dtype=np.int64)
        return self.verify_argmax(draft_tokens, best)

    @staticmethod
    def verify_argmax(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> VerifyResult:
        """The same rule from the target's argmax ids ([k + 1]) directly."""
        a = 0
        for d, t in zip(draft_tokens, target_argmax):
            if int(d) != int(t):
                break
            a += 1
        return VerifyResult(a, int(target_argmax[a]))


class RejectionVerifier:
    """Speculative rejection sampling; lossless in distribution."""

    name = "rejection"

    def __init__(self, options: Any = None) -> None:
        self.options = dict(options or {})

    def verify(self, draft_tokens: Sequence[int], draft_probs: Any, target_probs: Any, rng: Any) -> VerifyResult:
        p = np.asarray(target_probs, dtype=np.float64)
        k = len(draft_tokens)
        if p.shape[0] != k + 1:
            raise ValueError(f"target_probs has {p.shape[0]} rows, expected {k + 1} (k drafts + 1)")
        q = None if draft_probs is None else np.asarray(draft_probs, dtype=np.float64)
        for i, d in enumerate(int(t) for t in draft_tokens):
            pd = p[i, d]
            qd = 1.0 if q is None else q[i, d]
            if pd > 0.0 and qd > 0.0 and rng.random() * qd <= pd:  # u <= p/q without dividing
                continue
            if q is None:  # one-hot q: the residual is p with d removed
                residual = p[i].copy()
                residual[d] = 0.0
            else:
                residual = np.maximum(p[i] - q[i], 0.0)
            total = residual.sum()
            if total <= 0.0:  # p == q up to rounding: the residual is empty, p itself is exact
                residual, total = p[i], p[i].sum()
            return VerifyResult(i, _draw(residual / total, rng))
        return VerifyResult(k, _draw(p[k] / p[k].sum(), rng))


def _draw(p: np.ndarray, rng: Any) -> int:
    cum = np.cumsum(p)
    u = rng.random() * cum[-1]
    return int(min(np.searchsorted(cum, u, side="right"), p.shape[0] - 1))


def verify_draft(verifier: Any, sampler: Any, draft_tokens: Sequence[int], draft_probs: Any, logits: Any,
                 history: Sequence[int], rng: Any, constraint: Any = None) -> VerifyResult:
    """Verify one sequence's draft from the target's logits rows ``[k + 1, n_vocab]``.

    ``sampler``: the request's :class:`plinth.sampling.Sampler`; ``history``: its tokens before the
    draft (prompt and output); ``constraint``: its :class:`plinth.grammar.ConstraintState` or None.
    With a constraint, the state is left advanced over the kept drafts and the next token.
    """
    draft = [int(t) for t in draft_tokens]
    k = len(draft)
    lg = np.asarray(logits)
    hist = list(history)
    if constraint is None:
        if isinstance(verifier, GreedyVerifier) and sampler.config.greedy and sampler.config.plain_logits:
            return GreedyVerifier.verify_argmax(draft, lg.argmax(axis=-1))
        probs = np.stack([sampler.probs(lg[i], hist + draft[:i]) for i in range(k + 1)])
        return verifier.verify(draft, draft_probs, probs, rng)
    if isinstance(verifier, GreedyVerifier) and sampler.config.greedy:
        for i in range(k + 1):
            t = sampler.token(lg[i], hist + draft[:i], constraint)
            constraint.advance(t)
            if i == k or t != draft[i]:
                return VerifyResult(i, t)
    rows = []
    m = 0  # drafted tokens consumed by the grammar
    for i in range(k + 1):
        rows.append(sampler.probs(lg[i], hist + draft[:i], constraint))
        if i == k or not constraint.allows(draft[i]):
            break
        constraint.advance(draft[i])
        m += 1
    while len(rows) < k + 1:  # past a forbidden draft: never read (that draft is rejected for sure)
        rows.append(rows[-1])
    res = verifier.verify(draft, draft_probs, np.stack(rows), rng)
    a = int(res.n_accepted)
    if a > m:
        raise RuntimeError(f"verifier {getattr(verifier, 'name', verifier)!r} accepted a drafted token the "
                           "grammar forbids")
    constraint.rollback(m - a)
    constraint.advance(int(res.next_token))
    return res


BUILTIN_VERIFIERS = {"greedy": GreedyVerifier, "rejection": RejectionVerifier}


def make_verifier(name: str, registry: Any = None) -> Any:
    """A verifier by name: the built-ins directly, anything else through the plugin registry."""
    if name in BUILTIN_VERIFIERS and registry is None:
        return BUILTIN_VERIFIERS[name]()
    if registry is None:
        from ..plugins import default_registry

        registry = default_registry()
    return registry.make_verifier(name)

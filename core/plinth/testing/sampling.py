"""Checks that speculative sampling keeps the target's distribution.

The second generated token of a prompt is the first one a draft can change; its exact marginal
under plain sampling is :func:`second_token_marginal`, and draws with a drafter are compared with
it by :func:`assert_counts_fit` (chi-square, Wilson-Hilferty threshold)::

    marginal = second_token_marginal(model, sampler, prompt)
    counts = np.zeros(model.n_vocab)
    for _ in range(400):
        counts[gen.generate(prompt, 3)[1]] += 1
    assert_counts_fit(counts, marginal)
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np


def second_token_marginal(model: Any, sampler: Any, prompt: Sequence[int]) -> np.ndarray:
    """p(second token) = sum over first tokens t1 of p(t1) p(t2 | t1), with ``sampler.probs`` (temperature,
    top-k ... applied) on ``model``'s logits."""
    prompt = list(prompt)
    p1 = sampler.probs(model.new_context().decode(prompt).logits[-1], prompt)
    marginal = np.zeros(model.n_vocab)
    for t1 in np.nonzero(p1)[0]:
        c = model.new_context()
        c.decode(prompt)
        marginal += p1[t1] * sampler.probs(c.decode([int(t1)]).logits[-1], prompt + [int(t1)])
    return marginal


def assert_counts_fit(counts: np.ndarray, probs: np.ndarray, *, min_expected: float = 5.0, z: float = 3.29) -> None:
    """``counts`` are draws from ``probs``: chi-square over the outcomes expected ``min_expected`` times or more
    (the rest pooled into one cell), below the Wilson-Hilferty threshold at ``z`` standard deviations
    (3.29: p ~ 0.0005)."""
    n = counts.sum()
    keep = probs * n >= min_expected
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep] * n, probs[~keep].sum() * n)
    ok = exp > 0
    stat, df = float(((obs[ok] - exp[ok]) ** 2 / exp[ok]).sum()), int(ok.sum() - 1)
    a = 2.0 / (9.0 * df)
    assert stat < df * (1.0 - a + z * math.sqrt(a)) ** 3, stat

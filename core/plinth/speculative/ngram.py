"""``ngram``: prompt-lookup drafting, no draft model.

At each step the last ``n`` tokens of the history (prompt + generated, ``n``
from ``n_match_max`` (3) down to ``n_match_min`` (2: a one-token match is weak
evidence, and a rejected draft costs a verify batch)) are looked up among earlier
positions; the tokens that followed the most recent earlier occurrence are the
draft. Text that repeats or edits its input (code edits, "fix this text",
summaries quoting the source) drafts well; free prose rarely matches, and then
the step is a plain decode. The drafter is deterministic, so its ``q`` is
one-hot (the rejection rule accepts ``d`` with probability ``p(d)``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .base import BaseDrafter, Draft, DrafterRequirements


class NgramDrafter(BaseDrafter):
    name = "ngram"

    def __init__(self, n_match_max: int = 3, n_match_min: int = 2, n_draft: int = 16,
                 search: str = "last") -> None:
        if not 1 <= n_match_min <= n_match_max:
            raise ValueError(f"need 1 <= n_match_min <= n_match_max, got {n_match_min}, {n_match_max}")
        if search not in ("last", "first"):
            raise ValueError(f"search must be 'last' (most recent match) or 'first', not {search!r}")
        self.n_match_max = int(n_match_max)
        self.n_match_min = int(n_match_min)
        self.n_draft = int(n_draft)
        self.search = search

    def requirements(self) -> DrafterRequirements:
        return DrafterRequirements(max_draft=self.n_draft)

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        return Draft(tokens=tuple(lookup(history, n_max, self.n_match_max, self.n_match_min, self.search)))


def lookup(history: Sequence[int], n_max: int, n_match_max: int = 3, n_match_min: int = 1,
           search: str = "last") -> list[int]:
    """Tokens that followed an earlier occurrence of the history's last n tokens (longest n first)."""
    h = np.asarray(history, dtype=np.int64)
    L = h.shape[0]
    for n in range(min(n_match_max, L - 1), n_match_min - 1, -1):
        key = h[L - n:]
        # candidate starts i with h[i:i+n] == key and i + n < L (something follows the match)
        starts = np.nonzero(h[: L - n] == key[0])[0]
        if n > 1 and starts.size:
            ok = np.ones(starts.size, dtype=bool)
            for j in range(1, n):
                ok &= h[starts + j] == key[j]
            starts = starts[ok]
        if not starts.size:
            continue
        i = int(starts[-1] if search == "last" else starts[0])
        follow = h[i + n: i + n + n_max]
        if follow.size:
            return follow.tolist()
    return []


def make_ngram(target: Any, options: Mapping[str, Any]) -> NgramDrafter:
    return NgramDrafter(n_match_max=int(options.get("ngram_max", 3)), n_match_min=int(options.get("ngram_min", 2)),
                        n_draft=int(options.get("n_max", 16)), search=str(options.get("ngram_search", "last")))

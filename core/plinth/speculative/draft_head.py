"""A greedy drafter around a draft head shipped inside the target's file (MTP blocks and the like).

The head is the object ``target.target_view().draft_head(name)`` returns. It provides ``taps``
(the first is the target feature tap it reads), ``xp``, ``new_cache()``, ``to_numpy(a)`` and
``run(batch, hidden, cache, ...)`` returning ``logits`` and ``hidden`` rows; a head whose input is
not the tapped row itself also has ``target_rows(tapped)``.

How :class:`HeadDrafter` drafts after the last committed token ``t`` that will sit at ``pos``:

1. catch up: every committed position p < pos the head has not seen yet becomes one head row
   (the token at p+1 and the target's tapped row h_p); these rows stay in the head's cache for
   good, since they depend on committed tokens and target rows only;
2. the last caught-up row (h_{pos-1}, t) gives d_1 = argmax of its logits;
3. chain: the head's own output row stands in for the target row, so (out_j, d_j) at position
   pos + j - 1 gives d_{j+1}; these speculative rows are dropped afterwards (snapshot / restore
   of the head's cache).

Greedy and deterministic; verification makes it lossless. A plugin subclasses it to name the
drafter, word the error for a target without the head, and pass the head extra arguments.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..batch import Batch
from ..errors import UserError
from .base import BaseDrafter, Draft, DrafterRequirements, TargetOutput


class HeadDrafter(BaseDrafter):
    """Drafts with the target's draft head ``head_name`` (see the module docstring)."""

    name = "mtp"
    #: the draft head of the target's view this drafter drives
    head_name = "mtp"

    def __init__(self, target: Any, n_draft: int) -> None:
        view = target.target_view()
        if self.head_name not in view.draft_heads:
            raise UserError(self.missing_head(target, view))
        self.head = view.draft_head(self.head_name)
        self.n_draft = n_draft
        self.tap = self.head.taps[0]
        self._rows: dict[int, dict[int, Any]] = {}  # seq -> position -> tapped target row
        self._cache: dict[int, Any] = {}
        self._done: dict[int, int] = {}  # seq -> positions folded into the head's cache (0..done-1)

    def missing_head(self, target: Any, view: Any) -> str:
        """The error for a target whose file has no such head."""
        return (f"drafter '{self.name}': {target.path} ({target.arch}) ships no draft head '{self.head_name}' "
                f"(draft heads: {view.draft_heads or 'none'}); use another drafter")

    def requirements(self) -> DrafterRequirements:
        return DrafterRequirements(taps=(self.tap,), shares_embedding=True, shares_head=True, max_draft=self.n_draft)

    def begin(self, seq: int, prompt_ids: Sequence[int]) -> None:
        self._rows[seq] = {}
        self._cache[seq] = self.head.new_cache()
        self._done[seq] = 0

    def process(self, target_output: TargetOutput) -> None:
        feats = target_output.features.get(self.tap)
        if feats is None:
            raise UserError(f"drafter '{self.name}': the target output has no tap {self.tap}")
        rows = self._rows.setdefault(target_output.seq, {})
        for i, p in enumerate(target_output.positions.tolist()):
            rows[int(p)] = feats[i]  # a re-run position (after a rejection) overwrites its row

    def run(self, seq: int, tokens: Sequence[int], hidden: Any, start: int) -> Any:
        """The head on ``tokens`` at ``start..`` with input rows ``hidden``, in ``seq``'s cache."""
        batch = Batch.from_tokens(list(tokens), start=start, seq=seq, output="all")
        return self.head.run(batch, hidden, self._cache[seq])

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        n = min(n_max, self.n_draft)
        if n <= 0 or pos == 0:
            return Draft()
        xp = self.head.xp
        done, rows = self._done[seq], self._rows[seq]
        ps = list(range(done, pos))
        if not ps or any(p not in rows for p in ps):
            return Draft()  # the target has not shown these rows
        hidden = xp.stack([rows.pop(p) for p in ps])
        to_input = getattr(self.head, "target_rows", None)
        out = self.run(seq, [history[p + 1] for p in ps], to_input(hidden) if to_input else hidden, ps[0])
        cache = self._cache[seq]
        committed = cache.snapshot(seq)
        self._done[seq] = pos
        tokens: list[int] = []
        logits, hidden = out.logits[-1], out.hidden[-1:]
        try:
            for j in range(n):
                tokens.append(int(np.argmax(np.asarray(self.head.to_numpy(logits)))))
                if j == n - 1:
                    break
                step = self.run(seq, [tokens[-1]], hidden, pos + j)
                logits, hidden = step.logits[-1], step.hidden
        finally:
            cache.restore(committed)
        return Draft(tokens=tuple(tokens))

    def end(self, seq: int) -> None:
        for table in (self._rows, self._cache, self._done):
            table.pop(seq, None)

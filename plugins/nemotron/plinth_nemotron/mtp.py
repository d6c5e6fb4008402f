"""The ``mtp`` drafter for Nemotron-H targets whose file carries the MTP head (blk.{n_layer}, blk.{n_layer+1}).

The head predicts the token after next from a target row and the next token. Drafting after the
last committed token ``t`` that will sit at position ``pos``:

1. catch up: every committed position p < pos the head has not seen yet becomes one head row
   (token at p+1, target row h_p); these rows stay in the head's cache for good, because
   they depend on committed tokens and target rows only;
2. the last caught-up row (h_{pos-1}, t) gives d_1 = argmax of its logits;
3. chain: the head's own output row stands in for the target row, so (out_{j}, d_j) at
   position pos + j - 1 gives d_{j+1}; these speculative rows are dropped afterwards
   (snapshot / restore of the head's cache).

Everything comes from the target through the declared interface: the feature tap (the residual
before the final norm, normed by the head's ``target_rows``) and the draft head "mtp" of
``target.target_view()``. Greedy and deterministic; verification makes it lossless.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from plinth.context import Batch
from plinth.errors import UserError
from plinth.speculative.base import BaseDrafter, Draft, DrafterRequirements, TargetOutput


class NemotronMtpDrafter(BaseDrafter):
    name = "mtp"

    def __init__(self, target: Any, n_draft: int = 3) -> None:
        view = target.target_view()
        if "mtp" not in view.draft_heads:
            raise UserError(f"drafter 'mtp': {target.path} ({target.arch}) has no MTP head (nextn_predict_layers "
                            "= 0; convert with the mtp option on a checkpoint that has mtp.* tensors) or use "
                            "another drafter")
        if n_draft < 1:
            raise UserError(f"drafter 'mtp': n_max must be >= 1, got {n_draft}")
        self.head = view.draft_head("mtp")
        self.n_draft = n_draft
        self.tap = self.head.taps[0]
        self._rows: dict[int, dict[int, Any]] = {}  # seq -> position -> tapped target row [n_embd]
        self._cache: dict[int, Any] = {}
        self._done: dict[int, int] = {}  # seq -> positions folded into the head's cache (0..done-1)

    def requirements(self) -> DrafterRequirements:
        return DrafterRequirements(taps=(self.tap,), shares_embedding=True, shares_head=True, max_draft=self.n_draft)

    def begin(self, seq: int, prompt_ids: Sequence[int]) -> None:
        self._rows[seq] = {}
        self._cache[seq] = self.head.new_cache()
        self._done[seq] = 0

    def process(self, target_output: TargetOutput) -> None:
        feats = target_output.features.get(self.tap)
        if feats is None:
            raise UserError(f"drafter 'mtp': the target output has no tap {self.tap}")
        rows = self._rows.setdefault(target_output.seq, {})
        for i, p in enumerate(target_output.positions.tolist()):
            rows[int(p)] = feats[i]  # a re-run position (after a rejection) overwrites its row

    def _run(self, seq: int, tokens: Sequence[int], hidden: Any, start: int) -> Any:
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
        hidden = self.head.target_rows(xp.stack([rows.pop(p) for p in ps]))
        out = self._run(seq, [history[p + 1] for p in ps], hidden, ps[0])
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
                step = self._run(seq, [tokens[-1]], hidden, pos + j)
                logits, hidden = step.logits[-1], step.hidden
        finally:
            cache.restore(committed)
        return Draft(tokens=tuple(tokens))

    def end(self, seq: int) -> None:
        for table in (self._rows, self._cache, self._done):
            table.pop(seq, None)


def make_mtp_drafter(target: Any, options: Mapping[str, Any]) -> NemotronMtpDrafter:
    return NemotronMtpDrafter(target, n_draft=int(options.get("n_max", 3)))


__all__ = ["NemotronMtpDrafter", "make_mtp_drafter"]

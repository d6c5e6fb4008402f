"""The ``mtp`` drafter: DeepSeek V4's next-token-prediction block, shipped inside the target file.

How it drafts after the last committed token ``t_pos`` (at position ``pos``, not run by the target yet):

1. catch up: for every position p < pos not folded in yet, the MTP block reads the target's
   streams h_p (tap n_layer, seen in ``process``) and the token t_{p+1}; these rows go into the
   drafter's own cache for good (they depend only on committed tokens and target rows);
2. the last caught-up row (h_{pos-1}, t_pos) predicts d_1 = argmax;
3. chain: the block's own output streams stand in for the target's h (as the DeepSeek V3/V4
   MTP runs chained), so row (X_{pos-1}, d_j) at position pos + j - 1 predicts d_{j+1};
   these speculative rows are dropped again (snapshot / restore of the drafter's cache).

The drafter gets what it needs from the target through the declared interface only: the
feature tap (``requirements().taps``) and the draft head "mtp" of ``target.target_view()``
(:class:`plinth_deepseek41.deepseek4.MtpHead`), which runs the file's MTP block with the
target's shared embedding and head. It is deterministic (greedy);
losslessness comes from verification, as for every drafter.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from plinth.context import Batch
from plinth.errors import UserError
from plinth.speculative.base import BaseDrafter, Draft, DrafterRequirements, TargetOutput


class MtpDrafter(BaseDrafter):
    name = "mtp"

    def __init__(self, target: Any, n_draft: int = 4, depth: int = 0) -> None:
        view = target.target_view()
        if "mtp" not in view.draft_heads:
            raise UserError(f"drafter 'mtp': {target.path} ({target.arch}) ships no MTP block (draft heads: "
                            f"{view.draft_heads or 'none'}); use another drafter")
        self.head = view.draft_head("mtp")
        if self.head.n_blocks <= depth:
            raise UserError(f"drafter 'mtp': MTP block {depth} asked for, the file has {self.head.n_blocks}")
        self.n_draft = n_draft
        self.depth = depth
        self.n_layer = self.head.taps[0]
        self._hidden: dict[int, dict[int, Any]] = {}  # seq -> position -> target streams [hc·E]
        self._cache: dict[int, KVCache] = {}
        self._done: dict[int, int] = {}  # seq -> positions folded into the MTP cache (0..done-1)

    def requirements(self) -> DrafterRequirements:
        return DrafterRequirements(taps=(self.n_layer,), shares_embedding=True, shares_head=True,
                                   max_draft=self.n_draft)

    def begin(self, seq: int, prompt_ids: Sequence[int]) -> None:
        self._hidden[seq] = {}
        self._cache[seq] = self.head.new_cache()
        self._done[seq] = 0

    def process(self, target_output: TargetOutput) -> None:
        feats = target_output.features.get(self.n_layer)
        if feats is None:
            raise UserError(f"drafter 'mtp': the target output has no tap {self.n_layer}")
        rows = self._hidden.setdefault(target_output.seq, {})
        for i, p in enumerate(target_output.positions.tolist()):
            rows[int(p)] = feats[i]

    def _forward(self, seq: int, tokens: Sequence[int], hidden: Any, start: int) -> Any:
        batch = Batch.from_tokens(list(tokens), start=start, seq=seq, output="all")
        return self.head.run(batch, hidden, self._cache[seq], self.depth)

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        n = min(n_max, self.n_draft)
        if n <= 0 or pos == 0:
            return Draft()
        xp = self.head.xp
        done, rows = self._done[seq], self._hidden[seq]
        # 1. fold in positions done..pos-1: (h_p, t_{p+1}); history[p] is the token at position p
        ps = list(range(done, pos))
        if not ps or any(p not in rows for p in ps):
            return Draft()  # the target has not shown these rows
        cache = self._cache[seq]
        out = self._forward(seq, [history[p + 1] for p in ps], xp.stack([rows.pop(p) for p in ps]), ps[0])
        committed = cache.snapshot(seq)
        self._done[seq] = pos
        # 2-3. draft greedily, chaining the block's own streams; then drop the speculative rows
        tokens: list[int] = []
        logits, hidden = out.logits[-1], out.hidden[-1:]
        try:
            for j in range(n):
                tok = int(np.argmax(np.asarray(self.head.to_numpy(logits))))
                tokens.append(tok)
                if j == n - 1:
                    break
                step = self._forward(seq, [tok], hidden, pos + j)
                logits, hidden = step.logits[-1], step.hidden
        finally:
            cache.restore(committed)
        return Draft(tokens=tuple(tokens))

    def end(self, seq: int) -> None:
        for table in (self._hidden, self._cache, self._done):
            table.pop(seq, None)


def make_mtp_drafter(target: Any, options: Mapping[str, Any]) -> MtpDrafter:
    return MtpDrafter(target, n_draft=int(options.get("n_max", 4)), depth=int(options.get("mtp_depth", 0)))


__all__ = ["MtpDrafter", "make_mtp_drafter"]

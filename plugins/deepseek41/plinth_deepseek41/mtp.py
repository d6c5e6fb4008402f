"""The ``mtp`` drafter: DeepSeek V4's next-token-prediction block, shipped inside the target file.

How it drafts (catch up on committed rows, then chain its own output rows) is
:class:`plinth.speculative.draft_head.HeadDrafter`'s: the MTP block reads the target's streams
h_p (tap n_layer) and the token t_{p+1}, and when chaining its own output streams stand in for
the target's h (as the DeepSeek V3/V4 MTP runs chained). The draft head "mtp" of
``target.target_view()`` (:class:`plinth_deepseek41.deepseek4.MtpHead`) runs the file's MTP block
``depth`` with the target's shared embedding and head. Deterministic (greedy); losslessness
comes from verification, as for every drafter.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from plinth.context import Batch
from plinth.errors import UserError
from plinth.speculative.draft_head import HeadDrafter


class MtpDrafter(HeadDrafter):
    name = "mtp"

    def __init__(self, target: Any, n_draft: int = 4, depth: int = 0) -> None:
        super().__init__(target, n_draft)
        if self.head.n_blocks <= depth:
            raise UserError(f"drafter 'mtp': MTP block {depth} asked for, the file has {self.head.n_blocks}")
        self.depth = depth

    def missing_head(self, target: Any, view: Any) -> str:
        return (f"drafter 'mtp': {target.path} ({target.arch}) ships no MTP block (draft heads: "
                f"{view.draft_heads or 'none'}); use another drafter")

    def run(self, seq: int, tokens: Sequence[int], hidden: Any, start: int) -> Any:
        batch = Batch.from_tokens(list(tokens), start=start, seq=seq, output="all")
        return self.head.run(batch, hidden, self._cache[seq], self.depth)


def make_mtp_drafter(target: Any, options: Mapping[str, Any]) -> MtpDrafter:
    return MtpDrafter(target, n_draft=int(options.get("n_max", 4)), depth=int(options.get("mtp_depth", 0)))


__all__ = ["MtpDrafter", "make_mtp_drafter"]

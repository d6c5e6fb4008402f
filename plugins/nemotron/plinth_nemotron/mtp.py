"""The ``mtp`` drafter for Nemotron-H targets whose file carries the MTP head (blk.{n_layer}, blk.{n_layer+1}).

The head predicts the token after next from a target row and the next token; how it drafts
(catch up on committed rows, then chain its own output rows) is
:class:`plinth.speculative.draft_head.HeadDrafter`'s. Everything comes from the target through
the declared interface: the feature tap (the residual before the final norm, normed by the
head's ``target_rows``) and the draft head "mtp" of ``target.target_view()``. Greedy and
deterministic; verification makes it lossless.
"""

from __future__ import annotations

from typing import Any, Mapping

from plinth.errors import UserError
from plinth.speculative.draft_head import HeadDrafter


class NemotronMtpDrafter(HeadDrafter):
    name = "mtp"

    def __init__(self, target: Any, n_draft: int = 3) -> None:
        super().__init__(target, n_draft)  # refuses a target without the head first
        if n_draft < 1:
            raise UserError(f"drafter 'mtp': n_max must be >= 1, got {n_draft}")

    def missing_head(self, target: Any, view: Any) -> str:
        return (f"drafter 'mtp': {target.path} ({target.arch}) has no MTP head (nextn_predict_layers = 0; convert "
                "with the mtp option on a checkpoint that has mtp.* tensors) or use another drafter")


def make_mtp_drafter(target: Any, options: Mapping[str, Any]) -> NemotronMtpDrafter:
    return NemotronMtpDrafter(target, n_draft=int(options.get("n_max", 3)))


__all__ = ["NemotronMtpDrafter", "make_mtp_drafter"]

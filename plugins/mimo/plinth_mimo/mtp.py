"""The ``mtp`` drafter of plinth-mimo: the core's HeadDrafter over the file's first MTP block (draft head
"mtp" of :class:`plinth_mimo.mimo2.MiMo2Graph`), chained on its own output for ``n_max`` tokens."""

from __future__ import annotations

from typing import Any, Mapping

from plinth.errors import UserError
from plinth.speculative.draft_head import HeadDrafter


class MiMoMtpDrafter(HeadDrafter):
    name = "mtp"

    def __init__(self, target: Any, n_draft: int = 3) -> None:
        super().__init__(target, n_draft)  # refuses a target without the head first
        if n_draft < 1:
            raise UserError(f"drafter 'mtp': n_max must be >= 1, got {n_draft}")

    def missing_head(self, target: Any, view: Any) -> str:
        return (f"drafter 'mtp': {target.path} ({target.arch}) carries no MTP block (its nextn_predict_layers "
                "slots hold no tensors: convert the checkpoint with its model.mtp.* tensors) or use another drafter")


def make_mtp_drafter(target: Any, options: Mapping[str, Any]) -> MiMoMtpDrafter:
    return MiMoMtpDrafter(target, n_draft=int(options.get("n_max", 3)))


__all__ = ["MiMoMtpDrafter", "make_mtp_drafter"]

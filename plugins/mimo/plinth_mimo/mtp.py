"""The ``mtp`` drafter of plinth-mimo: the core's HeadDrafter over the file's first MTP block (draft head
"mtp" of :class:`plinth_mimo.mimo2.MiMo2Graph`), chained on its own output for ``n_max`` tokens."""

from __future__ import annotations

from typing import Any, Mapping

from plinth.errors import UserError
from plinth.speculative.draft_head import HeadDrafter


class MiMoMtpDrafter(HeadDrafter):
    name = "mtp"

    def missing_head(self, target: Any, view: Any) -> str:
        return (f"drafter 'mtp': {target.path} ({target.arch}) carries no MTP block (convert the checkpoint with "
                "its model.mtp.* tensors, without --no-mtp) or use another drafter")


def make_mtp_drafter(target: Any, options: Mapping[str, Any]) -> MiMoMtpDrafter:
    n = int(options.get("n_max", 3))
    if n < 1:
        raise UserError(f"drafter 'mtp': n_max must be >= 1, got {n}")
    return MiMoMtpDrafter(target, n)


__all__ = ["MiMoMtpDrafter", "make_mtp_drafter"]

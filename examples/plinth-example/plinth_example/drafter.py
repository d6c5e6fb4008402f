"""toy-repeat: a drafter that proposes the last committed token again (good for runs like "aaaa")."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from plinth.speculative.base import BaseDrafter, Draft, DrafterRequirements


class RepeatDrafter(BaseDrafter):
    name = "toy-repeat"

    def __init__(self, target: Any, options: Mapping[str, Any]) -> None:
        self.n_draft = int(options.get("n_max", 4))

    def requirements(self) -> DrafterRequirements:
        return DrafterRequirements(max_draft=self.n_draft)  # no taps, nothing shared with the target

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        return Draft(tokens=(int(history[-1]),) * min(n_max, self.n_draft) if len(history) else ())

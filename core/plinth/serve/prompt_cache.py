"""The prompt cache: whole prompts' cache rows kept for reuse, least recently used out first.

When a request's prefill ends, its cache rows (every cache kind of every layer, recurrent states
included) are copied to a parked sequence with the logits of its last prompt token; a later request
with the same prompt tokens copies them back and samples its first token from those logits, with no
forward. Only whole prompts are reused: the rest of a prompt prefilled after a shared part would not
go through the arithmetic a lone run gives it (another batch shape, and the int8 kernels turn
last-bit differences into other tokens at near-ties), so a hit gives exactly the tokens a fresh
prefill gives.

A prompt prefilled by a speculative request under ``--spec-policy auto`` is kept with the rows its
drafters were to be shown (tokens, positions, the target's tap features), so that a later speculative
request with the same prompt gives them to its own drafters instead of prefilling; a speculative request
reuses only such a prompt.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

import numpy as np


class PromptCache:
    """Up to ``size`` prompts and ``max_tokens`` prompt tokens over all of them, parked in ``cache`` under
    the sequence ids ``first_seq .. first_seq + size - 1``."""

    def __init__(self, cache: Any, first_seq: int, size: int, max_tokens: int) -> None:
        self.cache = cache
        self.size = max(0, int(size))
        self.max_tokens = max(0, int(max_tokens))
        # prompt tokens -> [parked sequence id, logits of the last prompt token, the drafters' rows or None],
        # least recent first
        self._prompts: collections.OrderedDict[tuple[int, ...], list[Any]] = collections.OrderedDict()
        self._free = list(range(first_seq, first_seq + self.size))
        self.n_tokens = 0

    def __len__(self) -> int:
        return len(self._prompts)

    def restore(self, prompt: Sequence[int], seq: int, drafted: bool = False) -> tuple[Any, Any] | None:
        """Copy a kept prompt's rows into ``seq`` and return (its last logits, its drafters' rows or None);
        None when not kept (with ``drafted``: not kept with the drafters' rows)."""
        key = tuple(prompt)
        hit = self._prompts.get(key)
        if hit is None or (drafted and hit[2] is None):
            return None
        self._prompts.move_to_end(key)
        parked, logits, rows = hit
        self.cache.seq_cp(parked, seq)
        return logits, rows

    def keep(self, prompt: Sequence[int], seq: int, logits: Any, drafter_rows: Any = None) -> None:
        """Park a copy of ``seq``'s rows (its prompt just prefilled) and the prompt's last ``logits`` (and the
        rows its drafters are to be shown, from a speculative request)."""
        n = len(prompt)
        if not self.size or n > self.max_tokens:
            return
        key = tuple(prompt)
        if key in self._prompts:
            self._prompts.move_to_end(key)
            if drafter_rows is not None and self._prompts[key][2] is None:
                self._prompts[key][2] = drafter_rows
            return
        while self._prompts and (not self._free or self.n_tokens + n > self.max_tokens):
            old, (parked, _, _) = self._prompts.popitem(last=False)
            self.cache.clear(parked)
            self._free.append(parked)
            self.n_tokens -= len(old)
        parked = self._free.pop()
        self.cache.seq_cp(seq, parked)
        self._prompts[key] = [parked, np.array(logits, dtype=np.float32, copy=True), drafter_rows]
        self.n_tokens += n

"""``draft``: a smaller GGUF model with the target's vocabulary drafts autoregressively.

The draft model runs on the same engine in its own context. Before each draft
its cache is brought in line with the committed history (rows past the common
prefix are dropped, missing tokens decoded), then it decodes ``n_max`` tokens:
greedily when the target decodes greedily (``q`` one-hot, the top probability
as confidence for ``p_min``), else sampled from its own distribution at the
target's sampler settings, with that distribution returned as ``q`` for the
rejection rule.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import UserError
from ..sampling import Sampler, SamplerConfig
from .base import BaseDrafter, Draft, DrafterRequirements, VocabInfo


class DraftModelDrafter(BaseDrafter):
    name = "draft"

    def __init__(self, draft_model: Any, sampler: SamplerConfig | None = None, n_draft: int = 16) -> None:
        self.model = draft_model
        self.sampler = Sampler(sampler or SamplerConfig(temperature=0.0))
        self.n_draft = int(n_draft)
        self.ctx: dict[int, Any] = {}
        self.cached: dict[int, list[int]] = {}

    def requirements(self) -> DrafterRequirements:
        return DrafterRequirements(max_draft=self.n_draft, vocab=VocabInfo.of_model(self.model))

    def begin(self, seq: int, prompt_ids: Sequence[int]) -> None:
        self.ctx[seq] = self.model.new_context()
        self.cached[seq] = []

    def _sync(self, seq: int, history: Sequence[int]) -> Any:
        """Make the draft cache hold ``history[:-1]`` plus ``history[-1]``; return the logits after it."""
        ctx, cached = self.ctx[seq], self.cached[seq]
        n = 0
        limit = min(len(cached), len(history) - 1)  # always re-run at least the last token for its logits
        while n < limit and cached[n] == history[n]:
            n += 1
        if n < len(cached):
            if not ctx.cache.can_cut(seq, n):
                ctx = self.ctx[seq] = self.model.new_context()
                n = 0
            else:
                ctx.cache.seq_rm(seq, n)
        out = ctx.decode(list(history[n:]), seq=seq)
        self.cached[seq] = list(history)
        return out

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        if seq not in self.ctx:
            self.begin(seq, history)
        if len(history) + n_max > self.model.n_ctx:
            n_max = self.model.n_ctx - len(history)
        if n_max <= 0:
            return Draft()
        out = self._sync(seq, history)
        ctx = self.ctx[seq]
        be = self.model.backend
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        hist = list(history)
        for i in range(n_max):
            logits = np.asarray(be.to_numpy(out.logits[-1]), dtype=np.float32)
            res = self.sampler.sample(logits, hist)
            if self.sampler.config.greedy:
                z = logits.astype(np.float64) - logits.max()
                rows.append(np.exp(z) / np.exp(z).sum())  # for the confidence only
            else:
                rows.append(res.probs)
            tokens.append(res.token)
            hist.append(res.token)
            if i + 1 < n_max:
                out = ctx.decode([res.token], seq=seq)
                self.cached[seq].append(res.token)
        conf = np.array([r[t] for r, t in zip(rows, tokens)])
        probs = None if self.sampler.config.greedy else np.stack(rows)
        return Draft(tokens=tuple(tokens), probs=probs, confidences=conf)

    def end(self, seq: int) -> None:
        self.ctx.pop(seq, None)
        self.cached.pop(seq, None)


def make_draft_model(target: Any, options: Mapping[str, Any]) -> DraftModelDrafter:
    from ..model import load_model

    path = options.get("draft")
    if not path:
        raise UserError("the 'draft' drafter needs a draft model: --draft MODEL (a .gguf path or a known name)")
    draft = load_model(path, backend=options.get("backend", "numpy"), n_ctx=target.n_ctx,
                       progress=bool(options.get("progress", False)))
    sampler = SamplerConfig(temperature=float(options.get("temperature", 0.0)),
                            top_k=int(options.get("top_k", 0)), top_p=float(options.get("top_p", 1.0)),
                            min_p=float(options.get("min_p", 0.0)), seed=options.get("seed"))
    return DraftModelDrafter(draft, sampler, n_draft=int(options.get("n_max", 16)))

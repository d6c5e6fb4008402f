"""The DSpark drafter: plinth-dflash's drafter (KV injection, block forward, cache hygiene) plus the heads.

One draft (llama.cpp ``common_speculative_impl_draft_dflash``, ``is_dspark`` branch):

* the block runs through the DFlash backbone: anchor-first ``[anchor, MASK x (n-1)]`` (row 0 already
  predicts, up to B drafts) or 1+N ``[anchor, MASK x n]`` (rows 1..n, up to B-1);
* the Markov head chains greedily through the prediction rows (:func:`plinth_dspark.heads.markov_chain`);
* the draft is cut at the first confidence below ``p_min`` (with a confidence head ``p_min`` is the
  confidence threshold; without one, a ``p_min`` > 0 is refused), then drafts shorter than ``n_min``
  are dropped.

Drafts are deterministic (argmax of the biased logits), so the engine's rejection sampler treats q as
one-hot and stays lossless.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from plinth.errors import UserError
from plinth.speculative.base import Draft, DrafterRequirements
from plinth_dflash.drafter import DFlashDrafter

from .format import T_CONF, T_CONF_B, T_D2T, T_W1, T_W2, DSparkFile, DSparkFormatError, load_dspark
from .heads import MarkovOutput, markov_chain, transposed_w2


class DSparkDrafter(DFlashDrafter):
    """A DSpark draft over the target; ``stats`` adds per-draft confidence figures (see :meth:`figures`)."""

    def __init__(self, target: Any, file: DSparkFile, *, n_min: int = 0, p_min: float = 0.0,
                 n_max: int | None = None) -> None:
        ds, draft = file.dspark, file.draft
        src = str(draft.path)
        if float(p_min or 0.0) > 0.0 and not ds.has_confidence_head:
            raise DSparkFormatError(f"{src}: the draft declares no confidence head ('dflash.has_confidence_head' = "
                                    "false), so --spec-p-min has no confidence to compare; set --spec-p-min 0")
        n_vocab = int(target.n_vocab)
        if ds.n_vocab != n_vocab:  # first: the backbone's head check would blame the head for the same misfit
            raise DSparkFormatError(f"{src}: '{T_W1}' has {ds.n_vocab} rows, the target's vocabulary {n_vocab}; the "
                                    "Markov head is indexed by target token ids (wrong target for this draft?)")
        super().__init__(target, draft, n_min=n_min, p_min=p_min, n_max=None, head_rows=ds.draft_vocab)
        self.name = "dspark"
        self.ds = ds
        w = draft.weights
        xp = self.xp
        self.w1, self.w2 = w[T_W1], w[T_W2]
        self.w2t = transposed_w2(self.w2, xp) if xp is np else None  # (the host chain's layout, made once)
        self.conf_w = w.get(T_CONF) if ds.has_confidence_head else None
        self.conf_b = w.get(T_CONF_B) if ds.has_confidence_head else None
        self.d2t = None
        if ds.reduced:
            d2t = np.asarray(target.backend.to_numpy(w[T_D2T]), dtype=np.int64)
            bad = np.nonzero((d2t < 0) | (d2t >= n_vocab))[0]
            if bad.size:
                raise DSparkFormatError(f"{src}: 'd2t' maps draft id {int(bad[0])} to {int(d2t[bad[0]])}, outside the "
                                        f"target's vocabulary 0..{n_vocab - 1} ({bad.size} ids out of range)")
            self.d2t = xp.asarray(d2t)
        self.n_max = self.max_block if not n_max else min(int(n_max), self.max_block)
        self.stats.update({k: 0 for k in self.FIGURE_KEYS})
        self._pending: dict[int, np.ndarray] = {}

    FIGURE_KEYS = ("drafts", "drafted", "pruned", "conf_accepted_sum", "conf_accepted_n", "conf_rejected_sum",
                   "conf_rejected_n")

    def begin(self, seq: int, prompt_ids: Sequence[int]) -> None:
        super().begin(seq, prompt_ids)
        self.stats.update({k: 0 for k in self.FIGURE_KEYS})  # figures() covers one generation

    @property
    def max_block(self) -> int:
        """Most drafts one block gives: B anchor-first, B-1 with the bonus anchor."""
        return self.hp.block_size if self.ds.sample_from_anchor else self.hp.block_size - 1

    def requirements(self) -> DrafterRequirements:
        return attrs.evolve(super().requirements(), shares_head=self.head_source == "target",
                            max_draft=self.max_block)

    # ------------------------------------------------------------------ drafting

    def run_block(self, seq: int, anchor: int, pos: int, n: int) -> MarkovOutput:
        """Heads' output for ``n`` prediction rows of one block at ``pos`` (no cache change)."""
        s = self.ds.first_row
        hidden = self.block_hidden(seq, anchor, pos, n - 1 + s)[s:]  # [n, E]: the prediction rows only
        z = self.graph.logits(hidden)  # [n, V_d] (1+N: no head product for the anchor row)
        return markov_chain(z, hidden, [anchor], 1, w1=self.w1, w2=self.w2, d2t=self.d2t, conf_w=self.conf_w,
                            conf_b=self.conf_b, first_row=0, max_block=self.hp.block_size, xp=self.xp,
                            w2t=self.w2t)

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        n = min(int(n_max), self.n_max)
        self._pending.pop(seq, None)
        if n < 1 or n < self.n_min or not history:
            return Draft()
        out = self.run_block(seq, int(history[-1]), pos, n)
        be = self.target.backend
        toks = np.asarray(be.to_numpy(out.tokens[0]), dtype=np.int64)
        if out.conf is not None:
            conf = np.asarray(be.to_numpy(out.conf[0]), dtype=np.float64)
        else:  # no confidence head: the top-1 probability of the biased logits (p_min is refused anyway)
            lg = np.asarray(be.to_numpy(out.logits[0]), dtype=np.float64)
            p = np.exp(lg - lg.max(axis=-1, keepdims=True))
            conf = p.max(axis=-1) / p.sum(axis=-1)
        k = n
        if self.p_min > 0.0:
            low = np.nonzero(conf < self.p_min)[0]
            if low.size:
                k = int(low[0])
        self.stats["pruned"] += n - k
        if k < max(self.n_min, 1):
            return Draft()
        self.stats["drafts"] += 1
        self.stats["drafted"] += k
        self._pending[seq] = conf[:k]
        return Draft(tokens=tuple(int(t) for t in toks[:k]), confidences=conf[:k])

    def accept(self, seq: int, n_accepted: int) -> None:
        super().accept(seq, n_accepted)
        conf = self._pending.pop(seq, None)
        if conf is None or self.ds.has_confidence_head is False:
            return
        a = min(int(n_accepted), conf.size)
        st = self.stats
        st["conf_accepted_sum"] += float(conf[:a].sum())
        st["conf_accepted_n"] += a
        st["conf_rejected_sum"] += float(conf[a:a + 1].sum())  # only the first rejected position was judged
        st["conf_rejected_n"] += int(conf[a:a + 1].size)

    def figures(self) -> dict[str, float]:
        """Per-run figures for ``--stats``: mean confidence at accepted / rejected positions, positions pruned."""
        st = self.stats
        out = {"pruned positions": float(st["pruned"])}
        if self.ds.has_confidence_head:
            out["mean conf accepted"] = st["conf_accepted_sum"] / st["conf_accepted_n"] if st["conf_accepted_n"] \
                else float("nan")
            out["mean conf rejected"] = st["conf_rejected_sum"] / st["conf_rejected_n"] if st["conf_rejected_n"] \
                else float("nan")
        return out

    # ------------------------------------------------------------------ inspection (tests, benchmarks)

    def block_outputs(self, seq: int, anchor: int, pos: int, n: int) -> dict[str, np.ndarray]:
        """Biased logits [n, V_d], confidences [n] (if any) and chained tokens [n] of one block, as numpy."""
        out = self.run_block(seq, anchor, pos, n)
        be = self.target.backend
        res = {"logits": np.asarray(be.to_numpy(out.logits[0])), "tokens": np.asarray(be.to_numpy(out.tokens[0]))}
        if out.conf is not None:
            res["conf"] = np.asarray(be.to_numpy(out.conf[0]))
        return res


def make_dspark(target: Any, options: Mapping[str, Any]) -> DSparkDrafter:
    """``--spec dspark --draft FILE``: a dflash GGUF with DSpark heads."""
    from .drafters import resolve

    path = resolve(options.get("draft"), target)  # a file, a shipped drafter's name, or the one for this target
    be = options.get("backend")
    if isinstance(be, str) and be != getattr(target.backend, "name", be):
        raise UserError(f"the draft runs on the target's backend ({target.backend.name}); backend {be!r} was asked for")
    return DSparkDrafter(target, load_dspark(path, target.backend), n_min=int(options.get("n_min") or 0),
                         p_min=float(options.get("p_min") or 0.0), n_max=options.get("n_max"))

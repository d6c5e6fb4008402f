"""One speculative step, shared by the solo loop (:mod:`.engine`) and the server's scheduler
(:mod:`plinth.serve.scheduler`): which verification rule a request gets, the target batch of a
drafted step, the decision over its rows, and the rollback of the rows it did not keep.

The verification rule (``--spec-verify``):

* ``auto``: ``greedy`` at temperature 0, ``rejection`` otherwise;
* ``greedy``: keep the drafted tokens the target would have chosen itself. It reproduces
  temperature-0 decoding only, so a sampled request (temperature > 0) with ``greedy`` is
  refused (:class:`GreedyNeedsTemperatureZero`): ``plinth generate`` exits with the error,
  the server answers 400 naming ``temperature``. It is never switched to another rule;
* ``rejection`` (or a plugin's rule): the verifier's own test against the sampler's
  distribution of every row.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..batch import Batch
from ..errors import UserError
from ..ops import array_module
from .base import Draft, TargetOutput, target_kv_views
from .verify import make_verifier, verify_draft


class GreedyNeedsTemperatureZero(UserError):
    """The greedy rule was asked for a sampled request."""


def verifier_name(rule: str, temperature: float) -> str:
    """The verification rule a request at ``temperature`` gets under ``rule`` (``auto``, ``greedy``,
    ``rejection`` or a registered name); ``greedy`` at temperature > 0 raises
    :class:`GreedyNeedsTemperatureZero`."""
    if rule == "auto":
        return "greedy" if temperature == 0.0 else "rejection"
    if rule == "greedy" and temperature != 0.0:
        raise GreedyNeedsTemperatureZero(
            f"greedy verification only reproduces temperature-0 decoding; with temperature {temperature:g} use the "
            "'rejection' verifier (or 'auto')")
    return rule


def make_step_verifier(rule: str, temperature: float, registry: Any = None) -> Any:
    """The verifier object for :func:`verifier_name` (``registry`` for a plugin's rule)."""
    name = verifier_name(rule, temperature)
    return make_verifier(name, registry if name not in ("greedy", "rejection") else None)


def target_batch(ctx: Any, seq: int, last: int, draft: Draft, pos: int) -> tuple[Batch, Any]:
    """The target's rows of one step, ``[last, d_1..d_k]`` at positions ``pos..pos+k``, and the
    snapshot a rollback will need (None where a crop is enough: no draft, or rows that can be cut)."""
    k = len(draft)
    batch = Batch.from_tokens([last, *draft.tokens], start=pos, seq=seq, output="all" if k else "last")
    snap = ctx.cache.snapshot(seq) if k and ctx.rollback_plan(seq, pos, pos + k + 1) == "snapshot" else None
    return batch, snap


def decide(verifier: Any, sampler: Any, draft: Draft, logits: np.ndarray, history: Sequence[int],
           rng: Any, constraint: Any = None) -> tuple[int, int]:
    """(drafted tokens kept, next token) from the target's ``logits`` rows [k + 1, n_vocab] of a step:
    :func:`plinth.speculative.verify.verify_draft` (the greedy rule compares each draft token with the
    sampler's own choice at its row, with every logit transform the sampler applies and the grammar's
    mask under a ``constraint``, so it keeps exactly what greedy decoding would have produced; other
    rules test the drafts against the sampler's distributions)."""
    res = verify_draft(verifier, sampler, draft.tokens, draft.probs, logits, history, rng, constraint)
    return int(res.n_accepted), int(res.next_token)


def rollback(ctx: Any, seq: int, pos: int, kept: Sequence[int], snap: Any) -> None:
    """Drop ``seq``'s rows past the ``kept`` ones of a step that started at ``pos``: a crop, or, with a
    snapshot (recurrent state, ...), its restore and a replay of the kept rows."""
    if snap is None:
        ctx.cache.seq_rm(seq, pos + len(kept))
        return
    ctx.cache.restore(snap)
    ctx.forward(Batch.from_tokens(list(kept), start=pos, seq=seq, output="none"))


# Rows kept for the drafters instead of shown at once: a plain step's row (and a server request's prompt) under
# ``--spec-policy auto``. The drafters see them together before the sequence's next draft, in one ``process``
# call instead of one a step (a DSpark drafter's layers over one row cost a plain step a good part of its time,
# and a sequence that never drafts never pays for them). A chunk: (tokens, positions, {tap: features}).

def defer_chunk(batch: Batch, out: Any, first: int, n: int, taps: Sequence[int]) -> tuple[Any, Any, dict[int, Any]]:
    """Rows ``first .. first + n`` of a target forward, as a chunk (copies: the forward's buffers are reused)."""
    feats = {t: out.features[t][first:first + n].copy() for t in taps if t in out.features}
    return batch.tokens[first:first + n].copy(), batch.positions[first:first + n].copy(), feats


def chunk_bytes(chunk: tuple[Any, Any, dict[int, Any]]) -> int:
    """What a chunk holds (features, tokens and positions)."""
    return sum(int(f.nbytes) for f in chunk[2].values()) + 16 * len(chunk[0])


class Unseen:
    """The rows each drafter has not been shown yet, kept as chunks (:func:`defer_chunk`) per drafter.

    Under ``--spec-policy auto`` a drafter sees its rows together just before it is asked for a draft (one
    ``process`` call instead of one a step), or once they hold ``limit`` bytes. A drafted step's rows go at
    once to the drafter that drafted it (its work on them is part of that draft's cost) and its kept rows to the
    others' chunks: with ``ngram,dspark`` an n-gram draft no longer pays for DSpark's layers over its rows, which
    DSpark takes in one call at its next draft. Every drafter's chunks hold the same rows, in order, less those
    it was shown as they came.
    """

    def __init__(self, n: int, limit: int = 8 << 20) -> None:
        self.chunks: list[list[Any]] = [[] for _ in range(n)]
        self.nbytes = [0] * n
        self.limit = limit

    def add(self, chunk: tuple[Any, Any, dict[int, Any]], skip: int = -1) -> list[int]:
        """Keep ``chunk`` for every drafter but ``skip``; returns the drafters whose rows now reach the limit."""
        size, full = chunk_bytes(chunk), []
        for i, kept in enumerate(self.chunks):
            if i != skip:
                kept.append(chunk)
                self.nbytes[i] += size
                if self.nbytes[i] >= self.limit:
                    full.append(i)
        return full

    def take(self, i: int) -> list[Any]:
        """Drafter ``i``'s chunks, which it is now to be shown (none kept after)."""
        chunks, self.chunks[i], self.nbytes[i] = self.chunks[i], [], 0
        return chunks

    def show(self, i: int, drafters: Sequence[Any], requirements: Sequence[Any], seq: int, cache: Any) -> None:
        """Hand drafter ``i`` (-1: every drafter) the rows kept for it in one ``process`` call, as kept rows
        (:func:`deferred_output`), with ``seq``'s K / V views of the target ``cache`` it reads."""
        for j, (drafter, req) in enumerate(zip(drafters, requirements)):
            chunks = self.take(j) if i < 0 or i == j else None
            if chunks:
                drafter.process(deferred_output(seq, chunks, req.taps, target_kv_views(cache, req, seq)))

    def put(self, chunks: Sequence[Any]) -> None:
        """Every drafter's rows are ``chunks`` (a reused prompt's), none others."""
        size = sum(chunk_bytes(c) for c in chunks)
        for i in range(len(self.chunks)):
            self.chunks[i] = list(chunks)
            self.nbytes[i] = size

    def common(self) -> list[Any] | None:
        """The chunks every drafter holds (each was shown none of its rows yet), or None where they differ."""
        first = self.chunks[0] if self.chunks else []
        same = all(len(c) == len(first) and all(a is b for a, b in zip(c, first)) for c in self.chunks)
        return list(first) if same else None


def deferred_output(seq: int, chunks: Sequence[tuple[Any, Any, dict[int, Any]]], taps: Sequence[int],
                    kv: Any) -> TargetOutput:
    """The chunks as one target output for a drafter reading ``taps``: kept rows (phase "prefill")."""
    feats = {}
    for t in taps:
        parts = [c[2][t] for c in chunks if t in c[2]]
        if parts:
            feats[t] = array_module(parts[0]).concatenate(parts)  # (a copy: chunks may be kept)
    return TargetOutput(seq=seq, phase="prefill", tokens=np.concatenate([c[0] for c in chunks]),
                        positions=np.concatenate([c[1] for c in chunks]), features=feats, has_embeddings=False,
                        logits=None, kv=kv)

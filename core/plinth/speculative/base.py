"""The drafter contract: what a drafter declares, what it is shown, what it returns.

The engine (:mod:`plinth.speculative.engine`) drives every drafter the same way,
after llama.cpp's ``common_speculative_impl``:

1. ``begin(seq, prompt_ids)`` when a sequence starts;
2. ``process(target_output)`` after every target forward of that sequence
   (prefill chunks and verify batches), with the rows' tokens, positions and
   the feature taps the drafter asked for;
3. ``draft(seq, n_max, history=..., pos=...)`` to propose up to ``n_max`` tokens
   following ``history[-1]`` (the last committed token, which the target has
   not run yet and which will sit at position ``pos``);
4. ``accept(seq, n_accepted)`` once the verify batch ``[history[-1], d_1..d_k]``
   has been checked: its first ``1 + n_accepted`` rows are kept, the rest are
   gone from the target and must not persist in the drafter either.

A drafter states its needs in :class:`DrafterRequirements`; the engine checks
them against the target when it is built and refuses an incompatible pair with
a message naming the mismatch.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import numpy as np

from ..errors import UserError


@attrs.frozen
class VocabInfo:
    """The parts of a vocabulary two models must share for their token ids to mean the same."""

    n_vocab: int
    bos_id: int | None = None
    eos_id: int | None = None
    tokens: tuple[str, ...] | None = None  # token texts, when the drafter has its own vocabulary

    @classmethod
    def of_model(cls, model: Any) -> "VocabInfo":
        md = model.metadata
        toks = md.get("tokenizer.ggml.tokens")
        bos = md.get("tokenizer.ggml.bos_token_id")
        eos = md.get("tokenizer.ggml.eos_token_id")
        return cls(n_vocab=int(model.n_vocab), bos_id=None if bos is None else int(bos),
                   eos_id=None if eos is None else int(eos), tokens=None if toks is None else tuple(toks))


@attrs.frozen
class DrafterRequirements:
    """What a drafter needs from its target.

    taps: target layers whose inputs the drafter reads in ``process`` (k = n_layer
        is the residual before the final norm).
    shares_embedding / shares_head: the drafter uses the target's token embedding /
        LM head (it then needs the target's hidden size to match ``n_embd``).
    n_embd: hidden size the drafter expects of the target's features (None = any).
    max_draft: the longest draft it can make in one step (a block drafter's B-1);
        the engine clamps ``n_max`` to it.
    vocab: the drafter's vocabulary when it proposes ids of its own (a draft model);
        None when it proposes target ids by construction.
    target_kv: target layers whose stored K/V the drafter reads (Gemma 4's assistant attends
        to them instead of keeping a cache of its own); each ``process`` call then carries a
        read-only :class:`TargetKV` per layer in ``TargetOutput.kv``.
    """

    taps: tuple[int, ...] = ()
    shares_embedding: bool = False
    shares_head: bool = False
    n_embd: int | None = None
    max_draft: int | None = None
    vocab: VocabInfo | None = None
    target_kv: tuple[int, ...] = ()


class TargetKV:
    """Read-only access to the K/V that one target layer keeps for one sequence.

    :meth:`read` returns what the target's cache holds *when called* (a drafter reads it in
    ``draft``, after the engine has dropped a verify batch's rejected rows): K [n, n_head_kv,
    head_dim], V [n, n_head_kv, head_dim_v] (float32; a typed cache's rows decoded) and the
    rows' positions [n], in cache order. The arrays may be views of the cache: never write into
    them. A KV-shared layer reads its source layer's rows.
    """

    def __init__(self, cache: Any, layer: int, seq: int) -> None:
        self._cache, self.layer, self.seq = cache, int(layer), int(seq)

    def read(self) -> tuple[Any, Any, np.ndarray]:
        try:
            kind = self._cache.kv(self.layer)
        except KeyError as exc:
            raise UserError(f"target layer {self.layer} keeps no K/V rows a drafter could read ({exc.args[0]})") \
                from None
        k, v, pos = kind.get(self.seq)
        return k, v, np.asarray(pos)


@attrs.frozen
class Draft:
    """Proposed tokens, and optionally how sure the drafter was of each.

    tokens: the draft, in order.
    probs: [n, n_vocab] — the distribution each token was drawn from (rejection
        sampling uses it as q); None means one-hot q (a deterministic drafter).
    confidences: [n] — a score in [0, 1] per token for ``p_min`` pruning; when None
        and ``probs`` is given, ``probs[i, tokens[i]]`` is used.
    """

    tokens: tuple[int, ...] = ()
    probs: Any = None
    confidences: Any = None

    def __len__(self) -> int:
        return len(self.tokens)

    def confidence(self) -> np.ndarray | None:
        if self.confidences is not None:
            return np.asarray(self.confidences, dtype=np.float64)
        if self.probs is not None:
            p = np.asarray(self.probs)
            return p[np.arange(len(self.tokens)), np.asarray(self.tokens, dtype=np.int64)].astype(np.float64)
        return None

    def truncated(self, n: int) -> "Draft":
        if n >= len(self.tokens):
            return self
        return Draft(tokens=tuple(self.tokens[:n]),
                     probs=None if self.probs is None else self.probs[:n],
                     confidences=None if self.confidences is None else self.confidences[:n])


@attrs.frozen
class TargetOutput:
    """One target forward of one sequence, as a drafter sees it in ``process``.

    phase: "prefill" (prompt rows) or "verify" (``[last, d_1..d_k]``).
    tokens / positions: [n] the rows of this sequence in the batch.
    features: {tap: [n, n_embd]} on the target's backend, for the taps asked for.
    has_embeddings: some rows were embeddings, not tokens (block drafters skip such batches).
    logits: [n_out, n_vocab] of the rows that had outputs, or None.
    kv: {layer: TargetKV} for the layers in ``DrafterRequirements.target_kv``.
    """

    seq: int
    phase: str
    tokens: np.ndarray
    positions: np.ndarray
    features: dict[int, Any] = attrs.field(factory=dict)
    has_embeddings: bool = False
    logits: Any = None
    kv: dict[int, TargetKV] = attrs.field(factory=dict)


def target_kv_views(cache: Any, req: DrafterRequirements, seq: int) -> dict[int, TargetKV]:
    """``TargetOutput.kv`` for a drafter with requirements ``req`` (what the engine and the scheduler pass)."""
    return {int(il): TargetKV(cache, il, seq) for il in req.target_kv}


class BaseDrafter:
    """Convenient defaults: no taps, nothing to do in ``begin``/``process``/``accept``.

    Subclasses set ``name`` and implement :meth:`draft`; override ``requirements``
    to declare taps, shared tensors or a vocabulary.
    """

    name = "base"

    def requirements(self) -> DrafterRequirements:
        return DrafterRequirements()

    def begin(self, seq: int, prompt_ids: Sequence[int]) -> None:
        pass

    def process(self, target_output: TargetOutput) -> None:
        pass

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        raise NotImplementedError

    def accept(self, seq: int, n_accepted: int) -> None:
        pass

    def end(self, seq: int) -> None:
        """The sequence is finished; free what was kept for it."""


def requirements_of(drafter: Any) -> DrafterRequirements:
    req = getattr(drafter, "requirements", None)
    if req is None:
        return DrafterRequirements()
    return req() if callable(req) else req


def check_compatible(target: Any, drafter: Any) -> DrafterRequirements:
    """Refuse a drafter whose requirements the target does not meet; return the requirements."""
    req = requirements_of(drafter)
    name = getattr(drafter, "name", type(drafter).__name__)
    n_layer = int(target.hparams.n_layer)
    extra = set(getattr(getattr(target, "graph", None), "extra_taps", ()))  # taps the graph defines beyond its layers
    bad = [t for t in req.taps if not 0 <= int(t) <= n_layer and int(t) not in extra]
    if bad:
        raise UserError(f"drafter {name!r} asks for target layer taps {bad}, but the target "
                        f"({target.arch}) has layers 0..{n_layer} (n_layer = {n_layer})")
    bad = [il for il in req.target_kv if not 0 <= int(il) < n_layer]
    if bad:
        raise UserError(f"drafter {name!r} reads the stored K/V of target layers {bad}, but the target "
                        f"({target.arch}) has layers 0..{n_layer - 1}")
    t_embd = int(target.hparams.n_embd)
    if req.n_embd is not None and t_embd and req.n_embd != t_embd:
        what = "shares the target's embedding/head and" if (req.shares_embedding or req.shares_head) else ""
        raise UserError(f"drafter {name!r} {what} expects target hidden size {req.n_embd}, "
                        f"but the target ({target.arch}) has n_embd = {t_embd}")
    if req.vocab is not None:
        tv = VocabInfo.of_model(target)
        dv = req.vocab
        if dv.n_vocab != tv.n_vocab:
            raise UserError(f"drafter {name!r} has a vocabulary of {dv.n_vocab} tokens, "
                            f"the target has {tv.n_vocab}")
        for field in ("bos_id", "eos_id"):
            a, b = getattr(dv, field), getattr(tv, field)
            if a is not None and b is not None and a != b:
                raise UserError(f"drafter {name!r} has {field} {a}, the target has {b}")
        if dv.tokens is not None and tv.tokens is not None:
            for i, (a, b) in enumerate(zip(dv.tokens, tv.tokens)):
                if a != b:
                    raise UserError(f"drafter {name!r} and the target disagree on token {i}: "
                                    f"{a!r} vs {b!r}")
    return req

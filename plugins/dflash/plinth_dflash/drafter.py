"""The DFlash-family drafter on plinth's drafter contract.

Life of one sequence (llama.cpp ``common_speculative_impl_draft_dflash``):

* ``process``: the target's features for its rows (taps in the file's order) are
  sanitised (NaN -> 0, clamp to +-65504, warned once), fused and injected as K/V at the
  rows' target positions; batches carrying embeddings are skipped.
* ``draft``: cache rows at or past the anchor position are dropped, then the block
  ``[anchor, MASK x n]`` (n = n_max clamped to B-1) runs once; the draft comes from
  argmax (DFlash), the candidate lattice walk (DFlash2) or the LiLiCorr walk, cut at
  the first confidence below ``p_min`` and dropped when shorter than ``n_min``.
* ``accept``: rows of the verify batch past ``1 + n_accepted`` are dropped.

The output head comes from the file: its own ``output.weight``; its own
``token_embd.weight`` when ``dflash.tie_word_embeddings`` is true; otherwise the
target's head. Nothing else is tried.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

import numpy as np

from plinth.errors import UserError
from plinth.speculative.base import BaseDrafter, Draft, DrafterRequirements, TargetOutput

from . import constants as C
from .format import DFlashFormatError, DraftFile, load_draft
from .graph import DraftGraph
from .selector import argmax_walk, dflash2_lattice, lattice_walk, lilicorr_scores, lilicorr_walk

F16_MAX = 65504.0


class FeatureWarning(UserWarning):
    """Target features held NaN/inf or values beyond the f16 range; they were sanitised."""


def sanitize_features(f: Any, xp: Any) -> tuple[Any, bool]:
    """NaN -> 0, +-inf and |x| > 65504 -> +-65504. f: [n, m]. Returns (clean f, whether anything changed)."""
    bad = bool(xp.any(~(xp.abs(f) <= F16_MAX)))  # NaN, inf or beyond f16, in one device read
    if not bad:
        return f, False
    f = xp.nan_to_num(f, nan=0.0, posinf=F16_MAX, neginf=-F16_MAX)
    return xp.clip(f, -F16_MAX, F16_MAX), True


class DFlashDrafter(BaseDrafter):
    """A DFlash / DFlash2 / LiLiCorr draft (one loaded ``dflash`` GGUF) serving any number of sequences."""

    def __init__(self, target: Any, draft: DraftFile, *, n_min: int = 0, p_min: float = 0.0,
                 n_max: int | None = None, head_rows: int | None = None) -> None:
        """head_rows: rows the output head must have (default the target's vocabulary; a subclass drafting over
        a reduced vocabulary passes its own size and maps ids itself)."""
        hp = draft.hparams
        self.hp = hp
        self.name = hp.variant
        self.draft_file = draft
        self.target = target
        self.xp = target.backend.xp
        self.n_min = int(n_min or 0)
        self.p_min = float(p_min or 0.0)
        self.n_max = hp.max_draft if not n_max else min(int(n_max), hp.max_draft)
        t_embd = int(target.hparams.n_embd)
        n_layer = int(target.hparams.n_layer)
        src = str(draft.path)
        if t_embd != hp.n_embd:
            raise UserError(f"{src}: the draft's fc expects {hp.n_taps} target features of width E = {hp.n_embd} "
                            f"(n_embd_inp_enc = {hp.n_taps * hp.n_embd}), but the target ({target.arch}) has "
                            f"n_embd = {t_embd}; this draft was trained for another target")
        bad = [t for t in hp.target_layers if not 0 <= t <= n_layer]
        if bad:
            raise UserError(f"{src}: '{C.ARCH}.{C.KEY_TARGET_LAYERS}' = {list(hp.target_layers)} has taps {bad} "
                            f"outside the target's 0..{n_layer} (tap {n_layer} = the pre-final-norm residual)")
        w = draft.weights
        n_vocab = int(target.n_vocab)
        own_embd = w.get(C.T_TOKEN_EMBD)
        self.shares_embedding = own_embd is None
        view = target.target_view()  # the target's declared embedding, head and sizes
        embed = own_embd if own_embd is not None else view.embed_table
        if C.T_OUTPUT in w:
            head, self.head_source = w[C.T_OUTPUT], "own"
        elif hp.tied:
            head, self.head_source = w[C.T_TOKEN_EMBD], "tied"
        else:
            head, self.head_source = view.head_weight, "target"
        for what, arr, rows in (("token embedding", embed, n_vocab), ("output head", head, head_rows or n_vocab)):
            if int(arr.shape[0]) != rows:
                raise UserError(f"{src}: the draft's {what} has {arr.shape[0]} rows, expected {rows} (the "
                                f"target's vocabulary is {n_vocab}); a DFlash draft proposes target ids")
        for name in (C.T_SEL_PRED, C.T_SEL_SUCC):
            if name in w and int(w[name].shape[0]) != n_vocab:
                raise UserError(f"{src}: '{name}' has {w[name].shape[0]} rows, the target's vocabulary {n_vocab}")
        if hp.n_vocab is not None and hp.n_vocab != n_vocab and head_rows is None:
            raise UserError(f"{src}: the draft was made for a vocabulary of {hp.n_vocab} tokens, the target "
                            f"({target.arch}) has {n_vocab}; a DFlash draft proposes target ids (wrong target?)")
        if not 0 <= hp.mask_token < n_vocab:
            raise UserError(f"{src}: mask token {hp.mask_token} is outside the vocabulary (0..{n_vocab - 1})")
        self.target_embed = view.embed_table
        self.graph = DraftGraph(hp, w, self.xp, embed, head)
        self.cache = self.graph.new_cache()
        self._verify_start: dict[int, int] = {}
        self._anchor: dict[int, tuple[np.ndarray, Any]] = {}  # LiLiCorr: last fused rows and their positions
        self._warned = False
        self.stats = {"injected_rows": 0, "skipped_batches": 0, "sanitised_batches": 0}

    # ------------------------------------------------------------------ contract

    def requirements(self) -> DrafterRequirements:
        return DrafterRequirements(taps=tuple(sorted(set(self.hp.target_layers))),
                                   shares_embedding=self.shares_embedding,
                                   shares_head=self.head_source == "target", n_embd=self.hp.n_embd,
                                   max_draft=self.hp.max_draft)

    def begin(self, seq: int, prompt_ids: Sequence[int]) -> None:
        self.end(seq)

    def end(self, seq: int) -> None:
        self.cache.clear(seq)
        self._verify_start.pop(seq, None)
        self._anchor.pop(seq, None)

    def features_of(self, out: TargetOutput) -> Any:
        """[n, n_taps * E]: the taps concatenated in the file's order, sanitised."""
        xp = self.xp
        missing = [t for t in self.hp.target_layers if t not in out.features]
        if missing:
            raise UserError(f"{self.name} drafter: the target output lacks feature taps {missing} "
                            f"(asked for {list(self.hp.target_layers)})")
        for t in self.hp.target_layers:
            shape = tuple(out.features[t].shape)
            if len(shape) != 2 or shape[1] != self.hp.n_embd:
                raise UserError(f"{self.name} drafter ({self.draft_file.path.name}): the target ({self.target.arch}) "
                                f"gives tap {t} as rows of shape {list(shape)}, the draft's fc reads "
                                f"{self.hp.n_taps} taps of width E = {self.hp.n_embd} each; this target's taps are "
                                "not hidden states this draft can read")
        f = xp.concatenate([xp.asarray(out.features[t], dtype=xp.float32) for t in self.hp.target_layers], axis=1)
        f, changed = sanitize_features(f, xp)
        if changed:
            self.stats["sanitised_batches"] += 1
            if not self._warned:
                self._warned = True
                warnings.warn(f"{self.name} drafter: target features held NaN/inf or |x| > 65504; NaN were set to 0 "
                              "and the rest clamped to +-65504 (shown once)", FeatureWarning, stacklevel=2)
        return f

    def process(self, target_output: TargetOutput) -> None:
        out = target_output
        if out.has_embeddings:
            self.stats["skipped_batches"] += 1  # image/embedding rows are never mirrored into the draft
            return
        positions = np.asarray(out.positions, dtype=np.int64)
        if positions.size == 0:
            return
        g = self.graph.fuse(self.features_of(out))
        self.cache.seq_rm(out.seq, int(positions.min()))
        self.graph.inject(self.cache, out.seq, positions, g)
        self.stats["injected_rows"] += int(positions.size)
        if out.phase == "verify":
            self._verify_start[out.seq] = int(positions.min())
        if self.hp.variant == "lilicorr":
            self._anchor[out.seq] = (positions, g)

    def accept(self, seq: int, n_accepted: int) -> None:
        start = self._verify_start.pop(seq, None)
        if start is not None:
            self.cache.seq_rm(seq, start + 1 + int(n_accepted))

    def block_hidden(self, seq: int, anchor: int, pos: int, n: int) -> Any:
        """Final-normed hidden [n + 1, E] of the block ``[anchor, MASK x n]`` at positions pos..pos+n."""
        self.cache.seq_rm(seq, pos)  # noise rows never persist; rows at >= pos belong to rejected drafts
        tokens = [int(anchor)] + [self.hp.mask_token] * n
        return self.graph.forward_block(self.cache, seq, tokens, np.arange(pos, pos + n + 1))

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        n = min(int(n_max), self.n_max)  # n_max <= B - 1: one block per draft
        if n < 1 or n < self.n_min or not history:
            return Draft()
        anchor = int(history[-1])
        hidden = self.block_hidden(seq, anchor, pos, n)
        toks, conf = self.choose(seq, anchor, pos, hidden)
        if len(toks) < max(self.n_min, 1):
            return Draft()
        return Draft(tokens=tuple(toks), confidences=np.asarray(conf, dtype=np.float64))

    def choose(self, seq: int, anchor: int, pos: int, hidden: Any) -> tuple[list[int], list[float]]:
        """Pick the draft from the block's hidden rows [b, E] (row 0 is the anchor)."""
        hp, xp = self.hp, self.xp
        if hp.variant == "dflash":
            return argmax_walk(self.graph.logits(hidden[1:]), self.p_min)
        if hp.variant == "dflash2":
            rows = self.graph.logits(hidden[1:])  # row 0 (the anchor) is no prediction slot: no LM head for it
            logits = xp.concatenate([xp.zeros((1, rows.shape[1]), dtype=rows.dtype), rows])
            lat = dflash2_lattice(hidden, logits, [anchor], self.graph.w, hp.selector_top_k,
                                  max_block=hp.block_size)
            return lattice_walk(lat, hp.selector_top_k, hidden.shape[0], self.p_min)
        rows = self._anchor.get(seq)
        valid = False
        anchor_row = xp.zeros(hp.n_embd, dtype=xp.float32)
        if rows is not None:
            hit = np.nonzero(rows[0] == pos - 1)[0]
            if hit.size:
                anchor_row, valid = rows[1][int(hit[-1])], True
        ids, start, pair = lilicorr_scores(hidden[1:], self.graph.head, self.target_embed, anchor_row, valid,
                                           self.graph.w, hp.lilicorr, hp.block_size, hp.norm_eps)
        return lilicorr_walk(ids, start, pair, self.p_min)

    # ------------------------------------------------------------------ inspection (tests, benchmarks)

    def draft_logits(self, seq: int, anchor: int, pos: int, n: int) -> Any:
        """Logits [n, V] of block rows 1..n (no cache change)."""
        return self.graph.logits(self.block_hidden(seq, anchor, pos, n)[1:])


def _open(target: Any, options: Mapping[str, Any], want: str | None) -> DFlashDrafter:
    path = options.get("draft")
    if not path:
        raise UserError(f"the {want or 'dflash'} drafter needs a draft GGUF: pass --draft FILE.gguf "
                        "(option 'draft')")
    be = options.get("backend")
    if isinstance(be, str) and be != getattr(target.backend, "name", be):
        raise UserError(f"the draft runs on the target's backend ({target.backend.name}); backend {be!r} "
                        "was asked for")
    draft = load_draft(path, target.backend)
    if want is not None and draft.hparams.variant != want:
        raise DFlashFormatError(f"{path} is a {draft.hparams.variant} draft, not {want} (use --spec "
                                f"{draft.hparams.variant}, or --spec dflash to auto-detect)")
    drafter = DFlashDrafter(target, draft, n_min=int(options.get("n_min") or 0),
                            p_min=float(options.get("p_min") or 0.0), n_max=options.get("n_max"))
    return drafter


def make_dflash(target: Any, options: Mapping[str, Any]) -> DFlashDrafter:
    """``--spec dflash``: any dflash GGUF; the variant (DFlash, DFlash2, LiLiCorr) is read from its tensors."""
    return _open(target, options, None)


def make_dflash2(target: Any, options: Mapping[str, Any]) -> DFlashDrafter:
    return _open(target, options, "dflash2")


def make_lilicorr(target: Any, options: Mapping[str, Any]) -> DFlashDrafter:
    return _open(target, options, "lilicorr")

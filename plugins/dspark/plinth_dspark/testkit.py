"""Tiny synthetic DSpark drafts for tests and benchmarks (a tiny DFlash draft plus the DSpark heads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from plinth_dflash import constants as DC
from plinth_dflash.testkit import random_draft_tensors, tiny_draft_metadata

from .format import KEY_FROM_ANCHOR, KEY_HAS_CONF, T_CONF, T_CONF_B, T_D2T, T_W1, T_W2


def dspark_tensors(n_vocab: int, n_embd: int, *, rank: int = 16, draft_vocab: int | None = None,
                   conf: bool = True, conf_with_markov: bool = True, w2_scale: float | None = None, seed: int = 0,
                   scale: float = 0.5) -> dict[str, np.ndarray]:
    """Random Markov / confidence heads at O(1) scale (and ``d2t`` + own head for a reduced vocabulary)."""
    rng = np.random.default_rng(seed + 100)
    vd = draft_vocab or n_vocab
    t = {T_W1: (scale * rng.standard_normal((n_vocab, rank))).astype(np.float32),
         T_W2: (scale * rng.standard_normal((vd, rank))).astype(np.float32)}
    if w2_scale is not None:
        t[T_W2] = (t[T_W2] / np.float32(w2_scale)).astype(np.float32)
        t["markov_w2.scale"] = np.array([w2_scale], dtype=np.float32)
    if conf:
        cols = n_embd + rank if conf_with_markov else n_embd
        t[T_CONF] = (0.3 * rng.standard_normal((1, cols))).astype(np.float32)
        t[T_CONF_B] = np.array([0.5], dtype=np.float32)
    if draft_vocab is not None and draft_vocab < n_vocab:
        t[T_D2T] = np.sort(rng.choice(n_vocab, size=draft_vocab, replace=False)).astype(np.int64)
        t[DC.T_OUTPUT] = (0.2 * rng.standard_normal((draft_vocab, n_embd))).astype(np.float32)
    return t


def write_tiny_dspark(path: str | Path, *, seed: int = 0, rank: int = 16, draft_vocab: int | None = None,
                      conf: bool = True, conf_with_markov: bool = True, sample_from_anchor: bool | None = None,
                      has_confidence_head: bool | None = None, w2_scale: float | None = None, scale: float = 0.2,
                      head_scale: float = 0.5, extra_tensors: Any = None, **md_kw: Any) -> Path:
    """A random DSpark draft: ``sample_from_anchor`` / ``has_confidence_head`` None leave the key out."""
    from plinth.convert import write_gguf

    md = tiny_draft_metadata("dflash", **md_kw)
    if sample_from_anchor is not None:
        md[f"{DC.ARCH}.{KEY_FROM_ANCHOR}"] = bool(sample_from_anchor)
    if has_confidence_head is not None:
        md[f"{DC.ARCH}.{KEY_HAS_CONF}"] = bool(has_confidence_head)
    tensors = random_draft_tensors(md, "dflash", seed=seed, scale=scale)
    n_vocab, n_embd = int(md[f"{DC.ARCH}.vocab_size"]), int(md[f"{DC.ARCH}.embedding_length"])
    tensors.update(dspark_tensors(n_vocab, n_embd, rank=rank, draft_vocab=draft_vocab, conf=conf,
                                  conf_with_markov=conf_with_markov, w2_scale=w2_scale, seed=seed, scale=head_scale))
    tensors.update(extra_tensors or {})
    return write_gguf(path, md, tensors)

"""Embeddings: one vector a text, pooled from the final-norm hidden states (the LM head is skipped), unit
length (L2-normalised, as OpenAI returns them).

The pooling is the model's own where its file declares one (``{arch}.pooling_type``: 1 mean, 2 cls,
3 last, as llama.cpp reads it), else ``mean``; a request (``pooling``) or ``--pooling`` may choose
another. Each text runs in its own forward in a fresh context, so the same text gives the same bits
whatever else is asked with it. Used by ``/v1/embeddings`` and ``plinth embed``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..batch import Batch
from ..errors import UserError

POOLINGS = ("mean", "cls", "last")
#: llama.cpp's LLAMA_POOLING_TYPE values (0 none, 4 rank: not a text embedding)
_DECLARED = {1: "mean", 2: "cls", 3: "last"}


def declared_pooling(model: Any) -> str | None:
    """The pooling the model file declares (``{arch}.pooling_type``), or None."""
    v = getattr(model, "metadata", {}).get(f"{model.arch}.pooling_type")
    return _DECLARED.get(int(v)) if isinstance(v, int) else None


def choose_pooling(model: Any, requested: str | None) -> str:
    """``requested`` ("mean", "cls", "last"; None or "model": the model's own, else mean)."""
    if requested in (None, "model"):
        return declared_pooling(model) or "mean"
    if requested not in POOLINGS:
        raise UserError(f"pooling {requested!r} is unknown (choose from model, {', '.join(POOLINGS)})")
    return requested


def embed(model: Any, prompts: Sequence[Sequence[int]], pooling: str, normalize: bool = True) -> np.ndarray:
    """float32 [len(prompts), n_embd]: each prompt's pooled final hidden state (unit length with
    ``normalize``)."""
    rows = []
    for ids in prompts:
        ids = [int(t) for t in ids]
        if not ids:
            raise UserError("an input is empty after tokenization")
        if len(ids) > model.n_ctx:
            raise UserError(f"an input has {len(ids)} tokens; the context holds {model.n_ctx}")
        ctx = model.new_context(pooling=pooling)
        out = ctx.forward(Batch.from_tokens(ids, start=0, seq=0, output="last"))
        if out.embeddings is None:
            raise UserError(f"the architecture '{model.arch}' returned no pooled embeddings")
        v = np.asarray(model.backend.to_numpy(out.embeddings), dtype=np.float64).reshape(-1)
        if normalize:
            norm = float(np.linalg.norm(v))
            v = v / norm if norm > 0 else v
        rows.append(v.astype(np.float32))
    return np.stack(rows)

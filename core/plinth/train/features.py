"""The target's side of training: features and next-token logits from plinth's own forward.

The drafter at inference reads the target's taps from plinth's forwards (prefill chunks, verify
batches) on the int8 path; training reads them from the same model file through the same code
(:meth:`plinth.model.Context.forward` with the draft's taps), one sequence in chunks, so the
features it learns from carry the numerics it will see.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..batch import Batch

CHUNK = 256  # rows per forward (a prompt prefill chunk's size in the server)


class TargetFeatures:
    """Features [T, n_taps * E] and next-token logits over the draft vocabulary [T, V_d] of whole sequences.

    The logits are the target's head rows at ``d2t`` applied to its final-normed last residual (tap
    ``n_layer``), in float32: a full-vocabulary head per row would cost six times the draft's whole step.
    """

    def __init__(self, model: Any, taps: Sequence[int], d2t: np.ndarray) -> None:
        self.model = model
        self.taps = tuple(int(t) for t in taps)
        self.n_layer = int(model.hparams.n_layer)
        self.ctx = model.new_context(taps=sorted(set(self.taps) | {self.n_layer}))
        self.be = model.backend
        w = model.weights.get("output_norm.weight")
        if w is None:
            from ..errors import UserError

            raise UserError(f"{model.path}: the target has no 'output_norm.weight'; train-drafter reads the "
                            "target's logits as head(rms_norm(last residual)) and supports such targets only")
        self.norm_w = np.asarray(self.be.to_numpy(w), dtype=np.float32)
        self.eps = float(model.hparams.norm_eps)
        self.d2t = np.asarray(d2t, dtype=np.int64)
        self.head = np.ascontiguousarray(head_table(model)[self.d2t])  # [V_d, E]

    def __call__(self, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(features [T, n_taps * E], next-token logits at d2t [T, V_d])."""
        toks = np.asarray(tokens, dtype=np.int64)
        ctx = self.ctx
        ctx.cache.clear(0)
        feats, last = [], []
        try:
            for s in range(0, toks.size, CHUNK):
                out = ctx.forward(Batch.from_tokens(toks[s:s + CHUNK], start=s, seq=0, output="none"))
                feats.append(np.concatenate([np.asarray(self.be.to_numpy(out.features[t]), dtype=np.float32)
                                             for t in self.taps], axis=1))
                last.append(np.asarray(self.be.to_numpy(out.features[self.n_layer]), dtype=np.float32))
        finally:
            ctx.cache.clear(0)
        h = np.concatenate(last)
        h = h / np.sqrt((h * h).mean(axis=1, keepdims=True) + self.eps) * self.norm_w
        return np.concatenate(feats), h @ self.head.T


def embed_table(model: Any) -> np.ndarray:
    """The target's token embedding [V, E] as float32 (what the draft's block rows are looked up in)."""
    t = model.target_view().embed_table
    return np.asarray(t.dequantize() if hasattr(t, "dequantize") else model.backend.to_numpy(t), dtype=np.float32)


def head_table(model: Any) -> np.ndarray:
    """The target's LM head [V, E] as float32 (the draft head's rows start from it)."""
    t = model.target_view().head_weight
    return np.asarray(t.dequantize() if hasattr(t, "dequantize") else model.backend.to_numpy(t), dtype=np.float32)


def layer_weights(model: Any, il: int) -> dict[str, np.ndarray]:
    """Target layer ``il``'s weights as float32 (the draft's cheap start)."""
    out = {}
    for k, w in model.weights.items():
        if k.startswith(f"blk.{il}."):
            name = k[len(f"blk.{il}."):].removesuffix(".weight")
            out[name] = np.array(w.dequantize() if hasattr(w, "dequantize") else model.backend.to_numpy(w),
                                   dtype=np.float32)
    return out

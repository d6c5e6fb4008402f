"""A toy bigram language model and a toy drafter.

The model: the next-token logits depend only on the current token, read from one
table ``bigram.weight: [n_vocab, n_vocab]`` (row = current token).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs
import numpy as np


@attrs.frozen
class ToyHParams:
    n_vocab: int


@attrs.frozen
class ToyOutput:
    logits: np.ndarray  # [n_tokens, n_vocab]


class ToyGraph:
    def __init__(self, table: np.ndarray) -> None:
        self.table = table  # [n_vocab, n_vocab]

    def forward(self, tokens: Sequence[int]) -> ToyOutput:
        return ToyOutput(logits=self.table[np.asarray(tokens, dtype=np.int64)])


class ToyBigram:
    """The three architecture steps: hparams, tensor declaration, graph."""

    name = "toy-bigram"

    def load_hparams(self, metadata: Mapping[str, Any], source: str) -> ToyHParams:
        key = "toy-bigram.vocab_size"
        if key not in metadata:
            raise KeyError(f"{source}: missing required key '{key}'")
        return ToyHParams(n_vocab=int(metadata[key]))

    def tensor_specs(self, hparams: ToyHParams) -> list[dict[str, Any]]:
        return [{"name": "bigram.weight", "shape": (hparams.n_vocab, hparams.n_vocab), "required": True}]

    def build(self, hparams: ToyHParams, weights: Mapping[str, Any], backend: Any) -> ToyGraph:
        table = backend.asarray(weights["bigram.weight"], dtype="float32")
        if table.shape != (hparams.n_vocab, hparams.n_vocab):
            raise ValueError(f"bigram.weight has shape {table.shape}, expected {(hparams.n_vocab,) * 2}")
        return ToyGraph(table)


class RepeatDrafter:
    """Proposes the last committed token again, ``n_max`` times (good for runs like "aaaa")."""

    name = "toy-repeat"

    def __init__(self, target: Any, options: Mapping[str, Any]) -> None:
        self.n_draft = int(options.get("n_max", 4))

    def requirements(self) -> Any:
        from plinth.speculative.base import DrafterRequirements

        return DrafterRequirements(max_draft=self.n_draft)  # no taps, no shared tensors

    def begin(self, seq: int, prompt_ids: Sequence[int]) -> None:
        """Nothing to set up: the engine passes the whole history to ``draft``."""

    def process(self, target_output: Any) -> None:
        """This drafter needs nothing from the target's batches."""

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Any:
        from plinth.speculative.base import Draft

        return Draft(tokens=(int(history[-1]),) * n_max if len(history) else ())

    def accept(self, seq: int, n_accepted: int) -> None:
        """It keeps no per-position state, so there is nothing to drop."""
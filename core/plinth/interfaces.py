"""Typed protocols for what plugins hand to the core.

These are structural types (``typing.Protocol``): a plugin's classes need not
inherit from them, only provide the methods, so plugin code is checkable by mypy
without depending on core internals.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Architecture(Protocol):
    """One model architecture, in three separate steps (:class:`plinth.graph.Architecture` implements
    them from ``hparams(r)``, ``tensors(hp)`` and a graph class)."""

    name: str

    def load_hparams(self, metadata: Mapping[str, Any], source: str) -> Any:
        """GGUF metadata -> frozen hparams (a missing required key names key and source)."""

    def tensor_specs(self, hparams: Any) -> Sequence[Any]:
        """Every tensor the architecture reads, as ``plinth.tensors.TensorSpec``."""

    def build(self, hparams: Any, weights: Mapping[str, Any], backend: Any) -> Any:
        """Weights on ``backend`` -> a :class:`plinth.graph.Graph` (``cache_layout()`` and
        ``forward(batch, cache, *, taps, pooling, embeddings) -> ForwardOutput``)."""


@runtime_checkable
class Drafter(Protocol):
    """A speculative-decoding drafter (llama.cpp's ``common_speculative_impl`` shape).

    * ``begin(seq, prompt_ids)``: a new sequence starts with this prompt.
    * ``process(target_output)``: after every target batch (prefill chunks and
      verify batches); sees the rows, positions and requested feature taps.
    * ``draft(seq, n_max, *, history, pos)``: propose up to ``n_max`` tokens after
      ``history[-1]`` (the last committed token, to sit at position ``pos``), as a
      :class:`plinth.speculative.base.Draft` (optionally with probabilities
      ``[n, n_vocab]`` or confidences ``[n]``).
    * ``accept(seq, n_accepted)``: how many of the last draft the target kept.
    * ``requirements()`` (optional): a :class:`plinth.speculative.base.DrafterRequirements`
      — feature taps, shared tensors, longest draft, vocabulary.

    :class:`plinth.speculative.base.BaseDrafter` documents the full protocol.
    """

    name: str

    def begin(self, seq: int, prompt_ids: Sequence[int]) -> None: ...

    def process(self, target_output: Any) -> None: ...

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Any: ...

    def accept(self, seq: int, n_accepted: int) -> None: ...


@runtime_checkable
class Verifier(Protocol):
    """A verification strategy for one drafted chain."""

    name: str

    def verify(self, draft_tokens: Sequence[int], draft_probs: Any, target_probs: Any, rng: Any) -> Any:
        """Return the accepted prefix length and the token that follows it."""


@runtime_checkable
class Backend(Protocol):
    """A compute backend: an array module plus transfers."""

    name: str
    xp: Any

    def asarray(self, array: Any) -> Any: ...

    def to_numpy(self, array: Any) -> Any: ...


@runtime_checkable
class Converter(Protocol):
    """An HF (config.json + safetensors) to GGUF converter.

    ``convert`` writes ``out_path`` and returns its notes: one-line strings on what was left out or
    assumed (``[]`` when nothing was), which it also prints to stderr prefixed with its plugin's name.
    """

    hf_arch: str

    def convert(self, model_dir: str, out_path: str, options: Mapping[str, Any]) -> list[str] | None: ...

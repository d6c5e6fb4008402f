"""Host round trips of the generation loops, measured on the strict backend.

A host round trip is one device-to-host transfer (see :mod:`plinth.testing.strict`).
Plain decoding needs exactly one per token: the logits row the sampler reads. These
functions run the real loops (:class:`plinth.generate.Generator`, the speculative engine)
on a model loaded with ``backend="strict"`` and count what each step reads back.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs

from .strict import count_transfers


def decode_step_transfers(model: Any, prompt: Sequence[int], n_steps: int = 8) -> list[int]:
    """Host round trips of each plain decode step after the prompt (decode forward + sampling).

    Returns one count per step (fewer when the model ends generation early). Needs a model
    on the strict backend; on another backend nothing is counted.
    """
    from ..generate import Generator

    counts: list[int] = []
    with count_transfers() as n:
        it = Generator(model).tokens(list(prompt), n_steps + 1)
        for i, _ in enumerate(it):  # the first token comes from the prompt's forward
            if i:
                counts.append(n.count - before)
            before = n.count
    return counts


@attrs.frozen
class SpecTransfers:
    """Host round trips of speculative decoding, after the prompt.

    n_steps: verify steps; total: round trips over those steps (drafting, verifying, rolling
    back, the drafters' bookkeeping); sites: where they came from (file:line -> count).
    """

    n_steps: int
    total: int
    sites: dict[str, int]

    @property
    def per_step(self) -> float:
        return self.total / self.n_steps if self.n_steps else 0.0


def speculative_step_transfers(model: Any, make_drafter: Callable[[], Any], prompt: Sequence[int],
                               max_tokens: int = 24, n_max: int = 4, verifier: str = "greedy") -> SpecTransfers:
    """Run speculative decoding with one drafter and count the host round trips of its verify steps."""
    from ..speculative.engine import SpecConfig, SpeculativeGenerator

    gen = SpeculativeGenerator(model, [make_drafter()], config=SpecConfig(n_max=n_max, verifier=verifier))
    with count_transfers() as n:
        it = gen.tokens(list(prompt), max_tokens)
        first = next(it, None)  # the prompt's forward and the first token
        start, start_sites = n.count, len(n.sites)
        if first is not None:
            for _ in it:
                pass
    sites: dict[str, int] = {}
    for s in n.sites[start_sites:]:
        where = s.split(": ", 1)[0]
        sites[where] = sites.get(where, 0) + 1
    return SpecTransfers(n_steps=gen.stats.n_steps, total=n.count - start, sites=sites)

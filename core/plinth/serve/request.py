"""What a request is to the scheduler: its settings and running state, the events it is sent, and the
exceptions :meth:`plinth.serve.scheduler.Scheduler.submit` raises."""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable

import attrs

from ..sampling import SamplerConfig
from ..speculative.engine import SpecStats


class QueueFull(Exception):
    """The waiting queue is at its bound; the client should retry later."""


class ShuttingDown(Exception):
    """The scheduler is stopping and takes no new requests."""


@attrs.frozen
class TokenInfo:
    """One emitted token: its id and, when asked for, its log-probability and the top alternatives."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class Event:
    """What the scheduler tells a request's handler: new text and tokens, or the end.

    finish: None while running; "stop" (end-of-generation token or stop string),
    "length" (max_tokens or the context), "cancelled" or "error" at the end.
    prompt: the prompt's tokens with their log-probabilities (``prompt_logprobs``), sent once,
    before the first generated token.
    """

    text: str = ""
    tokens: tuple[TokenInfo, ...] = ()
    finish: str | None = None
    error: str | None = None
    stats: dict[str, Any] | None = None
    prompt: tuple[TokenInfo, ...] | None = None


@attrs.define(eq=False)
class Request:
    """One generation request and its running state (owned by the scheduler thread once admitted).

    logprobs: None (off) or k >= 0: each generated token's log-probability and the top k.
    prompt_logprobs: the same for the prompt's tokens (every prompt row's logits are computed; the
        first token has no log-probability); the prompt is then always prefilled.
    leader: another request with the same prompt (the choices of one ``n`` > 1 request): this one
        waits for the leader's prefill and copies its cache rows and last logits instead of
        prefilling the prompt again.
    """

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplerConfig
    emit: Callable[[Event], None]
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    speculative: bool = True
    constraint: Any = None  # the grammar state (plinth.grammar.ConstraintState) its tokens must follow, or None
    leader: Request | None = None
    followed: bool = False  # some request's leader: keeps its prompt's last logits for the followers
    id: int = attrs.field(factory=itertools.count().__next__)
    # running state
    seq: int = -1
    n_prefilled: int = 0
    prompt_looked_up: bool = False  # in the prompt cache (once, at its first step)
    prompt_logits: Any = None  # the logits of the last prompt token, once prefilled (for the followers)
    prompt_infos: list[TokenInfo] = attrs.field(factory=list)
    prompt_sent: bool = False
    history: list[int] = attrs.field(factory=list)
    n_generated: int = 0
    cancelled: bool = False
    done: bool = False
    sampler: Any = None
    rng: Any = None
    verifier: Any = None
    draft_state: Any = None  # its drafting policy's state (plinth.serve.spec_policy.SeqDraftState), speculative
    unseen: Any = None  # the rows its drafters have not seen yet (plinth.speculative.step.Unseen), speculative
    text: Any = None  # the TextStream (plinth.generate) of the generated tokens
    stats: SpecStats = attrs.field(factory=SpecStats)
    t_submit: float = attrs.field(factory=time.perf_counter)
    t_first: float | None = None
    t_last: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.n_prefilled < len(self.prompt_ids)

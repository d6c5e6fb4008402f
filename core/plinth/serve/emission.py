"""Text emission: a request's decided tokens recorded, turned into text and sent as events.

A request ends here on an end-of-generation token, its token budget, the context's end or a stop
string; its text comes from one :class:`plinth.generate.TextStream` (the holder ``plinth
generate`` streams through), so it never ends in the middle of a character and never shows any
part of a stop string.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np

from .request import Event, Request, TokenInfo


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of one logits row [n_vocab]."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def token_info(token: int, logits: Any, top: int | None) -> TokenInfo:
    """``token``'s :class:`TokenInfo`: with ``top`` (not None) its log-probability under ``logits`` and the
    ``top`` most likely tokens'."""
    if top is None:
        return TokenInfo(token)
    lp = log_softmax(logits)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        ids = np.argpartition(-lp, top)[:top]
        ids = ids[np.argsort(-lp[ids], kind="stable")]
        best = tuple((int(i), float(lp[i])) for i in ids)
    return TokenInfo(token, float(lp[token]), best)


class Emitter:
    """Records decided tokens of requests and sends their text; ``finish(req, reason)`` ends one."""

    def __init__(self, tokenizer: Any, n_ctx: int, metrics: Any, finish: Callable[[Request, str], None]) -> None:
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.metrics = metrics
        self.finish = finish

    def emit(self, req: Request, decided: Sequence[tuple[int, Any]]) -> None:
        """Record ``decided`` (token, its logits row) for ``req``, send their text, end ``req`` when done."""
        tok, metrics = self.tokenizer, self.metrics
        infos: list[TokenInfo] = []
        finish = None
        out = req.text
        text = ""
        for token, lg in decided:
            if tok.is_eog(token):
                finish, req.stats.stop_reason = "stop", "end of generation token"
                break
            req.history.append(token)
            req.n_generated += 1
            req.stats.n_generated += 1
            metrics.tokens_out += 1
            now = time.perf_counter()
            if req.t_first is None:
                req.t_first = now
                metrics.observe_ttft(now - req.t_submit)
            elif req.t_last is not None:
                metrics.observe_itl(now - req.t_last)
            req.t_last = now
            infos.append(token_info(token, lg, req.logprobs))
            text += out.feed(token)
            if out.stopped:
                finish, req.stats.stop_reason = "stop", "stop string"
                break
            if req.n_generated >= req.max_tokens or len(req.history) >= self.n_ctx:
                finish = "length"
                req.stats.stop_reason = "max tokens" if req.n_generated >= req.max_tokens else "context full"
                break
        prompt = None
        if req.prompt_logprobs is not None and not req.prompt_sent:
            prompt, req.prompt_sent = tuple(req.prompt_infos), True
        if finish is not None:
            text += out.finish()
        if infos or text or prompt is not None:
            req.emit(Event(text=text, tokens=tuple(infos), prompt=prompt))
        if finish is not None:
            self.finish(req, finish)

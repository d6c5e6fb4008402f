"""The generation loop: prompt in, streamed text out.

Stops on an end-of-generation token, on a stop string, or after ``max_tokens``;
detokenises incrementally so a multi-byte character split across tokens is
never printed in halves; reports tokens/s split into prompt and decode.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Iterator, Sequence

import attrs
import numpy as np

from .errors import UserError
from .sampling import Sampler, SamplerConfig


@attrs.define
class GenerationStats:
    n_prompt: int = 0
    n_generated: int = 0
    prompt_s: float = 0.0
    decode_s: float = 0.0
    sample_s: float = 0.0
    stop_reason: str = ""
    wall_s: float = 0.0  # prompt to last token, everything included (sampling, detokenising, streaming)

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.prompt_s if self.prompt_s else 0.0

    @property
    def decode_tps(self) -> float:
        # the first generated token comes from the prefill; the rest from decode steps
        steps = max(self.n_generated - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0

    @property
    def wall_decode_tps(self) -> float:
        """Generated tokens per second after the prompt, by the wall clock (the user's view)."""
        steps = max(self.n_generated - 1, 0)
        t = self.wall_s - self.prompt_s
        return steps / t if t > 0 else 0.0

    def summary(self) -> str:
        return (f"prompt: {self.n_prompt} tokens in {self.prompt_s:.2f} s ({self.prompt_tps:.1f} tok/s); "
                f"decode: {self.n_generated} tokens in {self.decode_s:.2f} s ({self.decode_tps:.1f} tok/s; "
                f"{self.wall_decode_tps:.1f} tok/s wall, with sampling and streaming); "
                f"sampling {self.sample_s * 1000:.1f} ms; stop: {self.stop_reason}")


def render_chat(template: str | None, messages: Sequence[dict[str, str]], tokenizer: Any,
                add_generation_prompt: bool = True) -> str:
    """Render ``messages`` with the model's GGUF chat template (Jinja2)."""
    source = getattr(tokenizer, "source", None) or "the model"
    where = f"{source}: key 'tokenizer.chat_template'"
    if not template:
        raise UserError(f"{source}: this model has no 'tokenizer.chat_template'; run without --chat")
    compiled = _chat_template(template, where)
    bos = tokenizer.tokens[tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else ""
    eos = tokenizer.tokens[tokenizer.eos_id] if getattr(tokenizer, "eos_id", None) is not None else ""
    try:
        return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                               bos_token=bos, eos_token=eos)
    except UserError:
        raise
    except Exception as exc:  # jinja2.TemplateError, or a template calling a method wrongly
        raise UserError(f"{where}: the template failed while rendering: {type(exc).__name__}: {exc}") from None


@functools.lru_cache(maxsize=16)
def _chat_template(template: str, where: str) -> Any:
    """``template`` compiled in a sandbox, once per template and source (compiling SmolLM2's took ~1.5 ms,
    the whole of a render: a server rendered every request's messages). ``where`` names the key in the
    errors, the template's own ``raise_exception`` included."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise UserError(f"{where}: the template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"{where}: template syntax error at line {exc.lineno}: {exc.message}") from None


class Generator:
    """Runs one model with one sampler; ``stream`` yields text chunks, ``tokens`` token ids.

    Subclasses change how tokens are produced (speculative decoding overrides
    :meth:`tokens`); the text side — incremental detokenisation and stop
    strings, :class:`TextStream` — is shared (the server's scheduler uses it too).

    A model file without a tokenizer (no ``tokenizer.ggml.model``) decodes from token ids:
    :meth:`tokens` and :meth:`generate` run until ``max_tokens`` or the context's end (it has no
    end-of-generation token); :meth:`stream` needs text, and raises the tokenizer's error.
    """

    def __init__(self, model: Any, sampler: Sampler | None = None, prefix_embeddings: Any = None,
                 constraint: Any = None) -> None:
        """``prefix_embeddings``: [n, n_embd] rows (an image's, from the architecture's image encoder)
        run before the prompt tokens, at positions 0..n-1, as embedding rows of the batch."""
        self.model = model
        metadata = getattr(model, "metadata", None)
        has_tokenizer = metadata is None or "tokenizer.ggml.model" in metadata
        #: the model's tokenizer, or None for a tokenizer-less file
        self.tokenizer = model.tokenizer if has_tokenizer else None
        self.sampler = sampler or Sampler(SamplerConfig(temperature=0.0))
        self.stats = GenerationStats()
        self.tokens_out: list[int] = []
        self.prefix_embeddings = prefix_embeddings
        #: a :class:`plinth.grammar.Constraint` the output must follow (each generation starts its own state,
        #: :attr:`grammar`), or None
        self.constraint = constraint
        self.grammar: Any = None

    @property
    def n_prefix(self) -> int:
        rows = getattr(self, "prefix_embeddings", None)
        return 0 if rows is None else int(rows.shape[0])

    def _check_prompt(self, prompt_ids: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise UserError("the prompt is empty after tokenization")
        n_ctx, n_pre = self.model.n_ctx, self.n_prefix
        if len(prompt_ids) + n_pre >= n_ctx:
            rows = f" and {n_pre} image rows" if n_pre else ""
            raise UserError(f"the prompt has {len(prompt_ids)} tokens{rows}; the context holds {n_ctx}")
        return prompt_ids, min(max_tokens, n_ctx - len(prompt_ids) - n_pre)

    def _new_stats(self, n_prompt: int) -> GenerationStats:
        return GenerationStats(n_prompt=n_prompt)

    def _choose(self, logits: Any, history: Sequence[int]) -> int:
        """The sampler's token, under the grammar when there is one (its state then takes the token)."""
        token = self.sampler.token(logits, history, self.grammar)
        if self.grammar is not None:
            self.grammar.advance(token)
        return token

    def tokens(self, prompt_ids: Sequence[int], max_tokens: int = 128) -> Iterator[int]:
        """Generated token ids, one at a time (end-of-generation tokens are not yielded)."""
        prompt_ids, max_tokens = self._check_prompt(prompt_ids, max_tokens)
        self.sampler.n_prompt = len(prompt_ids)  # (frequency / presence penalties count the output only)
        self.grammar = self.constraint.start() if self.constraint is not None else None
        ctx = self.context = self.model.new_context()
        stats = self.stats = self._new_stats(len(prompt_ids))
        history = list(prompt_ids)
        self.tokens_out = []
        t0 = time.perf_counter()
        try:
            yield from self._plain_loop(ctx, prompt_ids, history, max_tokens, t0)
        finally:
            stats.wall_s = time.perf_counter() - t0

    def _plain_loop(self, ctx: Any, prompt_ids: list[int], history: list[int], max_tokens: int,
                    t0: float) -> Iterator[int]:
        model, stats = self.model, self.stats
        if self.n_prefix:
            from .batch import Batch

            ctx.forward(Batch.from_embeddings(self.prefix_embeddings, output="none"))
        out = ctx.decode(prompt_ids)
        stats.prompt_s = time.perf_counter() - t0
        while True:
            t1 = time.perf_counter()
            logits = np.asarray(model.backend.to_numpy(out.logits[-1]))
            token = self._choose(logits, history)
            stats.sample_s += time.perf_counter() - t1
            done = self._record(token, history, max_tokens)
            if done is None:
                return
            yield token
            if done:
                return
            t2 = time.perf_counter()
            out = ctx.decode([token])
            stats.decode_s += time.perf_counter() - t2

    def _record(self, token: int, history: list[int], max_tokens: int) -> bool | None:
        """Take a decided token: None for an end-of-generation token (not recorded: stop now);
        True once the budget or the context is full (stop after yielding it); False otherwise."""
        stats = self.stats
        if self.tokenizer is not None and self.tokenizer.is_eog(token):
            stats.stop_reason = "end of generation token"
            return None
        self.tokens_out.append(token)
        history.append(token)
        stats.n_generated += 1
        if stats.n_generated >= max_tokens:
            used = stats.n_prompt + self.n_prefix + stats.n_generated
            stats.stop_reason = "max tokens" if used < self.model.n_ctx else "context full"
            return True
        return False

    def generate(self, prompt_ids: Sequence[int], max_tokens: int = 128) -> list[int]:
        """All generated token ids."""
        return list(self.tokens(prompt_ids, max_tokens))

    def stream(self, prompt_ids: Sequence[int], max_tokens: int = 128,
               stop: Sequence[str] = ()) -> Iterator[str]:
        """Text chunks as tokens arrive; never half a UTF-8 character; ends at a stop string.

        With stop strings, text that could be the start of one is held back until the
        next tokens show it is not, so no part of a stop string is ever yielded.
        """
        out = TextStream(self.tokenizer if self.tokenizer is not None else self.model.tokenizer, stop)
        gen = self.tokens(prompt_ids, max_tokens)
        for token in gen:
            chunk = out.feed(token)
            if chunk:
                yield chunk
            if out.stopped:
                self.stats.stop_reason = "stop string"
                gen.close()
                return
        rest = out.finish()
        if rest:
            yield rest


class TextStream:
    """The text of generated tokens as it may be sent: decoded incrementally (never half a UTF-8
    character), ending at the first stop string (which is never sent, nor any part of it).

    :meth:`feed` takes one token and returns the text that can be sent now: text that could be
    the start of a stop string is held back until the next tokens show it is not. At a stop
    string it returns the text before it and sets :attr:`stopped`; later tokens give nothing.
    :meth:`finish` returns what is still held back at the end. The bytes of a character the last
    token left unfinished (``max_tokens`` cut it) are dropped there, so the text never ends in the
    middle of a character (nor in a U+FFFD standing for one).
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.decoder = tokenizer.incremental_decoder(skip_special=True)
        self.stop = tuple(stop)
        self.held = ""
        self.stopped = False

    def feed(self, token: int) -> str:
        if self.stopped:
            return ""
        text = self.held + self.decoder.feed(token)
        if not self.stop:
            return text
        hit = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0:
            self.stopped, self.held = True, ""
            return text[:hit]
        cut = len(text) - _stop_prefix_len(text, self.stop)
        self.held = text[cut:]
        return text[:cut]

    def finish(self) -> str:
        self.decoder.flush()  # (an unfinished character's bytes: dropped)
        text, self.held = self.held, ""
        return text


def _stop_prefix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is the beginning of a stop string (0 if none)."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def time_prefill_decode(model: Any, n_prompt: int, n_decode: int, runs: int = 3,
                        seed: int = 0) -> tuple[float, float]:
    """Best-of-``runs`` prompt and greedy decode speed, in tokens/s.

    Each run prefills ``n_prompt`` random token ids into a fresh context, then
    decodes ``n_decode`` tokens one at a time (argmax of the last row).
    """
    prompt = np.random.default_rng(seed).integers(0, model.n_vocab, n_prompt).tolist()
    best_pp = best_tg = float("inf")
    for _ in range(runs):
        ctx = model.new_context()
        t0 = time.perf_counter()
        out = ctx.decode(prompt)
        best_pp = min(best_pp, time.perf_counter() - t0)
        token = int(np.argmax(model.backend.to_numpy(out.logits[-1])))
        t0 = time.perf_counter()
        for _ in range(n_decode):
            out = ctx.decode([token])
            token = int(np.argmax(model.backend.to_numpy(out.logits[-1])))
        best_tg = min(best_tg, time.perf_counter() - t0)
    return n_prompt / best_pp, n_decode / best_tg

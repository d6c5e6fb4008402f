"""The HTTP side: an OpenAI-compatible ASGI app (Starlette) in front of a :class:`Scheduler`.

Endpoints: ``GET /`` (the chat page), ``GET /health``, ``GET /metrics`` (Prometheus
text), ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions``
(streamed as server-sent events ending in ``data: [DONE]`` when ``stream`` is true).

The scheduler runs in its own thread; each request's events cross to the event loop
through an :class:`asyncio.Queue`. A streaming client that goes away cancels its
request, and the scheduler frees its cache rows at the next step.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import UserError
from ..sampling import SamplerConfig
from .metrics import render_metrics
from .protocol import APIError, Params, chat_params, completion_params
from ..speculative.step import GreedyNeedsTemperatureZero
from .request import Event, QueueFull, Request, ShuttingDown
from .scheduler import Scheduler

PAGE = Path(__file__).with_name("static") / "chat.html"
MAX_BODY = 16 * 1024 * 1024  # bytes; a larger body is refused before it is parsed


class Server:
    """What the endpoints share: the model, its served name(s) and the scheduler."""

    def __init__(self, model: Any, scheduler: Scheduler, model_id: str, aliases: tuple[str, ...] = (),
                 spec_names: tuple[str, ...] = (), plugins: tuple[str, ...] = ()) -> None:
        self.model = model
        self.plugins = plugins  # the plugins this server loaded (an operator's check of a deployment)
        self.tokenizer = model.tokenizer
        self.scheduler = scheduler
        self.model_id = model_id
        self.names = {model_id, *aliases}
        self.spec_names = spec_names
        self.created = int(time.time())
        self.requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> count

    def count(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    # -------------------------------------------------------------- prompts

    def prompt_ids(self, p: Params) -> list[int]:
        """Token ids of the request's prompt (the chat template for messages)."""
        tok = self.tokenizer
        if p.messages is not None:
            from ..generate import render_chat

            try:
                text = render_chat(tok.chat_template, list(p.messages), tok)
            except UserError as exc:
                raise APIError(400, str(exc).replace("; run without --chat", "; use /v1/completions"),
                               param="messages") from None
            return tok.encode(text, add_special=False, parse_special=True)
        if p.prompt_ids is not None:
            bad = [t for t in p.prompt_ids if not 0 <= t < self.model.n_vocab]
            if bad:
                raise APIError(422, f"'prompt': token id {bad[0]} is outside the vocabulary (0..{self.model.n_vocab - 1})",
                               param="prompt", code="invalid_value")
            return list(p.prompt_ids)
        return tok.encode(p.prompt or "", add_special=True)

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_id}'",
                           param="model", code="model_not_found")


async def _body(request: HTTPRequest) -> Any:
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise APIError(413, f"the request body has {len(raw)} bytes; the server takes at most {MAX_BODY}")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Formatter:
    """Turns scheduler events into OpenAI response objects of one request."""

    def __init__(self, server: Server, chat: bool, logprobs: int | None) -> None:
        self.server = server
        self.chat = chat
        self.logprobs = logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.offset = 0

    def _piece(self, token: int) -> str:
        """A token's text; a piece that is not whole UTF-8 is written ``bytes:\\xNN..`` (as OpenAI does)."""
        raw = self.server.tokenizer.token_to_piece(token, special=False)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def logprob_obj(self, events: list[Event]) -> Any:
        if self.logprobs is None:
            return None
        infos = [t for e in events for t in e.tokens]
        if self.chat:
            def entry(tid: int, lp: float) -> dict[str, Any]:
                raw = self.server.tokenizer.token_to_piece(tid, special=False)
                return {"token": self._piece(tid), "logprob": lp, "bytes": list(raw)}

            return {"content": [{**entry(t.token, t.logprob),
                                 "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in infos]}
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in infos:
            piece = self._piece(t.token)
            out["tokens"].append(piece)
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append({self._piece(i): lp for i, lp in t.top})
            out["text_offset"].append(self.offset)
            self.offset += len(piece)
        return out

    def chunk(self, events: list[Event], text: str, finish: str | None, first: bool = False) -> dict[str, Any]:
        model = self.server.model_id
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text or (first and not finish):
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": self.logprob_obj(events), "finish_reason": finish}
            return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": model,
                    "system_fingerprint": None, "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": self.logprob_obj(events), "finish_reason": finish}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": model,
                "system_fingerprint": None, "choices": [choice]}

    def whole(self, events: list[Event], finish: str, usage: dict[str, int], stats: Any) -> dict[str, Any]:
        text = "".join(e.text for e in events)
        model = self.server.model_id
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self.logprob_obj(events), "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprob_obj(events), "finish_reason": finish}
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": model, "system_fingerprint": None,
                "choices": [choice], "usage": usage, "plinth": stats}


def _openai_finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


class Mailbox:
    """Events from the scheduler thread to the event loop's request queues, one wake-up of the loop for
    a burst (a step's events for every stream) instead of one per event.

    ``post`` (any thread) queues an event and wakes the loop unless a wake-up is already pending;
    the loop hands every queued event to its request's queue. ``settle`` (the scheduler thread, after
    a step that posted) waits, at most ``timeout`` seconds, until the loop has also run the streams
    those events woke (their chunks formatted and written to the sockets). On a machine whose cores
    the kernel threads fill, the loop's work then runs between two forwards instead of preempting
    one of their threads, which stalls every parallel region of the forward (each waits for its
    slowest thread); see docs/serving.md."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: collections.deque[tuple[asyncio.Queue, Event]] = collections.deque()
        self._waking = False
        self._posted = False

    def post(self, queue: asyncio.Queue, ev: Event) -> None:
        self._items.append((queue, ev))
        self._posted = True
        if not self._waking:
            self._waking = True
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the event loop is closed: the server is stopping
                pass

    def _drain(self) -> None:
        self._waking = False  # (before taking the items: a post from now on wakes the loop again)
        items = self._items
        while items:
            queue, ev = items.popleft()
            queue.put_nowait(ev)

    def settle(self, timeout: float = 0.005) -> None:
        if not self._posted:
            return
        self._posted = False
        done = threading.Event()
        try:
            # (queued behind the drain and the streams it wakes: it runs once they have written)
            self.loop.call_soon_threadsafe(self.loop.call_soon, done.set)
        except RuntimeError:
            return
        done.wait(timeout)


class Handlers:
    """The routes of one app, as methods sharing the server and the event loops' mailboxes."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.sched = server.scheduler
        self.boxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}  # (one per loop serving requests: usually one)

    def settle(self) -> None:
        for box in list(self.boxes.values()):
            box.settle()

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        sched = self.sched
        sched.after_step = self.settle
        sched.start()
        try:
            yield
        finally:
            sched.stop()
            sched.after_step = None

    def routes(self) -> list[Route]:
        return [
            Route("/", self.page, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ]

    async def page(self, request: HTTPRequest) -> Response:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    async def health(self, request: HTTPRequest) -> Response:
        server, sched = self.server, self.sched
        return JSONResponse({"status": "ok", "model": server.model_id, "active": sched.n_active,
                             "queued": sched.queue_depth, "cache_tokens": sched.cache_tokens(),
                             "cache_sequences": sched.cache_seqs(), "plugins": list(server.plugins),
                             "pid": os.getpid()})

    async def metrics(self, request: HTTPRequest) -> Response:
        return PlainTextResponse(render_metrics(self.server), media_type="text/plain; version=0.0.4")

    async def models(self, request: HTTPRequest) -> Response:
        server = self.server
        m = server.model
        return JSONResponse({"object": "list", "data": [{
            "id": server.model_id, "object": "model", "created": server.created, "owned_by": "plinth",
            "arch": m.arch, "n_ctx": m.n_ctx, "speculative": list(server.spec_names)}]})

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: HTTPRequest) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: HTTPRequest, chat: bool) -> Response:
        server, sched = self.server, self.sched
        endpoint = "chat" if chat else "completions"
        try:
            body = await _body(request)
            p = chat_params(body) if chat else completion_params(body)
            server.check_model(p.model)
            ids = await run_in_threadpool(server.prompt_ids, p)
            n_ctx = server.model.n_ctx
            if not ids:
                raise APIError(400, "the prompt is empty after tokenization", param="prompt")
            if len(ids) >= n_ctx:
                raise APIError(400, f"the prompt has {len(ids)} tokens; the context holds {n_ctx} (at most "
                               f"{n_ctx - 1} prompt tokens leave room for one generated token)",
                               param="messages" if chat else "prompt", code="context_length_exceeded")
            room = n_ctx - len(ids)
            max_tokens = room if p.max_tokens is None else min(p.max_tokens, room)
            sampling = SamplerConfig(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                                     repetition_penalty=p.repetition_penalty, seed=p.seed)
            queue: asyncio.Queue[Event] = asyncio.Queue()
            loop = asyncio.get_running_loop()
            box = self.boxes.get(loop) or self.boxes.setdefault(loop, Mailbox(loop))

            def emit(ev: Event) -> None:
                box.post(queue, ev)

            req = Request(prompt_ids=ids, max_tokens=max_tokens, sampling=sampling, emit=emit, stop=p.stop,
                          logprobs=p.logprobs, speculative=p.speculative)
            try:
                sched.submit(req)
            except QueueFull as exc:
                raise APIError(429, f"the server is busy: {exc}; retry later", type="rate_limit_error",
                               code="queue_full", headers={"Retry-After": "1"}) from None
            except GreedyNeedsTemperatureZero as exc:
                raise APIError(400, f"'temperature': {exc}; or send 'speculative': false", param="temperature",
                               code="invalid_value") from None
            except ShuttingDown as exc:
                raise APIError(503, str(exc), type="server_error", code="unavailable",
                               headers={"Retry-After": "5"}) from None
        except APIError as exc:
            server.count(endpoint, exc.status)
            return _error(exc)
        fmt = _Formatter(server, chat, p.logprobs)
        usage = {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
        server.count(endpoint, 200)
        if p.stream:
            return StreamingResponse(self._stream(req, queue, fmt, usage, p.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._collect(request, req, queue, fmt, usage)

    async def _collect(self, request: HTTPRequest, req: Request, queue: asyncio.Queue, fmt: _Formatter,
                       usage: dict[str, int]) -> Response:
        events: list[Event] = []
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(queue.get(), 1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        self.sched.cancel(req)
                        return Response(status_code=499)
                    continue
                events.append(ev)
                usage["completion_tokens"] += len(ev.tokens)
                if ev.finish is not None:
                    break
        finally:
            if not req.done:
                self.sched.cancel(req)
        if ev.finish == "error" or (ev.finish == "cancelled" and ev.error):
            return _error(APIError(500 if ev.finish == "error" else 503, ev.error or "generation failed",
                                   type="server_error"))
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return JSONResponse(fmt.whole(events, _openai_finish(ev.finish), usage, ev.stats))

    async def _stream(self, req: Request, queue: asyncio.Queue, fmt: _Formatter, usage: dict[str, int],
                      include_usage: bool) -> AsyncIterator[str]:
        finished = False
        try:
            if fmt.chat:
                yield _sse(fmt.chunk([], "", None, first=True))
            while True:
                ev = await queue.get()
                usage["completion_tokens"] += len(ev.tokens)
                if ev.text or ev.tokens:
                    yield _sse(fmt.chunk([ev], ev.text, None))
                if ev.finish is not None:
                    finished = True
                    if ev.finish == "error" or (ev.finish == "cancelled" and ev.error):
                        yield _sse(APIError(500, ev.error or "generation failed", type="server_error").body())
                        break
                    last = fmt.chunk([], "", _openai_finish(ev.finish))
                    last["plinth"] = ev.stats
                    yield _sse(last)
                    if include_usage:
                        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                        obj = fmt.chunk([], "", None)
                        obj["choices"] = []
                        obj["usage"] = usage
                        yield _sse(obj)
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                self.sched.cancel(req)


def build_app(server: Server) -> Starlette:
    """The ASGI app; starting it starts the scheduler thread, stopping it stops the thread."""
    handlers = Handlers(server)
    return Starlette(routes=handlers.routes(), lifespan=handlers.lifespan)

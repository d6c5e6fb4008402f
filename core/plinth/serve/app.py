"""The HTTP side: an OpenAI-compatible ASGI app (Starlette) in front of a :class:`Scheduler`.

Endpoints: ``GET /`` (the chat page), ``GET /health``, ``GET /metrics`` (Prometheus text),
``GET /v1/models`` and ``GET /v1/models/{id}``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (streamed as server-sent events ending in ``data: [DONE]`` when
``stream`` is true), ``POST /v1/embeddings``, and ``POST /tokenize`` / ``POST /detokenize``
(llama-server's and vLLM's request shapes). Every error, 404 and 405 included, is an OpenAI
error object.

The scheduler runs in its own thread; each request's events cross to the event loop
through an :class:`asyncio.Queue`. A client that goes away, streamed or not, cancels its
request(s), and the scheduler frees their cache rows at the next step.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import logging
import os
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import attrs
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..errors import UserError
from ..sampling import SamplerConfig
from ..speculative.step import GreedyNeedsTemperatureZero
from .metrics import render_metrics
from .protocol import APIError, Params, chat_params, completion_params, unserved
from .request import Event, QueueFull, Request, ShuttingDown, TokenInfo
from .scheduler import Scheduler

STATIC = Path(__file__).with_name("static")
PAGE = STATIC / "chat.html"
MAX_BODY = 16 * 1024 * 1024  # bytes; a larger body is refused before it is parsed
_log = logging.getLogger("plinth.serve")


class Server:
    """What the endpoints share: the model, its served name(s), the scheduler and the server's options.

    lenient: unknown request fields are logged and dropped instead of refused (400).
    pooling: the embeddings' pooling ("model": the model's own, else mean; or mean / cls / last).
    allowed_origins: the origins a browser may call this server from (CORS); empty: none.
    """

    def __init__(self, model: Any, scheduler: Scheduler, model_id: str, aliases: tuple[str, ...] = (),
                 spec_names: tuple[str, ...] = (), plugins: tuple[str, ...] = (), *, lenient: bool = False,
                 pooling: str = "model", allowed_origins: Sequence[str] = ()) -> None:
        self.model = model
        self.plugins = plugins  # the plugins this server loaded (an operator's check of a deployment)
        self.tokenizer = model.tokenizer
        self.scheduler = scheduler
        self.model_id = model_id
        self.names = {model_id, *aliases}
        self.spec_names = spec_names
        self.created = int(time.time())
        self.requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> count
        self.lenient = bool(lenient)
        self.pooling = pooling
        self.allowed_origins = tuple(allowed_origins)

    def count(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    # -------------------------------------------------------------- prompts

    def check_ids(self, ids: Sequence[int], param: str) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.model.n_vocab]
        if bad:
            raise APIError(422, f"'{param}': token id {bad[0]} is outside the vocabulary (0..{self.model.n_vocab - 1})",
                           param=param, code="invalid_value")
        return list(ids)

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        from ..generate import render_chat

        tok = self.tokenizer
        try:
            return render_chat(tok.chat_template, list(messages), tok, add_generation_prompt=add_generation_prompt)
        except UserError as exc:
            raise APIError(400, str(exc).replace("; run without --chat", "; use /v1/completions"),
                           param="messages") from None

    def prompt_ids(self, p: Params) -> list[list[int]]:
        """Token ids of each of the request's prompts (one: the chat template over the messages)."""
        tok = self.tokenizer
        if p.messages is not None:
            return [tok.encode(self.render(p.messages), add_special=False, parse_special=True)]
        out = []
        for prompt in p.prompts or ():
            if isinstance(prompt, str):
                out.append(tok.encode(prompt, add_special=True))
            else:
                out.append(self.check_ids(prompt, "prompt"))
        return out

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_id}'",
                           param="model", code="model_not_found")

    def model_object(self) -> dict[str, Any]:
        m = self.model
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "plinth",
                "arch": m.arch, "n_ctx": m.n_ctx, "speculative": list(self.spec_names)}


def context_error(n: int, n_ctx: int, what: str) -> APIError:
    """OpenAI's wording and code for a prompt the context cannot hold: clients match them (litellm the
    wording, LangChain the code's name in the message, as older openai clients put the whole body there)."""
    return APIError(400, f"This model's maximum context length is {n_ctx} tokens. However, your {what} resulted in "
                    f"{n} tokens (at most {n_ctx - 1} leave room for one generated token). Please reduce the length "
                    f"of the {what}. (context_length_exceeded)", param=what, code="context_length_exceeded")


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


def _fields(body: Any, known: Sequence[str], lenient: bool, what: str) -> dict[str, Any]:
    """``body`` as an object with only ``known`` fields (an unknown one: 400, or dropped when lenient)."""
    if not isinstance(body, dict):
        raise APIError(422, "the request body must be a JSON object", code="invalid_value")
    for name in list(body):
        if name not in known:
            if not lenient:
                raise APIError(400, f"'{name}': unknown field for {what}; this server does not honour it",
                               param=name, code="unknown_parameter")
            _log.warning("dropped unknown request field %s of %s (--lenient)", name, what)
            body = {k: v for k, v in body.items() if k != name}
    return body


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(422, f"'{name}': expected true or false, got {type(v).__name__}", param=name,
                       code="invalid_value")
    return v


def _id_list(v: Any, param: str) -> list[int] | None:
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return list(v)
    return None


class _Formatter:
    """Turns scheduler events into OpenAI response objects of one request (its choices by index)."""

    def __init__(self, server: Server, chat: bool, logprobs: int | None) -> None:
        self.server = server
        self.chat = chat
        self.logprobs = logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.offsets: dict[int, int] = collections.defaultdict(int)

    def _piece(self, token: int) -> str:
        """A token's text; a piece that is not whole UTF-8 is written ``bytes:\\xNN..`` (as OpenAI does)."""
        raw = self.server.tokenizer.token_to_piece(token, special=False)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def logprob_obj(self, index: int, infos: Sequence[TokenInfo]) -> Any:
        if self.logprobs is None:
            return None
        if self.chat:
            def entry(tid: int, lp: float | None) -> dict[str, Any]:
                raw = self.server.tokenizer.token_to_piece(tid, special=False)
                return {"token": self._piece(tid), "logprob": lp, "bytes": list(raw)}

            return {"content": [{**entry(t.token, t.logprob),
                                 "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in infos]}
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in infos:
            piece = self._piece(t.token)
            out["tokens"].append(piece)
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append({self._piece(i): lp for i, lp in t.top} if t.logprob is not None else None)
            out["text_offset"].append(self.offsets[index])
            self.offsets[index] += len(piece)
        return out

    def chunk(self, index: int, infos: Sequence[TokenInfo], text: str, finish: str | None,
              first: bool = False) -> dict[str, Any]:
        model = self.server.model_id
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text or (first and not finish):
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": self.logprob_obj(index, infos),
                      "finish_reason": finish}
            return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": model,
                    "system_fingerprint": None, "choices": [choice]}
        choice = {"index": index, "text": text, "logprobs": self.logprob_obj(index, infos), "finish_reason": finish}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": model,
                "system_fingerprint": None, "choices": [choice]}

    def choice(self, index: int, text: str, infos: Sequence[TokenInfo], finish: str) -> dict[str, Any]:
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": self.logprob_obj(index, infos), "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": self.logprob_obj(index, infos), "finish_reason": finish}

    def whole(self, choices: list[dict[str, Any]], usage: dict[str, int], stats: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.server.model_id, "system_fingerprint": None,
                "choices": choices, "usage": usage, "plinth": stats}


def _openai_finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"


class Mailbox:
    """Events from the scheduler thread to the event loop's request queues, one wake-up of the loop for
    a burst (a step's events for every stream) instead of one per event.

    ``settle`` (the scheduler thread: after each step, and before a forward where the step's planning
    posted a first token) wakes the loop for the events posted since the last one and waits, at most
    ``timeout`` seconds, until the loop has handed them to their requests' queues and run the streams
    they woke (their chunks formatted and written to the sockets). ``post`` queues an event; from the
    thread that settles it waits for that thread's next ``settle``, from any other thread it wakes the
    loop unless a wake-up is already pending. So the loop's work for a step runs after the step's last
    event, while the scheduler thread waits: not beside the step's sampling and emission, the two
    threads trading the GIL (that way a 16-stream step's sampling and emission took 1.0-1.3 ms, held
    0.4-0.5 ms; its time outside the forward 2.1-2.3 ms against 1.4-1.8), nor during the next forward.
    On a machine whose cores the kernel threads fill, a thread running during a forward preempts one of
    theirs, which stalls every parallel region of the forward (each waits for its slowest thread); see
    docs/serving.md."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: collections.deque[tuple[asyncio.Queue, Event]] = collections.deque()
        self._waking = False
        self._posted = False
        self._holder: int | None = None  # the thread that settles: its posts wait for its settle

    def post(self, queue: asyncio.Queue, ev: Event) -> None:
        self._items.append((queue, ev))
        self._posted = True
        if threading.get_ident() != self._holder:
            self._wake()

    def _wake(self) -> None:
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
        self._holder = threading.get_ident()
        if not self._posted:
            return
        self._posted = False
        if self._items:
            self._wake()
        done = threading.Event()
        try:
            # (queued behind the drain and the streams it wakes: it runs once they have written)
            self.loop.call_soon_threadsafe(self.loop.call_soon, done.set)
        except RuntimeError:
            return
        done.wait(timeout)


class _Choices:
    """The requests of one completions / chat request (its prompts x n choices) and their events."""

    def __init__(self, reqs: list[Request], echo: list[str | None], queue: asyncio.Queue) -> None:
        self.reqs = reqs
        self.echo = echo  # per choice: the prompt text to put before its completion (echo), or None
        self.queue = queue
        self.disconnected = False
        #: max_tokens 0 with echo: the prompt scored, the one token run to get there not returned
        self.score_only = False
        #: per choice, the reader of a reply that may hold tool calls (plinth.serve.structured), or None
        self.tools: list[Any] | None = None


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
        sched.send_events = self.settle
        sched.start()
        try:
            yield
        finally:
            sched.stop()
            sched.send_events = None

    def routes(self) -> list[Any]:
        return [
            Route("/", self.page, methods=["GET"]),
            Mount("/static", app=StaticFiles(directory=str(STATIC)), name="static"),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ]

    # -------------------------------------------------------------- errors

    async def http_error(self, request: HTTPRequest, exc: Exception) -> Response:
        """404, 405 and the other HTTP errors as OpenAI error objects."""
        status = getattr(exc, "status_code", 500)
        if status == 404:
            message, code = f"{request.method} {request.url.path}: no such route", "not_found"
        elif status == 405:
            message, code = f"{request.method} {request.url.path}: method not allowed", "method_not_allowed"
        else:
            message, code = str(getattr(exc, "detail", "") or exc), None
        return _error(APIError(status, message, code=code, headers=dict(getattr(exc, "headers", None) or {})))

    async def server_error(self, request: HTTPRequest, exc: Exception) -> Response:
        _log.exception("%s %s failed", request.method, request.url.path)
        return _error(APIError(500, f"{type(exc).__name__}: {exc}", type="server_error"))

    # -------------------------------------------------------------- plain routes

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
        return JSONResponse({"object": "list", "data": [self.server.model_object()]})

    async def model(self, request: HTTPRequest) -> Response:
        try:
            self.server.check_model(request.path_params["model_id"])
        except APIError as exc:
            return _error(exc)
        return JSONResponse(self.server.model_object())

    # -------------------------------------------------------------- tokenizer routes

    async def tokenize(self, request: HTTPRequest) -> Response:
        """llama-server's ``{"content", "add_special", "parse_special", "with_pieces"}`` and vLLM's
        ``{"model", "prompt" | "messages", "add_special_tokens", "add_generation_prompt",
        "return_token_strs"}``; the answer holds both servers' fields."""
        server = self.server
        try:
            body = _fields(await _body(request), ("content", "prompt", "messages", "model", "add_special",
                                                  "add_special_tokens", "parse_special", "with_pieces",
                                                  "add_generation_prompt", "return_token_strs"),
                           server.lenient, "/tokenize")
            server.check_model(body.get("model"))
            given = [k for k in ("content", "prompt", "messages") if body.get(k) is not None]
            if len(given) != 1:
                raise APIError(422, "give one of 'content' (llama-server), 'prompt' or 'messages' (vLLM)",
                               param="content", code="invalid_value")
            tok = server.tokenizer
            if given[0] == "messages":
                p = chat_params({"model": server.model_id, "messages": body["messages"]})
                text = server.render(p.messages or (), _flag(body, "add_generation_prompt", True))
                add, parse = _flag(body, "add_special_tokens", False), True
            else:
                text = body[given[0]]
                if not isinstance(text, str):
                    raise APIError(422, f"'{given[0]}': expected a string", param=given[0], code="invalid_value")
                # llama-server's content: no BOS unless asked; vLLM's prompt: the special tokens by default
                add = _flag(body, "add_special", False) if given[0] == "content" else \
                    _flag(body, "add_special_tokens", True)
                parse = _flag(body, "parse_special", True)
            ids = await run_in_threadpool(tok.encode, text, add_special=add, parse_special=parse)
        except APIError as exc:
            return _error(exc)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": server.model.n_ctx}
        pieces = [tok.token_to_piece(i, special=True).decode("utf-8", errors="replace") for i in ids]
        if _flag(body, "with_pieces", False):
            out["tokens"] = [{"id": i, "piece": p} for i, p in zip(ids, pieces)]
        else:
            out["tokens"] = ids
        if _flag(body, "return_token_strs", False):
            out["token_strs"] = pieces
        return JSONResponse(out)

    async def detokenize(self, request: HTTPRequest) -> Response:
        """``{"tokens": [...]}`` (and vLLM's ``model``): the text, as llama-server's ``content`` and vLLM's
        ``prompt``."""
        server = self.server
        try:
            body = _fields(await _body(request), ("tokens", "model"), server.lenient, "/detokenize")
            server.check_model(body.get("model"))
            toks = body.get("tokens")
            if toks == []:
                ids: list[int] = []
            else:
                got = _id_list(toks, "tokens")
                if got is None:
                    raise APIError(422, "'tokens': expected a list of token ids", param="tokens", code="invalid_value")
                ids = server.check_ids(got, "tokens")
        except APIError as exc:
            return _error(exc)
        text = server.tokenizer.decode(ids) if ids else ""
        return JSONResponse({"content": text, "prompt": text})

    # -------------------------------------------------------------- embeddings

    async def embeddings(self, request: HTTPRequest) -> Response:
        from .embeddings import choose_pooling, embed

        server = self.server
        try:
            body = _fields(await _body(request), ("input", "model", "encoding_format", "dimensions", "user", "pooling"),
                           server.lenient, "/v1/embeddings")
            if not isinstance(body.get("model"), str):
                raise APIError(422, "'model': required, a string", param="model", code="invalid_value")
            server.check_model(body["model"])
            fmt = body.get("encoding_format") or "float"
            if fmt not in ("float", "base64"):
                raise APIError(422, f"'encoding_format': 'float' or 'base64', got {fmt!r}", param="encoding_format",
                               code="invalid_value")
            n_embd = int(server.model.hparams.n_embd)
            dims = body.get("dimensions")
            if dims is not None and dims != n_embd:
                raise unserved("dimensions", f"this model's embeddings have {n_embd} dimensions; shortening them is "
                               "not served")
            try:
                pooling = choose_pooling(server.model, body.get("pooling") or server.pooling)
            except UserError as exc:
                raise APIError(422, f"'pooling': {exc}", param="pooling", code="invalid_value") from None
            inp = body.get("input")
            one = _id_list(inp, "input")
            if isinstance(inp, str):
                items: list[Any] = [inp]
            elif one is not None:
                items = [one]
            elif isinstance(inp, list) and inp and all(isinstance(x, str) or _id_list(x, "input") is not None
                                                       for x in inp):
                items = list(inp)
            else:
                raise APIError(422, "'input': expected a string, a list of token ids, or a non-empty list of either",
                               param="input", code="invalid_value")
            tok = server.tokenizer
            prompts = [tok.encode(x, add_special=True) if isinstance(x, str) else server.check_ids(x, "input")
                       for x in items]
            n_ctx = server.model.n_ctx
            for ids in prompts:
                if not ids:
                    raise APIError(400, "an input is empty after tokenization", param="input")
                if len(ids) > n_ctx:
                    raise APIError(400, f"This model's maximum context length is {n_ctx} tokens. However, your input "
                                   f"resulted in {len(ids)} tokens. Please reduce the length of the input. "
                                   "(context_length_exceeded)",
                                   param="input", code="context_length_exceeded")
            try:
                fut = self.sched.call(lambda: embed(server.model, prompts, pooling))
            except ShuttingDown as exc:
                raise APIError(503, str(exc), type="server_error", code="unavailable") from None
            try:
                vectors = await asyncio.wrap_future(fut)
            except UserError as exc:
                raise APIError(400, str(exc), param="input") from None
        except APIError as exc:
            server.count("embeddings", exc.status)
            return _error(exc)
        server.count("embeddings", 200)
        data = []
        for i, v in enumerate(vectors):
            emb: Any = base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n = sum(len(p) for p in prompts)
        return JSONResponse({"object": "list", "data": data, "model": server.model_id,
                             "usage": {"prompt_tokens": n, "total_tokens": n}, "plinth": {"pooling": pooling}})

    # -------------------------------------------------------------- generation

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: HTTPRequest) -> Response:
        return await self._generate(request, chat=True)

    def _sampling(self, p: Params, j: int) -> SamplerConfig:
        """Choice ``j``'s sampling settings: the request's, with the seed + j (each choice its own draws)."""
        bad = [t for t, _ in p.logit_bias if t >= self.server.model.n_vocab]
        if bad:
            raise APIError(422, f"'logit_bias': token id {bad[0]} is outside the vocabulary "
                           f"(0..{self.server.model.n_vocab - 1})", param="logit_bias", code="invalid_value")
        return SamplerConfig(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                             repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
                             presence_penalty=p.presence_penalty, logit_bias=p.logit_bias,
                             seed=None if p.seed is None else (p.seed + j) % 2**64)

    def _grammar(self, p: Params) -> Any:
        """The request's grammar compiled for the model (each choice starts its own state), or None."""
        from .structured import StructuredError, compile_for

        if p.structured is None or p.structured.grammar is None:
            return None
        try:
            return compile_for(p.structured, self.server.tokenizer, self.server.model.n_vocab)
        except StructuredError as exc:
            raise APIError(400, exc.message, param=exc.param, code="invalid_value") from None

    def _submit(self, reqs: list[Request]) -> None:
        """Queue every request, or none (those already queued are cancelled)."""
        taken: list[Request] = []
        try:
            for r in reqs:
                self.sched.submit(r)
                taken.append(r)
        except BaseException:
            for r in taken:
                self.sched.cancel(r)
            raise

    async def _generate(self, request: HTTPRequest, chat: bool) -> Response:
        server, sched = self.server, self.sched
        endpoint = "chat" if chat else "completions"
        try:
            body = await _body(request)
            p = chat_params(body, server.lenient) if chat else completion_params(body, server.lenient)
            server.check_model(p.model)
            prompts = await run_in_threadpool(server.prompt_ids, p)
            n_ctx = server.model.n_ctx
            for ids in prompts:
                if not ids:
                    raise APIError(400, "the prompt is empty after tokenization", param="prompt")
                if len(ids) >= n_ctx:
                    raise context_error(len(ids), n_ctx, "messages" if chat else "prompt")
            grammar = await run_in_threadpool(self._grammar, p)
            queue: asyncio.Queue = asyncio.Queue()
            loop = asyncio.get_running_loop()
            box = self.boxes.get(loop) or self.boxes.setdefault(loop, Mailbox(loop))
            reqs: list[Request] = []
            echo: list[str | None] = []
            for i, ids in enumerate(prompts):
                room = n_ctx - len(ids)
                max_tokens = room if p.max_tokens is None else min(max(p.max_tokens, 1), room)
                text = None
                if p.echo:
                    src = (p.prompts or ())[i]
                    text = src if isinstance(src, str) else server.tokenizer.decode(list(src))
                leader = None
                for j in range(p.n):
                    index = len(reqs)

                    def emit(ev: Event, index: int = index) -> None:
                        box.post(queue, (index, ev))

                    req = Request(prompt_ids=ids, max_tokens=max_tokens, sampling=self._sampling(p, j), emit=emit,
                                  stop=p.stop, logprobs=p.logprobs, speculative=p.speculative, leader=leader,
                                  prompt_logprobs=p.logprobs if p.echo and p.logprobs is not None else None,
                                  constraint=grammar.start() if grammar is not None else None)
                    if p.n > 1 and leader is None:
                        req.followed, leader = True, req
                    reqs.append(req)
                    echo.append(text)
            if len(reqs) > sched.max_batch + sched.max_queue:
                raise APIError(400, f"the request asks for {len(reqs)} choices; this server runs {sched.max_batch} "
                               f"sequences at once and queues {sched.max_queue}", param="n", code="invalid_value")
            try:
                self._submit(reqs)
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
        n_prompt = sum(len(ids) for ids in prompts)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt}
        server.count(endpoint, 200)
        choices = _Choices(reqs, echo, queue)
        choices.score_only = p.max_tokens == 0
        if chat and p.structured is not None and p.structured.calls_tools:
            from .structured import ToolCallStream

            choices.tools = [ToolCallStream(p.structured) for _ in reqs]
        if p.stream:
            return StreamingResponse(self._stream(choices, fmt, usage, p.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._collect(request, choices, fmt, usage)

    async def _watch(self, request: HTTPRequest, choices: _Choices) -> None:
        """Cancel ``choices`` as soon as the client disconnects (the body is read: the next message the
        server gets is the disconnect)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                choices.disconnected = True
                for r in choices.reqs:
                    self.sched.cancel(r)
                return

    async def _collect(self, request: HTTPRequest, choices: _Choices, fmt: _Formatter,
                       usage: dict[str, int]) -> Response:
        reqs = choices.reqs
        events: list[list[Event]] = [[] for _ in reqs]
        ends: dict[int, Event] = {}
        watcher = asyncio.ensure_future(self._watch(request, choices))
        try:
            while len(ends) < len(reqs):
                index, ev = await choices.queue.get()
                if choices.score_only:
                    ev = attrs.evolve(ev, text="", tokens=(), finish="length" if ev.finish == "stop" else ev.finish)
                events[index].append(ev)
                usage["completion_tokens"] += len(ev.tokens)
                if ev.finish is not None:
                    ends[index] = ev
        finally:
            watcher.cancel()
            for r in reqs:
                if not r.done:
                    self.sched.cancel(r)
        if choices.disconnected:
            return Response(status_code=499)
        for ev in ends.values():
            if ev.finish == "error" or (ev.finish == "cancelled" and ev.error):
                return _error(APIError(500 if ev.finish == "error" else 503, ev.error or "generation failed",
                                       type="server_error"))
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        out = []
        for index, evs in enumerate(events):
            text = "".join(e.text for e in evs)
            infos = [t for e in evs for t in e.tokens]
            if choices.echo[index] is not None:
                text = choices.echo[index] + text
                infos = [t for e in evs if e.prompt for t in e.prompt] + infos
            choice = fmt.choice(index, text, infos, _openai_finish(ends[index].finish or ""))
            if choices.tools is not None:  # tool calls read from the reply
                tcs = choices.tools[index]
                tcs.feed(text)
                _, choice["finish_reason"] = tcs.finish(choice["finish_reason"])
                choice["message"] = tcs.message()
            out.append(choice)
        stats = ends[0].stats if len(reqs) == 1 else [ends[i].stats for i in range(len(reqs))]
        return JSONResponse(fmt.whole(out, usage, stats))

    async def _stream(self, choices: _Choices, fmt: _Formatter, usage: dict[str, int],
                      include_usage: bool) -> AsyncIterator[str]:
        reqs = choices.reqs
        ended = 0
        started = [False] * len(reqs)
        try:
            if fmt.chat:
                for index in range(len(reqs)):
                    yield _sse(fmt.chunk(index, [], "", None, first=True))
            while ended < len(reqs):
                index, ev = await choices.queue.get()
                if choices.score_only:
                    ev = attrs.evolve(ev, text="", tokens=(), finish="length" if ev.finish == "stop" else ev.finish)
                usage["completion_tokens"] += len(ev.tokens)
                text, infos = ev.text, list(ev.tokens)
                if not started[index]:
                    started[index] = True
                    if choices.echo[index] is not None:
                        text = choices.echo[index] + text
                        infos = list(ev.prompt or ()) + infos
                if choices.tools is not None:  # OpenAI's tool-call deltas (content while the reply is text)
                    for d in self._tool_deltas(fmt, index, infos, choices.tools[index].feed(text)):
                        yield d
                elif text or infos:
                    yield _sse(fmt.chunk(index, infos, text, None))
                if ev.finish is not None:
                    ended += 1
                    if ev.finish == "error" or (ev.finish == "cancelled" and ev.error):
                        yield _sse(APIError(500, ev.error or "generation failed", type="server_error").body())
                        break
                    finish = _openai_finish(ev.finish)
                    if choices.tools is not None:
                        rest, finish = choices.tools[index].finish(finish)
                        for d in self._tool_deltas(fmt, index, [], rest):
                            yield d
                    last = fmt.chunk(index, [], "", finish)
                    last["plinth"] = ev.stats
                    yield _sse(last)
            else:
                if include_usage:
                    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                    obj = fmt.chunk(0, [], "", None)
                    obj["choices"] = []
                    obj["usage"] = usage
                    yield _sse(obj)
            yield "data: [DONE]\n\n"
        finally:
            for r in reqs:
                if not r.done:
                    self.sched.cancel(r)


    @staticmethod
    def _tool_deltas(fmt: _Formatter, index: int, infos: list[TokenInfo], deltas: list[dict]) -> list[str]:
        """Chunks of one choice's deltas (the step's log-probabilities on the first; an empty delta carries
        them when the reply's text is held back)."""
        out = []
        for d in deltas or ([{}] if infos else []):
            c = fmt.chunk(index, infos, "", None)
            c["choices"][0]["delta"] = d
            infos = []
            out.append(_sse(c))
        return out


def build_app(server: Server) -> Starlette:
    """The ASGI app; starting it starts the scheduler thread, stopping it stops the thread."""
    handlers = Handlers(server)
    middleware = []
    if server.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(server.allowed_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"]))
    return Starlette(routes=handlers.routes(), lifespan=handlers.lifespan, middleware=middleware,
                     exception_handlers={HTTPException: handlers.http_error, Exception: handlers.server_error})

"""The OpenAI request fields plinth serves, checked; and the error shape.

Each request body is read into a :class:`Params` after every field has been checked for its type and
range. Every field is honoured or refused: a field the endpoint does not know, or one it knows but
does not serve, is a 400 naming it (with ``lenient`` a field it does not know is logged and dropped
instead; a known field it does not serve is still refused). A problem raises :class:`APIError` with
the status code and the OpenAI error object (``{"error": {"message", "type", "param", "code"}}``):
400 for a body that is not JSON, an unknown or unserved field, or a prompt longer than the context;
404 for a model that is not served; 422 for a missing or ill-typed field or a value out of range.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

_log = logging.getLogger("plinth.serve")

#: fields of both generation endpoints (``user`` is an end-user id OpenAI keeps for abuse monitoring: it
#: changes nothing in the output, and plinth reads it as such). ``top_k``, ``min_p``,
#: ``repetition_penalty`` and ``speculative`` are plinth's (llama-server's / vLLM's) extensions.
COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
                 "presence_penalty", "frequency_penalty", "logit_bias", "seed", "user", "top_k", "min_p",
                 "repetition_penalty", "speculative")
COMPLETION_FIELDS = COMMON_FIELDS + ("prompt", "logprobs", "echo", "best_of", "suffix")
CHAT_FIELDS = COMMON_FIELDS + ("messages", "max_completion_tokens", "logprobs", "top_logprobs")
#: fields that ask for constrained decoding (structured output, tool calls, grammars)
GRAMMAR_FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls", "grammar", "json_schema",
                  "guided_json", "guided_regex", "guided_choice", "guided_grammar", "functions", "function_call",
                  "guided_decoding_backend", "guided_whitespace_pattern")
#: at most this many choices (prompts x n) in one request
MAX_CHOICES = 128


class APIError(Exception):
    """An error answered to the client: HTTP ``status`` and the OpenAI error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, what: str) -> APIError:
    return APIError(422, f"'{param}': {what}", param=param, code="invalid_value")


def unserved(param: str, what: str) -> APIError:
    """A 400 for a field plinth knows but does not serve (or a value of it it does not serve)."""
    return APIError(400, f"'{param}': {what}", param=param, code="unsupported_parameter")


def _number(body: dict, name: str, default: float | None, lo: float, hi: float) -> float | None:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(name, f"expected a number, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise _bad(name, f"must be in [{lo}, {hi}], got {v}")
    return float(v)


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"expected an integer, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        raise _bad(name, f"must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def _boolean(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"expected true or false, got {type(v).__name__}")
    return v


@attrs.frozen
class Params:
    """The checked fields of one completion or chat request.

    prompts: the prompts of a completions request (each a text or a tuple of token ids), or None;
    messages: the chat messages (chat) or None; logprobs: None (off) or the number of top
    alternatives to return per token (0 = only the chosen token's logprob); n: choices per prompt;
    echo: the prompt is returned before each completion (with its tokens' logprobs when logprobs
    is set); logit_bias: (token id, bias) pairs.
    """

    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: tuple[tuple[int, float], ...]
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None
    speculative: bool
    n: int = 1
    echo: bool = False
    prompts: tuple[str | tuple[int, ...], ...] | None = None
    messages: tuple[dict[str, str], ...] | None = None
    dropped: tuple[str, ...] = ()  # unknown fields dropped (lenient)
    structured: Any = None  # the grammar and tool settings (plinth.serve.structured.Structured)

    @property
    def prompt(self) -> str | None:
        """The text of a one-prompt completions request (None for token ids or chat)."""
        if self.prompts and len(self.prompts) == 1 and isinstance(self.prompts[0], str):
            return self.prompts[0]
        return None

    @property
    def prompt_ids(self) -> tuple[int, ...] | None:
        """The token ids of a one-prompt completions request given as ids."""
        if self.prompts and len(self.prompts) == 1 and not isinstance(self.prompts[0], str):
            return self.prompts[0]
        return None


def _structured(body: dict, chat: bool) -> Any:
    """The request's grammar / tool settings (:func:`plinth.serve.structured.parse`); 400 naming the field."""
    from .structured import StructuredError, parse

    try:
        return parse(body, chat=chat)
    except StructuredError as exc:
        raise APIError(400, exc.message, param=exc.param, code="invalid_value") from None


def _check_fields(body: dict, known: tuple[str, ...], lenient: bool) -> tuple[str, ...]:
    """Refuse (or, lenient, drop) fields the endpoint does not know; refuse the grammar fields by name."""
    dropped = []
    for name in body:
        if name in known:
            continue
        if name in GRAMMAR_FIELDS:  # read (and refused where not served) by plinth.serve.structured
            continue
        if not lenient:
            raise APIError(400, f"'{name}': unknown field; this server does not honour it (a server started with "
                           "--lenient drops unknown fields instead)", param=name, code="unknown_parameter")
        dropped.append(name)
    if dropped:
        _log.warning("dropped unknown request field(s): %s (--lenient)", ", ".join(dropped))
    return tuple(dropped)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise _bad("logit_bias", "expected an object mapping token ids to biases")
    out = []
    for key, bias in v.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise _bad("logit_bias", f"key {key!r} is not a token id") from None
        if tid < 0:
            raise _bad("logit_bias", f"token id {tid} is negative")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise _bad("logit_bias", f"the bias of token {tid} must be a number in [-100, 100], got {bias!r}")
        out.append((tid, float(bias)))
    return tuple(sorted(out))


def _common(body: Any, chat: bool, lenient: bool) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(422, "the request body must be a JSON object", code="invalid_value")
    dropped = _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, lenient)
    model = body.get("model")
    if model is None:
        raise _bad("model", "required")
    if not isinstance(model, str):
        raise _bad("model", f"expected a string, got {type(model).__name__}")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("user", f"expected a string, got {type(body['user']).__name__}")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _bad("stop", "expected a string or a list of strings")
    if len(stops) > 4:
        raise _bad("stop", f"at most 4 stop strings, got {len(stops)}")
    if any(not s for s in stops):
        raise _bad("stop", "a stop string must not be empty")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("stream_options", "expected an object")
    for key in opts or {}:
        if key != "include_usage":
            raise unserved(f"stream_options.{key}", "not served (stream_options takes include_usage)")
    include_usage = _boolean(opts or {}, "include_usage", False)
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("seed", f"expected an integer, got {type(seed).__name__}")
    if seed is not None and not 0 <= seed < 2**64:
        raise _bad("seed", f"must be in [0, 2**64 - 1], got {seed}")
    return dict(
        model=model,
        max_tokens=_integer(body, max_key, None, 0),  # (0: completions with echo only, checked below)
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_integer(body, "top_k", 0, 0),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-3, 10.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body),
        seed=seed,
        stop=stops,
        stream=_boolean(body, "stream", False),
        include_usage=include_usage,
        speculative=_boolean(body, "speculative", True),
        n=_integer(body, "n", 1, 1, MAX_CHOICES),
        dropped=dropped,
        structured=_structured(body, chat),
    )


def _one_prompt(p: Any) -> str | tuple[int, ...] | None:
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return tuple(p)
    return None


def completion_params(body: Any, lenient: bool = False) -> Params:
    fields = _common(body, chat=False, lenient=lenient)
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("prompt", "required")
    one = _one_prompt(prompt)
    if one is not None:
        prompts: tuple[str | tuple[int, ...], ...] = (one,)
    elif isinstance(prompt, list) and prompt and all(_one_prompt(p) is not None for p in prompt):
        prompts = tuple(_one_prompt(p) for p in prompt)  # type: ignore[misc]
    else:
        raise _bad("prompt", "expected a string, a list of token ids, or a non-empty list of either")
    fields["prompts"] = prompts
    if len(prompts) * fields["n"] > MAX_CHOICES:
        raise _bad("n", f"{len(prompts)} prompts x n = {fields['n']} asks for {len(prompts) * fields['n']} choices; "
                   f"at most {MAX_CHOICES} are served in one request")
    fields["logprobs"] = _integer(body, "logprobs", None, 0, 20)
    fields["echo"] = _boolean(body, "echo", False)
    best_of = _integer(body, "best_of", None, 1, MAX_CHOICES)
    if best_of is not None and best_of != fields["n"]:
        raise unserved("best_of", f"best_of = {best_of} with n = {fields['n']} is not served: plinth returns every "
                       "choice it generates and ranks none (send n alone, or best_of equal to n)")
    suffix = body.get("suffix")
    if suffix is not None:
        if not isinstance(suffix, str):
            raise _bad("suffix", f"expected a string, got {type(suffix).__name__}")
        if suffix:
            raise unserved("suffix", "fill-in-the-middle (a suffix after the completion) is not served")
    if fields["max_tokens"] is None:
        fields["max_tokens"] = 16  # the OpenAI default for completions
    if fields["max_tokens"] == 0 and not fields["echo"]:
        raise _bad("max_tokens", "0 generates nothing: it is served with 'echo': true only (the prompt scored)")
    return Params(**fields)


def chat_params(body: Any, lenient: bool = False) -> Params:
    fields = _common(body, chat=True, lenient=lenient)
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages", "required")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "expected an object with a string 'role'")
        for key in m:
            if key not in ("role", "content", "name", "tool_calls", "tool_call_id", "refusal"):
                raise unserved(f"messages[{i}].{key}", "not served in a message (role, content, name, and a tool "
                               "call's and result's fields are)")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}].content", "only text content parts are served")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", f"expected a string, got {type(content).__name__}")
        msg = {"role": m["role"], "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    s = fields["structured"]
    if s.calls_tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        from .structured import StructuredError, chat_messages

        try:  # tools described in the system message, earlier calls and results rendered
            out = chat_messages(messages, s)
        except StructuredError as exc:
            raise unserved(exc.param, exc.message.removeprefix(f"'{exc.param}': ")) from None
    fields["messages"] = tuple(out)
    want = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None, 0, 20)
    if top is not None and not want:
        raise _bad("top_logprobs", "needs 'logprobs': true")
    fields["logprobs"] = (top or 0) if want else None
    if fields["max_tokens"] == 0:
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        raise _bad(name, "must be in [1, inf], got 0")
    return Params(**fields)

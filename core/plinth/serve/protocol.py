"""The OpenAI request fields plinth serves, checked; and the error shape.

Each request body is read into a :class:`Params` after every field has been
checked for its type and range. A problem raises :class:`APIError` with the
status code and the OpenAI error object (``{"error": {"message", "type",
"param", "code"}}``): 400 for a body that is not JSON or a prompt longer than
the context, 404 for a model that is not served, 422 for a missing or
ill-typed field or an unsupported value.
"""

from __future__ import annotations

from typing import Any

import attrs


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

    prompt: the text (completions) or None; prompt_ids: token ids given directly;
    messages: the chat messages (chat) or None; logprobs: None (off) or the number of
    top alternatives to return per token (0 = only the chosen token's logprob).
    """

    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None
    speculative: bool
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, str], ...] | None = None


def _common(body: Any, chat: bool) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(422, "the request body must be a JSON object", code="invalid_value")
    model = body.get("model")
    if model is None:
        raise _bad("model", "required")
    if not isinstance(model, str):
        raise _bad("model", f"expected a string, got {type(model).__name__}")
    n = _integer(body, "n", 1, 1)
    if n != 1:
        raise _bad("n", f"only n = 1 is served, got {n}")
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
    for name in ("frequency_penalty", "presence_penalty"):
        v = _number(body, name, 0.0, -2.0, 2.0)
        if v:
            raise _bad(name, "not supported (use repetition_penalty)")
    if body.get("echo"):
        raise _bad("echo", "not supported")
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of", "only 1 is served")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("stream_options", "expected an object")
    include_usage = _boolean(opts or {}, "include_usage", False)
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("seed", f"expected an integer, got {type(seed).__name__}")
    return dict(
        model=model,
        max_tokens=_integer(body, max_key, None, 1),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_integer(body, "top_k", 0, 0),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-3, 10.0),
        seed=seed,
        stop=stops,
        stream=_boolean(body, "stream", False),
        include_usage=include_usage,
        speculative=_boolean(body, "speculative", True),
    )


def completion_params(body: Any) -> Params:
    fields = _common(body, chat=False)
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("prompt", "required")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        fields["prompt"] = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        fields["prompt_ids"] = tuple(prompt)
    else:
        raise _bad("prompt", "expected a string or a list of token ids (one prompt per request)")
    fields["logprobs"] = _integer(body, "logprobs", None, 0, 20)
    if fields["max_tokens"] is None:
        fields["max_tokens"] = 16  # the OpenAI default for completions
    return Params(**fields)


def chat_params(body: Any) -> Params:
    fields = _common(body, chat=True)
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages", "required")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "expected an object with a string 'role'")
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
        out.append({"role": m["role"], "content": content})
    fields["messages"] = tuple(out)
    want = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None, 0, 20)
    if top is not None and not want:
        raise _bad("top_logprobs", "needs 'logprobs': true")
    fields["logprobs"] = (top or 0) if want else None
    return Params(**fields)

"""Structured output and tool calls: the request fields that constrain decoding, and the tool-call replies.

:func:`parse` reads the fields of a request body that ask for a grammar and returns a :class:`Structured`
(or raises :class:`StructuredError`, which the app answers with a 400 naming the field):

* OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` (any JSON object) or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`` (JSON that
  conforms to the schema; every keyword is honoured, or the schema is refused naming the keyword, strict
  or not);
* OpenAI's ``tools`` (functions: name, description, parameters, strict), ``tool_choice`` (``"none"``,
  ``"auto"``, ``"required"`` or ``{"type": "function", "function": {"name": ...}}``) and
  ``parallel_tool_calls`` (default true: one reply may call several tools);
* llama-server's ``grammar`` (GBNF) and ``json_schema`` (a schema), and vLLM's ``guided_json``,
  ``guided_regex``, ``guided_choice`` and ``guided_grammar`` (GBNF).

At most one of them may ask for a grammar (``tools`` may go with ``response_format``, see below).

Tool calls
----------
The tools are described to the model in a system message (:func:`chat_messages`, with an example of the
call format), and the model's calls are read back from plinth's own format, which the grammar enforces::

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

(compact JSON: no spaces). With ``tool_choice`` ``"required"`` the reply is the JSON array alone (one call or
more; exactly one with ``parallel_tool_calls: false``), each call's ``arguments`` conforming to its tool's
``parameters``; with a named function, the array holds calls of that function only. With ``"auto"``, the
reply is either text that does not start with ``<tool_call>`` (with ``response_format`` too: JSON of that
format), or ``<tool_call>`` followed by the array: the model decides with its first tokens, and a reply
that starts as a call must finish as a valid one. With ``"none"`` the tools are not described and no call
can be made. Calls come back as ``tool_calls`` (``finish_reason: "tool_calls"``, ``content: null``); a
reply cut by ``max_tokens`` inside a call comes back as its text with ``finish_reason: "length"``.
Earlier calls (assistant messages with ``tool_calls``) are shown to the model in the same format, and
tool results (``role: "tool"``) as user messages naming the call.

:class:`ToolCallStream` turns the reply's text, as it is generated, into OpenAI's chat deltas: text as
``content``; a call as a first delta with its ``index``, ``id``, ``type`` and ``function.name`` (and empty
``arguments``), then its ``arguments`` text in pieces, as OpenAI streams them.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Sequence

import attrs

from .. import grammar as G

__all__ = ["StructuredError", "Tool", "Structured", "parse", "chat_messages", "compile_for", "constraint_for",
           "ToolCallStream",
           "TOOL_MARKER", "GRAMMAR_FIELDS"]

TOOL_MARKER = "<tool_call>"

#: every request field this module reads
GRAMMAR_FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls", "grammar", "json_schema",
                  "guided_json", "guided_regex", "guided_choice", "guided_grammar")
#: fields of the same families plinth does not serve, refused by name
REFUSED = {
    "functions": "the deprecated 'functions' field is not served; send 'tools'",
    "function_call": "the deprecated 'function_call' field is not served; send 'tool_choice'",
    "guided_decoding_backend": "plinth has one grammar engine (llguidance); leave 'guided_decoding_backend' out",
    "guided_whitespace_pattern": "'guided_whitespace_pattern' is not served (JSON is generated compact)",
}

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: llguidance's JSON options inside a Lark grammar (compact JSON, as for a plain schema)
_COMPACT = {"whitespace_flexible": False, "lenient": False}


class StructuredError(ValueError):
    """A structured-output field the server cannot honour; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"'{param}': {message}")
        self.param = param
        self.message = f"'{param}': {message}"


@attrs.frozen
class Tool:
    name: str
    description: str = ""
    parameters: Any = attrs.field(factory=lambda: {"type": "object", "properties": {}}, eq=False)


@attrs.frozen
class Structured:
    """What a request asks for beyond free text.

    grammar: the constraint on the whole reply (None: free text); tools / tool_choice ("none", "auto",
    "required" or "function") / tool_name / parallel: the tool-call settings; source: the field that set
    the grammar (for messages).
    """

    grammar: G.Grammar | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "none"
    tool_name: str | None = None
    parallel: bool = True
    source: str | None = None

    @property
    def calls_tools(self) -> bool:
        """Whether the reply may hold tool calls (it is then read by :class:`ToolCallStream`)."""
        return bool(self.tools) and self.tool_choice != "none"


# ---------------------------------------------------------------------------------------------- parsing


def _schema_grammar(schema: Any, param: str) -> G.Grammar:
    try:
        return G.json_schema(schema, what=param)
    except G.GrammarError as exc:
        raise StructuredError(param, str(exc).removeprefix(f"{param}: ").removeprefix(f"{param} ")) from None


def _response_format(v: Any) -> tuple[G.Grammar | None, Any]:
    """(grammar, schema for the tool grammar's text branch or None)."""
    if not isinstance(v, dict):
        raise StructuredError("response_format", f"expected an object, got {type(v).__name__}")
    kind = v.get("type")
    extra = set(v) - {"type", "json_schema"}
    if extra:
        raise StructuredError("response_format", f"unknown field {sorted(extra)[0]!r}")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return G.json_object(), {"type": "object"}
    if kind == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict):
            raise StructuredError("response_format.json_schema", "expected an object with a 'schema'")
        extra = set(js) - {"name", "schema", "strict", "description"}
        if extra:
            raise StructuredError("response_format.json_schema", f"unknown field {sorted(extra)[0]!r}")
        name = js.get("name")
        if name is not None and (not isinstance(name, str) or not _NAME.match(name)):
            raise StructuredError("response_format.json_schema.name", "must be 1-64 letters, digits, _ or -")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise StructuredError("response_format.json_schema.strict", "expected true or false")
        schema = js.get("schema")
        if schema is None:
            raise StructuredError("response_format.json_schema.schema", "required")
        return _schema_grammar(schema, "response_format.json_schema.schema"), schema
    raise StructuredError("response_format.type", f"expected 'text', 'json_object' or 'json_schema', got {kind!r}")


def _tools(v: Any) -> tuple[Tool, ...]:
    if not isinstance(v, list):
        raise StructuredError("tools", f"expected a list, got {type(v).__name__}")
    out: list[Tool] = []
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise StructuredError(where, "expected {'type': 'function', 'function': {...}} (only function tools "
                                         "are served)")
        if set(t) - {"type", "function"}:
            raise StructuredError(where, f"unknown field {sorted(set(t) - {'type', 'function'})[0]!r}")
        f = t["function"]
        extra = set(f) - {"name", "description", "parameters", "strict"}
        if extra:
            raise StructuredError(f"{where}.function", f"unknown field {sorted(extra)[0]!r}")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise StructuredError(f"{where}.function.name", "must be 1-64 letters, digits, _ or -")
        if any(o.name == name for o in out):
            raise StructuredError(f"{where}.function.name", f"{name!r} names two tools")
        desc = f.get("description", "")
        if not isinstance(desc, str):
            raise StructuredError(f"{where}.function.description", "expected a string")
        if f.get("strict") is not None and not isinstance(f.get("strict"), bool):
            raise StructuredError(f"{where}.function.strict", "expected true or false")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise StructuredError(f"{where}.function.parameters", "expected a JSON schema object")
        _schema_grammar(params, f"{where}.function.parameters")  # refused here, naming the tool, if unusable
        out.append(Tool(name, desc, params))
    return tuple(out)


def _tool_choice(v: Any, tools: tuple[Tool, ...]) -> tuple[str, str | None]:
    if v is None:
        return ("auto" if tools else "none"), None
    if isinstance(v, str):
        if v not in ("none", "auto", "required"):
            raise StructuredError("tool_choice", f"expected 'none', 'auto', 'required' or a function, got {v!r}")
        if v != "none" and not tools:
            raise StructuredError("tool_choice", f"{v!r} needs 'tools'")
        return v, None
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict):
        name = v["function"].get("name")
        if not any(t.name == name for t in tools):
            raise StructuredError("tool_choice.function.name", f"{name!r} is not one of the request's tools")
        return "function", name
    raise StructuredError("tool_choice", "expected 'none', 'auto', 'required' or "
                                         "{'type': 'function', 'function': {'name': ...}}")


def _call_schema(tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
    one = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": one[0] if len(one) == 1 else {"anyOf": one}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    schema["x-guidance"] = dict(_COMPACT)
    return schema


def _not_prefixed(marker: str) -> str:
    """A regex of every text that does not start with ``marker``: its proper prefixes, and texts that leave it
    at some character."""
    alts = [re.escape(marker[:i]) for i in range(len(marker))]
    alts += [re.escape(marker[:i]) + "[^" + re.escape(marker[i]) + "](?s:.)*" for i in range(len(marker))]
    return "(" + "|".join(alts) + ")"


def _tool_grammar(tools: Sequence[Tool], choice: str, name: str | None, parallel: bool,
                  text_schema: Any) -> G.Grammar:
    chosen = [t for t in tools if name is None or t.name == name]
    calls = json.dumps(_call_schema(chosen, parallel))
    if choice in ("required", "function"):
        return G.lark(f"start: calls\ncalls: %json {calls}\n", what="tools")
    if text_schema is not None:  # auto with a response_format: JSON of that format, or calls
        ts = dict(text_schema) if isinstance(text_schema, dict) else text_schema
        if isinstance(ts, dict):
            ts.setdefault("x-guidance", dict(_COMPACT))
        text_rule = f"text: %json {json.dumps(ts)}\n"
    else:
        text_rule = f"text: TEXT\nTEXT: /{_not_prefixed(TOOL_MARKER)}/\n"
    return G.lark(f'start: text | "{TOOL_MARKER}" calls\ncalls: %json {calls}\n{text_rule}', what="tools")


# the extension fields that carry a grammar, in the order they are read, and what builds each (None: a JSON schema)
_GRAMMAR_FIELDS = (("grammar", G.gbnf), ("guided_grammar", G.gbnf), ("json_schema", None), ("guided_json", None),
                   ("guided_regex", G.regex), ("guided_choice", G.choice))


def parse(body: dict[str, Any], *, chat: bool) -> Structured:
    """The structured-output settings of a request body (``chat``: the chat endpoint, where tools are served)."""
    for k, why in REFUSED.items():
        if body.get(k) is not None:
            raise StructuredError(k, why)
    asked: list[tuple[str, G.Grammar]] = []
    text_schema = None
    if body.get("response_format") is not None:
        g, text_schema = _response_format(body["response_format"])
        if g is not None:
            asked.append(("response_format", g))
    for k, build in _GRAMMAR_FIELDS:
        if body.get(k) is None:
            continue
        if build is None:  # a JSON schema: _schema_grammar names the field in its own errors
            asked.append((k, _schema_grammar(body[k], k)))
            continue
        try:
            asked.append((k, build(body[k], what=k)))
        except G.GrammarError as exc:
            raise StructuredError(k, str(exc).removeprefix(f"{k} ")) from None
    if len(asked) > 1:
        raise StructuredError(asked[1][0], f"only one grammar per request: '{asked[0][0]}' already asks for one")
    tools: tuple[Tool, ...] = ()
    choice, name = "none", None
    parallel = True
    if not chat:
        for k in ("tools", "tool_choice", "parallel_tool_calls"):
            if body.get(k) is not None:
                raise StructuredError(k, "tools are served on /v1/chat/completions")
    else:
        if body.get("tools") is not None:
            tools = _tools(body["tools"])
        choice, name = _tool_choice(body.get("tool_choice"), tools)
        p = body.get("parallel_tool_calls")
        if p is not None and not isinstance(p, bool):
            raise StructuredError("parallel_tool_calls", "expected true or false")
        parallel = True if p is None else p
    if tools and choice != "none":
        if asked and asked[0][0] != "response_format":
            raise StructuredError(asked[0][0], "cannot go with 'tools' (only response_format can)")
        if asked and choice != "auto":
            raise StructuredError("response_format", f"with tool_choice {choice!r} the reply is a tool call")
        g = _tool_grammar(tools, choice, name, parallel, text_schema if asked else None)
        return Structured(g, tools, choice, name, parallel, "tools")
    if asked:
        return Structured(asked[0][1], tools, choice, name, parallel, asked[0][0])
    return Structured(None, tools, choice, name, parallel, None)


def compile_for(s: Structured, tokenizer: Any, n_vocab: int | None = None) -> G.Constraint | None:
    """The request's grammar compiled once for the model (None: free text); each choice then takes its own
    state with ``.start()``. A grammar the engine refuses raises :class:`StructuredError` naming the field."""
    if s.grammar is None:
        return None
    try:
        return G.Constraint(s.grammar, tokenizer, n_vocab)
    except G.GrammarError as exc:
        raise StructuredError(s.source or "grammar", str(exc).removeprefix(f"{s.grammar.describe}: ")) from None


def constraint_for(s: Structured, tokenizer: Any, n_vocab: int | None = None) -> G.ConstraintState | None:
    """A fresh grammar state for one sequence of this request (None: free text); a grammar the engine
    refuses raises :class:`StructuredError` naming the field."""
    if s.grammar is None:
        return None
    try:
        return G.Constraint(s.grammar, tokenizer, n_vocab).start()
    except G.GrammarError as exc:
        raise StructuredError(s.source or "grammar", str(exc).removeprefix(f"{s.grammar.describe}: ")) from None


# ---------------------------------------------------------------------------------------------- prompt


def _describe_tools(s: Structured) -> str:
    lines = ["You can call these functions (tools). Each is given as JSON: its name, what it does, and a JSON "
             "schema of its arguments."]
    for t in s.tools:
        if s.tool_choice == "function" and t.name != s.tool_name:
            continue
        lines.append(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                ensure_ascii=False))
    example = '[{"name":"NAME","arguments":{...}}]'
    if s.tool_choice == "auto":
        lines.append(f"To call functions, reply with {TOOL_MARKER} followed by a JSON list of calls and nothing "
                     f"else, like: {TOOL_MARKER}{example}. Otherwise answer normally.")
    else:
        lines.append(f"Reply with a JSON list of function calls and nothing else, like: {example}.")
    return "\n".join(lines)


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise StructuredError(f"{where}.content", "only text content parts are served")
            parts.append(p["text"])
        return "".join(parts)
    raise StructuredError(f"{where}.content", f"expected a string, got {type(content).__name__}")


def chat_messages(messages: Sequence[dict[str, Any]], s: Structured) -> list[dict[str, str]]:
    """The messages as the chat template gets them (role and text): the tools described in the system
    message (first), earlier calls in plinth's call format, tool results as user messages naming the call."""
    names: dict[str, str] = {}
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise StructuredError(where, "expected an object with a string 'role'")
        role = m["role"]
        allowed = {"role", "content", "name"} | ({"tool_calls", "refusal"} if role == "assistant" else set()) | \
            ({"tool_call_id"} if role == "tool" else set())
        extra = set(m) - allowed
        if extra:
            raise StructuredError(f"{where}.{sorted(extra)[0]}", f"not served in a {role!r} message")
        text = _text(m.get("content"), where)
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                f = c.get("function") if isinstance(c, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                    raise StructuredError(f"{where}.tool_calls[{j}]", "expected {'id', 'type': 'function', "
                                                                      "'function': {'name', 'arguments'}}")
                args = f.get("arguments", "{}")
                try:
                    args_v = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    raise StructuredError(f"{where}.tool_calls[{j}].function.arguments", "is not JSON") from None
                if isinstance(c.get("id"), str):
                    names[c["id"]] = f["name"]
                calls.append({"name": f["name"], "arguments": args_v})
            text = (text + "\n" if text else "") + TOOL_MARKER + json.dumps(calls, separators=(",", ":"),
                                                                             ensure_ascii=False)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            cid = m.get("tool_call_id")
            who = names.get(cid, m.get("name") or "a function")
            out.append({"role": "user", "content": f"Result of the call to {who}"
                                                   f"{f' ({cid})' if isinstance(cid, str) else ''}:\n{text}"})
        else:
            out.append({"role": role, "content": text})
    if s.calls_tools:
        desc = _describe_tools(s)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + desc}
        else:
            out.insert(0, {"role": "system", "content": desc})
    return out


# ---------------------------------------------------------------------------------------------- replies


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolCallStream:
    """Reads a reply as it is generated and gives OpenAI chat deltas (``{"content": ...}`` or
    ``{"tool_calls": [...]}``) for the parts that are sure.

    :meth:`feed` takes new text and returns deltas; :meth:`finish` takes the generation's finish reason and
    returns the last deltas and the reply's finish reason (``"tool_calls"`` when calls were made).
    :attr:`calls` holds the finished calls (``id``, ``type``, ``function``: ``name``, ``arguments``) and
    :attr:`content` the text, for a reply that is not streamed.
    """

    def __init__(self, s: Structured) -> None:
        self.s = s
        self.buf = ""  # text not yet turned into deltas
        self.mode = "undecided" if s.tool_choice == "auto" else "calls"
        if not s.calls_tools:
            self.mode = "text"
        self.content: str | None = None
        self.calls: list[dict[str, Any]] = []
        self.raw = ""  # the whole reply
        self._i = 0  # scan position in buf for the calls' JSON
        self._state = "start"  # start, before_name, name, args, after_args, between, end
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._cur: dict[str, Any] | None = None

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.raw += text
        self.buf += text
        out: list[dict[str, Any]] = []
        if self.mode == "undecided":
            if self.buf.startswith(TOOL_MARKER):
                self.mode = "calls"
                self.buf = self.buf[len(TOOL_MARKER):]
            elif TOOL_MARKER.startswith(self.buf):
                return out  # may still become a call
            else:
                self.mode = "text"
        if self.mode == "text":
            if self.buf:
                self.content = (self.content or "") + self.buf
                out.append({"content": self.buf})
                self.buf = ""
            return out
        return self._scan()

    def _scan(self) -> list[dict[str, Any]]:
        """Walk the compact JSON array of calls ``[{"name":"N","arguments":{...}},...]`` the grammar produces."""
        out: list[dict[str, Any]] = []
        b = self.buf
        i = 0
        while i < len(b):
            st = self._state
            if st == "start":
                if b[i] != "[":
                    raise ValueError("a tool call reply must start with '['")
                self._state = "between"
                i += 1
            elif st == "between":
                if b[i] in ",":
                    i += 1
                elif b[i] == "]":
                    self._state = "end"
                    i += 1
                elif b.startswith('{"name":"', i):
                    self._state = "name"
                    i += len('{"name":"')
                elif '{"name":"'.startswith(b[i:]):
                    break  # wait for more text
                else:
                    raise ValueError(f"unexpected text in a tool call reply: {b[i:]!r}")
            elif st == "name":
                j = b.find('"', i)
                if j < 0:
                    break
                name = json.loads('"' + b[i:j] + '"')
                self._cur = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
                out.append({"tool_calls": [{"index": len(self.calls), "id": self._cur["id"], "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
                self._state = "before_args"
                i = j + 1
            elif st == "before_args":
                key = ',"arguments":'
                if b.startswith(key, i):
                    self._state = "args"
                    self._depth, self._in_str, self._esc = 0, False, False
                    i += len(key)
                elif key.startswith(b[i:]):
                    break
                else:
                    raise ValueError(f"unexpected text in a tool call reply: {b[i:]!r}")
            elif st == "args":
                start = i
                done = False
                while i < len(b):
                    c = b[i]
                    i += 1
                    if self._in_str:
                        if self._esc:
                            self._esc = False
                        elif c == "\\":
                            self._esc = True
                        elif c == '"':
                            self._in_str = False
                    elif c == '"':
                        self._in_str = True
                    elif c in "{[":
                        self._depth += 1
                    elif c in "}]" and self._depth > 0:
                        self._depth -= 1
                        if self._depth == 0:
                            done = True
                            break
                    elif c in ",}" and self._depth == 0:  # a scalar argument value ended (not an object)
                        i -= 1
                        done = True
                        break
                piece = b[start:i]
                if piece:
                    self._cur["function"]["arguments"] += piece
                    out.append({"tool_calls": [{"index": len(self.calls), "function": {"arguments": piece}}]})
                if done:
                    self._state = "close"
            elif st == "close":
                if b[i] != "}":
                    raise ValueError(f"unexpected text in a tool call reply: {b[i:]!r}")
                self.calls.append(self._cur)
                self._cur = None
                self._state = "between"
                i += 1
            else:  # end: the grammar allows nothing more
                raise ValueError(f"text after the tool calls: {b[i:]!r}")
        self.buf = b[i:]
        return out

    def finish(self, reason: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas and the reply's finish reason, given the generation's (``stop``, ``length``...)."""
        out: list[dict[str, Any]] = []
        if self.mode == "undecided":  # ended on a prefix of the marker: that was text
            self.mode = "text"
            if self.buf:
                self.content = (self.content or "") + self.buf
                out.append({"content": self.buf})
                self.buf = ""
        if self.mode == "calls":
            if self._state == "end" and self.calls:
                return out, "tool_calls"
            # cut short (max_tokens, a stop string, cancelled): the reply's text, as it came
            self.mode = "text"
            self.calls = []
            self.content = self.raw
            return out, reason
        return out, reason

    def message(self) -> dict[str, Any]:
        """The assistant message of a whole (not streamed) reply, after :meth:`finish`."""
        if self.mode == "calls" and self.calls:
            return {"role": "assistant", "content": None, "tool_calls": [dict(c) for c in self.calls]}
        return {"role": "assistant", "content": self.content or ""}

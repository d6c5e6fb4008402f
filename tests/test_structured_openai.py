"""Structured output and tool calls of `plinth serve` through the real `openai` client.

A real server subprocess on 127.0.0.1 serving a tiny random llama with the byte vocabulary and a chat
template (the model knows nothing: every structure in the replies comes from the grammar):
``client.chat.completions.parse(response_format=PydanticModel)`` parses into the model's type; ``tools``
come back as ``tool_calls`` with JSON arguments of the tool's schema (required, a named function, auto);
streamed tool-call deltas assemble into the same calls as the whole reply; llama-server's and vLLM's
grammar fields; refusals name the field; a speculative server gives the same constrained replies.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Literal

import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from plinth.testing import byte_vocab, make_registry, tiny_metadata, write_synthetic_gguf  # noqa: E402
from plinth.testing.server import ROLE_CHAT_TEMPLATE, free_port, served  # noqa: E402

CHAT_TEMPLATE = ROLE_CHAT_TEMPLATE
TIMEOUT = 120
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}}, "required": ["tz"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    tags: list[Literal["a", "b"]] = pydantic.Field(max_length=3)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    from plinth_llama.plugin import plugin

    md = tiny_metadata("llama", n_vocab=257, n_ctx=1024) | byte_vocab() | {"tokenizer.chat_template": CHAT_TEMPLATE}
    return write_synthetic_gguf(tmp_path_factory.mktemp("so") / "tiny.gguf", "llama", md, make_registry(plugin),
                                seed=4)


def _serve(model_path: Path, tmp: Path, *extra: str):
    port = free_port()
    cmd = [sys.executable, "-m", "plinth", "serve", "-m", str(model_path), "--port", str(port), *extra]
    return served(cmd, port, timeout=TIMEOUT, log=tmp / f"server-{port}.log")


@pytest.fixture(scope="module")
def client(model_path, tmp_path_factory):
    with _serve(model_path, tmp_path_factory.mktemp("log"), "--max-batch", "4") as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def spec_client(model_path, tmp_path_factory):
    with _serve(model_path, tmp_path_factory.mktemp("log"), "--max-batch", "4", "--spec", "ngram,draft",
                "--draft", str(model_path), "--spec-n-max", "4") as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def check_weather(args: str) -> dict:
    v = json.loads(args)
    assert set(v) == {"city", "unit"} and v["unit"] in ("C", "F") and len(v["city"]) <= 12
    return v


def test_parse_into_a_pydantic_model(client):
    r = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "Who?"}],
                                      response_format=Person, max_tokens=300, temperature=0)
    p = r.choices[0].message.parsed
    assert isinstance(p, Person) and r.choices[0].finish_reason == "stop"
    assert len(p.name) <= 8 and 0 <= p.age <= 120 and len(p.tags) <= 3
    r = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "Who?"}],
                                      response_format=Person, max_tokens=300, temperature=0.8, seed=3)
    assert isinstance(r.choices[0].message.parsed, Person)


def test_json_object_and_the_extension_fields(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=200, temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    cases = [({"guided_choice": ["sunny", "rainy", "foggy"]}, lambda t: t in ("sunny", "rainy", "foggy")),
             ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
             ({"grammar": 'root ::= ("yes" | "no") "!"'}, lambda t: t in ("yes!", "no!")),
             ({"guided_grammar": 'root ::= [a-c]+ "."'}, lambda t: re.fullmatch("[a-c]+[.]", t)),
             ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 50}}, lambda t: 5 <= json.loads(t) <= 50),
             ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
              lambda t: all(isinstance(x, bool) for x in json.loads(t)))]
    for extra, ok in cases:
        r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=100, temperature=0,
                                           extra_body=extra)
        assert r.choices[0].finish_reason == "stop" and ok(r.choices[0].message.content), (extra, r)
        c = client.completions.create(model="tiny", prompt="Say:", max_tokens=100, temperature=0.5, seed=1,
                                      extra_body=extra)
        assert ok(c.choices[0].text), (extra, c)


def test_tool_choice_required_and_named(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=300, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and ch.message.tool_calls
    for call in ch.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        if call.function.name == "get_weather":
            check_weather(call.function.arguments)
        else:
            assert call.function.name == "get_time" and set(json.loads(call.function.arguments)) == {"tz"}
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=300,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       parallel_tool_calls=False, temperature=0.7, seed=5)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    check_weather(calls[0].function.arguments)
    # the call and its result go back to the model in the next turn
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
                    {"role": "tool", "tool_call_id": calls[0].id, "content": "12 C and rain"}]
    r = client.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content is not None


def test_streamed_tool_calls_assemble_into_the_whole_reply(client):
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=300,
              temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    n_arg_chunks = 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert c["id"] is None and tc.function.name
                c["id"], c["name"] = tc.id, tc.function.name
            if tc.function and tc.function.arguments:
                c["arguments"] += tc.function.arguments
                n_arg_chunks += 1
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and n_arg_chunks > len(calls)  # arguments arrive in pieces
    got = [calls[i] for i in sorted(calls)]
    assert [(c["name"], c["arguments"]) for c in got] == [(w.function.name, w.function.arguments) for w in whole]
    for c in got:
        json.loads(c["arguments"])


def test_auto_answers_in_text_or_calls(client):
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=300,
                                           temperature=1.0, seed=seed)
        m = r.choices[0].message
        if m.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls" and m.content is None
            check_weather(m.tool_calls[0].function.arguments)
        else:
            assert not (m.content or "").startswith("<tool_call>")


def test_refusals_name_the_field(client):
    bad = [({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema"),
        ({"grammar": "root ::= (", "stream": False}, "grammar"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),  # (the later of the two, as read)
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend")]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, extra_body=extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"tools": [WEATHER]})
    assert e.value.body["param"] == "tools"


def test_speculative_server_gives_the_same_constrained_replies(client, spec_client):
    for kw in (dict(response_format={"type": "json_object"}),
               dict(tools=[WEATHER, TIME], tool_choice="required"),
               dict(extra_body={"guided_regex": "(ab|cd)+x"})):
        a = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=200, temperature=0, **kw)
        b = spec_client.chat.completions.create(model="tiny", messages=ASK, max_tokens=200, temperature=0, **kw)
        ma, mb = a.choices[0].message, b.choices[0].message
        assert ma.content == mb.content
        assert [(c.function.name, c.function.arguments) for c in ma.tool_calls or []] == \
            [(c.function.name, c.function.arguments) for c in mb.tool_calls or []]

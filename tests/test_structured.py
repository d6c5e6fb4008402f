"""plinth.serve.structured: request fields -> grammar, the tool-call grammar and prompt, and the tool-call
deltas (in process; the HTTP tests drive the same through the openai client).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from plinth import grammar as G
from plinth.serve import structured as S
from plinth.tokenizer import Tokenizer

from pathlib import Path

from plinth.testing import load_module

_tg = load_module(Path(__file__).with_name("test_grammar.py"), "plinth_test_grammar_helpers")
_vocab_md, walk = _tg._vocab_md, _tg.walk  # the test vocabulary (bytes, a few multi-byte tokens, end)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_metadata(_vocab_md())


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"], "additionalProperties": False}}}


def accepts(s: S.Structured, tok, text: str) -> bool:
    state = S.constraint_for(s, tok)
    return walk(state, tok, list(text.encode()))


def test_each_field_sets_its_grammar(tok):
    cases = [
        ({"response_format": {"type": "json_object"}}, '{"a":[1]}', "[1]"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "strict": True, "schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                    "required": ["n"], "additionalProperties": False}}}},
         '{"n":3}', '{"n":"3"}'),
        ({"json_schema": {"type": "string", "maxLength": 3}}, '"abc"', '"abcd"'),
        ({"guided_json": json.dumps({"type": "boolean"})}, "true", "1"),
        ({"guided_regex": "[a-c]{2}"}, "ab", "ad"),
        ({"guided_choice": ["left", "right"]}, "right", "up"),
        ({"grammar": 'root ::= "x" [0-9]+'}, "x12", "y12"),
        ({"guided_grammar": 'root ::= "a" | "b"'}, "b", "c"),
    ]
    for body, good, bad in cases:
        s = S.parse(body, chat=True)
        assert s.grammar is not None and s.source == next(iter(body)), body
        assert accepts(s, tok, good), (body, good)
        assert not accepts(s, tok, bad), (body, bad)
    assert S.parse({"response_format": {"type": "text"}}, chat=True).grammar is None
    assert S.parse({}, chat=False).grammar is None


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "bogus": 1}}},
     "response_format.json_schema"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"grammar": 'root ::= "a"', "guided_regex": "a"}, "guided_regex"),
    ({"functions": [{}]}, "functions"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"tools": [WEATHER], "tool_choice": "maybe"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "grammar": 'root ::= "a"'}, "grammar"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(S.StructuredError) as e:
        S.parse(body, chat=True)
    assert e.value.param == param, e.value.message
    assert e.value.message.startswith(f"'{param}'")


def test_tools_only_on_chat():
    with pytest.raises(S.StructuredError, match="chat"):
        S.parse({"tools": [WEATHER]}, chat=False)
    assert S.parse({"guided_regex": "a"}, chat=False).grammar is not None


def test_tool_choice_grammars(tok):
    call = '[{"name":"get_weather","arguments":{"city":"Oslo","unit":"C"}}]'
    two = call[:-1] + ',{"name":"get_time","arguments":{"tz":"UTC"}}]'
    req = S.parse({"tools": [WEATHER, TIME], "tool_choice": "required"}, chat=True)
    assert accepts(req, tok, call) and accepts(req, tok, two)
    assert not accepts(req, tok, "Sunny.") and not accepts(req, tok, "[]")
    assert not accepts(req, tok, '[{"name":"get_weather","arguments":{"city":"Oslo"}}]')  # unit is required
    one = S.parse({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}, chat=True)
    assert accepts(one, tok, call) and not accepts(one, tok, two)
    named = S.parse({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                    chat=True)
    assert accepts(named, tok, '[{"name":"get_time","arguments":{"tz":"CET"}}]') and not accepts(named, tok, call)
    auto = S.parse({"tools": [WEATHER, TIME]}, chat=True)
    assert auto.tool_choice == "auto"
    for text in ("Sunny in Oslo.", "", "<tool", "<b>bold</b>", S.TOOL_MARKER + call):
        assert accepts(auto, tok, text), text
    for text in (S.TOOL_MARKER + "Sunny", S.TOOL_MARKER + call + " and more"):
        assert not accepts(auto, tok, text), text
    fmt = S.parse({"tools": [WEATHER], "response_format": {"type": "json_object"}}, chat=True)
    assert accepts(fmt, tok, '{"ok":true}') and accepts(fmt, tok, S.TOOL_MARKER + call[:-1].replace(
        ',{"name":"get_time","arguments":{"tz":"UTC"}}', "") + "]")
    assert not accepts(fmt, tok, "plain text")
    none = S.parse({"tools": [WEATHER], "tool_choice": "none"}, chat=True)
    assert none.grammar is None and not none.calls_tools


def test_chat_messages_describe_tools_and_render_history():
    s = S.parse({"tools": [WEATHER], "tool_choice": "auto"}, chat=True)
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city":"Oslo","unit":"C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"}]
    out = S.chat_messages(msgs, s)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n")
    assert '"name": "get_weather"' in out[0]["content"] and S.TOOL_MARKER in out[0]["content"]
    assert out[1] == {"role": "user", "content": "Weather in Oslo?"}
    assert out[2] == {"role": "assistant",
                      "content": S.TOOL_MARKER + '[{"name":"get_weather","arguments":{"city":"Oslo","unit":"C"}}]'}
    assert out[3]["role"] == "user" and "get_weather (call_1)" in out[3]["content"] and "12 C, rain" in out[3]["content"]
    plain = S.chat_messages([{"role": "user", "content": "hi"}], S.parse({}, chat=True))
    assert plain == [{"role": "user", "content": "hi"}]
    with pytest.raises(S.StructuredError, match=r"messages\[0\].tool_calls"):
        S.chat_messages([{"role": "user", "content": "x", "tool_calls": []}], s)
    with pytest.raises(S.StructuredError, match="not JSON"):
        S.chat_messages([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f",
                                                                                          "arguments": "{x"}}]}], s)


def assemble(chunks: list[dict]) -> tuple[str | None, list[dict]]:
    """What an OpenAI client does with streamed deltas."""
    content = None
    calls: dict[int, dict] = {}
    for d in chunks:
        if "content" in d:
            content = (content or "") + d["content"]
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                c["id"] = tc["id"]
                c["name"] = tc["function"]["name"]
            c["arguments"] += tc["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_tool_call_stream_assembles_from_any_split(choice):
    s = S.parse({"tools": [WEATHER, TIME], "tool_choice": choice}, chat=True)
    body = ('[{"name":"get_weather","arguments":{"city":"Sa\\"o {P}","unit":"F"}},'
            '{"name":"get_time","arguments":{"tz":"America/Sao_Paulo"}}]')
    reply = (S.TOOL_MARKER if choice == "auto" else "") + body
    rng = np.random.default_rng(0)
    for trial in range(30):
        cuts = sorted(rng.choice(len(reply), size=rng.integers(0, 12), replace=False).tolist()) if trial else []
        pieces = [reply[a:b] for a, b in zip([0] + cuts, cuts + [len(reply)]) if b > a]
        st = S.ToolCallStream(s)
        deltas = [d for p in pieces for d in st.feed(p)]
        last, finish = st.finish("stop")
        deltas += last
        assert finish == "tool_calls"
        content, calls = assemble(deltas)
        assert content is None
        assert [c["name"] for c in calls] == ["get_weather", "get_time"]
        assert json.loads(calls[0]["arguments"]) == {"city": 'Sa"o {P}', "unit": "F"}
        assert json.loads(calls[1]["arguments"]) == {"tz": "America/Sao_Paulo"}
        assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
        msg = st.message()
        assert msg["content"] is None and [c["function"]["arguments"] for c in msg["tool_calls"]] == \
            [c["arguments"] for c in calls]


def test_auto_text_reply_and_cut_calls():
    s = S.parse({"tools": [WEATHER]}, chat=True)
    st = S.ToolCallStream(s)
    out = st.feed("<to") + st.feed("ast> is ") + st.feed("bread")
    last, finish = st.finish("stop")
    assert finish == "stop" and assemble(out + last) == ("<toast> is bread", [])
    assert st.message() == {"role": "assistant", "content": "<toast> is bread"}
    st = S.ToolCallStream(s)
    assert st.feed("<tool") == []
    last, finish = st.finish("length")  # ended on a prefix of the marker: text
    assert finish == "length" and assemble(last) == ("<tool", [])
    st = S.ToolCallStream(s)
    st.feed(S.TOOL_MARKER + '[{"name":"get_weather","arguments":{"ci')
    last, finish = st.finish("length")
    assert finish == "length" and st.message()["content"] == S.TOOL_MARKER + '[{"name":"get_weather","arguments":{"ci'


def test_scalar_arguments_end_at_the_call():
    tool = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}}
    s = S.parse({"tools": [tool], "tool_choice": "required"}, chat=True)
    st = S.ToolCallStream(s)
    deltas = st.feed('[{"name":"echo","arguments":{"n":12}}]')
    assert st.finish("stop")[1] == "tool_calls" and assemble(deltas)[1][0]["arguments"] == '{"n":12}'


def test_a_real_vocabulary_compiles_every_tool_mode():
    """On SmolLM2's vocabulary where the model file is here (the grammars compile; masks are computed)."""
    import os

    path = os.path.expanduser("~/.cache/plinth/SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        pytest.skip("no SmolLM2 file")
    from plinth.gguf import GGUFFile

    with GGUFFile(path) as gf:
        tok = Tokenizer.from_metadata(dict(gf.metadata))
    for body in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "required"},
                 {"response_format": {"type": "json_object"}}, {"guided_choice": ["yes", "no"]}):
        st = S.constraint_for(S.parse(body, chat=True), tok)
        assert st.mask().any()
    ids = tok.encode(S.TOOL_MARKER + '[{"name":"get_weather","arguments":{"city":"Oslo","unit":"C"}}]',
                     add_special=False)
    st = S.constraint_for(S.parse({"tools": [WEATHER]}, chat=True), tok)
    for t in ids:
        assert st.allows(t)
        st.advance(t)
    assert st.allows(2) and isinstance(G.ConstraintState, type)

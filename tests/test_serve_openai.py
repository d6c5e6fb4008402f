"""`plinth serve` through the real `openai` client (and httpx where the client has no method): every item
of the server surface: fields honoured or refused by name, sampling parameters, n, echo, lists of prompts,
embeddings, tokenize / detokenize, models/{id}, JSON errors, context overflow, CORS, cancellation of a
disconnected client, --threads, text that never ends mid-character.

The model is a tiny random llama with a byte vocabulary (token id = byte), served on 127.0.0.1; outputs
are compared with plinth's own in-process loop (Generator) over the same file and sampler settings.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import plinth  # noqa: E402
from plinth.generate import Generator  # noqa: E402
from plinth.sampling import Sampler, SamplerConfig  # noqa: E402
from plinth.testing import byte_vocab, make_registry, tiny_metadata, write_synthetic_gguf  # noqa: E402
from plinth.testing.server import ROLE_CHAT_TEMPLATE, free_port, served  # noqa: E402

CHAT_TEMPLATE = ROLE_CHAT_TEMPLATE
N_CTX = 1024
TIMEOUT = 60


@pytest.fixture(scope="module")
def registry():
    from plinth_llama.plugin import plugin

    return make_registry(plugin)


@pytest.fixture(scope="module")
def model_path(registry, tmp_path_factory) -> Path:
    md = tiny_metadata("llama", n_vocab=257, n_ctx=N_CTX) | byte_vocab() | {"tokenizer.chat_template": CHAT_TEMPLATE}
    return write_synthetic_gguf(tmp_path_factory.mktemp("oai") / "tiny.gguf", "llama", md, registry, seed=4)


@pytest.fixture(scope="module")
def model(registry, model_path):
    m = plinth.load_model(model_path, registry=registry)
    _TOKENIZER[:] = [m.tokenizer]
    return m


def _serve(model_path: Path, tmp: Path, *extra: str):
    port = free_port()
    cmd = [sys.executable, "-m", "plinth", "serve", "-m", str(model_path), "--port", str(port),
           "--model-alias", "tiny", *extra]
    return served(cmd, port, timeout=TIMEOUT, log=tmp / f"server-{port}.log")


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    with _serve(model_path, tmp_path_factory.mktemp("log"), "--max-batch", "8", "--threads", "1") as srv:
        yield srv.url


@pytest.fixture(scope="module")
def lenient(model_path, tmp_path_factory):
    with _serve(model_path, tmp_path_factory.mktemp("log"), "--lenient", "--allowed-origins",
                "http://example.org") as srv:
        yield srv.url


def client(url: str, timeout: float = TIMEOUT) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=timeout, max_retries=0)


def solo(model, prompt: bytes | list[int], n: int, **sampling) -> list[int]:
    ids = list(prompt)
    return Generator(model, Sampler(SamplerConfig(**({"temperature": 0.0} | sampling)))).generate(ids, n)


def text_of(ids: list[int]) -> str:
    """The text `plinth generate` prints for these generated ids (byte vocabulary)."""
    from plinth.generate import TextStream

    out = TextStream(_TOKENIZER[0])
    return "".join(out.feed(t) for t in ids) + out.finish()


_TOKENIZER: list = []


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            if key == name or key.startswith(name + "{"):
                total += float(value)
    return total


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


# ---------------------------------------------------------------- every field honoured or refused


def test_an_unknown_field_is_a_400_naming_it(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"mirostat": 2})
    assert e.value.body["param"] == "mirostat" and "mirostat" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                  extra_body={"typical_p": 0.5})
    assert e.value.body["param"] == "typical_p"
    with pytest.raises(openai.BadRequestError) as e:  # a field of the tool families plinth never serves
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                  extra_body={"functions": [{"name": "f", "parameters": {}}]})
    assert e.value.body["param"] == "functions"


def test_lenient_drops_unknown_fields(lenient, model):
    r = client(lenient).completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0,
                                           extra_body={"mirostat": 2})
    assert r.choices[0].text == text_of(solo(model, b"Hello", 6))
    with pytest.raises(openai.BadRequestError):  # a known field it does not serve is still refused
        client(lenient).completions.create(model="tiny", prompt="Hello", max_tokens=2, suffix="!")


def test_best_of_and_suffix(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="hi", max_tokens=2, best_of=3)
    assert e.value.body["param"] == "best_of"
    r = c.completions.create(model="tiny", prompt="hi", max_tokens=2, best_of=2, n=2, temperature=0)
    assert len(r.choices) == 2
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="def f(", max_tokens=2, suffix="\n    return x")
    assert e.value.body["param"] == "suffix"
    c.completions.create(model="tiny", prompt="hi", max_tokens=1, suffix="", user="someone")  # (nothing to do)


@pytest.mark.parametrize("field, value", [("frequency_penalty", 1.5), ("presence_penalty", 1.2),
                                          ("frequency_penalty", -1.0)])
def test_penalties_reach_the_sampler(server, model, field, value):
    prompt = b"abcabcabc"
    got = client(server).completions.create(model="tiny", prompt="abcabcabc", max_tokens=24, temperature=0,
                                            **{field: value})
    want = solo(model, prompt, 24, **{field: value})
    assert got.choices[0].text == text_of(want)
    assert want != solo(model, prompt, 24)  # (the penalty changes this text: the test can fail)


def test_logit_bias_bans_and_forces(server, model):
    c = client(server)
    plain = solo(model, b"Hello", 8)
    banned = c.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0,
                                  logit_bias={str(plain[0]): -100})
    assert banned.choices[0].text == text_of(solo(model, b"Hello", 8, logit_bias={plain[0]: -100.0}))
    assert banned.choices[0].text[:1] != chr(plain[0])
    forced = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       temperature=0, logit_bias={str(ord("Q")): 100})
    assert forced.choices[0].message.content == "QQQ"


def test_text_never_ends_mid_character(server):
    """The first byte of a three-byte character forced by logit_bias and cut by max_tokens: no U+FFFD."""
    r = client(server).completions.create(model="tiny", prompt="x", max_tokens=1, temperature=0,
                                          logit_bias={"226": 100})  # 0xE2: the first byte of '€'
    assert r.choices[0].text == "" and r.usage.completion_tokens == 1
    r = client(server).completions.create(model="tiny", prompt="x", max_tokens=4, temperature=0,
                                          logit_bias={"65": 100})
    assert r.choices[0].text == "AAAA"


# ---------------------------------------------------------------- n, echo, lists of prompts


def test_n_choices_share_the_prompt(server, model):
    c = client(server)
    r = c.completions.create(model="tiny", prompt="The sea is", max_tokens=10, n=3, temperature=0)
    want = text_of(solo(model, b"The sea is", 10))
    assert [ch.index for ch in r.choices] == [0, 1, 2] and all(ch.text == want for ch in r.choices)
    assert r.usage.prompt_tokens == len(b"The sea is") and r.usage.completion_tokens == 30
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12, n=2,
                                  temperature=0.9, seed=7)
    prompt = f"<|user|>hi\n<|assistant|>".encode()
    for j, ch in enumerate(r.choices):
        assert ch.message.content == text_of(solo(model, prompt, 12, temperature=0.9, seed=7 + j))
    assert r.choices[0].message.content != r.choices[1].message.content


def test_n_streamed(server, model):
    stream = client(server).completions.create(model="tiny", prompt="abc", max_tokens=8, n=2, temperature=0,
                                               stream=True)
    texts = ["", ""]
    finished = set()
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and texts == [text_of(solo(model, b"abc", 8))] * 2


def test_a_list_of_prompts(server, model):
    prompts = ["Hello there", "1, 2, 3,"]
    r = client(server).completions.create(model="tiny", prompt=prompts, max_tokens=6, n=2, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    for ch in r.choices:
        assert ch.text == text_of(solo(model, prompts[ch.index // 2].encode(), 6))
    ids = client(server).completions.create(model="tiny", prompt=[[72, 105], [65, 66]], max_tokens=4, temperature=0)
    assert [ch.text for ch in ids.choices] == [text_of(solo(model, [72, 105], 4)), text_of(solo(model, [65, 66], 4))]


def test_echo_with_prompt_logprobs(server, model):
    r = client(server).completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0, echo=True,
                                          logprobs=2)
    ch = r.choices[0]
    assert ch.text == "Hello" + text_of(solo(model, b"Hello", 3))
    lp = ch.logprobs
    assert lp.tokens[:5] == list("Hello") and len(lp.tokens) == 8
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    logits = model.logits(list(b"Hello"))
    for j in range(1, 5):
        z = logits[j - 1].astype(np.float64)
        z = z - z.max() - np.log(np.exp(z - z.max()).sum())
        assert lp.token_logprobs[j] == pytest.approx(z[b"Hello"[j]], abs=1e-4)
    assert lp.text_offset[:6] == [0, 1, 2, 3, 4, 5]
    plain = client(server).completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text == ch.text and plain.choices[0].logprobs is None


# ---------------------------------------------------------------- endpoints


def test_embeddings(server, model):
    c = client(server)
    a = c.embeddings.create(model="tiny", input="the same text")  # (the client asks for base64)
    b = c.embeddings.create(model="tiny", input=["the same text", "another one"], encoding_format="float")
    va, vb, vc = (np.asarray(x, dtype=np.float32) for x in
                  (a.data[0].embedding, b.data[0].embedding, b.data[1].embedding))
    assert va.shape == (model.hparams.n_embd,)
    assert np.array_equal(va, vb) and not np.allclose(vb, vc)
    assert np.linalg.norm(va) == pytest.approx(1.0, abs=1e-5)
    assert b.usage.prompt_tokens == len(b"the same text") + len(b"another one")
    # mean pooling of the final hidden states, the head skipped: against the core's own pooled forward
    ctx = model.new_context(pooling="last")
    from plinth.graph import Batch

    ids = list(b"another one")
    ref = np.asarray(ctx.forward(Batch.from_tokens(ids, output="last")).embeddings, dtype=np.float64)[0]
    last = c.embeddings.create(model="tiny", input="another one", encoding_format="float",
                               extra_body={"pooling": "last"})
    assert np.allclose(last.data[0].embedding, ref / np.linalg.norm(ref), atol=1e-6)
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="tiny", input="x", dimensions=8)
    assert e.value.body["param"] == "dimensions"
    raw = httpx.post(server + "/v1/embeddings", json={"model": "tiny", "input": [72, 105],
                                                      "encoding_format": "base64"}, timeout=TIMEOUT).json()
    v = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert v.shape == (model.hparams.n_embd,)


def test_embed_command_gives_the_servers_vectors(server, model_path, capsys):
    from plinth.cli import main

    capsys.readouterr()
    assert main(["embed", "-m", str(model_path), "the same text", "another one"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    served_ = client(server).embeddings.create(model="tiny", input=["the same text", "another one"],
                                               encoding_format="float")
    for row, d in zip(rows, served_.data):
        assert np.array_equal(np.float32(row["embedding"]), np.float32(d.embedding))


def test_tokenize_and_detokenize_in_both_shapes(server):
    post = lambda path, body: httpx.post(server + path, json=body, timeout=TIMEOUT)  # noqa: E731
    r = post("/tokenize", {"content": "Hi"}).json()  # llama-server
    assert r["tokens"] == [72, 105] and r["count"] == 2
    r = post("/tokenize", {"content": "Hi", "with_pieces": True}).json()
    assert r["tokens"] == [{"id": 72, "piece": "H"}, {"id": 105, "piece": "i"}]
    r = post("/tokenize", {"model": "tiny", "prompt": "Hi"}).json()  # vLLM
    assert r["tokens"] == [72, 105] and r["max_model_len"] == N_CTX
    r = post("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert bytes(r["tokens"]) == b"<|user|>Hi\n<|assistant|>"
    assert post("/detokenize", {"tokens": [72, 105]}).json() == {"content": "Hi", "prompt": "Hi"}
    bad = post("/tokenize", {"content": "Hi", "nonsense": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "nonsense"
    assert post("/detokenize", {"tokens": [999]}).status_code == 422


def test_model_by_id(server):
    c = client(server)
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"


# ---------------------------------------------------------------- errors, CORS


def test_every_error_is_json(server):
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("DELETE", "/v1/models", 405), ("POST", "/health", 405)):
        r = httpx.request(method, server + path, timeout=10)
        assert r.status_code == status
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error"
    r = httpx.post(server + "/v1/completions", content=b"{", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_context_overflow_speaks_openais_wording(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * N_CTX}],
                                               max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    assert e.value.message.startswith(f"Error code: 400 - This model's maximum context length is {N_CTX} tokens.")


def test_cors_only_behind_allowed_origins(server, lenient):
    pre = {"Origin": "http://example.org", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type"}
    r = httpx.options(lenient + "/v1/chat/completions", headers=pre, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://example.org"
    r = httpx.get(lenient + "/v1/models", headers={"Origin": "http://example.org"}, timeout=10)
    assert r.headers["access-control-allow-origin"] == "http://example.org"
    r = httpx.get(lenient + "/v1/models", headers={"Origin": "http://evil.example"}, timeout=10)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(server + "/v1/models", headers={"Origin": "http://example.org"}, timeout=10)
    assert "access-control-allow-origin" not in r.headers  # off by default


# ---------------------------------------------------------------- a client that goes away


def _free_within(url: str, seconds: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        h = health(url)
        if not h["active"] and not h["cache_tokens"] and not h["queued"]:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"the slots were still busy {seconds} s after the client left: {health(url)}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnected_client_frees_its_slot_within_a_second(server, stream):
    _free_within(server, 20.0)
    before = metric(server, 'plinth_requests_finished_total{reason="cancelled"}')
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": N_CTX - 32, "n": 4, "temperature": 0.9,
            "stream": stream, "logit_bias": {"256": -100}}  # (no end-of-generation token: all four run on)
    if stream:
        with httpx.stream("POST", server + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            for _ in zip(range(3), r.iter_lines()):
                pass
    else:
        with pytest.raises(openai.APITimeoutError):
            client(server, timeout=0.3).completions.create(**body)
    left = time.monotonic()
    took = _free_within(server, 1.0)
    assert metric(server, 'plinth_requests_finished_total{reason="cancelled"}') == before + 4
    assert time.monotonic() - left < 1.0, took


def test_threads_on_serve(server, model_path):
    from plinth.cli import parse_command

    args = parse_command(["serve", "-m", str(model_path), "--threads", "3"])
    assert args.threads == 3
    with pytest.raises(SystemExit):
        parse_command(["serve", "-m", str(model_path), "--threads", "0"])
    assert health(server)["status"] == "ok"  # (the fixture's server runs with --threads 1)


def test_echo_with_max_tokens_zero_scores_the_prompt(server, model):
    """lm-eval-harness's loglikelihood request: echo, logprobs and max_tokens 0 return the prompt and its
    tokens' log-probabilities and generate nothing."""
    c = client(server)
    r = c.completions.create(model="tiny", prompt="Hello sea", max_tokens=0, echo=True, logprobs=1, temperature=0)
    ch = r.choices[0]
    assert ch.text == "Hello sea" and ch.finish_reason == "length" and r.usage.completion_tokens == 0
    assert ch.logprobs.tokens == list("Hello sea") and ch.logprobs.token_logprobs[0] is None
    full = c.completions.create(model="tiny", prompt="Hello sea", max_tokens=2, echo=True, logprobs=1, temperature=0)
    assert full.choices[0].logprobs.token_logprobs[:9] == ch.logprobs.token_logprobs
    streamed = c.completions.create(model="tiny", prompt=["ab", "cd"], max_tokens=0, echo=True, stream=True)
    texts = {}
    for chunk in streamed:
        for x in chunk.choices:
            texts[x.index] = texts.get(x.index, "") + x.text
    assert texts == {0: "ab", 1: "cd"}
    for bad in ({"prompt": "x", "max_tokens": 0}, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}):
        path = "/v1/completions" if "prompt" in bad else "/v1/chat/completions"
        r = httpx.post(server + path, json={"model": "tiny", **bad}, timeout=TIMEOUT)
        assert r.status_code == 422 and r.json()["error"]["param"] == "max_tokens"

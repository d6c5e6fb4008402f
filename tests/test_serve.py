"""`plinth serve` driven as a client would: the official `openai` package and raw HTTP.

Every server here is a real subprocess (``python -m plinth serve``) on 127.0.0.1 at a
free port, serving a tiny synthetic llama with a byte-level tokenizer and a chat
template, so the suite stays fast. Greedy output is compared with `plinth generate
--temperature 0` on the same file, alone and with 8 concurrent clients, with and
without speculative decoding.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from plinth.cli import main as plinth_main  # noqa: E402
from plinth.testing import byte_vocab, make_registry, tiny_metadata, write_synthetic_gguf  # noqa: E402
from plinth.testing.server import ROLE_CHAT_TEMPLATE, free_port, served  # noqa: E402

CHAT_TEMPLATE = ROLE_CHAT_TEMPLATE
N_CTX = 1024
PROMPTS = ["Hello there", "The sea is", "abcabcabc", "1, 2, 3, 4,", "Once upon a time", "def f(x):",
           "Zebra crossing", "plinth serves"]
TIMEOUT = 60


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    from plinth_llama.plugin import plugin

    registry = make_registry(plugin)
    md = tiny_metadata("llama", n_vocab=257, n_ctx=N_CTX) | byte_vocab() | {"tokenizer.chat_template": CHAT_TEMPLATE}
    return write_synthetic_gguf(tmp_path_factory.mktemp("serve") / "tiny.gguf", "llama", md, registry, seed=4)


def _serve(model_path: Path, tmp: Path, *extra: str):
    port = free_port()
    cmd = [sys.executable, "-m", "plinth", "serve", "-m", str(model_path), "--port", str(port), *extra]
    return served(cmd, port, timeout=TIMEOUT, log=tmp / f"server-{port}.log")


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    with _serve(model_path, tmp_path_factory.mktemp("log"), "--max-batch", "8") as srv:
        yield srv.url


@pytest.fixture(scope="module")
def spec_server(model_path, tmp_path_factory):
    # ngram first, then the model itself as its own draft model (every greedy draft is accepted)
    with _serve(model_path, tmp_path_factory.mktemp("log"), "--max-batch", "8", "--spec", "ngram,draft",
                "--draft", str(model_path), "--spec-n-max", "4") as srv:
        yield srv.url


def client(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def generate_cli(capsys, model_path: Path, prompt: str, *args: str) -> str:
    """What `plinth generate` prints for ``prompt`` (its trailing newline removed)."""
    capsys.readouterr()
    assert plinth_main(["generate", "-m", str(model_path), prompt, *args]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out[:-1]


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def wait_idle(url: str, timeout: float = 20.0) -> dict:
    """Poll /health until no request is active and the KV cache is empty (bounded)."""
    deadline = time.monotonic() + timeout
    h = health(url)
    while time.monotonic() < deadline and (h["active"] or h["cache_tokens"] or h["queued"]):
        time.sleep(0.1)
        h = health(url)
    return h


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            if key == name or key.startswith(name + "{"):
                total += float(value)
    return total


# ---------------------------------------------------------------- greedy equals `plinth generate`


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    h = health(server)
    assert h["status"] == "ok" and h["cache_tokens"] == 0


def test_greedy_completion_equals_generate(server, model_path, capsys):
    want = generate_cli(capsys, model_path, PROMPTS[0], "-n", "40", "--temperature", "0")
    r = client(server).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=40, temperature=0)
    assert r.choices[0].text == want
    assert r.usage.completion_tokens <= 40 and r.usage.prompt_tokens == len(PROMPTS[0].encode())
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("which", ["plain", "speculative"])
def test_greedy_eight_concurrent_clients_equal_generate(which, server, spec_server, model_path, capsys):
    url = server if which == "plain" else spec_server
    want = {p: generate_cli(capsys, model_path, p, "-n", "48", "--temperature", "0") for p in PROMPTS}
    c = client(url)

    def one(p: str) -> str:
        stream = c.completions.create(model="tiny", prompt=p, max_tokens=48, temperature=0, stream=True)
        return "".join(ch.choices[0].text for ch in stream if ch.choices)

    start = threading.Barrier(len(PROMPTS), timeout=TIMEOUT)

    def together(p: str) -> str:
        start.wait()
        return one(p)

    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = dict(zip(PROMPTS, pool.map(together, PROMPTS, timeout=TIMEOUT)))
    assert got == want
    assert one(PROMPTS[2]) == want[PROMPTS[2]]  # and alone
    assert wait_idle(url)["cache_tokens"] == 0


def test_speculative_stats_and_metrics(spec_server, model_path, capsys):
    want = generate_cli(capsys, model_path, PROMPTS[4], "-n", "32", "--temperature", "0")
    r = client(spec_server).completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=32, temperature=0)
    assert r.choices[0].text == want
    stats = r.model_extra["plinth"]
    assert stats["n_drafts"] > 0 and stats["n_accepted"] > 0 and stats["tau"] > 1.0
    assert metric(spec_server, "plinth_spec_accepted_tokens_total") > 0
    assert metric(spec_server, "plinth_spec_tau") > 1.0


# ---------------------------------------------------------------- chat, streaming, stop, seed, logprobs


def test_chat_uses_template_and_streams(server, model_path, capsys):
    want = generate_cli(capsys, model_path, "Tell me about ships", "--chat", "-n", "24", "--temperature", "0")
    c = client(server)
    msgs = [{"role": "user", "content": "Tell me about ships"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [r.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stream_ends_with_done(server):
    with httpx.stream("POST", server + "/v1/completions", timeout=TIMEOUT,
                      json={"model": "tiny", "prompt": "Hi", "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_stop_strings(server, model_path, capsys):
    c = client(server)
    full = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=60, temperature=0).choices[0].text
    # a printable ASCII character some way into the text
    idx = next(i for i, ch in enumerate(full) if i >= 4 and 33 <= ord(ch) < 127)
    stop = full[idx]
    cut = full.find(stop)
    r = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=60, temperature=0, stop=[stop, "\x00zz"])
    assert r.choices[0].text == full[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == generate_cli(capsys, model_path, PROMPTS[1], "-n", "60", "--temperature", "0",
                                             "--stop", stop, "--stop", "\x00zz")
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=60, temperature=0, stop=stop, stream=True) if ch.choices)
    assert streamed == full[:cut]
    # a two-character stop string spanning two tokens is held back, never half sent
    two = full[idx:idx + 2]
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=60, temperature=0, stop=two, stream=True) if ch.choices)
    assert streamed == full[:full.find(two)]


def test_seed_reproducible_and_equal_to_generate(server, model_path, capsys):
    c = client(server)

    def sample(seed: int) -> str:
        return c.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=30, temperature=0.9,
                                    seed=seed).choices[0].text

    a, b, other = sample(7), sample(7), sample(8)
    assert a == b
    assert a != other
    assert a == generate_cli(capsys, model_path, PROMPTS[3], "-n", "30", "--temperature", "0.9", "--seed", "7")


def test_logprobs(server):
    c = client(server)
    r = c.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and val <= 0.0
        assert max(top.values()) == pytest.approx(val)  # greedy picks the most likely token
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                  temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)


# ---------------------------------------------------------------- errors


def test_openai_errors(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x" * (N_CTX + 5), max_tokens=2)
    assert f"{N_CTX + 5} tokens" in e.value.message and f"maximum context length is {N_CTX} tokens" in e.value.message
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.UnprocessableEntityError):
        c.completions.create(model="tiny", prompt="x", max_tokens=2, n=0)
    with pytest.raises(openai.UnprocessableEntityError):
        c.chat.completions.create(model="tiny", messages=[], max_tokens=2)


def _post(url: str, path: str, content: bytes | str) -> httpx.Response:
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=TIMEOUT)


@pytest.mark.parametrize("body, status, param", [
    ('{"model": "tiny", "prompt": ', 400, None),
    ("not json at all", 400, None),
    ('[1, 2, 3]', 422, None),
    ('{"prompt": "hi"}', 422, "model"),
    ('{"model": "tiny"}', 422, "prompt"),
    ('{"model": "tiny", "prompt": "hi", "max_tokens": "ten"}', 422, "max_tokens"),
    ('{"model": "tiny", "prompt": "hi", "max_tokens": 0}', 422, "max_tokens"),
    ('{"model": "tiny", "prompt": "hi", "temperature": "hot"}', 422, "temperature"),
    ('{"model": "tiny", "prompt": "hi", "temperature": 9}', 422, "temperature"),
    ('{"model": "tiny", "prompt": "hi", "top_p": 1.5}', 422, "top_p"),
    ('{"model": "tiny", "prompt": "hi", "stream": "yes"}', 422, "stream"),
    ('{"model": "tiny", "prompt": "hi", "seed": 1.5}', 422, "seed"),
    ('{"model": "tiny", "prompt": "hi", "stop": 5}', 422, "stop"),
    ('{"model": "tiny", "prompt": "hi", "logprobs": 50}', 422, "logprobs"),
    ('{"model": 5, "prompt": "hi"}', 422, "model"),
    ('{"model": "tiny", "prompt": [1, 999999]}', 422, "prompt"),
])
def test_raw_bad_completion_requests(server, body, status, param):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param


@pytest.mark.parametrize("body, param", [
    ('{"model": "tiny"}', "messages"),
    ('{"model": "tiny", "messages": "hello"}', "messages"),
    ('{"model": "tiny", "messages": [{"content": "hi"}]}', "messages[0]"),
    ('{"model": "tiny", "messages": [{"role": "user", "content": 3}]}', "messages[0].content"),
    ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', "top_logprobs"),
])
def test_raw_bad_chat_requests(server, body, param):
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == param


def test_one_megabyte_prompt(server):
    prompt = "lorem ipsum " * (1024 * 1024 // 12 + 1)
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4})
    assert len(body) > 1024 * 1024
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert f"{len(prompt.encode())} tokens" in err["message"] and str(N_CTX) in err["message"]
    assert health(server)["status"] == "ok"


def test_unsupported_method_and_path(server):
    assert httpx.get(server + "/v1/completions", timeout=10).status_code == 405
    assert httpx.get(server + "/v1/nothing", timeout=10).status_code == 404


# ---------------------------------------------------------------- disconnects, the queue bound, metrics


def test_client_disconnect_frees_rows(tmp_path):
    # A model that cannot end its answer (no end-of-generation token in its vocabulary) and a long
    # context: the request is certainly still generating when the client goes, however loaded the
    # machine is (with the end token, a sampled end could finish the stream before the health check).
    from plinth_llama.plugin import plugin

    md = tiny_metadata("llama", n_vocab=257, n_ctx=8192) | byte_vocab(eos="<|no-end|>")
    del md["tokenizer.ggml.eos_token_id"]
    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "llama", md, make_registry(plugin), seed=4)
    with _serve(path, tmp_path, "--n-ctx", "8192") as srv:
        _disconnect_mid_stream(srv.url, 8000)


def _disconnect_mid_stream(server: str, max_tokens: int) -> None:
    wait_idle(server)
    before = metric(server, 'plinth_requests_finished_total{reason="cancelled"}')
    with httpx.stream("POST", server + "/v1/completions", timeout=TIMEOUT,
                      json={"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert all(g.startswith("data: ") or not g for g in got)
        assert all('"error"' not in g and "[DONE]" not in g for g in got), got
        h = health(server)
        assert h["cache_tokens"] > 0, (h, got)  # the request holds cache rows while it runs
    # the connection is closed here, mid-stream
    h = wait_idle(server)
    assert h["cache_tokens"] == 0 and h["cache_sequences"] == 0 and h["active"] == 0
    assert metric(server, 'plinth_requests_finished_total{reason="cancelled"}') == before + 1


def test_queue_full_answers_429(model_path, tmp_path):
    """A burst larger than batch + queue: the excess gets 429 with Retry-After, every other request completes."""
    with _serve(model_path, tmp_path, "--max-batch", "1", "--max-queue", "1") as srv:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 400, "temperature": 0}
        n = 8
        start = threading.Barrier(n, timeout=TIMEOUT)

        def one(_: int) -> httpx.Response:
            start.wait()
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=TIMEOUT)

        with cf.ThreadPoolExecutor(n) as pool:
            answers = list(pool.map(one, range(n), timeout=TIMEOUT))
        codes = sorted(r.status_code for r in answers)
        assert set(codes) == {200, 429} and codes.count(200) >= 2, codes
        texts = {r.json()["choices"][0]["text"] for r in answers if r.status_code == 200}
        assert len(texts) == 1  # every accepted request ran to the end, the same greedy text
        for r in answers:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
        assert metric(srv.url, 'plinth_requests_total{endpoint="completions",code="429"}') == codes.count(429)
        assert wait_idle(srv.url)["cache_tokens"] == 0


def test_metrics_text(server):
    client(server).completions.create(model="tiny", prompt="metrics", max_tokens=3, temperature=0)
    text = httpx.get(server + "/metrics", timeout=10).text
    for name in ("plinth_requests_total", "plinth_prompt_tokens_total", "plinth_generated_tokens_total",
                 "plinth_queue_depth", "plinth_time_to_first_token_seconds_bucket", "plinth_decode_tokens_per_second",
                 "plinth_spec_acceptance_rate", "plinth_spec_tau", "plinth_kv_cache_tokens"):
        assert f"# TYPE {name.removesuffix('_bucket')} " in text, name
    assert metric(server, "plinth_generated_tokens_total") >= 3
    assert metric(server, 'plinth_requests_total{endpoint="completions",code="200"}') >= 1
    assert metric(server, "plinth_time_to_first_token_seconds_count") >= 1


def test_serve_option_errors(capsys):
    with pytest.raises(SystemExit):
        plinth_main(["serve", "--port", "70000"])
    assert "must be in [1, 65535]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plinth_main(["serve", "--max-batch", "0"])
    assert "--max-batch" in capsys.readouterr().err


def test_chat_page(server):
    r = httpx.get(server + "/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in r.text


# ---------------------------------------------------------------- the real model (opt-in: -m real)


@pytest.mark.real
@pytest.mark.slow
def test_real_model_greedy_chat_eight_clients_equal_generate(request, tmp_path, capsys):
    """SmolLM2 through the server, 8 concurrent chat clients, equals `plinth generate --chat --temperature 0`;
    and again with every prompt reused from the prompt cache."""
    if "real" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in: run with -m real (SmolLM2 decoding 8 answers twice takes minutes on 2 cores)")
    from plinth import hub

    path = hub.resolve_model("smollm2-135m-instruct")
    questions = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?", "Say hello.",
                 "What is a plinth?", "Give me a word that rhymes with cat.", "What do bees make?",
                 "Which planet is the largest?"]
    want = {q: generate_cli(capsys, path, q, "--chat", "-n", "24", "--temperature", "0") for q in questions}
    with _serve(path, tmp_path, "--max-batch", "8", "--n-ctx", "1024") as srv:
        c = client(srv.url)
        model = c.models.list().data[0].id
        start = threading.Barrier(len(questions), timeout=TIMEOUT)

        def ask(q: str) -> str:
            start.wait()
            stream = c.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                               max_tokens=24, temperature=0, stream=True)
            return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

        with cf.ThreadPoolExecutor(len(questions)) as pool:
            got = dict(zip(questions, pool.map(ask, questions, timeout=600)))
        assert got == want
        with cf.ThreadPoolExecutor(len(questions)) as pool:  # again: every prompt from the prompt cache
            again = dict(zip(questions, pool.map(ask, questions, timeout=600)))
        assert again == want
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert "plinth_prompt_cache_hits_total 8" in metrics, metrics

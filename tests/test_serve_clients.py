"""`plinth serve` driven by the client libraries people use with OpenAI-compatible servers: `llm`,
`litellm` and `langchain-openai`.

Opt-in (``make test-clients``, ``pytest -m clients``): the libraries live in their own venv
(``.venv-clients``, named by ``PLINTH_CLIENTS_PYTHON``) and each check runs there as a script against a
tiny byte-vocabulary model served on 127.0.0.1 from this venv. Greedy answers must equal plinth's own
generation loop; embeddings of the same text must be identical and of different texts differ; the
context-overflow error must be the libraries' own overflow exception; a request whose client gave up
must leave the server's slots free within a second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from plinth.testing.server import ROLE_CHAT_TEMPLATE

pytestmark = [pytest.mark.clients, pytest.mark.slow]

PYTHON = os.environ.get("PLINTH_CLIENTS_PYTHON", "")
CHAT_TEMPLATE = ROLE_CHAT_TEMPLATE
N_CTX = 512
TIMEOUT = 120


@pytest.fixture(scope="module", autouse=True)
def _opt_in(request):
    if "clients" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in suite: run with -m clients (make test-clients)")
    if not PYTHON or not Path(PYTHON).exists():
        pytest.skip("PLINTH_CLIENTS_PYTHON must name the clients' venv python (make test-clients makes it)")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import plinth
    from plinth.testing import byte_vocab, make_registry, tiny_metadata, write_synthetic_gguf
    from plinth.testing.server import free_port, served
    from plinth_llama.plugin import plugin

    registry = make_registry(plugin)
    md = tiny_metadata("llama", n_vocab=257, n_ctx=N_CTX) | byte_vocab() | {"tokenizer.chat_template": CHAT_TEMPLATE}
    tmp = tmp_path_factory.mktemp("clients")
    path = write_synthetic_gguf(tmp / "tiny.gguf", "llama", md, registry, seed=4)
    port = free_port()
    cmd = [sys.executable, "-m", "plinth", "serve", "-m", str(path), "--port", str(port), "--model-alias", "tiny"]
    with served(cmd, port, timeout=TIMEOUT, log=tmp / "server.log") as srv:
        yield srv.url, plinth.load_model(path, registry=registry), tmp


def run_client(tmp: Path, url: str, code: str) -> dict:
    """Run ``code`` (which fills ``out``) in the clients' venv; its ``out`` as JSON."""
    script = "import json, sys\nURL = sys.argv[1]\nout = {}\n" + textwrap.dedent(code) + \
        "\nprint('RESULT' + json.dumps(out))\n"
    env = dict(os.environ, LLM_USER_PATH=str(tmp / "llm"), LITELLM_LOCAL_MODEL_COST_MAP="True",
               OPENAI_API_KEY="none", NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    env.pop("PYTHONPATH", None)
    r = subprocess.run([PYTHON, "-c", script, url], capture_output=True, text=True, timeout=TIMEOUT, env=env)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT")]
    assert r.returncode == 0 and lines, f"client script failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT"):])


def greedy_chat(model, content: str, n: int) -> str:
    from plinth.generate import Generator

    ids = list(f"<|user|>{content}\n<|assistant|>".encode())
    return "".join(Generator(model).stream(ids, n))


def wait_free(url: str, seconds: float) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        h = httpx.get(url + "/health", timeout=10).json()
        if not h["active"] and not h["queued"] and not h["cache_tokens"]:
            return
        time.sleep(0.02)
    raise AssertionError(f"slots still busy {seconds} s after the client gave up")


def test_litellm(setup):
    url, model, tmp = setup
    out = run_client(tmp, url, """
        import litellm
        kw = dict(model="openai/tiny", api_base=URL + "/v1", api_key="none")
        r = litellm.completion(messages=[{"role": "user", "content": "Hello"}], temperature=0, max_tokens=12, **kw)
        out["chat"] = r.choices[0].message.content
        r = litellm.completion(messages=[{"role": "user", "content": "Hello"}], temperature=0, max_tokens=12,
                               stream=True, **kw)
        out["stream"] = "".join(c.choices[0].delta.content or "" for c in r)
        r = litellm.completion(messages=[{"role": "user", "content": "Hi"}], temperature=0.8, max_tokens=8, n=2,
                               seed=3, frequency_penalty=0.5, presence_penalty=0.2, **kw)
        out["n"] = [c.message.content for c in r.choices]
        e = litellm.embedding(input=["same text", "same text", "other text"], **kw)
        out["emb"] = [d["embedding"] for d in e.data]
        try:
            litellm.completion(messages=[{"role": "user", "content": "x" * 600}], max_tokens=2, **kw)
            out["overflow"] = "no error"
        except litellm.ContextWindowExceededError as exc:
            out["overflow"] = "ContextWindowExceededError"
        try:
            litellm.completion(messages=[{"role": "user", "content": "go"}], max_tokens=480, temperature=0.9, n=4,
                               timeout=0.3, num_retries=0, **kw)
            out["timeout"] = "finished"
        except Exception as exc:
            out["timeout"] = type(exc).__name__
    """)
    want = greedy_chat(model, "Hello", 12)
    assert out["chat"] == want and out["stream"] == want
    assert len(out["n"]) == 2
    emb = np.asarray(out["emb"])
    assert np.array_equal(emb[0], emb[1]) and not np.allclose(emb[0], emb[2])
    assert out["overflow"] == "ContextWindowExceededError"
    assert out["timeout"] != "finished"
    wait_free(url, 1.0)


def test_langchain_openai(setup):
    url, model, tmp = setup
    out = run_client(tmp, url, """
        from langchain_openai import ChatOpenAI, OpenAIEmbeddings
        chat = ChatOpenAI(base_url=URL + "/v1", api_key="none", model="tiny", temperature=0, max_tokens=12)
        out["chat"] = chat.invoke("Hello").content
        out["stream"] = "".join(c.content for c in chat.stream("Hello"))
        emb = OpenAIEmbeddings(base_url=URL + "/v1", api_key="none", model="tiny", check_embedding_ctx_length=False)
        out["emb"] = emb.embed_documents(["same text", "same text", "other text"])
        out["query"] = emb.embed_query("same text")
        try:
            chat.invoke("x" * 600)
            out["overflow"] = "no error"
        except Exception as exc:
            out["overflow"] = type(exc).__name__
            out["overflow_mro"] = [c.__name__ for c in type(exc).__mro__]
    """)
    want = greedy_chat(model, "Hello", 12)
    assert out["chat"] == want and out["stream"] == want
    emb = np.asarray(out["emb"])
    assert np.array_equal(emb[0], emb[1]) and not np.allclose(emb[0], emb[2])
    assert np.array_equal(emb[0], np.asarray(out["query"]))
    assert out["overflow"] == "OpenAIContextOverflowError"  # (LangChain's own: it matched OpenAI's wording)


def test_llm(setup):
    url, model, tmp = setup
    (tmp / "llm").mkdir(exist_ok=True)
    (tmp / "llm" / "extra-openai-models.yaml").write_text(
        f'- model_id: plinth-tiny\n  model_name: tiny\n  api_base: "{url}/v1"\n')
    out = run_client(tmp, url, """
        import llm
        m = llm.get_model("plinth-tiny")
        out["chat"] = m.prompt("Hello", temperature=0, max_tokens=12).text()
        out["stream"] = "".join(m.prompt("Hello", temperature=0, max_tokens=12))
    """)
    want = greedy_chat(model, "Hello", 12)
    assert out["chat"] == want and out["stream"] == want

"""The chat page in a real browser: Debian's chromium, headless, driven by playwright.

Opt-in (``make test-browser``, ``pytest -m browser``): it needs the ``chromium`` Debian
package and the ``playwright`` Python package; the browser is the system's
``/usr/bin/chromium`` (playwright never downloads one here). A question is typed, the
streamed answer is read from the page and compared with the API's answer for the same
settings, the Stop button is exercised, and no console error may appear. A screenshot is
kept in ``$PLINTH_ARTIFACTS`` (default: the test's tmp dir) for a person to look at.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = os.environ.get("PLINTH_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
QUESTION = "What is a plinth?"


@pytest.fixture(autouse=True)
def _opt_in(request):
    if "browser" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in suite: run with -m browser (make test-browser)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install chromium (make test-browser)")


def test_chat_page_streams_an_answer(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    httpx = pytest.importorskip("httpx")
    from plinth.testing import byte_vocab, make_registry, tiny_metadata, write_synthetic_gguf
    from plinth.testing.server import free_port, served
    from plinth_llama.plugin import plugin

    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    md = tiny_metadata("llama", n_vocab=257, n_ctx=4096) | byte_vocab() | {"tokenizer.chat_template": template}
    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "llama", md, make_registry(plugin), seed=4)
    port = free_port()
    artifacts = Path(os.environ.get("PLINTH_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "plinth", "serve", "-m", str(path), "--port", str(port), "--spec", "draft",
           "--draft", str(path), "--spec-n-max", "4"]
    with served(cmd, port, timeout=60, log=tmp_path / "server.log") as srv:
        want = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 48,
            "temperature": 0}).json()["choices"][0]["message"]["content"]
        errors: list[str] = []
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1100, "height": 700})
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(srv.url + "/", timeout=30_000)
                page.wait_for_function("document.querySelectorAll('#model option').length > 0", timeout=30_000)
                assert page.locator("#model").input_value() == "tiny"
                page.fill("#max_tokens", "48")
                page.fill("#temperature", "0")
                page.fill("#prompt", QUESTION)
                page.click("#send")
                answer = page.locator(".msg.assistant").last
                page.wait_for_function(
                    "document.querySelector('.msg.assistant:last-child') && "
                    "document.querySelector('.msg.assistant:last-child').dataset.done === '1'", timeout=60_000)
                assert page.locator(".msg.user").last.inner_text() == QUESTION
                assert answer.locator(".text").evaluate("e => e.dataset.raw") == want
                assert answer.locator(".text").evaluate("e => e.innerHTML === renderMarkdown(e.dataset.raw)")
                stats = answer.locator(".stats").inner_text()
                assert "tokens" in stats and "speculative:" in stats and "tau" in stats, stats
                page.screenshot(path=str(artifacts / "chat_page.png"), full_page=True)
                # Stop: a long answer, stopped after it started streaming
                page.fill("#max_tokens", "3000")
                page.fill("#prompt", "Go on, at length.")
                page.click("#send")
                page.wait_for_function(
                    "document.querySelector('.msg.assistant:last-child .text').textContent.length > 0",
                    timeout=60_000)
                page.click("#stop")
                page.wait_for_function("document.querySelector('.msg.assistant:last-child').dataset.done === '1'",
                                       timeout=30_000)
                assert page.locator(".msg.assistant").last.locator(".stats").inner_text() == "stopped"
                assert not page.locator("#send").is_disabled()
            finally:
                browser.close()
        assert errors == []
        deadline_ok = False
        for _ in range(100):
            h = httpx.get(srv.url + "/health", timeout=10).json()
            if h["active"] == 0 and h["cache_tokens"] == 0:
                deadline_ok = True
                break
            import time

            time.sleep(0.1)
        assert deadline_ok, "the stopped answer's rows were not freed"


HOSTILE = ("Here: <img src=x onerror=\"window.__pwned=1\"><script>window.__pwned=1</script> "
           "[click](javascript:window.__pwned=1) <a href=\"javascript:window.__pwned=1\">a</a>\n\n"
           "**bold** and a [link](https://example.org/)\n\n```\n<b onmouseover=\"window.__pwned=1\">x</b>\n```")


def test_a_hostile_reply_is_shown_as_text(tmp_path):
    """The page renders a reply's Markdown, and the reply's own HTML never becomes elements: the answer
    is a hostile server-sent stream (the route is fulfilled by the test), in the real browser."""
    import json

    sync_api = pytest.importorskip("playwright.sync_api")
    from plinth.testing import byte_vocab, make_registry, tiny_metadata, write_synthetic_gguf
    from plinth.testing.server import free_port, served
    from plinth_llama.plugin import plugin

    md = tiny_metadata("llama", n_vocab=257, n_ctx=512) | byte_vocab()
    path = write_synthetic_gguf(tmp_path / "tiny.gguf", "llama", md, make_registry(plugin), seed=4)
    port = free_port()
    chunks = [HOSTILE[i:i + 7] for i in range(0, len(HOSTILE), 7)]  # (split anywhere, as tokens are)
    body = "".join("data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]})
                   + "\n\n" for c in chunks)
    body += "data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + "\n\n"
    body += "data: [DONE]\n\n"
    with served([sys.executable, "-m", "plinth", "serve", "-m", str(path), "--port", str(port)], port, timeout=60,
                log=tmp_path / "server.log") as srv:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
            try:
                page = browser.new_page()
                page.route("**/v1/chat/completions", lambda route: route.fulfill(
                    status=200, headers={"content-type": "text/event-stream"}, body=body))
                page.goto(srv.url + "/", timeout=30_000)
                page.wait_for_function("document.querySelectorAll('#model option').length > 0", timeout=30_000)
                page.fill("#prompt", "hi")
                page.click("#send")
                page.wait_for_function("document.querySelector('.msg.assistant:last-child') && "
                                       "document.querySelector('.msg.assistant:last-child').dataset.done === '1'",
                                       timeout=30_000)
                text = page.locator(".msg.assistant").last.locator(".text")
                assert text.evaluate("e => e.dataset.raw") == HOSTILE
                assert text.locator("img, script, b").count() == 0
                assert text.locator("strong").inner_text() == "bold"
                assert [a.get_attribute("href") for a in text.locator("a").all()] == ["https://example.org/"]
                assert "<script>" in text.inner_text() and "<img" in text.inner_text()  # shown as text
                text.locator("pre").hover()
                assert page.evaluate("window.__pwned") is None
            finally:
                browser.close()

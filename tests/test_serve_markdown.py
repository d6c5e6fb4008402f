"""The chat page's Markdown (core/plinth/serve/static/markdown.js), run with node: rendered, and safe
against a hostile reply (the model's text never becomes HTML of its own: no element, attribute,
event handler or javascript: link gets through). Skips without node; the page in a real browser is
the opt-in browser suite."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import plinth.serve

JS = Path(plinth.serve.__file__).with_name("static") / "markdown.js"
NODE = shutil.which("node") or shutil.which("nodejs")

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")

HOSTILE = [
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    "[click](javascript:alert(1))",
    "[click](JaVaScRiPt:alert(1))",
    '[x](http://a.b/"onmouseover="alert(1))',
    "**<b onclick=alert(1)>bold</b>**",
    "```html\n<script>alert(1)</script>\n```",
    "`<svg onload=alert(1)>`",
    "# <iframe src=javascript:alert(1)>",
    "- <a href=javascript:alert(1)>x</a>\n- two",
    "![x](javascript:alert(1))",
    "<style>body{display:none}</style>",
    "&lt;script&gt; stays text",
]


def render(texts: list[str]) -> list[str]:
    script = ("const {renderMarkdown} = require(process.argv[1]);"
              "const inp = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
              "process.stdout.write(JSON.stringify(inp.map(renderMarkdown)));")
    out = subprocess.run([NODE, "-e", script, str(JS)], input=json.dumps(texts), capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def test_markdown_is_rendered():
    html = render(["# Title\n\nSome **bold**, *italic* and `code`.\n\n- one\n- two\n\n1. first\n2. second\n\n"
                   "```python\nprint('<hi>')\n```\n\n[plinth](https://example.org/a?b=1&c=2)"])[0]
    assert "<h1>Title</h1>" in html
    assert "<strong>bold</strong>" in html and "<em>italic</em>" in html and "<code>code</code>" in html
    assert "<ul><li>one</li><li>two</li></ul>" in html and "<ol><li>first</li><li>second</li></ol>" in html
    assert '<pre><code class="language-python">print(&#39;&lt;hi&gt;&#39;)</code></pre>' in html
    assert '<a href="https://example.org/a?b=1&amp;c=2" rel="noopener noreferrer" target="_blank">plinth</a>' in html


def test_a_hostile_reply_never_becomes_html():
    import html.parser

    class Tags(html.parser.HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.found: list[tuple[str, list]] = []

        def handle_starttag(self, tag, attrs):
            self.found.append((tag, attrs))

    allowed = {"p", "br", "strong", "em", "code", "pre", "ul", "ol", "li", "a", "h1", "h2", "h3", "h4", "h5", "h6"}
    for text, out in zip(HOSTILE, render(HOSTILE)):
        parser = Tags()
        parser.feed(out)
        for tag, attrs in parser.found:
            assert tag in allowed, (text, out)
            for name, value in attrs:
                assert not name.startswith("on"), (text, out)
                if name == "href":
                    assert value.lower().startswith(("http://", "https://", "mailto:")), (text, out)
                else:
                    assert (tag, name) in {("a", "rel"), ("a", "target"), ("code", "class")}, (text, out)
        assert "<script" not in out.lower() and "<img" not in out.lower() and "<iframe" not in out.lower()
    assert "&amp;lt;script&amp;gt; stays text" in render([HOSTILE[-1]])[0]


def test_the_chat_page_renders_answers_through_it():
    page = (JS.parent / "chat.html").read_text(encoding="utf-8")
    assert '<script src="/static/markdown.js"></script>' in page
    assert "out.innerHTML = renderMarkdown(answer)" in page
    assert page.count("innerHTML") == 1  # nothing else writes HTML from text

// Markdown for the chat page's answers: the model's text is escaped first (no HTML of its own ever
// reaches the page), then a small subset is turned into elements: fenced code blocks, inline code,
// headings, bold, italics, bullet and numbered lists, paragraphs, and links whose target is http(s)
// or mailto (any other target stays text). Loaded by chat.html; tests/test_serve_markdown.py runs it
// with node against hostile replies.
"use strict";

function escapeHtml(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
          .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

function inline(s) {
  // s is escaped already; code spans first, kept away from the other rules
  const codes = [];
  s = s.replace(/`([^`\n]+)`/g, (_, c) => { codes.push(c); return "\u0000" + (codes.length - 1) + "\u0000"; });
  s = s.replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (all, text, url) => {
    const raw = url.replace(/&amp;/g, "&");
    if (!/^(https?:\/\/|mailto:)/i.test(raw)) return all;
    return '<a href="' + url + '" rel="noopener noreferrer" target="_blank">' + text + "</a>";
  });
  s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^*\w])\*([^*\n]+)\*(?=[^*\w]|$)/g, "$1<em>$2</em>");
  s = s.replace(/(^|[^_\w])_([^_\n]+)_(?=[^_\w]|$)/g, "$1<em>$2</em>");
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => "<code>" + codes[Number(i)] + "</code>");
}

function renderMarkdown(src) {
  const lines = escapeHtml(String(src)).split("\n");
  const out = [];
  let para = [];
  let list = null;  // "ul" or "ol"
  const flushPara = () => { if (para.length) { out.push("<p>" + para.map(inline).join("<br>") + "</p>"); para = []; } };
  const closeList = () => { if (list) { out.push("</" + list + ">"); list = null; } };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
    if (fence) {
      flushPara(); closeList();
      const body = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) body.push(lines[i]);
      const cls = fence[1] ? ' class="language-' + fence[1] + '"' : "";
      out.push("<pre><code" + cls + ">" + body.join("\n") + "</code></pre>");
      continue;
    }
    const h = line.match(/^(#{1,6})\s+(.*)$/);
    const ul = line.match(/^\s*[-*+]\s+(.*)$/);
    const ol = line.match(/^\s*\d+[.)]\s+(.*)$/);
    if (h) {
      flushPara(); closeList();
      out.push("<h" + h[1].length + ">" + inline(h[2]) + "</h" + h[1].length + ">");
    } else if (ul || ol) {
      flushPara();
      const kind = ul ? "ul" : "ol";
      if (list !== kind) { closeList(); out.push("<" + kind + ">"); list = kind; }
      out.push("<li>" + inline((ul || ol)[1]) + "</li>");
    } else if (!line.trim()) {
      flushPara(); closeList();
    } else {
      closeList();
      para.push(line);
    }
  }
  flushPara(); closeList();
  return out.join("");
}

if (typeof module !== "undefined") module.exports = { renderMarkdown, escapeHtml };

"""Compare grammar libraries for plinth's token mask on a real vocabulary (issue 35).

For llguidance, xgrammar and outlines-core (whichever import), on the GGUF's own vocabulary (plinth's
tokenizer: the token byte strings, control tokens marked special; nothing from a hub):

* tokenizer build time, and per schema the compile time;
* JSON-schema coverage: for each keyword case a valid document must pass token by token (every token in
  the mask before it is consumed, the end-of-generation token allowed at the end) and an invalid one must
  be refused somewhere (a token outside the mask, or no end allowed). "error" = the library refuses the
  schema; "loose" = it compiles but lets the invalid document through; "ok" = both hold;
* the time of one mask (the whole vocabulary's bit mask) per token along a ~150-token document.

Usage::

    .venv/bin/python benchmarks/bench_grammar.py [--model PATH] [--libs llguidance,xgrammar,outlines]

xgrammar needs torch at import and outlines-core is not a plinth dependency; to measure all three without
changing the environment: ``pip install --no-deps --target /tmp/g xgrammar==0.2.9 outlines-core==0.2.14
apache-tvm-ffi`` and ``PYTHONPATH=/tmp/g`` (torch comes from the ``[ref]`` extra).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "core"))

from plinth.tokenizer.core import TT_CONTROL, TT_UNKNOWN, TT_UNUSED  # noqa: E402

SPECIAL = (TT_CONTROL, TT_UNKNOWN, TT_UNUSED)

# (name, schema, valid document, invalid document)
CASES = [
    ("types", {"type": "object", "properties": {"s": {"type": "string"}, "i": {"type": "integer"},
                                                 "n": {"type": "number"}, "b": {"type": "boolean"},
                                                 "z": {"type": "null"}},
               "required": ["s", "i", "n", "b", "z"], "additionalProperties": False},
     {"s": "x", "i": 3, "n": -1.5e3, "b": True, "z": None}, {"s": "x", "i": 3.5, "n": 1, "b": True, "z": None}),
    ("enum", {"enum": ["red", "green", 3]}, "green", "blue"),
    ("const", {"const": "fixed"}, "fixed", "fixes"),
    ("nested array of objects", {"type": "array", "items": {"type": "object", "properties": {
        "k": {"type": "string"}}, "required": ["k"], "additionalProperties": False}},
     [{"k": "a"}, {"k": "b"}], [{"k": "a"}, {"j": "b"}]),
    ("optional property", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a"], "additionalProperties": False}, {"a": 1}, {"b": 1}),
    ("additionalProperties false", {"type": "object", "properties": {"a": {"type": "integer"}},
                                    "additionalProperties": False}, {"a": 1}, {"a": 1, "c": 2}),
    ("additionalProperties schema", {"type": "object", "additionalProperties": {"type": "integer"}},
     {"x": 1, "y": 2}, {"x": "1"}),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, "ab", "abc"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"properties": {"a": {"maximum": 5}}}]}, {"a": 4}, {"a": 6}),
    ("$ref / $defs", {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}},
                                      "required": ["x"], "additionalProperties": False}},
                      "type": "array", "items": {"$ref": "#/$defs/p"}}, [{"x": 1}], [{"x": "1"}]),
    ("recursive $ref", {"$defs": {"n": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
        "required": ["v", "kids"], "additionalProperties": False}}, "$ref": "#/$defs/n"},
     {"v": 1, "kids": [{"v": 2, "kids": []}]}, {"v": 1, "kids": [{"v": 2}]}),
    ("minLength / maxLength", {"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcde"),
    ("pattern", {"type": "string", "pattern": "^[a-z]+-[0-9]{3}$"}, "abc-123", "abc-12"),
    ("minItems / maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     [1, 2], [1]),
    ("minimum / maximum", {"type": "integer", "minimum": 10, "maximum": 99}, 42, 100),
    ("exclusiveMinimum (number)", {"type": "number", "exclusiveMinimum": 0}, 0.5, -1),
    ("format date-time", {"type": "string", "format": "date-time"}, "2024-05-01T10:20:30Z", "yesterday"),
    ("format email", {"type": "string", "format": "email"}, "a@b.org", "not an email"),
    ("format uuid", {"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000", "1234"),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
     ["a", 1], [1, "a"]),
    ("type list", {"type": ["string", "null"]}, None, 1),
    ("patternProperties", {"type": "object", "patternProperties": {"^n_": {"type": "integer"}},
                           "additionalProperties": False}, {"n_a": 1}, {"m_a": 1}),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
]

BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]}},
        "projects": {"type": "array", "items": {"type": "object", "properties": {
            "title": {"type": "string"}, "stars": {"type": "integer"}, "active": {"type": "boolean"}},
            "required": ["title", "stars", "active"], "additionalProperties": False}},
    },
    "required": ["name", "age", "email", "address", "roles", "projects"],
    "additionalProperties": False,
}
BENCH_DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@analytical.example",
             "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
             "roles": ["admin", "viewer"],
             "projects": [{"title": "Notes on the Analytical Engine", "stars": 1843, "active": False},
                          {"title": "Bernoulli numbers, by machine", "stars": 42, "active": True},
                          {"title": "Poetical science", "stars": 7, "active": True}]}


def vocab(tok) -> list[bytes]:
    return [tok.token_to_piece(i) for i in range(tok.n_vocab)]


class LLG:
    name = "llguidance"

    def __init__(self, tok):
        from plinth.grammar import llg_tokenizer  # plinth's own adapter

        import llguidance
        self.llg = llguidance
        self.version = llguidance.__version__ if hasattr(llguidance, "__version__") else "?"
        self.t = llg_tokenizer(tok)
        self.n = tok.n_vocab
        self.bm = np.zeros((self.n + 31) // 32, dtype=np.int32)

    def compile(self, schema):
        g = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = self.llg.LLMatcher(self.t, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def mask(self, m):
        m.unsafe_compute_mask_ptr(self.bm.ctypes.data, self.bm.nbytes)
        return self.bm

    def consume(self, m, t):
        return m.consume_token(t)


class XGR:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar  # (imports torch: timed apart from the tokenizer)
        self.x = xgrammar
        t0 = time.perf_counter()
        self.version = xgrammar.__version__ if hasattr(xgrammar, "__version__") else "?"
        enc = [b"" if tok.token_types[i] in SPECIAL else p for i, p in enumerate(vocab(tok))]
        self.info = xgrammar.TokenizerInfo(enc, xgrammar.VocabType.RAW, vocab_size=tok.n_vocab,
                                           stop_token_ids=sorted(tok.eog_ids))
        self.compiler = xgrammar.GrammarCompiler(self.info)
        self.bm = np.zeros((1, (tok.n_vocab + 31) // 32), dtype=np.int32)
        self.build_s = time.perf_counter() - t0

    def compile(self, schema):
        c = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                                  strict_mode=True)
        return self.x.GrammarMatcher(c)

    def mask(self, m):
        m.fill_next_token_bitmask(self.bm)
        return self.bm[0]

    def consume(self, m, t):
        return m.accept_token(t)


class OC:
    name = "outlines-core"

    def __init__(self, tok):
        import outlines_core
        self.oc = outlines_core
        eos = sorted(tok.eog_ids)[0]
        voc: dict[bytes, list[int]] = {}
        for i, p in enumerate(vocab(tok)):
            if tok.token_types[i] in SPECIAL or not p:
                continue
            voc.setdefault(p, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, voc)
        self.bm = np.zeros((tok.n_vocab + 31) // 32, dtype=np.int32)

    def compile(self, schema):
        rx = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), r"")
        return self.oc.Guide(self.oc.Index(rx, self.vocab))

    def mask(self, m):
        m.write_mask_into(self.bm.ctypes.data, self.bm.size, 4)
        return self.bm

    def consume(self, m, t):
        try:
            m.advance(t)
            return True
        except Exception:
            return False


LIBS = {"llguidance": LLG, "xgrammar": XGR, "outlines": OC}


def allowed(bm, t) -> bool:
    return bool((int(bm[t // 32]) >> (t % 32)) & 1)


def walk(lib, m, ids, eos, times=None) -> bool:
    """Feed ids (then eos), each checked against the mask first; True if all went through."""
    for t in list(ids) + [eos]:
        t0 = time.perf_counter()
        bm = lib.mask(m)
        if times is not None:
            times.append(time.perf_counter() - t0)
        if not allowed(bm, t):
            return False
        if t == eos:
            return True
        if not lib.consume(m, t):
            return False
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/plinth/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--libs", default="llguidance,xgrammar,outlines")
    ap.add_argument("--repeat", type=int, default=5, help="mask-time walks per library (best kept)")
    args = ap.parse_args(argv)
    from plinth.gguf import GGUFFile
    from plinth.tokenizer import Tokenizer

    with GGUFFile(args.model) as gf:
        tok = Tokenizer.from_metadata(dict(gf.metadata), source=args.model)
    eos = sorted(tok.eog_ids)[0]
    print(f"model {Path(args.model).name}: {tok.n_vocab} tokens; load {os.getloadavg()[0]:.2f}")
    doc_ids = tok.encode(json.dumps(BENCH_DOC, separators=(",", ":")), add_special=False)
    for key in args.libs.split(","):
        try:
            t0 = time.perf_counter()
            lib = LIBS[key](tok)
            t_tok = getattr(lib, "build_s", time.perf_counter() - t0)
        except ImportError as exc:
            print(f"\n{key}: not importable ({exc})")
            continue
        print(f"\n== {lib.name}: tokenizer built in {t_tok:.2f} s")
        verdicts = {}
        for name, schema, good, bad in CASES:
            try:
                t0 = time.perf_counter()
                m = lib.compile(schema)
                tc = time.perf_counter() - t0
                ok_good = walk(lib, m, tok.encode(json.dumps(good, separators=(",", ":")), add_special=False), eos)
                m = lib.compile(schema)
                ok_bad = walk(lib, m, tok.encode(json.dumps(bad, separators=(",", ":")), add_special=False), eos)
                v = "ok" if ok_good and not ok_bad else ("loose" if ok_good else "rejects valid")
                verdicts[name] = v
                print(f"  {name:28s} {v:14s} compile {tc * 1e3:8.1f} ms")
            except Exception as exc:  # the library refuses the schema
                verdicts[name] = "error"
                print(f"  {name:28s} error          {str(exc).splitlines()[0][:90]}")
        n_ok = sum(v == "ok" for v in verdicts.values())
        print(f"  coverage: {n_ok}/{len(CASES)} cases ok")
        t0 = time.perf_counter()
        lib.compile(BENCH_SCHEMA)
        tc = time.perf_counter() - t0
        best = None
        for _ in range(args.repeat):
            times: list[float] = []
            m = lib.compile(BENCH_SCHEMA)
            if not walk(lib, m, doc_ids, eos, times):
                print("  the benchmark document was refused")
                break
            if best is None or statistics.median(times) < statistics.median(best):
                best = times
        if best:
            print(f"  mask per token over {len(best)} tokens (best of {args.repeat}): median "
                  f"{statistics.median(best) * 1e6:.1f} us, mean {statistics.fmean(best) * 1e6:.1f} us, max "
                  f"{max(best) * 1e6:.0f} us; compile {tc * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Tokenizer conformance (llama.cpp's own vectors) and behaviour tests."""
from __future__ import annotations

import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("tokenizer_fixtures", Path(__file__).with_name("tokenizer_fixtures.py"))
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)

from plinth.tokenizer import IncrementalDecoder, Tokenizer, UnsupportedTokenizerError  # noqa: E402

CLAIMED = [
    "gpt-2", "llama-bpe", "qwen2", "qwen35", "deepseek-llm", "deepseek-coder", "falcon", "mpt",
    "starcoder", "command-r", "refact", "llama-spm", "phi-3", "gemma-4",
]
UNCLAIMED = {
    "bert-bge": "WordPiece (bert) is not implemented",
    "nomic-bert-moe": "Unigram (t5) is not implemented",
}
# vocab files the sdist ships without test vectors
NO_VECTORS = ["aquila", "gpt-neox", "baichuan"]

pytestmark = pytest.mark.network


@lru_cache(maxsize=None)
def _dir():
    d = fx.vocab_dir()
    if d is None:
        pytest.skip("could not download llama-cpp-python sdist test vectors")
    return d


@lru_cache(maxsize=4)
def _tok(name):
    return Tokenizer.from_metadata(fx.metadata(_dir() / f"ggml-vocab-{name}.gguf"))


@pytest.mark.parametrize("name", CLAIMED)
def test_llama_cpp_vectors(name):
    cases = fx.vectors(_dir(), name)
    tok = _tok(name)
    bad = [(s, tok.encode(s, add_special=False), exp) for s, exp in cases if tok.encode(s, add_special=False) != exp]
    assert not bad, f"{len(bad)}/{len(cases)} mismatches, first: {bad[0]!r}"


def test_every_vocab_file_is_covered():
    names = {p.name[len("ggml-vocab-"):-len(".gguf")] for p in _dir().glob("ggml-vocab-*.gguf")}
    with_vectors = {n for n in names if (_dir() / f"ggml-vocab-{n}.gguf.out").exists()}
    assert with_vectors - set(UNCLAIMED) == set(CLAIMED)
    assert names - with_vectors - set(UNCLAIMED) == set(NO_VECTORS)


@pytest.mark.parametrize("name", NO_VECTORS)
def test_vocab_without_vectors_loads_and_round_trips(name):
    tok = _tok(name)
    for t in TEXTS:
        ids = tok.encode(t, add_special=False)
        assert ids and tok.decode(ids) == t


def test_gemma4_model_adds_bos():
    """The file as llama.cpp's converter writes it (tokenizer model 'gemma4', no pre value; its vectors
    are in CLAIMED): read as byte-pair merges with the gemma4 pre-tokenizer, BOS added."""
    tok = _tok("gemma-4")
    assert fx.metadata(_dir() / "ggml-vocab-gemma-4.gguf")["tokenizer.ggml.model"] == "gemma4"
    assert tok.add_bos and tok.encode("Hi")[0] == tok.bos_id
    for t in TEXTS:
        assert tok.decode(tok.encode(t, add_special=False)) == t


@pytest.mark.parametrize("name", sorted(UNCLAIMED))
def test_unclaimed_vocab_raises(name):
    md = fx.metadata(_dir() / f"ggml-vocab-{name}.gguf")
    with pytest.raises(UnsupportedTokenizerError, match="supported"):
        Tokenizer.from_metadata(md)


def test_unknown_pre_raises():
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "nonesuch", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(UnsupportedTokenizerError, match="nonesuch.*supported"):
        Tokenizer.from_metadata(md)


TEXTS = ["Hello world", " leading and  double  spaces", "tabs\tand\nnewlines\n\n", "émoji 🦙 中文 한국어 😀😀",
         "code: def f(x):\n    return x**2  # ok", "12345 numbers 3.14159"]


@pytest.mark.parametrize("name", ["gpt-2", "llama-spm"])
def test_round_trip(name):
    tok = _tok(name)
    for t in TEXTS:
        ids = tok.encode(t, add_special=False)
        assert tok.decode(ids) == t
        assert b"".join(tok.token_to_piece(i) for i in ids).decode() in (t, " " + t)


def test_spm_bos_and_byte_fallback():
    tok = _tok("llama-spm")
    assert tok.add_bos and tok.bos_id == 1
    ids = tok.encode("\U0001F999x")
    assert ids[0] == tok.bos_id
    byte_ids = [i for i in ids if tok.token_types[i] == 6]
    assert len(byte_ids) == 4  # the llama emoji has no piece: 4 <0xXX> tokens
    assert tok.decode(ids, skip_special=True) == "\U0001F999x"
    assert tok.decode(tok.encode("Hello")) == "<s> Hello"


def test_parse_special():
    tok = _tok("gpt-2")
    eot = tok.token_to_id["<|endoftext|>"]
    assert eot in tok.eog_ids
    with_special = tok.encode("a<|endoftext|>b", add_special=False, parse_special=True)
    assert eot in with_special
    plain = tok.encode("a<|endoftext|>b", add_special=False, parse_special=False)
    assert eot not in plain
    assert tok.decode(with_special) == "a<|endoftext|>b"
    assert tok.decode(with_special, skip_special=True) == "ab"
    spm = _tok("llama-spm")
    ids = spm.encode("hi</s>yo", add_special=False, parse_special=True)
    assert spm.eos_id in ids


@pytest.mark.parametrize("name", ["gpt-2", "llama-spm"])
def test_incremental_decoder_multibyte(name):
    tok = _tok(name)
    text = "aé中🦙b 😀 ok"
    ids = tok.encode(text, add_special=True)
    dec = IncrementalDecoder(tok, skip_special=True)
    chunks = [dec.feed(i) for i in ids]
    chunks.append(dec.flush())
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)
    # some token must be a partial UTF-8 sequence for this test to mean anything
    assert any(c == "" for c in chunks[:-1])


def test_properties():
    tok = _tok("llama-spm")
    assert tok.n_vocab == len(tok.tokens) == 32000
    assert tok.eos_id == 2 and 2 in tok.eog_ids

"""plinth's tokenizer against llama.cpp's own (llama-cpp-python), for every pre value.

Opt-in: ``pytest -m peer tests/test_tokenizer_peer.py``; skipped when ``llama_cpp``
is not importable.  Each ``tokenizer.ggml.pre`` value is written into a copy of
a vocab file from the llama-cpp-python sdist (gpt-2's byte-level vocabulary; the
raw-UTF-8 values go into gemma-4's vocabulary read as a ``gpt2`` model, as
llama.cpp reads it), llama.cpp loads it vocab-only, and both tokenize the same
texts with and without special tokens.
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("tokenizer_fixtures", Path(__file__).with_name("tokenizer_fixtures.py"))
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)

from plinth.tokenizer import SUPPORTED_PRE, Tokenizer  # noqa: E402
from plinth.tokenizer import pretok  # noqa: E402

llama_cpp = pytest.importorskip("llama_cpp")

pytestmark = [pytest.mark.peer, pytest.mark.network, pytest.mark.slow]

EXTRA = [
    "HelloWorld ÉCOLEécole 1234567 中文abc 漢字X'S it's I'LL",
    "a  12 ab12345cd 中文ไทย <sentinel:12>IMGIMGABZ",
    "हिन्दी a\u00a0b\u2003em\u3000x naïve café",
    "\n\n\n a b  c\r\n\t\tx   ",
]


@pytest.fixture(autouse=True)
def _opt_in(request):
    if "peer" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in suite: run with -m peer")


@lru_cache(maxsize=None)
def _dir():
    d = fx.vocab_dir()
    if d is None:
        pytest.skip("could not download llama-cpp-python sdist test vectors")
    return d


@lru_cache(maxsize=None)
def _texts():
    inp = (_dir() / "ggml-vocab-gpt-2.gguf.inp").read_text(encoding="utf-8")
    return inp.split("\n__ggml_vocab_test__\n")[:-1] + EXTRA


@lru_cache(maxsize=2)
def _base(name):
    return fx.metadata(_dir() / f"ggml-vocab-{name}.gguf")


def _rewrite(src: Path, dst: Path, changes: dict) -> None:
    import gguf

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst) + ".tmp", r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k in changes:
            continue
        w.add_key_value(k, f.contents(), f.types[0], sub_type=f.types[1] if len(f.types) > 1 else None)
    for k, v in changes.items():
        w.add_key_value(k, v, gguf.GGUFValueType.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    Path(str(dst) + ".tmp").rename(dst)


@pytest.mark.parametrize("pre", [p for p in SUPPORTED_PRE if p != "gpt-neox"])
def test_pre_value_matches_llama_cpp(pre):
    base = "gpt-2" if pretok.PRE_NAMES[pre].byte_encode else "gemma-4"
    changes = {"tokenizer.ggml.pre": pre}
    if base == "gemma-4":
        changes["tokenizer.ggml.model"] = "gpt2"
    out = fx.cache_dir() / "pre-gguf"
    out.mkdir(exist_ok=True)
    path = out / f"{base}-{pre}.gguf"
    if not path.exists():
        _rewrite(_dir() / f"ggml-vocab-{base}.gguf", path, changes)
    tok = Tokenizer.from_metadata({**_base(base), **changes})
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    bad = []
    for text in _texts():
        for add in (False, True):
            ours = tok.encode(text, add_special=add)
            theirs = ref.tokenize(text.encode("utf-8"), add_bos=add, special=False)
            if ours != theirs:
                bad.append((text, add, ours[:16], theirs[:16]))
    assert not bad, f"{len(bad)} of {2 * len(_texts())} differ, first: {bad[0]!r}"


def test_phi3_special_tokens_strip_like_llama_cpp():
    path = _dir() / "ggml-vocab-phi-3.gguf"
    import gguf

    md = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}
    tok = Tokenizer.from_metadata(md)
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in ["<|user|>\nHello<|end|>\n<|assistant|>\n", "a </s> b <s> c", "<|system|>  x\n\n<|end|>"]:
        assert tok.encode(text, parse_special=True) == ref.tokenize(text.encode(), add_bos=True, special=True)

"""Time building tokenizers from GGUF vocab metadata and encoding ~1 MB of text.

Usage: PYTHONPATH=core python benchmarks/bench_tokenizer.py [vocab-name ...]
Uses the llama.cpp vocab files cached by tests/tokenizer_fixtures.py.
"""
from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "core"))
_spec = importlib.util.spec_from_file_location("tokenizer_fixtures", ROOT / "tests" / "tokenizer_fixtures.py")
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)

from plinth.tokenizer import Tokenizer  # noqa: E402


def corpus(n_bytes: int = 1 << 20) -> str:
    import inspect
    import json
    import textwrap

    parts = [inspect.getsource(json), inspect.getsource(textwrap),
             "Ünïcödé façade — naïve café, 中文字符, 한국어, emoji 🦙😀. " * 50]
    text = "\n".join(parts)
    reps = n_bytes // len(text.encode()) + 1
    return (text * reps)[:n_bytes]


def main(names):
    d = fx.vocab_dir()
    if d is None:
        sys.exit("test vectors unavailable")
    text = corpus()
    nb = len(text.encode())
    for name in names:
        tm = time.perf_counter()
        md = fx.metadata(d / f"ggml-vocab-{name}.gguf")  # gguf.GGUFReader, not plinth
        t0 = time.perf_counter()
        tok = Tokenizer.from_metadata(md)
        t1 = time.perf_counter()
        ids = tok.encode(text, add_special=False)
        t2 = time.perf_counter()
        back = tok.decode(ids)
        t3 = time.perf_counter()
        assert back == text, name
        print(f"{name:14s} vocab={tok.n_vocab:6d} read-md={t0 - tm:5.2f}s build={t1 - t0:5.2f}s encode {nb / 1e6:.2f} MB -> "
              f"{len(ids)} tokens in {t2 - t1:5.2f}s ({nb / (t2 - t1) / 1e6:.2f} MB/s), decode {t3 - t2:.2f}s")


if __name__ == "__main__":
    main(sys.argv[1:] or ["gpt-2", "llama-bpe", "qwen2", "llama-spm"])

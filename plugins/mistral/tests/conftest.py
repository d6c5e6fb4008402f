"""Shared fixtures: tiny Mistral Large 4 models converted from HF folders (no torch needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plinth.testing import load_module

golden = load_module(Path(__file__).resolve().parent / "golden" / "make_golden.py")


@pytest.fixture(scope="session")
def mistral_models(tmp_path_factory):
    """(case, backend) -> plinth Model, converted once per session (lazily, per case)."""
    tmp = tmp_path_factory.mktemp("mistral-models")
    reg = golden.registry()
    cache: dict = {}

    def get(case: str, backend: str = "numpy"):
        if (case, backend) not in cache:
            cache[(case, backend)] = golden.plinth_model(case, tmp, reg, backend=backend)
        return cache[(case, backend)]

    return get


@pytest.fixture(scope="session")
def with_byte_vocab():
    """``write(src, out) -> out``: a converted file with a byte-level vocabulary (see :func:`byte_vocab_file`)."""
    return byte_vocab_file


def byte_vocab_file(src: Path, out: Path) -> Path:
    """``src`` rewritten with a byte-level vocabulary, so the generation loop and the CLI can run it.

    The tiny cases have exactly 256 rows, so the vocabulary is the 256 byte tokens with no end token
    (plinth refuses a tokenizer whose size differs from the embedding's rows); generation runs to its
    token budget.
    """
    import numpy as np

    from plinth.gguf import GGUFFile
    from plinth.testing import byte_vocab, write_gguf

    gf = GGUFFile(src)
    vocab = byte_vocab()
    n = int(gf.tensors["token_embd.weight"].shape[0])
    vocab.update({"tokenizer.ggml.tokens": vocab["tokenizer.ggml.tokens"][:n],
                  "tokenizer.ggml.token_type": vocab["tokenizer.ggml.token_type"][:n]})
    vocab.pop("tokenizer.ggml.eos_token_id")
    write_gguf(out, dict(gf.metadata, **vocab), {name: np.array(gf.raw(name)) for name in gf.tensors})
    return out

"""Fixtures shared by the test modules of this directory."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def byte_llama(tmp_path_factory):
    """A tiny random llama (seed 4) with a byte vocabulary of 257 ids, loaded with the llama plugin alone: the
    target of the speculative-decoding tests that compare drafted output with plain decoding."""
    import plinth
    from plinth.testing import byte_vocab, make_registry, tiny_metadata, write_synthetic_gguf
    from plinth_llama.plugin import plugin

    registry = make_registry(plugin)
    path = tmp_path_factory.mktemp("byte-llama") / "tiny-llama.gguf"
    md = tiny_metadata("llama", n_vocab=257) | byte_vocab()
    return plinth.load_model(write_synthetic_gguf(path, "llama", md, registry, seed=4), registry=registry)

"""Shared fixtures: tiny targets (qwen3, llama) and a writer of tiny DSpark drafts for them."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def targets(tmp_path_factory):
    from plinth_dflash.testkit import tiny_target

    d = tmp_path_factory.mktemp("targets")
    return {arch: tiny_target(d / f"{arch}.gguf", arch, n_layer=3, seed=5) for arch in ("qwen3", "llama")}


@pytest.fixture
def dspark_file(tmp_path):
    from plinth_dspark.testkit import write_tiny_dspark

    counter = iter(range(10_000))

    def make(**kw):
        kw.setdefault("n_vocab", 257)
        kw.setdefault("mask_token", 255)
        kw.setdefault("taps", (1, 3))
        return write_tiny_dspark(tmp_path / f"dspark-{next(counter)}.gguf", **kw)

    return make

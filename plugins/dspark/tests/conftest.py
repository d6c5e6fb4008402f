"""Shared fixtures: tiny targets (qwen3, llama) and a writer of tiny DSpark drafts for them."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def targets(tmp_path_factory):
    """Tiny qwen3 and llama targets, and gemma4 when plinth-gemma is installed."""
    import importlib.util

    from plinth_dflash.testkit import tiny_gemma4_target, tiny_target

    d = tmp_path_factory.mktemp("targets")
    out = {arch: tiny_target(d / f"{arch}.gguf", arch, n_layer=3, seed=5) for arch in ("qwen3", "llama")}
    if importlib.util.find_spec("plinth_gemma") is not None:
        out["gemma4"] = tiny_gemma4_target(d / "gemma4.gguf")
    return out


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

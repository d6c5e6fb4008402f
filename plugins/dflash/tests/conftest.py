"""Shared fixtures: tiny targets (qwen3, llama) and a writer of tiny drafts for them."""

from __future__ import annotations

import pytest


def has_gemma() -> bool:
    import importlib.util

    return importlib.util.find_spec("plinth_gemma") is not None


@pytest.fixture(scope="session")
def targets(tmp_path_factory):
    from plinth_dflash.testkit import tiny_gemma4_target, tiny_target

    d = tmp_path_factory.mktemp("targets")
    out = {arch: tiny_target(d / f"{arch}.gguf", arch, n_layer=3, seed=5) for arch in ("qwen3", "llama")}
    if has_gemma():
        out["gemma4"] = tiny_gemma4_target(d / "gemma4.gguf")
    return out


@pytest.fixture(scope="session")
def strict_targets(targets):
    """The same tiny targets loaded on the strict device stand-in (plinth.testing.strict)."""
    import plinth
    from plinth.testing import make_registry

    reg = make_registry("llama", *(("gemma",) if has_gemma() else ()))
    return {arch: plinth.load_model(m.path, backend="strict", registry=reg) for arch, m in targets.items()}


@pytest.fixture
def targets_on(request):
    """``targets_on(backend)``: the tiny targets on "numpy" or "strict"."""
    return lambda backend: request.getfixturevalue("targets" if backend == "numpy" else "strict_targets")


@pytest.fixture
def draft_file(tmp_path):
    from plinth_dflash.testkit import write_tiny_draft

    counter = iter(range(10_000))

    def make(variant="dflash", **kw):
        kw.setdefault("n_vocab", 257)
        kw.setdefault("mask_token", 255)
        return write_tiny_draft(tmp_path / f"{variant}-{next(counter)}.gguf", variant, **kw)

    return make


@pytest.fixture
def drafter(targets, draft_file):
    from plinth_dflash.drafter import make_dflash

    def make(variant="dflash", target="qwen3", options=None, **kw):
        kw.setdefault("taps", (1, 3))
        return make_dflash(targets[target], {"draft": str(draft_file(variant, **kw)), **(options or {})})

    return make

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

"""OLMo2, a third-party architecture written only from docs/writing-a-plugin.md and the public API.

tests/fixtures/plinth-olmo2 holds the plugin (architecture + converter) and its golden file
(transformers' Olmo2ForCausalLM logits on a tiny random config, weights drawn from a seed).
Checked here: the golden through convert -> load_model (default suite, no torch), live
transformers (marker ref), the test kit's architecture contract, and that the model code stays
small and uses only public names.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from plinth.testing import load_module

FIXTURE = Path(__file__).parent / "fixtures" / "plinth-olmo2"
golden = load_module(FIXTURE / "make_golden.py")
TOL = 1e-4


@pytest.fixture
def registry(plinth_registry, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURE))
    from plinth_olmo2.plugin import plugin

    return plinth_registry(plugin)


def converted(registry, tmp_path):
    from plinth import load_model
    from plinth.convert import convert
    from plinth.testing import write_hf_folder

    folder = write_hf_folder(tmp_path / "hf", golden.CONFIG, golden.hf_weights())
    return load_model(convert(folder, tmp_path / "olmo2.gguf", registry=registry), registry=registry)


def test_matches_the_transformers_golden(registry, tmp_path):
    model = converted(registry, tmp_path)
    with np.load(FIXTURE / "golden.npz") as z:
        assert json.loads(str(z["info"]))["config"] == golden.CONFIG
        for i in range(len(golden.PROMPTS)):
            prompt = z[f"prompt_{i}"].tolist()
            got = model.logits(prompt)
            diff = float(np.abs(got - z[f"logits_{i}"]).max())
            assert diff <= TOL, f"prompt {i}: max |plinth - transformers| = {diff:.3g}"
            assert np.abs(z[f"logits_{i}"]).max() > 1.0  # the golden is not trivially small


@pytest.mark.ref
def test_matches_live_transformers(registry, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    model = converted(registry, tmp_path)
    prompts = golden.PROMPTS + [[5] * 20]
    for prompt, want in zip(prompts, golden.reference_logits(prompts)):
        np.testing.assert_allclose(model.logits(prompt), want, atol=TOL, rtol=0)


@pytest.mark.parametrize("backend", ["numpy", "strict"])
def test_architecture_contract(registry, tmp_path, backend):
    from plinth.testing import check_architecture, tiny_metadata

    check_architecture(registry, "olmo2", tiny_metadata("olmo2", n_vocab=257), tmp_path, backend=backend)


def test_model_code_is_small_and_uses_only_public_names():
    import plinth
    import plinth.graph
    import plinth.ops

    path = FIXTURE / "plinth_olmo2" / "olmo2.py"
    assert len(path.read_text().splitlines()) <= 150
    public = {"plinth": set(plinth.__all__) | {"ops"}, "plinth.graph": set(plinth.graph.__all__),
              "plinth.ops": set(plinth.ops.__all__)}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plinth"):
            assert node.module in public, f"olmo2.py imports from {node.module}"
            for alias in node.names:
                assert alias.name in public[node.module], f"olmo2.py uses {node.module}.{alias.name}"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ops":
            assert node.attr in plinth.ops.__all__, f"olmo2.py uses ops.{node.attr}"

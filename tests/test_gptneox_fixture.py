"""GPT-NeoX, a third-party architecture written only from docs/writing-a-plugin.md and the public API.

tests/fixtures/plinth-gptneox holds the plugin (architecture + converter) and its golden file
(transformers' GPTNeoXForCausalLM logits on a tiny random config: exact GELU, partial rotary at a
quarter of each head, parallel residual, biases everywhere, weights drawn from a seed). Checked
here: the golden through convert -> load_model (default suite, no torch), live transformers with
both residual forms (marker ref), the test kit's architecture contract on the numpy and strict
backends, and that the plugin imports only public modules and public names.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from plinth.testing import load_module
from plinth.testing.layering import private_imports

FIXTURE = Path(__file__).parent / "fixtures" / "plinth-gptneox"
golden = load_module(FIXTURE / "make_golden.py")
TOL = 1e-4


@pytest.fixture
def registry(plinth_registry, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURE))
    from plinth_gptneox.plugin import plugin

    return plinth_registry(plugin)


def converted(registry, tmp_path, config=golden.CONFIG):
    from plinth import load_model
    from plinth.convert import convert
    from plinth.testing import write_hf_folder

    folder = write_hf_folder(tmp_path / "hf", config, golden.hf_weights(config))
    return load_model(convert(folder, tmp_path / "gptneox.gguf", registry=registry), registry=registry)


def test_matches_the_transformers_golden(registry, tmp_path):
    model = converted(registry, tmp_path)
    assert model.hparams.n_rot == 4 < model.hparams.head_dim == 16  # partial rotary
    with np.load(FIXTURE / "golden.npz") as z:
        assert json.loads(str(z["info"]))["config"] == golden.CONFIG
        for i in range(len(golden.PROMPTS)):
            want = z[f"logits_{i}"]
            diff = float(np.abs(model.logits(z[f"prompt_{i}"].tolist()) - want).max())
            assert diff <= TOL, f"prompt {i}: max |plinth - transformers| = {diff:.3g}"
            assert np.abs(want).max() > 1.0  # the golden is not trivially small


@pytest.mark.ref
@pytest.mark.parametrize("parallel", [True, False])
def test_matches_live_transformers(registry, tmp_path, parallel):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    config = {**golden.CONFIG, "use_parallel_residual": parallel}
    model = converted(registry, tmp_path, config)
    prompts = golden.PROMPTS + [[5] * 20]
    for prompt, want in zip(prompts, golden.reference_logits(prompts, config)):
        np.testing.assert_allclose(model.logits(prompt), want, atol=TOL, rtol=0)


@pytest.mark.parametrize("backend", ["numpy", "strict"])
def test_architecture_contract(registry, tmp_path, backend):
    from plinth.testing import check_architecture, tiny_metadata

    md = tiny_metadata("gptneox", n_vocab=257, attention__layer_norm_epsilon=1e-5, rope__dimension_count=4)
    del md["gptneox.attention.layer_norm_rms_epsilon"], md["gptneox.attention.head_count_kv"]
    check_architecture(registry, "gptneox", md, tmp_path, backend=backend)


def test_the_plugin_uses_only_public_modules_and_names():
    import plinth.graph
    import plinth.ops

    assert private_imports(FIXTURE / "plinth_gptneox") == []
    path = FIXTURE / "plinth_gptneox" / "gptneox.py"
    assert len(path.read_text().splitlines()) <= 120
    public = {"plinth": {"ops"}, "plinth.graph": set(plinth.graph.__all__)}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plinth"):
            for alias in node.names:
                assert alias.name in public[node.module], f"gptneox.py uses {node.module}.{alias.name}"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ops":
            assert node.attr in plinth.ops.__all__, f"gptneox.py uses ops.{node.attr}"

"""Files written by llama.cpp's own converter run in plinth as transformers runs the model (no torch).

``llamacpp/<case>.gguf`` is what llama.cpp 0.3.36's ``convert_hf_to_gguf.py`` wrote (``--outtype f16``,
lossless for the weights drawn) for a tiny random MiMo-V2-Flash, and ``llamacpp/<case>.npz`` holds
transformers' logits and 32-token greedy continuations for prompts of 1, 9 and 300 tokens (both written
by ``llamacpp/make_fixtures.py``). ``lc_release``: full / sliding / sliding / full, layer 0 dense and
MoE after it, sinks on the sliding layers; ``lc_dense``: sliding / full / sliding, all dense, a window
of 4. llama.cpp counts its 3 MTP blocks in ``block_count`` (they carry no tensors here).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import plinth
from plinth.testing import check_prefill_then_decode, greedy_through_cache, load_module

HERE = Path(__file__).resolve().parent / "llamacpp"
ATOL = 1e-4
cases = load_module(HERE.parent / "mimo_cases.py")
CASES = sorted(cases.FIXTURES)


@pytest.fixture(scope="module")
def models():
    reg = cases.registry()
    return {case: plinth.load_model(HERE / f"{case}.gguf", registry=reg) for case in CASES}


def records(case):
    d = np.load(HERE / f"{case}.npz")
    n = len([k for k in d.files if k.startswith("prompt_")])
    return json.loads(str(d["config"])), [(d[f"prompt_{i}"].tolist(), d[f"rows_{i}"], d[f"logits_{i}"],
                                           d[f"greedy_{i}"].tolist()) for i in range(n)]


@pytest.mark.parametrize("case", CASES)
def test_the_file_is_llama_cpps_layout(models, case):
    cfg, _ = records(case)
    assert cfg == json.loads(json.dumps(cases.FIXTURES[case]["config"]))
    m = models[case]
    hp = m.hparams
    assert (m.arch, hp.n_layer, hp.n_nextn) == ("mimo2", cfg["num_hidden_layers"], 3)
    assert list(hp.swa) == [t == cases.S for t in cfg["layer_types"]] + [True] * 3  # (the MTP slots: sliding)
    assert m.metadata["general.file_type"] == 1  # f16


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(models, case):
    _, runs = records(case)
    for prompt, rows, ref, _ in runs:
        got = models[case].logits(prompt)[rows]
        diff = float(np.abs(got - ref).max())
        assert diff <= ATOL, f"{case}, prompt of {len(prompt)}: max |plinth - transformers| = {diff:.3g}"


@pytest.mark.parametrize("case", CASES)
def test_greedy_continuation_matches_transformers(models, case):
    _, runs = records(case)
    m = models[case]
    for prompt, _, _, ref in runs[:2]:  # (the 300-token prompt's is in test_reference, live)
        assert greedy_through_cache(m.graph, m.hparams.n_layer, prompt, len(ref)) == ref, (case, len(prompt))


def test_prefill_then_decode_past_the_window(models):
    m = models["lc_dense"]  # window 4: decoding past it drops the oldest keys on the sliding layers
    check_prefill_then_decode(m.graph, m.hparams.n_layer, cases.prompts()[2][:20], n_prefill=3, atol=2e-5)

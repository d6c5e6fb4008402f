"""Accuracy of gemma4 against Hugging Face transformers' Gemma4ForCausalLM (5.24).

``golden/<case>.npz`` holds, for a tiny random model of each case (``golden/make_golden.py``:
dense sliding/full, proportional RoPE variants, per-layer embeddings with attention_k_eq_v, KV
sharing with the double-wide MLP, MoE, all at once), the reference's logits for prompts of 1, 9
and 300 tokens and a 32-token greedy continuation of each. Here the same weights are written as an
HF folder, converted by plinth's converter, loaded through the plugin, and compared. The default
run needs no torch; the ``ref`` tests recompute the reference live and convert a checkpoint
written by transformers' own ``save_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from plinth.testing import load_module
from plinth.testing.golden import assert_record_is_case, load_golden_rows, plinth_models
from plinth.testing.reference import assert_greedy_matches, assert_logits_close, assert_record_reproduces

GOLDEN = Path(__file__).resolve().parent / "golden"
LOGIT_ATOL = 1e-4

golden = load_module(GOLDEN / "make_golden.py")
CASES = sorted(golden.CASES)


def load(case):
    return load_golden_rows(GOLDEN / f"{case}.npz")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return plinth_models(golden, tmp_path_factory.mktemp("gemma4-golden"))


@pytest.mark.parametrize("case", CASES)
def test_golden_file_matches_this_case(case):
    info, runs = load(case)
    assert_record_is_case(info, runs, golden, case)


@pytest.mark.parametrize("case", CASES)
def test_converted_model_has_the_configured_layout(models, case):
    model, cfg = models[case], golden.CASES[case]["config"]
    hp = model.hparams
    swa, owns = golden.layout(cfg)
    assert model.arch == "gemma4" and hp.n_layer == cfg["num_hidden_layers"]
    assert list(hp.swa) == swa
    assert [hp.owns_kv(il) for il in range(hp.n_layer)] == owns
    kinds = [type(k[0]).__name__ for k in model.graph.cache_layout()]
    assert kinds == ["KV" if o else "SharedKV" for o in owns]
    assert hp.n_embd_per_layer == cfg["hidden_size_per_layer_input"]
    assert hp.n_expert == (cfg.get("num_experts") or 0)
    wide = [cfg["intermediate_size"] * (2 if cfg["use_double_wide_mlp"] and not o else 1) for o in owns]
    assert list(hp.n_ff) == wide
    if cfg["attention_k_eq_v"]:  # full layers have no V projection: K is V
        full = [il for il in range(hp.n_layer) if not swa[il] and owns[il]]
        assert all(f"blk.{il}.attn_v.weight" not in model.weights for il in full)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_reference(models, case):
    model = models[case]
    _, runs = load(case)
    for prompt, rows, ref, _ in runs:
        assert_logits_close(model.logits(prompt)[rows], ref, LOGIT_ATOL, f"{case}, prompt of {len(prompt)}")


@pytest.mark.parametrize("case", CASES)
def test_greedy_continuation_matches_reference(models, case):
    model = models[case]
    _, runs = load(case)
    for prompt, _, _, ref in runs:
        assert_greedy_matches(model.graph, model.hparams.n_layer, prompt, ref, f"{case}, prompt of {len(prompt)}")


def test_shared_layers_hold_no_cache_bytes(models):
    """KV sharing on the cache kinds: after a prompt the shared layers hold nothing, their sources all."""
    model = models["shared"]
    hp = model.hparams
    ctx = model.new_context()
    prompt = golden.prompts("shared")[1]
    ctx.decode(prompt)
    layers = ctx.cache.layers
    assert [il for il in range(hp.n_layer) if not hp.owns_kv(il)] == [3, 4]
    assert [hp.kv_source[il] for il in (3, 4)] == [1, 2]  # the last sliding and the last full layer before them
    assert [layers[il][0].nbytes() for il in (3, 4)] == [0, 0]
    kv = sum(len(prompt) * hp.n_head_kv[il] * hp.hd(il) * 2 * 4 for il in range(3))  # K and V, f32
    positions = 3 * len(prompt) * 8  # each owning layer's int64 positions
    assert ctx.cache.nbytes_by_kind().get("shared", 0) == 0
    assert ctx.cache.nbytes() == kv + positions


@pytest.mark.ref
@pytest.mark.parametrize("case", CASES)
def test_golden_logits_are_reproducible(case, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _, runs = load(case)
    assert_record_reproduces(golden.reference(case, tmp_path, with_greedy=False), runs, atol=1e-5)


@pytest.mark.ref
def test_save_pretrained_checkpoint_converts(tmp_path):
    """A checkpoint written by transformers itself (its own init, save_pretrained) through ``plinth convert``."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from plinth.convert import convert
    from plinth.model import load_model
    from plinth.testing.hf import byte_bpe_tokenizer

    cfg = {k: v for k, v in golden.CASES["all"]["config"].items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**cfg)).eval()
    with torch.no_grad():  # transformers' init leaves norms at 1 and scales at 1: redraw them
        for name, p in model.named_parameters():
            if p.ndim == 1 or name.endswith("layer_scalar"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand_like(b) + 0.5)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(json.dumps(byte_bpe_tokenizer()))
    reg = golden.registry()
    convert(folder, tmp_path / "m.gguf", registry=reg)
    ids = golden.prompts("all")[2][:64]
    with torch.no_grad():
        ref = model(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    got = load_model(tmp_path / "m.gguf", registry=reg).logits(ids)
    diff = float(np.max(np.abs(got - ref)))
    assert diff <= LOGIT_ATOL, f"save_pretrained checkpoint: max |plinth - transformers| = {diff:.3g}"


@pytest.mark.ref
def test_save_pretrained_multimodal_checkpoint_converts_its_text_model(tmp_path):
    """Gemma4ForConditionalGeneration (the released layout) saved by transformers: its text model converts."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from plinth.convert import convert
    from plinth.model import load_model
    from plinth.testing.hf import byte_bpe_tokenizer

    text = {k: v for k, v in golden.CASES["shared"]["config"].items() if k not in ("architectures", "model_type")}
    text["pad_token_id"] = 0  # the multimodal forward masks media tokens with it
    torch.manual_seed(1)
    cfg = transformers.Gemma4Config(text_config=transformers.Gemma4TextConfig(**text), vision_config=None,
                                    audio_config=None)
    model = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.ndim == 1 else torch.randn_like(p) / p.shape[-1] ** 0.5)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(json.dumps(byte_bpe_tokenizer()))
    reg = golden.registry()
    convert(folder, tmp_path / "m.gguf", registry=reg)
    ids = golden.prompts("shared")[2][:48]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()
    got = load_model(tmp_path / "m.gguf", registry=reg).logits(ids)
    diff = float(np.max(np.abs(got - ref)))
    assert diff <= LOGIT_ATOL, f"multimodal save_pretrained checkpoint: max |plinth - transformers| = {diff:.3g}"

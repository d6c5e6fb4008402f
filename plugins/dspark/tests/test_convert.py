"""Converters: DeepSpec's flat config and the speculators format (plus plinth-dflash's speculators reading)."""

from __future__ import annotations

import json

import numpy as np
import pytest


def heads(v=96, e=64, r=8, seed=0):
    rng = np.random.default_rng(seed)
    return {"markov_head.markov_w1.weight": rng.standard_normal((v, r)).astype(np.float32),
            "markov_head.markov_w2.weight": rng.standard_normal((v, r)).astype(np.float32),
            "confidence_head.weight": rng.standard_normal((1, e + r)).astype(np.float32),
            "confidence_head.bias": np.array([0.1], dtype=np.float32)}


def deepspec_dir(tmp_path, **cfg_kw):
    from plinth_dflash.testkit import hf_draft_config, write_hf_draft

    d = write_hf_draft(tmp_path / "deepspec", "dflash", extra_tensors=heads(), block_size=7)
    cfg = hf_draft_config("dflash", block_size=7)
    dc = cfg.pop("dflash_config")
    cfg.update(architectures=["Qwen3DSparkModel"], target_layer_ids=dc["target_layer_ids"],
               mask_token_id=dc["mask_token_id"], markov_rank=8, markov_head_type="vanilla",
               enable_confidence_head=True, confidence_head_with_markov=True)
    cfg.update(cfg_kw)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_deepspec_flat_config(tmp_path):
    from plinth.graph import NumpyBackend
    from plinth_dspark.convert import DeepSpecConverter
    from plinth_dspark.format import load_dspark

    out = tmp_path / "ds.gguf"
    DeepSpecConverter().convert(str(deepspec_dir(tmp_path)), str(out), {})
    f = load_dspark(out, NumpyBackend())
    assert f.dspark.sample_from_anchor  # DeepSpec default
    assert f.dspark.rank == 8 and f.dspark.has_confidence_head and f.dspark.conf_with_markov
    assert f.draft.hparams.block_size == 7 and f.draft.hparams.target_layers == (1, 2)  # the +1 rule


def test_non_vanilla_markov_head_is_refused(tmp_path):
    from plinth.errors import UserError
    from plinth_dspark.convert import DeepSpecConverter

    with pytest.raises(UserError) as exc:
        DeepSpecConverter().convert(str(deepspec_dir(tmp_path, markov_head_type="gated")), str(tmp_path / "x.gguf"), {})
    assert "markov_head_type = 'gated'" in str(exc.value) and "\n" not in str(exc.value)


def speculators_dir(tmp_path, *, draft_vocab=96, sample_from_anchor=None, variant="dspark"):
    from plinth_dflash.testkit import hf_draft_config, hf_draft_tensors, write_safetensors

    flat = hf_draft_config("dflash2" if variant == "dflash2" else "dflash", block_size=8)
    dc = flat.pop("dflash_config")
    cfg = {"speculators_model_type": variant, "architectures": [{"dspark": "DSparkDraftModel", "dflash": "DFlashDraftModel",
                                                              "dflash2": "DFlash2DraftModel"}[variant]],
           "transformer_layer_config": {k: v for k, v in flat.items() if k not in ("architectures", "block_size")},
           "draft_vocab_size": draft_vocab, "block_size": 8, "aux_hidden_state_layer_ids": dc["target_layer_ids"],
           "mask_token_id": dc["mask_token_id"], "speculators_version": "0.9.0"}
    if variant == "dflash2":
        cfg.update({k: dc[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")})
    if sample_from_anchor is not None:
        cfg["sample_from_anchor"] = sample_from_anchor
    t = hf_draft_tensors({**flat, "dflash_config": dc})
    if variant == "dspark":
        cfg.update(markov_rank=8, markov_head_type="vanilla", enable_confidence_head=True)
        h = heads()
        h["confidence_head.proj.weight"] = h.pop("confidence_head.weight")
        h["confidence_head.proj.bias"] = h.pop("confidence_head.bias")
        t.update(h)
        if draft_vocab < 96:
            rng = np.random.default_rng(3)
            ids = np.sort(rng.choice(96, draft_vocab, replace=False))
            t["d2t"] = (ids - np.arange(draft_vocab)).astype(np.int64)
            t["markov_head.markov_w2.weight"] = t["markov_head.markov_w2.weight"][:draft_vocab]
            t["lm_head.weight"] = rng.standard_normal((draft_vocab, 64)).astype(np.float32)
    d = tmp_path / f"spec-{variant}-{draft_vocab}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    write_safetensors(d / "model.safetensors", t)
    return d, t


@pytest.mark.parametrize("draft_vocab", [96, 40])
def test_speculators_dspark(tmp_path, draft_vocab):
    from plinth.graph import NumpyBackend
    from plinth_dspark.convert import SpeculatorsConverter
    from plinth_dspark.format import load_dspark

    d, t = speculators_dir(tmp_path, draft_vocab=draft_vocab)
    out = tmp_path / "s.gguf"
    SpeculatorsConverter().convert(str(d), str(out), {})
    f = load_dspark(out, NumpyBackend())
    assert f.dspark.sample_from_anchor  # speculators' DSpark default
    assert f.dspark.reduced == (draft_vocab < 96) and f.dspark.draft_vocab == draft_vocab
    if draft_vocab < 96:  # offsets -> absolute ids
        np.testing.assert_array_equal(f.draft.weights["d2t"], np.arange(draft_vocab) + t["d2t"])


def test_specforge_flat_schema_defaults_to_bonus_anchor(tmp_path):
    from plinth.graph import NumpyBackend
    from plinth_dspark.convert import SpeculatorsConverter
    from plinth_dspark.format import load_dspark

    d = deepspec_dir(tmp_path)  # a flat schema, no speculators_* fields, converted as a SpecForge export
    out = tmp_path / "sf.gguf"
    SpeculatorsConverter().convert(str(d), str(out), {})
    assert not load_dspark(out, NumpyBackend()).dspark.sample_from_anchor


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_plinth_dflash_reads_speculators_format(tmp_path, variant):
    from plinth_dflash.convert import DFlash2Converter, DFlashConverter
    from plinth_dflash.format import load_draft
    from plinth.graph import NumpyBackend

    d, _ = speculators_dir(tmp_path, variant=variant, sample_from_anchor=False)
    out = tmp_path / f"{variant}.gguf"
    (DFlash2Converter if variant == "dflash2" else DFlashConverter)().convert(str(d), str(out), {})
    f = load_draft(out, NumpyBackend())
    # speculators' aux ids are hidden-state indices, the GGUF taps themselves (no +1)
    assert f.hparams.variant == variant and f.hparams.block_size == 8 and f.hparams.target_layers == (0, 1)

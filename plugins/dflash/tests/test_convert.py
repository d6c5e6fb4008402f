"""``plinth convert`` of HF DFlash / DFlash2 / LiLiCorr draft folders."""

from __future__ import annotations

import json

import numpy as np
import pytest

from plinth.errors import UserError
from plinth.gguf import GGUFFile
from plinth_dflash.convert import DFlash2Converter, DFlashConverter, LiLiCorrConverter, map_tensor_name
from plinth_dflash.testkit import write_hf_draft

CONV = {"dflash": DFlashConverter, "dflash2": DFlash2Converter, "lilicorr": LiLiCorrConverter}


def convert(tmp_path, variant="dflash", options=None, **kw):
    kw.setdefault("n_vocab", 257)
    hf = write_hf_draft(tmp_path / f"hf-{variant}", variant, **kw)
    out = tmp_path / f"{variant}.gguf"
    CONV[variant]().convert(str(hf), str(out), options or {})
    return GGUFFile(out), out


@pytest.mark.parametrize("variant", ["dflash", "dflash2", "lilicorr"])
def test_converted_drafts_load_and_draft(tmp_path, targets, variant):
    from plinth_dflash.drafter import make_dflash

    from .test_drafter import prefill

    gf, out = convert(tmp_path, variant, target_layer_ids=(0, 2), n_target_layer=3, block_size=8)
    assert gf.metadata["dflash.target_layers"].tolist() == [1, 3]  # the +1 rule
    assert gf.metadata["tokenizer.ggml.mask_token_id"] == 256 and gf.metadata["dflash.block_size"] == 8
    assert "dflash.tie_word_embeddings" not in gf.metadata  # no own embedding: nothing to tie
    dr = make_dflash(targets["qwen3"], {"draft": str(out)})
    assert dr.name == variant
    prefill(dr, targets["qwen3"])
    assert len(dr.draft(0, 7, history=[1, 2, 3, 4, 5, 6, 7, 8, 9], pos=8)) == 7


def test_registered_converters_through_plinth_convert(tmp_path, plinth_registry):
    from plinth.convert import convert as plinth_convert
    from plinth_dflash.plugin import plugin

    reg = plinth_registry(plugin)
    for variant in ("dflash", "dflash2"):
        hf = write_hf_draft(tmp_path / variant, variant)
        out = plinth_convert(hf, tmp_path / f"{variant}.gguf", registry=reg)
        assert GGUFFile(out).metadata["general.architecture"] == "dflash"


def test_tied_flag_and_own_tensors(tmp_path):
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((257, 64)).astype(np.float32)
    gf, _ = convert(tmp_path, extra_tensors={"embed_tokens.weight": emb})
    assert gf.metadata["dflash.tie_word_embeddings"] is True and "token_embd.weight" in gf.tensors
    gf2, _ = convert(tmp_path / "b", extra_tensors={"embed_tokens.weight": emb, "lm_head.weight": emb})
    assert gf2.metadata["dflash.tie_word_embeddings"] is False and "output.weight" in gf2.tensors
    gf3, _ = convert(tmp_path / "c", options={"drop_embeddings": "1"}, extra_tensors={"embed_tokens.weight": emb})
    assert "token_embd.weight" not in gf3.tensors and "dflash.tie_word_embeddings" not in gf3.metadata


def test_layer_types_become_a_bool_pattern(tmp_path):
    gf, _ = convert(tmp_path, layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    assert gf.metadata["dflash.attention.sliding_window"] == 64
    pat = gf.metadata["dflash.attention.sliding_window_pattern"]
    assert pat.dtype == np.bool_ and pat.tolist() == [True, False]
    # reference semantics: a sliding layer is causal unless is_causal says otherwise
    assert gf.metadata["dflash.attention.causal_layers"].tolist() == [True, False]
    gf2, _ = convert(tmp_path / "b", layer_types=["sliding_attention", "full_attention"], sliding_window=64,
                     is_causal=False)
    assert "dflash.attention.causal_layers" not in gf2.metadata and gf2.metadata["dflash.attention.causal"] is False


def test_dflash2_keys(tmp_path):
    gf, _ = convert(tmp_path, "dflash2", output_multiplier=1.5, softcap=30.0)
    md = gf.metadata
    assert (md["dflash.conv_kernel_size"], md["dflash.conv_group_size"], md["dflash.selector_rank"],
            md["dflash.selector_top_k"]) == (2, 8, 8, 4)
    assert md["dflash.logit_scale"] == 1.5 and md["dflash.final_logit_softcapping"] == 30.0
    assert gf.tensors["blk.1.attn_conv_base"].shape == (2, 2, 64)


def test_default_taps_rule(tmp_path):
    cfg_dir = write_hf_draft(tmp_path / "hf", "dflash", n_layer=2, n_target_layer=36)
    cfg = json.loads((cfg_dir / "config.json").read_text())
    del cfg["dflash_config"]["target_layer_ids"]
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    DFlashConverter().convert(str(cfg_dir), str(tmp_path / "o.gguf"), {})
    assert GGUFFile(tmp_path / "o.gguf").metadata["dflash.target_layers"].tolist() == [2, 34]  # [1, 33] + 1


@pytest.mark.parametrize("edit, match", [
    (lambda c: c["dflash_config"].update(mystery_knob=3), "not understood"),
    (lambda c: c.update(model_type="llama"), "model_type"),
    (lambda c: c.update(quantization_config={"quant_method": "modelopt"}), "quantised"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda c: c.update(layer_types=["sliding_attention", "chunked_attention"]), "not understood"),
    (lambda c: c.update(attention_bias=True), "attention_bias"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_refuses_configs_it_does_not_understand(tmp_path, edit, match):
    hf = write_hf_draft(tmp_path / "hf", "dflash")
    cfg = json.loads((hf / "config.json").read_text())
    edit(cfg)
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=match):
        DFlashConverter().convert(str(hf), str(tmp_path / "o.gguf"), {})


def test_embedding_scale_and_tanh_gelu_are_written(tmp_path):
    """llama.cpp's DFlash converter writes input_embedding_scale as embedding_scale; a speculators draft for a
    Gemma 4 verifier is a Qwen3 layer with gelu_pytorch_tanh (speculators' create_transformer_layer_config)."""
    hf = write_hf_draft(tmp_path / "hf", "dflash", hidden_act="gelu_pytorch_tanh")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["dflash_config"]["input_embedding_scale"] = 2.0
    (hf / "config.json").write_text(json.dumps(cfg))
    DFlashConverter().convert(str(hf), str(tmp_path / "o.gguf"), {})
    md = GGUFFile(tmp_path / "o.gguf").metadata
    assert float(md["dflash.embedding_scale"]) == 2.0 and str(md["dflash.hidden_activation"]) == "gelu_pytorch_tanh"


def test_refuses_unknown_tensors_and_reduced_vocab(tmp_path):
    with pytest.raises(UserError, match="not part of"):
        convert(tmp_path, extra_tensors={"layers.0.mystery.weight": np.zeros(3, np.float32)})
    with pytest.raises(UserError, match="d2t"):
        convert(tmp_path / "b", extra_tensors={"d2t": np.arange(50, dtype=np.int64)})
    gf, _ = convert(tmp_path / "c", extra_tensors={"d2t": np.zeros(257, dtype=np.int64)})  # identity: dropped
    assert "d2t" not in gf.tensors


def test_target_option_copies_the_tokenizer_and_checks_sizes(tmp_path, targets):
    gf, _ = convert(tmp_path, options={"target": str(targets["qwen3"].path)}, target_layer_ids=(0, 2))
    assert "tokenizer.ggml.mask_token_id" in gf.metadata
    with pytest.raises(UserError, match="exceed"):
        convert(tmp_path / "b", options={"target": str(targets["qwen3"].path)}, target_layer_ids=(0, 5))


# 31. LiLiCorr head layers keep their own namespace (llama.cpp "bid clash" fix)
def test_lilicorr_head_ids_do_not_clash_with_backbone_blocks(tmp_path):
    assert map_tensor_name("lilicorr.layers.0.attn_norm.weight") == "lilicorr.blk.0.attn_norm.weight"
    assert map_tensor_name("layers.0.input_layernorm.weight") == "blk.0.attn_norm.weight"
    assert map_tensor_name("model.layers.1.mlp.up_proj.weight") == "blk.1.ffn_up.weight"
    gf, _ = convert(tmp_path, "lilicorr", lilicorr={"lilicorr_num_layers": 2})
    blk0 = sorted(n for n in gf.tensors if n.startswith("blk.0."))
    assert all(not n.startswith("blk.0.attn_qkv") for n in blk0)
    assert "lilicorr.blk.1.attn_qkv.weight" in gf.tensors and "blk.1.attn_q.weight" in gf.tensors
    assert gf.metadata["dflash.lilicorr.block_count"] == 2

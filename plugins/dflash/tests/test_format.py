"""The dflash GGUF format: keys, tensors, validation errors, variant detection, llama.cpp-style files."""

from __future__ import annotations

import numpy as np
import pytest

from plinth.convert import write_gguf
from plinth.errors import UserError
from plinth.gguf import GGUFFile
from plinth_dflash import constants as C
from plinth_dflash.format import DFlashFormatError, load_hparams, tensor_specs
from plinth_dflash.testkit import random_draft_tensors, tiny_draft_metadata


def _write(tmp_path, md, tensors, name="d.gguf"):
    return write_gguf(tmp_path / name, md, tensors)


def test_missing_target_layers_is_a_named_error():
    md = tiny_draft_metadata()
    del md["dflash.target_layers"]
    with pytest.raises(UserError, match="DFlash model requires 'target_layers'"):
        load_hparams(md, "x.gguf")


@pytest.mark.parametrize("pattern", [2, [1, 0]])
def test_integer_sliding_window_pattern_is_rejected(tmp_path, pattern):
    md = tiny_draft_metadata(sliding_window=4)
    md["dflash.attention.sliding_window_pattern"] = pattern
    path = _write(tmp_path, md, random_draft_tensors(tiny_draft_metadata(), "dflash"))
    with pytest.raises(UserError, match="bool array.*integer.*#26900"):
        load_hparams(dict(GGUFFile(path).metadata), str(path))


def test_bool_sliding_window_pattern_routes_layers(tmp_path):
    md = tiny_draft_metadata(sliding_window=4, swa_pattern=[True, False])
    path = _write(tmp_path, md, random_draft_tensors(md, "dflash"))
    hp = load_hparams(dict(GGUFFile(path).metadata), str(path))
    assert hp.sliding_window == 4 and hp.swa_layers == (True, False)
    assert hp.causal_layers == (False, False)  # non-causal unless the file says so


def test_sliding_window_without_pattern_is_an_error():
    md = tiny_draft_metadata(sliding_window=4)
    del md["dflash.attention.sliding_window_pattern"]
    with pytest.raises(UserError, match="sliding_window_pattern"):
        load_hparams(md, "x.gguf")


def test_causal_flags():
    assert load_hparams(tiny_draft_metadata(causal=True), "x").causal_layers == (True, True)
    md = tiny_draft_metadata()
    md["dflash.decoder_arch"] = "laguna"
    assert load_hparams(md, "x").causal_layers == (True, True)
    md = tiny_draft_metadata()
    md["dflash.attention.causal_layers"] = [True, False]
    assert load_hparams(md, "x").causal_layers == (True, False)


def test_mask_token_from_either_key():
    assert load_hparams(tiny_draft_metadata(mask_token=7), "x").mask_token == 7
    assert load_hparams(tiny_draft_metadata(mask_token=9, mask_key="mask_token_id"), "x").mask_token == 9
    md = tiny_draft_metadata()
    del md["tokenizer.ggml.mask_token_id"]
    with pytest.raises(UserError, match="mask token"):
        load_hparams(md, "x")


def test_block_size_defaults_to_16():
    md = tiny_draft_metadata()
    del md["dflash.block_size"]
    assert load_hparams(md, "x").block_size == 16


def test_variant_detection_from_tensors():
    md2 = tiny_draft_metadata("dflash2")
    assert load_hparams(md2, "x", ["fc.weight", "selector_hidden.weight"]).variant == "dflash2"
    assert load_hparams(tiny_draft_metadata(), "x", ["fc.weight"]).variant == "dflash"
    mdl = tiny_draft_metadata("lilicorr")
    assert load_hparams(mdl, "x", ["lilicorr.in_head.weight"]).variant == "lilicorr"
    with pytest.raises(DFlashFormatError, match="DSpark"):
        load_hparams(tiny_draft_metadata(), "x", ["markov_w1.weight"])


@pytest.mark.parametrize("change, match", [
    ({"dflash.conv_group_size": 7}, "not a multiple"),
    ({"dflash.selector_top_k": 8}, r"K\*\(K\+1\)"),
    ({"dflash.selector_rank": 0}, "> 0"),
])
def test_dflash2_metadata_validation(change, match):
    md = tiny_draft_metadata("dflash2")
    md.update(change)
    with pytest.raises(UserError, match=match):
        load_hparams(md, "x", ["selector_hidden.weight"])


def test_dflash2_missing_key():
    md = tiny_draft_metadata("dflash2")
    del md["dflash.conv_kernel_size"]
    with pytest.raises(UserError, match="conv_kernel_size"):
        load_hparams(md, "x", ["selector_hidden.weight"])


def test_lilicorr_keys_have_no_defaults():
    md = tiny_draft_metadata("lilicorr")
    del md["dflash.lilicorr.factor_dim"]
    with pytest.raises(UserError, match="lilicorr.factor_dim"):
        load_hparams(md, "x", ["lilicorr.in_head.weight"])
    md = tiny_draft_metadata("lilicorr", lilicorr={"top_k": 3})
    with pytest.raises(UserError, match="power of two"):
        load_hparams(md, "x", ["lilicorr.in_head.weight"])


def test_missing_and_misshaped_tensors_are_named(tmp_path, targets):
    from plinth_dflash.drafter import make_dflash

    md = tiny_draft_metadata(taps=(1, 3))
    t = random_draft_tensors(md, "dflash")
    del t["blk.1.attn_k_norm.weight"]
    t["fc.weight"] = t["fc.weight"][:, :64]
    path = _write(tmp_path, md, t)
    with pytest.raises(UserError) as e:
        make_dflash(targets["qwen3"], {"draft": str(path)})
    assert "blk.1.attn_k_norm.weight" in str(e.value) and "fc.weight" in str(e.value)


def test_llama_cpp_style_file_loads(tmp_path, targets):
    """Keys as llama.cpp's early converter wrote them: i32 tap array, dflash.mask_token_id, target_hidden_size,
    tokenizer keys; fc / enc.output_norm / blk.N.* names."""
    import gguf

    from plinth_dflash.drafter import make_dflash

    md = tiny_draft_metadata(taps=(1, 3), mask_key="mask_token_id", n_vocab=257)
    t = random_draft_tensors(md, "dflash")
    w = gguf.GGUFWriter(str(tmp_path / "lcpp.gguf"), "dflash")
    for k, v in md.items():
        if k == "general.architecture":
            continue
        if k == "dflash.target_layers":
            w.add_key_value(k, [int(x) for x in v], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        else:
            w.add_string(k, v)
    w.add_uint32("dflash.target_hidden_size", 64)
    for name, arr in t.items():
        w.add_tensor(name, arr.astype(np.float16) if arr.ndim == 2 else arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    dr = make_dflash(targets["qwen3"], {"draft": str(tmp_path / "lcpp.gguf")})
    assert dr.hp.target_layers == (1, 3) and dr.hp.mask_token == 256
    assert dr.draft_file.tensor_types["fc.weight"] == "F16"


def test_written_file_uses_llama_cpp_names(tmp_path):
    """Every key and tensor a plinth-written draft holds is in llama.cpp's dflash naming."""
    md = tiny_draft_metadata("dflash2", sliding_window=4, swa_pattern=[True, False])
    t = random_draft_tensors(md, "dflash2", own_head=True)
    gf = GGUFFile(_write(tmp_path, md, t))
    llama_cpp_keys = {"target_layers", "block_size", "vocab_size", "embedding_length", "block_count",
                      "attention.head_count", "attention.head_count_kv", "attention.key_length",
                      "attention.value_length", "feed_forward_length", "context_length", "rope.freq_base",
                      "attention.layer_norm_rms_epsilon", "attention.sliding_window",
                      "attention.sliding_window_pattern", "conv_kernel_size", "conv_group_size", "selector_rank",
                      "selector_top_k"}
    for k in gf.metadata:
        if k.startswith("dflash."):
            assert k[len("dflash."):] in llama_cpp_keys, k
    assert gf.metadata["dflash.attention.sliding_window_pattern"].dtype == np.bool_
    layer = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
             "ffn_gate", "ffn_up", "ffn_down", "attn_conv_base", "attn_conv_proj", "ffn_conv_base", "ffn_conv_proj"}
    for n in gf.tensors:
        if n.startswith("blk."):
            assert n.split(".")[2] in layer, n
        else:
            assert n in {"fc.weight", "enc.output_norm.weight", "output_norm.weight", "output.weight",
                         "selector_predecessor.weight", "selector_successor.weight", "selector_hidden.weight"}, n
    assert gf.tensors["blk.0.attn_conv_base"].ne == (64, 2, 2)  # ggml ne {E, Kc, 2}


def test_specs_declare_scale_companions():
    hp = load_hparams(tiny_draft_metadata("dflash2"), "x", ["selector_hidden.weight"])
    scaled = {s.name for s in tensor_specs(hp) if s.scale}
    for name in ("fc.weight", "output.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
                 "blk.0.attn_output.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight",
                 "selector_hidden.weight", "blk.1.attn_conv_proj.weight"):
        assert name in scaled, name
    assert C.T_FC_INPUT_SCALE in {s.name for s in tensor_specs(hp)}


@pytest.mark.parametrize("variant, label", [("dflash", "DFlash"), ("dflash2", "DFlash2"), ("lilicorr", "LiLiCorr")])
def test_plinth_info_describes_a_draft(draft_file, capsys, variant, label):
    """`plinth info` on a draft: described by the plugin declaring the 'dflash' draft format, not loaded as a target."""
    from plinth.cli import main

    path = draft_file(variant, taps=(1, 3), block_size=6)
    assert main(["--plugins", "llama,dflash", "info", "-m", str(path)]) == 0
    out = capsys.readouterr().out
    assert "described by plugin 'dflash'" in out
    assert f"drafter          {label}\n" in out
    assert "block_size       6 " in out and "target_layers    [1, 3]" in out
    assert "reduced_vocab    no (no d2t)" in out


def test_plinth_info_on_a_dspark_draft_without_plinth_dspark(draft_file, capsys):
    from plinth.cli import main

    extra = {"markov_w1.weight": np.zeros((257, 4), np.float32)}
    path = draft_file("dflash", extra_tensors=extra)
    assert main(["--plugins", "llama,dflash", "info", "-m", str(path)]) != 0
    err = capsys.readouterr().err
    assert "'dflash' draft that none of the plugins declaring that format (dflash) recognises" in err

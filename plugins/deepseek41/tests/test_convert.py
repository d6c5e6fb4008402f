"""The DeepseekV4ForCausalLM converter: names, config, release-format dequantization, refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.convert import SafetensorsDir
from plinth.errors import UserError
from plinth.testing import load_module
from plinth.testing.hf import write_raw_safetensors
from plinth_deepseek41 import convert as conv

golden = load_module(Path(__file__).resolve().parent / "golden" / "make_golden.py")


def test_e4m3_and_e8m0_values():
    raw = np.array([0x00, 0x38, 0x40, 0xC0, 0x01, 0x7E, 0x08, 0x3C], np.uint8)
    np.testing.assert_array_equal(conv.e4m3_to_f32(raw), [0.0, 1.0, 2.0, -2.0, 2.0 ** -9, 448.0, 2.0 ** -6, 1.5])
    assert np.isnan(conv.e4m3_to_f32(np.array([0x7F], np.uint8))[0])
    np.testing.assert_array_equal(conv.e8m0_to_f32(np.array([127, 128, 120], np.uint8)), [1.0, 2.0, 2.0 ** -7])


@pytest.mark.ref
def test_e4m3_matches_torch_for_every_byte():
    torch = pytest.importorskip("torch")
    raw = np.arange(256, dtype=np.uint8)
    ref = torch.from_numpy(raw).view(torch.float8_e4m3fn).float().numpy()
    ours = conv.e4m3_to_f32(raw)
    assert np.array_equal(np.isnan(ours), np.isnan(ref))
    np.testing.assert_array_equal(ours[~np.isnan(ref)], ref[~np.isnan(ref)])


def test_fp8_blocks_and_mxfp4_experts_are_dequantized(tmp_path):
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 0x7E, (130, 260)).astype(np.uint8)  # finite e4m3 codes
    scale_exp = rng.integers(120, 130, (2, 3)).astype(np.uint8)  # ceil(130/128) x ceil(260/128)
    packed = rng.integers(0, 256, (4, 32)).astype(np.uint8)  # 4 x 64 FP4 values
    fp4_scale = rng.integers(125, 130, (4, 2)).astype(np.uint8)  # one per 32 inputs
    write_raw_safetensors(tmp_path / "m.safetensors", {
        "layers.0.attn.wq_b.weight": ("F8_E4M3", codes.shape, codes.tobytes()),
        "layers.0.attn.wq_b.scale": ("F8_E8M0", scale_exp.shape, scale_exp.tobytes()),
        "layers.0.ffn.experts.0.w1.weight": ("I8", packed.shape, packed.tobytes()),
        "layers.0.ffn.experts.0.w1.scale": ("F8_E8M0", fp4_scale.shape, fp4_scale.tobytes()),
    })
    st = SafetensorsDir(tmp_path)
    w = conv._read(st, "layers.0.attn.wq_b.weight")
    want = conv.e4m3_to_f32(codes) * np.repeat(np.repeat(2.0 ** (scale_exp.astype(np.float64) - 127), 128, 0),
                                               128, 1)[:130, :260]
    np.testing.assert_array_equal(w, want.astype(np.float32))
    e = conv._read(st, "layers.0.ffn.experts.0.w1.weight")
    assert e.shape == (4, 64)
    r, c = 1, 37  # element 37: byte 18, high nibble; group 1
    code = packed[r, c // 2] >> 4
    assert e[r, c] == conv.FP4_VALUES[code] * 2.0 ** (int(fp4_scale[r, 1]) - 127)


def test_fp8_without_scale_is_refused(tmp_path):
    codes = np.zeros((4, 4), np.uint8)
    write_raw_safetensors(tmp_path / "m.safetensors", {"layers.0.attn.wkv.weight": ("F8_E4M3", (4, 4), codes.tobytes())})
    with pytest.raises(UserError, match="F8_E4M3 without a scale companion"):
        conv._read(SafetensorsDir(tmp_path), "layers.0.attn.wkv.weight")


def test_metadata_from_config():
    md = conv.gguf_metadata(golden.CASES["flash"]["config"], "config.json", "tiny")
    assert md["deepseek4.attention.compress_ratios"] == [0, 4, 8, 4]
    assert md["deepseek4.attention.hca_ratio"] == 8 and "deepseek4.attention.csa_ratio" not in md
    assert md["deepseek4.hash_layer_count"] == 2 and md["deepseek4.rope.dimension_count"] == 16
    legacy = dict(golden.CASES["flash"]["config"], compress_ratios=[0, 4, 128, 0], num_hash_layers=1)
    for k in ("layer_types", "compress_rates", "mlp_layer_types"):
        legacy.pop(k)
    md = conv.gguf_metadata(legacy, "config.json", "tiny")
    assert md["deepseek4.attention.compress_ratios"] == [0, 4, 128, 0] and md["deepseek4.hash_layer_count"] == 1
    with pytest.raises(UserError, match=r"compress_ratios has ratio\(s\) \[64\]"):
        conv.gguf_metadata(dict(legacy, compress_ratios=[0, 64, 0, 0]), "config.json", "tiny")
    with pytest.raises(UserError, match="hash_moe layer after a routed one"):
        conv.gguf_metadata(dict(golden.CASES["flash"]["config"], mlp_layer_types=["moe", "hash_moe", "moe", "moe"]),
                           "config.json", "tiny")


def test_incomplete_mtp_block_is_dropped_with_a_note(tmp_path):
    folder = golden.write_hf_folder("hca_only", tmp_path / "hf")
    state = golden.hf_random_state(golden.CASES["hca_only"]["config"], 1)
    state["mtp.0.e_proj.weight"] = np.zeros((64, 64), np.float32)
    golden.write_safetensors(folder / "model.safetensors", state)
    notes = conv.DeepseekV4Converter().convert(str(folder), str(tmp_path / "m.gguf"), {})
    assert notes[0] == "dropped 1 tensor(s) of incomplete MTP block(s) (no mtp.D.e_proj/h_proj pair)"
    assert notes[1:] == ["no tokenizer.json: the GGUF has no tokenizer (llama.cpp and plinth generate need one)"]


def test_release_mtp_block_is_exported(tmp_path):
    """``mtp.0.*`` (release names) -> ``blk.{n_layer}.*`` + ``nextn.eh_proj = [e_proj | h_proj]``; the drafter runs it."""
    import plinth
    from plinth_deepseek41.mtp import MtpDrafter

    base = golden.CASES["hca_only"]["config"]
    cfg4 = dict(base, num_hidden_layers=4, layer_types=base["layer_types"] + [golden.S],
                mlp_layer_types=["moe"] * 4)
    state = golden.hf_random_state(cfg4, 2)
    rng = np.random.default_rng(3)
    e, hc = base["hidden_size"], base["hc_mult"]
    for k in list(state):
        if k.startswith("model.layers.3."):
            state["mtp.0." + k[len("model.layers.3."):]] = state.pop(k)
    state.update({"mtp.0.enorm.weight": np.ones(e, np.float32), "mtp.0.hnorm.weight": np.ones(e, np.float32),
                  "mtp.0.e_proj.weight": rng.standard_normal((e, e)).astype(np.float32) / 8,
                  "mtp.0.h_proj.weight": rng.standard_normal((e, e)).astype(np.float32) / 8,
                  "mtp.0.norm.weight": np.ones(e, np.float32),
                  "mtp.0.hc_head_fn": rng.standard_normal((hc, hc * e)).astype(np.float32) / 16,
                  "mtp.0.hc_head_base": np.zeros(hc, np.float32), "mtp.0.hc_head_scale": np.ones(1, np.float32)})
    folder = golden.write_hf_folder("hca_only", tmp_path / "hf")
    golden.write_safetensors(folder / "model.safetensors", state)
    notes = conv.DeepseekV4Converter().convert(str(folder), str(tmp_path / "m.gguf"), {"mtp": "inline"})
    assert notes[0].startswith("the MTP block is written inline (plinth's layout, for --spec mtp); llama.cpp does "
                               "not open such a file") and len(notes) == 2  # and: no tokenizer.json
    assert conv.DeepseekV4Converter().convert(str(folder), str(tmp_path / "no.gguf"), {"mtp": "no"})[0] == \
        "dropped the MTP block (31 tensors, mtp=no)"
    from plinth.gguf import GGUFFile

    assert GGUFFile(tmp_path / "no.gguf").metadata["deepseek4.nextn_predict_layers"] == 0
    reg = golden.registry()
    model = plinth.load_model(tmp_path / "m.gguf", registry=reg)
    assert model.hparams.n_nextn == 1 and model.graph.n_mtp == 1
    eh = model.weights["blk.3.nextn.eh_proj.weight"]
    np.testing.assert_array_equal(eh[:, :e], state["mtp.0.e_proj.weight"])
    np.testing.assert_array_equal(eh[:, e:], state["mtp.0.h_proj.weight"])
    np.testing.assert_array_equal(model.weights["blk.3.attn_q_a.weight"], state["mtp.0.attn.wq_a.weight"])
    assert MtpDrafter(model).requirements().taps == (model.graph.wide_tap,)  # the whole streams after layer 2


def test_unknown_tensor_is_refused(tmp_path):
    folder = golden.write_hf_folder("hca_only", tmp_path / "hf")
    state = golden.hf_random_state(golden.CASES["hca_only"]["config"], 1)
    state["model.layers.0.attn.mystery.weight"] = np.zeros((2, 2), np.float32)
    golden.write_safetensors(folder / "model.safetensors", state)
    with pytest.raises(UserError, match="'model.layers.0.attn.mystery.weight' has no GGUF name"):
        conv.DeepseekV4Converter().convert(str(folder), str(tmp_path / "m.gguf"), {})


def test_release_mtp_block_goes_to_a_separate_head_file_by_default(tmp_path):
    """Default mtp=separate: the trunk file has no MTP block (llama.cpp opens it) and the head goes to
    ``<out>.mtp.gguf`` in llama.cpp's --mtp layout (the same keys and tensor names as llama.cpp's own head file);
    the mtp drafter takes it with the trunk and gives the inline layout's head logits."""
    import plinth
    from plinth.graph import Batch
    from plinth.gguf import GGUFFile
    from plinth_deepseek41.mtp import MtpDrafter

    folder = tmp_path / "hf"
    test_release_mtp_block_is_exported(tmp_path)  # writes the folder and the inline file (m.gguf)
    notes = conv.DeepseekV4Converter().convert(str(folder), str(tmp_path / "t.gguf"), {})
    assert f"the MTP head is in {tmp_path / 't.mtp.gguf'} (llama.cpp's --mtp layout; plinth: --spec mtp --draft " \
           f"{tmp_path / 't.mtp.gguf'})" in notes
    trunk_md, head_gf = GGUFFile(tmp_path / "t.gguf").metadata, GGUFFile(tmp_path / "t.mtp.gguf")
    assert trunk_md["deepseek4.nextn_predict_layers"] == 0 and trunk_md["deepseek4.block_count"] == 3
    assert head_gf.metadata["deepseek4.block_count"] == 4 and head_gf.metadata["deepseek4.nextn_predict_layers"] == 1
    lc = GGUFFile(Path(__file__).resolve().parent / "golden" / "llamacpp" / "lc_v4-mtp.gguf")
    lc_names = {n.replace("blk.3.", "blk.N.") for n in lc.tensors}
    ours = {n.replace("blk.3.", "blk.N.") for n in head_gf.tensors}
    assert ours == lc_names  # llama.cpp's head file layout (both: window-attention MTP block, routed MoE)
    reg = golden.registry()
    trunk = plinth.load_model(tmp_path / "t.gguf", registry=reg)
    head_model = plinth.load_model(tmp_path / "t.mtp.gguf", registry=reg)
    ref = plinth.load_model(tmp_path / "m.gguf", registry=reg)
    drafter = MtpDrafter(trunk, head_model=head_model)
    prompt = golden.prompts("hca_only")[1]
    outs = []
    for m, head in ((trunk, drafter.head), (ref, ref.target_view().draft_head("mtp"))):
        h = m.new_context(taps=head.taps).forward(Batch.from_tokens(prompt[:-1], output="all")).features[head.taps[0]]
        outs.append(np.asarray(head.run(Batch.from_tokens(prompt[1:], output="all"), h, head.new_cache()).logits))
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-5, rtol=0)

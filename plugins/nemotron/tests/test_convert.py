"""The HF -> GGUF converter (checklist item 42 and the refusals).

The Puzzle case's HF folder is rewritten in the other spellings a release may use: the
``model.*`` prefix instead of ``backbone.*``, the router bias as ``e_score_correction.bias``,
experts stacked in one tensor, extra ``mtp.*`` tensors. Every spelling must convert to the
same GGUF tensors; with ``mtp=no`` MTP tensors are dropped with a note and leave no trace in the
file (exporting the MTP head: ``test_mtp.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from plinth.errors import UserError
from plinth.gguf import GGUFFile
from plinth.testing import load_module


golden = load_module(Path(__file__).parent / "golden" / "make_golden.py")


@pytest.fixture(scope="module")
def reg():
    return golden.registry()


def puzzle_state():
    c = golden.CASES["puzzle"]
    return golden.hf_random_state(c["config"], c["seed"])


def convert_state(tmp, reg, state, config=None, name="m", options=None):
    from plinth.convert import convert

    folder = tmp / f"{name}-hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config or golden.CASES["puzzle"]["config"]))
    golden.write_safetensors(folder / "model.safetensors", state)
    out = tmp / f"{name}.gguf"
    convert(folder, out, registry=reg, options=options)
    return GGUFFile(out)


def tensors(gf):
    return {n: np.asarray(gf.raw(n)) for n in gf.tensors}


def test_puzzle_converts_to_per_layer_arrays(tmp_path, reg):
    gf = convert_state(tmp_path, reg, puzzle_state())
    md = gf.metadata
    assert md["general.architecture"] == "nemotron_h_moe"
    assert list(md["nemotron_h_moe.expert_used_count"]) == [0, 2, 0, 4, 0, 1]
    assert list(md["nemotron_h_moe.expert_feed_forward_length"]) == [0, 24, 0, 40, 0, 16]
    assert list(md["nemotron_h_moe.expert_shared_feed_forward_length"]) == [0, 48, 0, 32, 0, 48]
    assert list(md["nemotron_h_moe.attention.head_count_kv"]) == [0, 0, 1, 0, 0, 0]
    assert gf.tensors["blk.3.ffn_up_exps.weight"].shape == (8, 40, 64)
    assert gf.tensors["blk.0.ssm_a"].shape == (8, 1)
    a_log = puzzle_state()["backbone.layers.0.mixer.A_log"]
    np.testing.assert_allclose(np.asarray(gf.raw("blk.0.ssm_a"))[:, 0], -np.exp(a_log), rtol=1e-6)


def test_uniform_moe_writes_scalars(tmp_path, reg):
    c = golden.CASES["moe"]
    gf = convert_state(tmp_path, reg, golden.hf_random_state(c["config"], c["seed"]), config=c["config"])
    assert gf.metadata["nemotron_h_moe.expert_used_count"] == 2
    assert gf.metadata["nemotron_h_moe.expert_feed_forward_length"] == 32
    assert gf.metadata["nemotron_h_moe.expert_weights_scale"] == pytest.approx(2.5)


def test_model_prefix_router_bias_spelling_stacked_experts_and_mtp(tmp_path, reg, capsys):
    base = tensors(convert_state(tmp_path, reg, puzzle_state(), name="base"))
    capsys.readouterr()
    state = {}
    for name, t in puzzle_state().items():
        name = name.replace("backbone.", "model.").replace("e_score_correction_bias", "e_score_correction.bias")
        state[name] = t
    # stack layer 1's experts the way transformers holds them in memory
    for which in ("up", "down"):
        keys = sorted((k for k in state if k.startswith("model.layers.1.mixer.experts.") and f".{which}_proj" in k),
                      key=lambda k: int(k.split(".")[5]))
        state[f"model.layers.1.mixer.experts.{which}_proj"] = np.stack([state.pop(k) for k in keys])
    state["mtp.layers.0.mixer.q_proj.weight"] = np.zeros((4, 64), np.float32)
    state["mtp.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    config = dict(golden.CASES["puzzle"]["config"], mtp_block_configs=[{"block_type": "attention"},
                                                                       {"block_type": "moe"}])
    gf = convert_state(tmp_path, reg, state, config=config, name="variant", options={"mtp": "no"})
    note = capsys.readouterr().err
    assert "dropped 2 MTP tensor(s) (mtp.*)" in note
    got = tensors(gf)
    assert sorted(got) == sorted(base)
    for name in base:
        np.testing.assert_array_equal(got[name], base[name], err_msg=name)
    assert not any("nextn" in k or "mtp" in k for k in gf.metadata)
    assert not any("nextn" in n or "mtp" in n for n in gf.tensors)


def test_plinth_convert_command(tmp_path, capsys):
    from plinth.cli import main

    folder = golden.write_hf_folder("hybrid", tmp_path / "hf")
    out = tmp_path / "cli.gguf"
    assert main(["--plugins", "nemotron", "convert", str(folder), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert GGUFFile(out).metadata["general.architecture"] == "nemotron_h"
    assert main(["--plugins", "nemotron", "convert", str(folder), "-o", str(tmp_path / "f16.gguf"),
                 "--option", "outtype=f16"]) == 0
    f16 = GGUFFile(tmp_path / "f16.gguf")
    assert f16.tensors["blk.0.ssm_in.weight"].type_name == "F16"
    assert f16.tensors["blk.0.ssm_a"].type_name == "F32"


def test_refusals_name_the_problem(tmp_path, reg):
    state = puzzle_state()
    with pytest.raises(UserError, match="tensor 'backbone.layers.1.mixer.router.extra' has no GGUF name"):
        convert_state(tmp_path, reg, {**state, "backbone.layers.1.mixer.router.extra": np.zeros(3, np.float32)},
                      name="a")
    partial = {k: v for k, v in state.items() if k != "backbone.layers.3.mixer.experts.5.up_proj.weight"}
    with pytest.raises(UserError, match=r"layer 3 is missing up_proj of expert\(s\) \[5\]"):
        convert_state(tmp_path, reg, partial, name="b")
    missing = {k: v for k, v in state.items() if k != "backbone.layers.0.mixer.dt_bias"}
    with pytest.raises(UserError, match="missing tensor 'blk.0.ssm_dt.bias'"):
        convert_state(tmp_path, reg, missing, name="c")
    cfg = dict(golden.CASES["puzzle"]["config"], mlp_hidden_act="silu")
    with pytest.raises(UserError, match="mlp_hidden_act = \\['silu'\\]; plinth-nemotron implements only 'relu2'"):
        convert_state(tmp_path, reg, state, config=cfg, name="d")
    blocks = [dict(b) for b in golden.CASES["puzzle"]["config"]["block_configs"]]
    blocks[3]["n_routed_experts"] = 16
    cfg = dict(golden.CASES["puzzle"]["config"], block_configs=blocks)
    with pytest.raises(UserError, match="n_routed_experts differs between layers"):
        convert_state(tmp_path, reg, state, config=cfg, name="e")
    bad = dict(golden.CASES["hybrid"]["config"], layers_block_type=["mamba", "conv"])
    with pytest.raises(UserError, match=r"unknown layer type\(s\) \['conv'\]"):
        convert_state(tmp_path, reg, state, config=bad, name="f")

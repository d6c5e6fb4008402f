"""The core's architecture contract on tiny random mimo2 models (no torch): plinth's converter metadata of
each test case with the byte vocabulary, on the numpy and the strict backends; the hparams of the
layer patterns; errors named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.testing import CONTRACT_BACKENDS, check_architecture, load_module
from plinth_mimo.convert import gguf_metadata
from plinth_mimo.mimo2 import MiMo2

cases = load_module(Path(__file__).resolve().parent / "mimo_cases.py")


def metadata(case: str) -> dict:
    cfg = dict(cases.CASES[case]["config"], vocab_size=257)
    return gguf_metadata(cfg, f"{case}.json")


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
def test_core_architecture_contract(tmp_path, backend):
    case = "release"  # sliding and full layers, sinks, a dense layer and MoE layers
    model = check_architecture(cases.registry(), "mimo2", metadata(case), tmp_path, backend=backend)
    hp = model.hparams
    assert list(hp.swa) == [t == cases.S for t in cases.CASES[case]["config"]["layer_types"]]
    assert [model.graph.moe_layer[il] for il in range(hp.n_layer)] == [il > 0 for il in range(hp.n_layer)]
    assert any(s is not None for s in model.graph.sinks)


@pytest.mark.parametrize("case", sorted(cases.CASES))
def test_hparams_of_each_layer_pattern(case):
    cfg = cases.CASES[case]["config"]
    hp = MiMo2().load_hparams(metadata(case), case)
    swa = [t == cases.S for t in cfg["layer_types"]]
    assert (hp.n_layer, list(hp.swa), hp.sliding_window) == (len(swa), swa, cfg["sliding_window"])
    assert [hp.n_head_kv[il] for il in range(hp.n_layer)] == [2 if s else 1 for s in swa]
    assert (hp.head_dim_k, hp.head_dim_v, hp.n_rot) == (24, 16, 8)  # int(24 * 0.334)
    assert (hp.rope_base, hp.rope_base_swa) == (5e6, 1e4)
    assert hp.value_scale == pytest.approx(cfg["attention_value_scale"])
    assert (hp.expert_weights_scale, hp.expert_weights_norm, hp.n_group) == (
        cfg["routed_scaling_factor"], cfg["norm_topk_prob"], cfg["n_group"])


def test_llama_cpp_block_count_includes_the_mtp_layers():
    """llama.cpp's converter counts 3 MTP blocks in block_count (nextn_predict_layers) and writes the per-layer
    arrays that long; plinth runs the trunk."""
    md = metadata("release")
    n = md["mimo2.block_count"]
    md.update({"mimo2.block_count": n + 3, "mimo2.nextn_predict_layers": 3,
               "mimo2.attention.sliding_window_pattern": md["mimo2.attention.sliding_window_pattern"] + [True] * 3,
               "mimo2.attention.head_count_kv": md["mimo2.attention.head_count_kv"] + [2] * 3})
    hp = MiMo2().load_hparams(md, "lc.gguf")
    assert (hp.n_layer, hp.n_nextn) == (n, 3)


@pytest.mark.parametrize("key,value,message", [
    ("mimo2.expert_gating_func", 1, "routes by sigmoid"),
    ("mimo2.rope.scaling.type", "yarn", "no rope scaling"),
    ("mimo2.attention.sliding_window_pattern", [True], "has 1 entries"),
    ("mimo2.rope.dimension_count", 7, "must be even"),
    ("mimo2.attention.head_count_kv", [3, 3, 3, 3], "GQA needs a divisor"),
])
def test_bad_keys_are_refused_by_name(key, value, message):
    from plinth.graph import HParamsError

    md = dict(metadata("release"), **{key: value})
    with pytest.raises(HParamsError, match=message):
        MiMo2().load_hparams(md, "bad.gguf")


def test_a_layer_with_both_ffn_kinds_is_refused(tmp_path):
    from plinth.errors import UserError
    from plinth.testing import byte_vocab, write_gguf
    from plinth.model import load_model

    reg = cases.registry()
    arch = MiMo2()
    md = dict(metadata("release"), **byte_vocab())
    hp = arch.load_hparams(md, "x")
    rng = np.random.default_rng(0)
    tensors = {s.name: (0.2 * rng.standard_normal(s.shape)).astype(np.float32) for s in arch.synthetic_tensors(hp)}
    tensors["blk.1.ffn_gate.weight"] = np.zeros((hp.n_ff, hp.n_embd), np.float32)
    path = write_gguf(tmp_path / "both.gguf", md, tensors)
    with pytest.raises(UserError, match="layer 1 has both a dense FFN"):
        load_model(path, registry=reg)

"""GGUF files written by llama.cpp's own converter run in plinth and match transformers.

``golden/llamacpp/lc_v4.gguf`` is a tiny random DeepSeek V4 release checkpoint (FP4 experts, a hash
layer, CSA 4 + HCA 128 + window, YaRN) converted by llama.cpp's ``convert_hf_to_gguf.py --outtype
f32``: MXFP4 routed experts, ``ffn_gate_tid2eid`` as I32, llama.cpp's keys (``embedding_length_out``,
a ``compress_ratios`` list that still covers the MTP layer it leaves out). ``lc_v4-mtp.gguf`` is
the same converter's ``--mtp`` output: the MTP block alone. ``lc_v4.npz``: transformers 5.24's logits
for the same weights (``golden/make_llamacpp.py``). No torch here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.gguf import GGUFFile
from plinth.hparams import HParamsError
from plinth.testing import load_module

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "golden" / "llamacpp"
golden = load_module(HERE / "golden" / "make_golden.py")
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def reg():
    return golden.registry()


@pytest.fixture(scope="module")
def model(reg):
    from plinth.model import load_model

    return load_model(FIXTURES / "lc_v4.gguf", registry=reg)


def test_llama_cpp_file_has_its_types_and_keys(model):
    gf = GGUFFile(model.path)
    assert gf.tensors["blk.0.ffn_gate_tid2eid.weight"].type_name == "I32"
    assert gf.tensors["blk.1.ffn_up_exps.weight"].type_name == "MXFP4"
    md = gf.metadata
    assert list(md["deepseek4.attention.compress_ratios"]) == [4, 128, 0, 0] and md["deepseek4.block_count"] == 3
    assert "deepseek4.nextn_predict_layers" not in md
    hp = model.hparams
    assert (hp.n_layer, hp.n_nextn, list(hp.compress_ratios), hp.n_hash_layers) == (3, 0, [4, 128, 0], 1)
    assert hp.rope_yarn_factor == 4.0
    assert model.graph.tid2eid[0].dtype == np.int64


def test_logits_match_transformers(model):
    g = np.load(FIXTURES / "lc_v4.npz")
    for i in range(3):
        prompt, rows = g[f"prompt_{i}"].tolist(), g[f"rows_{i}"]
        diff = float(np.abs(model.logits(prompt)[rows] - g[f"logits_{i}"]).max())
        assert diff <= LOGIT_ATOL, f"prompt of {len(prompt)}: max |plinth - transformers| = {diff:.3g}"


def test_llama_cpp_mtp_head_file_is_refused_by_name(reg):
    from plinth.model import load_model

    path = FIXTURES / "lc_v4-mtp.gguf"
    md = GGUFFile(path).metadata
    assert md["deepseek4.block_count"] == 4 and md["deepseek4.nextn_predict_layers"] == 1
    with pytest.raises(HParamsError, match=r"lc_v4-mtp.gguf: llama.cpp's DeepSeek V4 MTP head file \(block_count 4 "
                                           r"counts 1 MTP layer\(s\), no trunk\)"):
        load_model(path, registry=reg)


def test_plinth_converts_the_same_release_checkpoint(reg, tmp_path):
    """The release folder llama.cpp converted (FP4 experts, ``attn.kv_norm``, ``mtp.0.*``), through plinth's converter."""
    import json

    from plinth.convert import convert
    from plinth.model import load_model

    maker = load_module(HERE / "golden" / "make_llamacpp.py")
    _, release = maker.states()
    folder = tmp_path / "release"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(maker.release_config()))
    maker.write_raw_safetensors(folder / "model.safetensors", release)
    convert(folder, tmp_path / "p.gguf", registry=reg)
    model = load_model(tmp_path / "p.gguf", registry=reg)
    assert model.graph.n_mtp == 1
    g = np.load(FIXTURES / "lc_v4.npz")
    for i in range(3):
        prompt, rows = g[f"prompt_{i}"].tolist(), g[f"rows_{i}"]
        diff = float(np.abs(model.logits(prompt)[rows] - g[f"logits_{i}"]).max())
        assert diff <= LOGIT_ATOL, f"prompt of {len(prompt)}: max |plinth - transformers| = {diff:.3g}"

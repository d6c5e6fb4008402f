"""GGUF files written by llama.cpp's own converter run in plinth and match transformers.

``golden/llamacpp/lc_v4.gguf`` is a tiny random DeepSeek V4 release checkpoint (FP4 experts, a hash
layer, CSA 4 + HCA 128 + window, YaRN) converted by llama.cpp's ``convert_hf_to_gguf.py --outtype
f32``: MXFP4 routed experts, ``ffn_gate_tid2eid`` as I32, llama.cpp's keys (``embedding_length_out``,
a ``compress_ratios`` list that still covers the MTP layer it leaves out). ``lc_v4-mtp.gguf`` is
the same converter's ``--mtp`` output: the MTP block alone, which the ``mtp`` drafter takes as its head. ``lc_v4.npz``: transformers 5.24's logits
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


def inline_copy(trunk: Path, head: Path, out: Path) -> Path:
    """plinth's combined layout built from llama.cpp's two files' own values: the trunk, plus the head file's
    block (dequantized to F32: Q8_0 eh_proj, MXFP4 experts) with its root output_hc_* as nextn.hc_head_*."""
    from plinth.gguf import quants
    from plinth.testing import write_gguf

    t, h = GGUFFile(trunk), GGUFFile(head)
    n = t.metadata["deepseek4.block_count"]

    def f32(gf, name):
        info = gf.tensors[name]
        raw = np.asarray(gf.raw(name))
        if info.type_name in ("F32", "I32"):
            return raw
        return np.asarray(quants.dequantize(raw, info.ggml_type, info.shape), np.float32)

    tensors = {name: f32(t, name) for name in t.tensors}
    for name in h.tensors:
        if name.startswith(f"blk.{n}."):
            tensors[name] = f32(h, name)
        elif name.startswith("output_hc_"):
            tensors[f"blk.{n}.nextn.hc_head_{name[len('output_hc_'):]}"] = f32(h, name)
    md = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in t.metadata.items()}
    md["deepseek4.nextn_predict_layers"] = 1
    return write_gguf(out, md, tensors)


def test_llama_cpp_mtp_head_file_drives_the_mtp_drafter(reg, tmp_path, monkeypatch):
    """llama.cpp's separate MTP head file (convert --mtp: block_count counts the MTP layer, no trunk, the block's
    hc head at the root) loads as a head-only model; the mtp drafter runs it on the trunk file's streams and
    gives the head logits of the same values in plinth's combined layout; as a model on its own it is refused."""
    from plinth.errors import UserError
    from plinth.model import load_model
    from plinth.testing.drafters import check_drafter_contract
    from plinth_deepseek41.mtp import MtpDrafter

    from plinth.graph import Batch

    # every weight dequantized, so the two layouts compute alike (a kept Q8_0 eh_proj quantizes its input)
    monkeypatch.setenv("PLINTH_DEQUANTIZE", "1")
    model = load_model(FIXTURES / "lc_v4.gguf", registry=reg)
    path = FIXTURES / "lc_v4-mtp.gguf"
    md = GGUFFile(path).metadata
    assert md["deepseek4.block_count"] == 4 and md["deepseek4.nextn_predict_layers"] == 1
    head_model = load_model(path, registry=reg)
    assert head_model.hparams.mtp_only and head_model.hparams.n_layer == 3 and head_model.graph.n_mtp == 1
    with pytest.raises(UserError, match="llama.cpp's MTP head file \\(no trunk\\)"):
        head_model.logits([1, 2, 3])
    drafter = MtpDrafter(model, head_model=head_model)
    inline = load_model(inline_copy(model.path, path, tmp_path / "inline.gguf"), registry=reg)
    ref_head = inline.target_view().draft_head("mtp")
    prompt = np.load(FIXTURES / "lc_v4.npz")["prompt_2"].tolist()[:40]
    for m, head in ((model, drafter.head), (inline, ref_head)):
        ctx = m.new_context(taps=head.taps)
        h = ctx.forward(Batch.from_tokens(prompt[:-1], output="all")).features[head.taps[0]]
        out = head.run(Batch.from_tokens(prompt[1:], output="all"), h, head.new_cache())
        if head is drafter.head:
            got = np.asarray(out.logits)
        else:
            want = np.asarray(out.logits)
    assert float(np.abs(got - want).max()) <= 1e-5
    stats = check_drafter_contract(model, lambda: MtpDrafter(model, n_draft=3, head_model=head_model),
                                   [prompt[:9]], max_tokens=10, n_max=3)
    assert all(s.n_drafts > 0 for s in stats)


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
    assert model.graph.n_mtp == 0 and (tmp_path / "p.mtp.gguf").is_file()  # the head in llama.cpp's own file
    g = np.load(FIXTURES / "lc_v4.npz")
    for i in range(3):
        prompt, rows = g[f"prompt_{i}"].tolist(), g[f"rows_{i}"]
        diff = float(np.abs(model.logits(prompt)[rows] - g[f"logits_{i}"]).max())
        assert diff <= LOGIT_ATOL, f"prompt of {len(prompt)}: max |plinth - transformers| = {diff:.3g}"

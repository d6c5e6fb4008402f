"""Live interop (``make test-interop``): llama.cpp's converter run now, plinth's files read by llama.cpp.

Each case of ``mimo_cases.CASES``, saved by transformers with the release config's spellings and a
300-token byte-level BPE (the harness of ``llamacpp/make_fixtures.py``: the pre-tokenizer hash answered,
config.json read as written):

* llama.cpp's own ``convert_hf_to_gguf.py`` writes a ``mimo2`` file that plinth runs as transformers
  runs the model (1e-4);
* plinth's converter on the same folder writes the same tensors (names, shapes, values) and the same
  ``mimo2.*`` keys, but for llama.cpp's MTP slots (``nextn_predict_layers`` 3 and the block count and
  per-layer arrays that count them: this folder has no MTP tensors) and ``vocab_size``;
* llama.cpp's converter does not write ``routed_scaling_factor`` or ``norm_topk_prob = false`` (its
  MiMo graph scales by ``expert_weights_scale`` and always renormalises): on the ``moe`` case its file
  is another model; plinth's converter writes both keys, and its file matches transformers;
* (``peer``: llama-cpp-python) llama.cpp computes on plinth's file what it computes on its own
  converter's file, with transformers' argmax.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import plinth
from plinth.convert import convert as convert_folder
from plinth.testing import load_module

pytestmark = [pytest.mark.interop, pytest.mark.ref]
HERE = Path(__file__).resolve().parent
cases = load_module(HERE / "mimo_cases.py")
fixtures = load_module(HERE / "llamacpp" / "make_fixtures.py")
CASES = ["dense", "release"]  # (moe: see test_llama_cpp_converter_leaves_out_routing_options)
ATOL = 1e-4


@pytest.fixture()
def folders(tmp_path, llama_cpp_converter):  # (the fixture skips without torch, transformers or the sources)
    def make(case):
        folder, ref = cases.write_folder(case, tmp_path / case, for_llama_cpp=True)
        theirs = fixtures.convert_with_llama_cpp(folder, tmp_path / f"{case}-llama_cpp.gguf", "--outtype", "f32")
        ours = convert_folder(folder, tmp_path / f"{case}-plinth.gguf", cases.registry())
        return ref, theirs, ours

    return make


@pytest.mark.parametrize("case", CASES)
def test_llama_cpp_files_run_in_plinth_as_in_transformers(folders, case):
    ref, theirs, ours = folders(case)
    reg = cases.registry()
    a, b = plinth.load_model(theirs, registry=reg), plinth.load_model(ours, registry=reg)
    for prompt in cases.prompts():
        want = cases.reference_logits(ref, prompt)
        diff = float(np.abs(a.logits(prompt) - want).max())
        assert diff <= ATOL, f"{case}, prompt of {len(prompt)}: llama.cpp's file in plinth, {diff:.3g}"
        np.testing.assert_array_equal(a.logits(prompt), b.logits(prompt))


@pytest.mark.parametrize("case", CASES)
def test_plinth_converter_writes_what_llama_cpp_writes(folders, case):
    from plinth.gguf import GGUFFile

    _, theirs, ours = folders(case)
    t, o = GGUFFile(theirs), GGUFFile(ours)
    assert sorted(t.tensors) == sorted(o.tensors)
    for name in t.tensors:
        np.testing.assert_array_equal(np.asarray(t.raw(name)), np.asarray(o.raw(name)), err_msg=name)
    n, nextn = o.metadata["mimo2.block_count"], t.metadata["mimo2.nextn_predict_layers"]
    assert (t.metadata["mimo2.block_count"], nextn) == (n + 3, 3)
    per_layer = ("mimo2.attention.head_count_kv", "mimo2.attention.sliding_window_pattern")
    skip = {"mimo2.block_count", "mimo2.nextn_predict_layers", "mimo2.vocab_size"}
    keys_t = {k for k in t.metadata if k.startswith("mimo2.")} - skip
    assert keys_t == {k for k in o.metadata if k.startswith("mimo2.")} - skip
    for k in sorted(keys_t):
        a, b = np.asarray(t.metadata[k]), np.asarray(o.metadata[k])
        if k in per_layer:
            a = a[:n]
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-7, err_msg=k)
    for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        assert list(t.metadata[k]) == list(o.metadata[k]), k


def test_llama_cpp_converter_leaves_out_routing_options(folders):
    ref, theirs, ours = folders("moe")  # routed_scaling_factor 2.5, norm_topk_prob false
    from plinth.gguf import GGUFFile

    t, o = GGUFFile(theirs).metadata, GGUFFile(ours).metadata
    assert "mimo2.expert_weights_scale" not in t and "mimo2.expert_weights_norm" not in t
    assert (o["mimo2.expert_weights_scale"], bool(o["mimo2.expert_weights_norm"])) == (2.5, False)
    prompt = cases.prompts()[1]
    want = cases.reference_logits(ref, prompt)
    reg = cases.registry()
    assert float(np.abs(plinth.load_model(ours, registry=reg).logits(prompt) - want).max()) <= ATOL
    assert float(np.abs(plinth.load_model(theirs, registry=reg).logits(prompt) - want).max()) > 0.1


@pytest.mark.peer
@pytest.mark.parametrize("case", CASES)
def test_plinth_written_files_run_in_llama_cpp(folders, case):
    llama_cpp = pytest.importorskip("llama_cpp")
    ref, theirs, ours = folders(case)
    prompt = cases.prompts()[2][:120]

    def run(path):
        f32 = llama_cpp.GGML_TYPE_F32
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, logits_all=True, verbose=False,
                              type_k=f32, type_v=f32, flash_attn=False)
        llm.eval(prompt)
        return np.asarray(llm.scores[:len(prompt)], dtype=np.float32)

    got = run(ours)
    np.testing.assert_allclose(got, run(theirs), atol=1e-6, rtol=0)
    want = cases.reference_logits(ref, prompt)
    assert float(np.mean(got.argmax(-1) == want.argmax(-1))) >= 0.95
    print(f"{case}: llama.cpp on plinth's file, max |llama.cpp - transformers| = {np.abs(got - want).max():.3g}")


def test_mtp_blocks_from_llama_cpps_converter(tmp_path, llama_cpp_converter):
    """A checkpoint with two MTP blocks: llama.cpp's converter writes them as blocks n and n + 1 of its 3 MTP
    slots, with the tensors plinth's converter writes (names and values); plinth's draft heads on its file
    give the logits they give on plinth's file, and the mtp drafter is lossless on it."""
    from plinth.gguf import GGUFFile
    from plinth.graph import Batch
    from plinth.testing.drafters import check_drafter_contract
    from plinth_dflash.testkit import write_safetensors

    folder, _ = cases.write_folder("release", tmp_path / "hf", for_llama_cpp=True)
    write_safetensors(folder / "model-mtp.safetensors", cases.mtp_state(cases.CASES["release"]["config"], 7, n_mtp=2))
    theirs = fixtures.convert_with_llama_cpp(folder, tmp_path / "llama_cpp.gguf", "--outtype", "f32")
    ours = convert_folder(folder, tmp_path / "plinth.gguf", cases.registry())
    t, o = GGUFFile(theirs), GGUFFile(ours)
    assert (t.metadata["mimo2.nextn_predict_layers"], o.metadata["mimo2.nextn_predict_layers"]) == (3, 2)
    assert sorted(t.tensors) == sorted(o.tensors) and "blk.5.nextn.eh_proj.weight" in t.tensors
    for name in t.tensors:
        np.testing.assert_array_equal(np.asarray(t.raw(name)), np.asarray(o.raw(name)), err_msg=name)
    reg = cases.registry()
    a, b = plinth.load_model(theirs, registry=reg), plinth.load_model(ours, registry=reg)
    assert sorted(a.graph.draft_heads()) == sorted(b.graph.draft_heads()) == ["mtp", "mtp.1"]
    ids = cases.prompts()[2][:50]
    n = a.hparams.n_layer
    tapped = a.new_context(taps=(n,)).decode(ids, output="all").features[n][:-1]
    for name in ("mtp", "mtp.1"):
        ha, hb = a.graph.draft_heads()[name], b.graph.draft_heads()[name]
        batch = Batch.from_tokens(ids[1:], output="all")
        np.testing.assert_array_equal(ha.run(batch, tapped, ha.new_cache()).logits,
                                      hb.run(batch, tapped, hb.new_cache()).logits)
    check_drafter_contract(a, lambda: reg.make_drafter("mtp", a, {"n_max": 3}), [ids[:12]], max_tokens=12, n_max=3)


@pytest.mark.peer
def test_plinth_mtp_file_opens_in_llama_cpp(tmp_path):
    """plinth's file with two MTP blocks loads in llama.cpp, whose trunk gives transformers' logits."""
    llama_cpp = pytest.importorskip("llama_cpp")
    pytest.importorskip("torch")
    from plinth_dflash.testkit import write_safetensors

    folder, ref = cases.write_folder("release", tmp_path / "hf")
    write_safetensors(folder / "model-mtp.safetensors", cases.mtp_state(cases.CASES["release"]["config"], 7, n_mtp=2))
    ours = convert_folder(folder, tmp_path / "plinth.gguf", cases.registry())
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(ours), n_ctx=128, n_batch=128, logits_all=True, verbose=False, type_k=f32,
                          type_v=f32, flash_attn=False)
    ids = cases.prompts()[2][:60]
    llm.eval(ids)
    got = np.asarray(llm.scores[:len(ids)], dtype=np.float32)
    assert float(np.abs(got - cases.reference_logits(ref, ids)).max()) <= ATOL

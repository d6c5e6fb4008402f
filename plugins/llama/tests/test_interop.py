"""Live interop (``make test-interop``): llama.cpp's converter run now, plinth's files read by llama.cpp.

* every case of ``llamacpp/make_fixtures.py`` converted by llama.cpp's ``convert_hf_to_gguf.py``
  now (not the committed file) runs in plinth as transformers runs the model;
* plinth's converter on the same Hugging Face folders (as ``save_pretrained`` wrote them) gives
  transformers' logits in plinth, and (``peer``: llama-cpp-python) in llama.cpp.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import plinth
from plinth.convert import convert as convert_folder
from plinth.testing import load_module

pytestmark = [pytest.mark.interop, pytest.mark.ref, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
fixtures = load_module(HERE / "llamacpp" / "make_fixtures.py")
byte_bpe = load_module(HERE / "test_convert.py").byte_bpe
CASES = sorted(fixtures.CASES)
ATOL = 1e-4
PEER_ATOL = 1e-3


@pytest.fixture(scope="module")
def registry():
    from plinth.testing import make_registry
    from plinth_llama.plugin import plugin

    return make_registry(plugin)


@pytest.mark.parametrize("case", [c for c in CASES if c != "gemma3_pattern"])
def test_llama_cpp_converter_now_gives_files_plinth_runs_as_transformers(case, tmp_path, llama_cpp_converter):
    ref = fixtures.make(case, tmp_path, convert=llama_cpp_converter)
    got = plinth.load_model(tmp_path / f"{case}.gguf").logits(ref["prompt"])
    diff = float(np.max(np.abs(got - ref["logits"])))
    assert diff <= ATOL, f"{case}: max |plinth - transformers| = {diff:.3g}"


def plinth_converted(case, tmp_path, registry, outtype="f32", spec=None):
    """(plinth's GGUF of the case's save_pretrained folder, prompt, transformers' logits); spec: a model
    that is not one of the fixtures' cases (see make_fixtures.hf_model)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = tmp_path / case
    model = fixtures.save_hf(case, folder, spec)
    (folder / "tokenizer.model").unlink()  # plinth converts byte-level BPE tokenizers
    (folder / "tokenizer.json").write_text(json.dumps(byte_bpe(fixtures.N_VOCAB)))
    out = tmp_path / f"{case}.gguf"
    convert_folder(folder, out, registry, {"outtype": outtype})
    ids = fixtures.prompt()
    return out, ids, fixtures.reference_logits(model, ids)


@pytest.mark.parametrize("case", CASES)
def test_plinth_converter_on_save_pretrained_folders(case, tmp_path, registry):
    path, ids, ref = plinth_converted(case, tmp_path, registry)
    diff = float(np.max(np.abs(plinth.load_model(path, registry=registry).logits(ids) - ref)))
    assert diff <= ATOL, f"{case}: max |plinth - transformers| = {diff:.3g}"


# models only the live tests make: rope parameters llama.cpp's files carry as keys
LIVE = {
    "qwen2_yarn_params": ("Qwen2ForCausalLM", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "attention_factor": 0.8, "beta_fast": 16.0, "beta_slow": 2.0})),
    "llama_yarn": ("LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32})),
    "llama_untied_linear": ("LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "linear", "rope_theta": 50000.0, "factor": 2.0})),
}


@pytest.mark.parametrize("case", sorted(LIVE))
def test_plinth_converter_rope_parameters(case, tmp_path, registry):
    """YaRN's attention_factor / beta_fast / beta_slow (keys rope.scaling.yarn_*), YaRN and linear on
    llama: plinth's file in plinth gives transformers' logits."""
    path, ids, ref = plinth_converted(case, tmp_path, registry, spec=LIVE[case])
    diff = float(np.max(np.abs(plinth.load_model(path, registry=registry).logits(ids) - ref)))
    assert diff <= ATOL, f"{case}: max |plinth - transformers| = {diff:.3g}"


def llama_cpp_logits(path, ids):
    """llama.cpp's logits [n, n_vocab] of ``ids`` (one sequence) with an f32 KV cache, no flash attention."""
    llama_cpp = pytest.importorskip("llama_cpp")
    f32 = llama_cpp.GGML_TYPE_F32  # llama.cpp's default f16 KV cache alone costs ~3e-3 on these models
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, logits_all=True, verbose=False,
                          type_k=f32, type_v=f32, flash_attn=False)
    llm.eval(ids)
    return np.asarray(llm.scores[:len(ids)], dtype=np.float32)


@pytest.mark.peer
@pytest.mark.parametrize("case", CASES)
def test_plinth_written_files_run_in_llama_cpp(case, tmp_path, registry):
    path, ids, ref = plinth_converted(case, tmp_path, registry)
    diff = float(np.max(np.abs(llama_cpp_logits(path, ids) - ref)))
    # llama.cpp's CPU GELU reads an f16 table: its gemma3 is ~1e-3 from transformers on any file
    tol = 2e-3 if case.startswith("gemma3") else PEER_ATOL
    assert diff <= tol, f"{case}: max |llama.cpp - transformers| = {diff:.3g}"


@pytest.mark.peer
@pytest.mark.parametrize("case", [c for c in CASES if c != "gemma3_pattern"])
def test_plinth_f16_files_compute_in_llama_cpp_as_its_own_files(case, tmp_path, registry):
    """plinth's f16 file and llama.cpp's f16 file of the same model give llama.cpp the same logits."""
    pytest.importorskip("llama_cpp")
    ids = fixtures.prompt()
    folder = tmp_path / case
    load_module(HERE / "test_convert.py").hf_folder(case, folder)
    out = tmp_path / f"{case}.gguf"
    convert_folder(folder, out, registry, {"outtype": "f16"})
    theirs = llama_cpp_logits(HERE / "llamacpp" / f"{case}.gguf", ids)
    diff = float(np.max(np.abs(llama_cpp_logits(out, ids) - theirs)))
    tol = 1e-4 if case == "llama_fused_qkv" else 1e-6  # one fused product against three
    assert diff <= tol, f"{case}: max |llama.cpp(plinth's file) - llama.cpp(its own file)| = {diff:.3g}"

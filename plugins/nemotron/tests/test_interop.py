"""Interop with llama.cpp, live (opt-in: ``-m interop``; needs llama-cpp-python, tokenizers, transformers, torch
and the llama-cpp-python sdist's converter, ``LLAMA_CPP_DIR``).

* plinth's converter -> llama.cpp: the folders of ``golden/make_llamacpp.py`` (tokenizer included) converted by
  plinth open in llama.cpp (``llama_cpp.Llama``, F32 K/V), whose logits match transformers' (the committed
  ``golden/llamacpp/<case>.npz``, same weights) within 1e-3; the MTP case's folded head loads there too.
* llama.cpp's converter -> plinth, live: today's converter output still loads and matches (the committed
  fixtures are one such output).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.testing import load_module

pytestmark = pytest.mark.interop

HERE = Path(__file__).resolve().parent
maker = load_module(HERE / "golden" / "make_llamacpp.py")
ATOL = 1e-3
GGML_TYPE_F32 = 0


@pytest.fixture(scope="module")
def reg():
    from plinth.testing import make_registry
    from plinth_nemotron.plugin import plugin

    return make_registry(plugin)


@pytest.mark.parametrize("case", sorted(maker.CASES))
def test_plinth_written_file_runs_in_llama_cpp(case, reg, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from plinth.convert import convert
    from plinth.gguf import GGUFFile

    folder = maker.write_hf_folder(case, tmp_path / case)
    out = tmp_path / f"{case}.gguf"
    convert(folder, out, registry=reg)
    md = GGUFFile(out).metadata
    arch = md["general.architecture"]
    assert f"{arch}.attention.layer_norm_epsilon" in md and len(md["tokenizer.ggml.tokens"]) == 304
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=256, logits_all=True, verbose=False, n_threads=2,
                          type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    ref = np.load(HERE / "golden" / "llamacpp" / f"{case}.npz")
    for i in range(len(maker.PROMPT_LENGTHS)):
        prompt = ref[f"prompt_{i}"].tolist()
        llm.reset()
        llm.eval(prompt)
        diff = float(np.abs(np.asarray(llm.scores[:len(prompt)]) - ref[f"logits_{i}"]).max())
        assert diff <= ATOL, f"{case}, prompt of {len(prompt)}: max |llama.cpp - transformers| = {diff:.3g}"


@pytest.mark.parametrize("case", sorted(maker.CASES))
def test_llama_cpp_converter_output_runs_in_plinth(case, reg, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    if not (maker.LLAMA_CPP_DIR / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"no llama.cpp converter at {maker.LLAMA_CPP_DIR} (set LLAMA_CPP_DIR)")
    from plinth.model import load_model

    folder = maker.write_hf_folder(case, tmp_path / case)
    maker.write_config(case, folder, for_llama_cpp=True)
    out = maker.convert_with_llama_cpp(folder, tmp_path / f"{case}.gguf")
    model = load_model(out, registry=reg)
    ref = np.load(HERE / "golden" / "llamacpp" / f"{case}.npz")
    for i in range(len(maker.PROMPT_LENGTHS)):
        prompt = ref[f"prompt_{i}"].tolist()
        diff = float(np.abs(model.logits(prompt) - ref[f"logits_{i}"]).max())
        assert diff <= 1e-4, f"{case}, prompt of {len(prompt)}: max |plinth - transformers| = {diff:.3g}"

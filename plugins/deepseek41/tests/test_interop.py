"""Interop with llama.cpp, live (opt-in: ``-m interop``; needs llama-cpp-python, torch, transformers, tokenizers
and the llama-cpp-python sdist's converter, ``LLAMA_CPP_DIR``).

The model of ``golden/make_llamacpp.py`` at the released head sizes (``INTEROP_CONFIG``: llama.cpp's
deepseek4 graph does not build for the tiny ones), one release checkpoint (FP4 experts, a hash layer,
CSA 4 + HCA 128 + window, YaRN, an MTP block, a tokenizer):

* plinth's converter (default: the MTP head in a file of its own, as llama.cpp writes it) -> llama.cpp
  (``llama_cpp.Llama``, F32 K/V): logits within 1e-3 of transformers';
* llama.cpp's converter -> plinth: logits within 1e-4 of transformers'.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.testing import load_module

pytestmark = pytest.mark.interop

HERE = Path(__file__).resolve().parent
maker = load_module(HERE / "golden" / "make_llamacpp.py")
golden = load_module(HERE / "golden" / "make_golden.py")
GGML_TYPE_F32 = 0
PROMPTS = maker.prompts(maker.INTEROP_PROMPT_SEED)


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    if not (maker.LLAMA_CPP_DIR / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"no llama.cpp sources at {maker.LLAMA_CPP_DIR} (set LLAMA_CPP_DIR or PLINTH_LLAMA_CPP_SRC)")
    import torch

    tmp = tmp_path_factory.mktemp("ds4-interop")
    hf, release = maker.write_folders(tmp, maker.INTEROP_CONFIG)
    ref = golden.reference_model(hf)
    with torch.no_grad():
        logits = [ref(torch.tensor([p]), use_cache=False).logits[0].float().numpy() for p in PROMPTS]
    return release, logits


def test_plinth_written_file_runs_in_llama_cpp(model_folders, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    from plinth.convert import convert
    from plinth.gguf import GGUFFile

    release, ref = model_folders
    out = tmp_path / "plinth.gguf"
    convert(release, out, registry=golden.registry())  # default: the MTP head to plinth.mtp.gguf, as llama.cpp does
    assert (tmp_path / "plinth.mtp.gguf").is_file()
    gf = GGUFFile(out)
    assert gf.tensors["blk.0.ffn_gate_tid2eid.weight"].type_name == "I32"
    assert len(gf.metadata["tokenizer.ggml.tokens"]) == 304
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=512, logits_all=True, verbose=False, n_threads=2,
                          type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    for prompt, want in zip(PROMPTS, ref):
        llm.reset()
        llm.eval(prompt)
        diff = float(np.abs(np.asarray(llm.scores[:len(prompt)]) - want).max())
        assert diff <= 1e-3, f"prompt of {len(prompt)}: max |llama.cpp - transformers| = {diff:.3g}"


def test_llama_cpp_converter_output_runs_in_plinth(model_folders, tmp_path):
    if not (maker.LLAMA_CPP_DIR / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"no llama.cpp converter at {maker.LLAMA_CPP_DIR} (set LLAMA_CPP_DIR)")
    from plinth.model import load_model

    release, ref = model_folders
    model = load_model(maker.convert_with_llama_cpp(release, tmp_path / "lc.gguf"), registry=golden.registry())
    model.graph.topk_ties = 0
    for prompt, want in zip(PROMPTS, ref):
        diff = float(np.abs(model.logits(prompt) - want).max())
        assert diff <= 1e-4, f"prompt of {len(prompt)}: max |plinth - transformers| = {diff:.3g}"
    assert model.graph.topk_ties == 0  # no answer here hangs on tie-breaking

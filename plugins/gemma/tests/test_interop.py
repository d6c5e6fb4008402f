"""Live interop (``make test-interop``): llama.cpp's converter run now, plinth's files read by llama.cpp.

Each golden case, with a 300-token Gemma-style tokenizer (BPE with byte fallback, what llama.cpp's
converter takes as a Gemma 4 vocabulary), saved as an HF folder:

* llama.cpp's own ``convert_hf_to_gguf.py`` turns it into a ``gemma4`` file that plinth loads and
  runs as transformers runs the model (1e-4);
* plinth's converter on the same folder writes the same ``gemma4.*`` keys with the same values, the
  same tokenizer keys and the same tensor names and shapes as llama.cpp's converter;
* (``peer``: llama-cpp-python) llama.cpp runs plinth's file exactly as it runs its own converter's
  file (its argmax that of transformers; see the test for how far its logits are from them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import plinth
from plinth.convert import convert as convert_folder
from plinth.testing import load_module

pytestmark = [pytest.mark.interop, pytest.mark.ref, pytest.mark.slow]

GOLDEN = Path(__file__).resolve().parent / "golden"
golden = load_module(GOLDEN / "make_golden.py")
CASES = sorted(golden.CASES)
ATOL = 1e-4
PEER_ARGMAX = 0.9  # share of positions where llama.cpp's argmax is transformers'


@pytest.fixture(scope="module")
def registry():
    return golden.registry()


def reference_logits(folder, ids):
    pytest.importorskip("torch")
    return golden.hf_reference(folder).logits(ids)


def prompt(case, n=40):
    return golden.prompts(case)[2][:n]


@pytest.mark.parametrize("case", CASES)
def test_llama_cpp_converter_gives_files_plinth_runs_as_transformers(case, tmp_path, llama_cpp_converter, registry):
    folder, _ = golden.write_gemma_folder(case, tmp_path / "hf")
    path = llama_cpp_converter(folder, tmp_path / "llama_cpp.gguf")
    ids = prompt(case)
    got = plinth.load_model(path, registry=registry).logits(ids)
    diff = float(np.max(np.abs(got - reference_logits(folder, ids))))
    assert diff <= ATOL, f"{case}: max |plinth - transformers| on llama.cpp's file = {diff:.3g}"


def _gguf_contents(path):
    """The ``gemma4.*`` and ``tokenizer.*`` keys (floats rounded) and the tensors' shapes of a GGUF file."""
    from plinth.gguf.reader import GGUFFile

    def plain(v):
        v = v.tolist() if hasattr(v, "tolist") else v
        if isinstance(v, list):
            return [plain(x) for x in v]
        return round(v, 4) if isinstance(v, float) else v

    f = GGUFFile(path)
    try:
        keys = {k: plain(v) for k, v in f.metadata.items() if k.startswith(("gemma4.", "tokenizer."))}
        tensors = {name: tuple(info.shape) for name, info in f.tensors.items()}
    finally:
        f.close()
    return keys, tensors


@pytest.mark.parametrize("case", CASES)
def test_plinth_converter_writes_what_llama_cpp_writes(case, tmp_path, llama_cpp_converter, registry):
    folder, _ = golden.write_gemma_folder(case, tmp_path / "hf")
    theirs = llama_cpp_converter(folder, tmp_path / "llama_cpp.gguf")
    ours = tmp_path / "plinth.gguf"
    convert_folder(folder, ours, registry)
    k_theirs, t_theirs = _gguf_contents(theirs)
    k_ours, t_ours = _gguf_contents(ours)
    assert sorted(k_ours) == sorted(k_theirs)
    for key in k_theirs:
        assert k_ours[key] == k_theirs[key], key
    assert t_ours == t_theirs
    ids = prompt(case)
    a = plinth.load_model(ours, registry=registry).logits(ids)
    b = plinth.load_model(theirs, registry=registry).logits(ids)
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def llama_cpp_logits(path, ids):
    """llama.cpp's logits [n, n_vocab] of ``ids`` (one sequence) with an f32 KV cache, no flash attention."""
    llama_cpp = pytest.importorskip("llama_cpp")
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_batch=128, logits_all=True, verbose=False,
                          type_k=f32, type_v=f32, flash_attn=False)
    llm.eval(ids)
    return np.asarray(llm.scores[:len(ids)], dtype=np.float32)


def llama_cpp_shares_kv_as_transformers(cfg):
    """Whether llama.cpp's KV-sharing rule (shared sliding layers read layer first-2, full ones first-1)
    names the layers transformers' rule does (the last earlier layer of the same kind). Where it does
    not, llama.cpp aborts the process on the file (a GGML assertion), whoever converted it."""
    n, shared = cfg["num_hidden_layers"], cfg["num_kv_shared_layers"]
    if not shared:
        return True
    swa = [t == golden.S for t in cfg["layer_types"]]
    first = n - shared
    return swa[first - 2] and not swa[first - 1]


@pytest.mark.peer
@pytest.mark.parametrize("case", CASES)
def test_plinth_written_files_run_in_llama_cpp(case, tmp_path, registry, llama_cpp_converter):
    """llama.cpp computes on plinth's file exactly what it computes on its own converter's file, with the
    argmax of transformers' logits. (Not the logits themselves: on these random models llama.cpp 0.3.36
    is ~0.5% off transformers with an own head and far off with a head tied to these N(0, 1) embeddings,
    logits correlated 0.98 and ~0.86 times transformers', on either file (an embedding 8 times smaller
    agrees); plinth matches transformers within 1e-4 on both files.)"""
    folder, cfg = golden.write_gemma_folder(case, tmp_path / "hf")
    if not llama_cpp_shares_kv_as_transformers(cfg):
        pytest.skip(f"{case}: llama.cpp's KV-sharing rule differs from transformers' for layer types "
                    f"{cfg['layer_types']} (llama.cpp cannot run this layout, from either converter)")
    ours = tmp_path / "plinth.gguf"
    convert_folder(folder, ours, registry)
    theirs = llama_cpp_converter(folder, tmp_path / "llama_cpp.gguf")
    ids = prompt(case)
    got = llama_cpp_logits(ours, ids)
    np.testing.assert_allclose(got, llama_cpp_logits(theirs, ids), atol=1e-6, rtol=0)
    ref = reference_logits(folder, ids)
    agree = float(np.mean(got.argmax(-1) == ref.argmax(-1)))
    assert agree >= PEER_ARGMAX, f"{case}: llama.cpp's argmax is transformers' at {agree:.0%} of the positions"


def test_real_26b_a4b_metadata_is_read_in_full():
    """llama.cpp's ``ggml-vocab-gemma-4.gguf`` carries the real gemma-4-26B-A4B metadata: every ``gemma4.*``
    key is read, and the hparams are the model card's (30 layers, 5:1 sliding, 512/256 head sizes, 2 KV
    heads on full layers, 128 experts of 704, top 8)."""
    from plinth.gguf.reader import GGUFFile
    from plinth.tensors import KeyUse
    from plinth.testing.interop import llama_cpp_sources
    from plinth_gemma.gemma4 import Gemma4

    src = llama_cpp_sources()
    if src is None or not (src / "models" / "ggml-vocab-gemma-4.gguf").is_file():
        pytest.skip("llama.cpp's ggml-vocab-gemma-4.gguf is not available")
    f = GGUFFile(src / "models" / "ggml-vocab-gemma-4.gguf")
    try:
        md = KeyUse(dict(f.metadata))
    finally:
        f.close()
    hp = Gemma4().load_hparams(md, "ggml-vocab-gemma-4.gguf")
    assert md.unread("gemma4.") == []
    assert (hp.n_layer, hp.n_embd, hp.head_dim, hp.head_dim_swa, hp.sliding_window) == (30, 2816, 512, 256, 1024)
    assert [il for il in range(30) if not hp.swa[il]] == [5, 11, 17, 23, 29]
    assert [hp.n_head_kv[il] for il in (0, 5)] == [8, 2]
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp[0], hp.final_softcap) == (128, 8, 704, 30.0)
    assert all(hp.owns_kv(il) for il in range(30)) and hp.n_embd_per_layer == 0

"""Accuracy of mimo2 against transformers 5.24's MiMoV2FlashForCausalLM, live (``ref``: torch + transformers).

Each case of ``mimo_cases.CASES`` (release: full / sliding / sliding / full, dense then MoE; dense: sliding
first and last, no experts; moe: MoE everywhere with grouped routing, routed scaling, unnormalised weights,
window 4 and value scale 1.3) is drawn with every parameter redrawn, saved by transformers'
``save_pretrained``, converted by ``plinth convert`` and compared: logits for prompts of 1, 9 and 300
tokens within 1e-4, the 32-token greedy continuation identical (9 and 300 tokens).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.testing import greedy_through_cache, load_module

pytestmark = pytest.mark.ref
cases = load_module(Path(__file__).resolve().parent / "mimo_cases.py")
CASES = ["dense", "moe", "release"]
ATOL = 1e-4
N_GREEDY = 32
MTP_SEED = 99


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from plinth.convert import convert
    from plinth.model import load_model

    reg = cases.registry()
    out = {}

    def get(case):
        if case not in out:
            tmp = tmp_path_factory.mktemp(case)
            folder, ref = cases.write_folder(case, tmp / "hf")
            convert(folder, tmp / "m.gguf", registry=reg)
            out[case] = (load_model(tmp / "m.gguf", registry=reg), ref)
        return out[case]

    return get


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(converted, case):
    model, ref = converted(case)
    for prompt in cases.prompts():
        diff = float(np.abs(model.logits(prompt) - cases.reference_logits(ref, prompt)).max())
        assert diff <= ATOL, f"{case}, prompt of {len(prompt)}: max |plinth - transformers| = {diff:.3g}"


@pytest.mark.parametrize("case", CASES)
def test_greedy_continuation_matches_transformers(converted, case):
    import torch

    model, ref = converted(case)
    for prompt in cases.prompts()[1:]:
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=N_GREEDY, min_new_tokens=N_GREEDY,
                                do_sample=False)[0, len(prompt):].tolist()
        got = greedy_through_cache(model.graph, model.hparams.n_layer, prompt, N_GREEDY)
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert got == want, f"{case}, prompt of {len(prompt)}: greedy tokens differ from step {first}"


def test_release_spelling_converts_to_the_same_file(converted, tmp_path):
    """The release config's spellings (hybrid_layer_pattern, top-level rope keys, no rope_parameters) give the
    same keys as transformers' spellings; with option mtp=no a checkpoint's MTP blocks are left out with a note."""
    from plinth.convert import SafetensorsDir
    from plinth.gguf import GGUFFile
    from plinth_dflash.testkit import write_safetensors
    from plinth_mimo.convert import MiMo2Converter

    model, _ = converted("release")
    folder, _ = cases.write_folder("release", tmp_path / "hf", for_llama_cpp=True)
    st = SafetensorsDir(folder)
    tensors = {n: st.get(n) for n in st.names()}
    tensors.update(cases.mtp_state(cases.CASES["release"]["config"], 99))
    write_safetensors(folder / "model.safetensors", tensors)
    notes = MiMo2Converter().convert(str(folder), str(tmp_path / "r.gguf"), {"mtp": "no"})
    assert any("14 MTP tensors (model.mtp.*) left out (option mtp=no)" in n for n in notes)
    f = GGUFFile(tmp_path / "r.gguf")
    keys = {k: v for k, v in f.metadata.items() if k.startswith("mimo2.")}
    theirs = {k: v for k, v in model.metadata.items() if k.startswith("mimo2.")}
    assert sorted(keys) == sorted(theirs)
    for k in keys:
        np.testing.assert_array_equal(np.asarray(keys[k]), np.asarray(theirs[k]), err_msg=k)


@pytest.mark.parametrize("case", ["release", "moe"])
def test_mtp_block_matches_transformers_decoder_layer(case, tmp_path):
    """Two MTP blocks converted into blocks n and n + 1 (nextn_predict_layers 2): each draft head's logits for
    rows (token p + 1, the trunk's residual at p) of a 120-token prompt, against transformers' own
    MiMoV2FlashDecoderLayer (a sliding layer) with the input fusion and head norm in torch
    (``mimo_cases.mtp_reference_logits``), within 1e-4; prefill then one-row steps through the head's
    cache give the one-pass logits."""
    pytest.importorskip("torch")
    from plinth.convert import convert
    from plinth.graph import Batch
    from plinth.model import load_model
    from plinth_dflash.testkit import write_safetensors

    folder, ref = cases.write_folder(case, tmp_path / "hf")
    state = cases.mtp_state(cases.CASES[case]["config"], MTP_SEED, n_mtp=2)
    write_safetensors(folder / "model-mtp.safetensors", state)
    reg = cases.registry()
    convert(folder, tmp_path / "m.gguf", registry=reg)
    model = load_model(tmp_path / "m.gguf", registry=reg)
    n = model.hparams.n_layer
    assert model.hparams.n_nextn == 2 and sorted(model.graph.draft_heads()) == ["mtp", "mtp.1"]
    ids = cases.prompts()[2][:120]
    tapped = model.new_context(taps=(n,)).decode(ids, output="all").features[n][:-1]
    for block, name in enumerate(["mtp", "mtp.1"]):
        head = model.graph.target_view().draft_head(name)
        got = head.run(Batch.from_tokens(ids[1:], output="all"), tapped, head.new_cache()).logits
        diff = float(np.abs(got - cases.mtp_reference_logits(ref, state, ids, block)).max())
        assert diff <= ATOL, f"{case}, MTP block {block}: max |plinth - transformers| = {diff:.3g}"
        cache = head.new_cache()
        parts = [head.run(Batch.from_tokens(ids[1:30], output="all"), tapped[:29], cache).logits]
        for p in range(29, 40):
            parts.append(head.run(Batch.from_tokens([ids[p + 1]], start=p, output="all"), tapped[p:p + 1],
                                  cache).logits)
        np.testing.assert_allclose(np.concatenate(parts), got[:40], atol=2e-5, rtol=0)

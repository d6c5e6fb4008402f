"""gemma4-assistant without torch: the converter's file, greedy losslessness on tiny gemma4 targets (numpy
and the strict device stand-in), the K/V the engine hands the drafter, and the named refusals.

The transformers oracle is ``test_assistant_reference.py`` (marker ``ref``)."""

from __future__ import annotations

import numpy as np
import pytest

from plinth.errors import UserError

PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 61, 18, 90, 33, 12], [200]]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from plinth_gemma.testkit import convert_pair

    tmp = tmp_path_factory.mktemp("gemma4-assistant")
    return {(t, a): convert_pair(tmp, t, a) for t, a in (("plain", "plain"), ("shared", "ordered"))}


def target(path, backend="numpy"):
    from plinth.model import load_model
    from plinth.testing import make_registry
    from plinth_gemma.plugin import plugin

    return load_model(path, registry=make_registry(plugin), backend=backend)


def test_converter_writes_llama_cpps_layout(pairs):
    from plinth.gguf import GGUFFile

    gf = GGUFFile(pairs[("shared", "ordered")][3])
    md = dict(gf.metadata)
    assert md["general.architecture"] == "gemma4-assistant"
    assert md["gemma4-assistant.embedding_length_out"] == 64
    assert md["gemma4-assistant.nextn_predict_layers"] == md["gemma4-assistant.block_count"] == 3
    assert md["gemma4-assistant.attention.shared_kv_layers"] == 3
    assert [bool(x) for x in md["gemma4-assistant.attention.sliding_window_pattern"]] == [True, True, False]
    assert md["gemma4-assistant.centroid_top_k"] == 4
    assert md["gemma4-assistant.final_logit_softcapping"] == 30.0  # written as llama.cpp does; not applied
    names = set(gf.tensors)
    assert {"token_embd.weight", "output_norm.weight", "nextn.pre_projection.weight", "nextn.post_projection.weight",
            "rope_freqs.weight", "masked_embd_centroids.weight", "masked_embd_ordering",
            "blk.2.layer_output_scale.weight", "blk.0.attn_q_norm.weight"} <= names
    assert not any(".attn_k." in n or ".attn_v." in n or n == "output.weight" for n in names)
    assert tuple(gf.tensors["nextn.pre_projection.weight"].shape) == (48, 128)  # numpy order [E, 2 E_target]
    plain = dict(GGUFFile(pairs[("plain", "plain")][3]).metadata)
    assert "gemma4-assistant.centroid_top_k" not in plain


@pytest.mark.parametrize("pair", [("plain", "plain"), ("shared", "ordered")])
def test_greedy_lossless_on_tiny_gemma4_targets(pairs, pair):
    from plinth.testing.drafters import check_drafter_contract
    from plinth_gemma.assistant import make_gemma4_assistant

    _, tg, _, ag = pairs[pair]
    m = target(tg)
    stats = check_drafter_contract(m, lambda: make_gemma4_assistant(m, {"draft": str(ag)}), PROMPTS,
                                   max_tokens=12, n_max=3)
    assert all(s.n_drafts > 0 for s in stats)


def test_greedy_lossless_on_the_strict_backend(pairs):
    from plinth.testing.drafters import check_drafter_contract
    from plinth_gemma.assistant import make_gemma4_assistant

    _, tg, _, ag = pairs[("shared", "ordered")]
    m = target(tg, backend="strict")
    stats = check_drafter_contract(m, lambda: make_gemma4_assistant(m, {"draft": str(ag)}), PROMPTS[:1],
                                   max_tokens=8, n_max=3)
    assert all(s.n_drafts > 0 for s in stats)


def test_p_min_and_n_min(pairs):
    from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
    from plinth_gemma.assistant import make_gemma4_assistant

    _, tg, _, ag = pairs[("plain", "plain")]
    m = target(tg)
    for opts, some in (({"p_min": 1.0}, False), ({"n_min": 4}, False), ({"p_min": 0.0, "n_min": 3}, True)):
        gen = SpeculativeGenerator(m, [make_gemma4_assistant(m, {"draft": str(ag), **opts})],
                                   config=SpecConfig(n_max=3))
        gen.generate(PROMPTS[0], 6)
        assert (gen.stats.n_drafts > 0) == some, opts


def test_the_engine_hands_the_store_layers_kv(pairs):
    """The requirement names the target's last sliding and full layers keeping K/V; the views the engine passes
    read the cache as it is when the drafter drafts (rows of a KV-shared layer are its source's)."""
    from plinth.speculative.base import TargetKV
    from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
    from plinth_gemma.assistant import make_gemma4_assistant

    _, tg, _, ag = pairs[("shared", "ordered")]
    m = target(tg)
    d = make_gemma4_assistant(m, {"draft": str(ag)})
    assert d.requirements().target_kv == (1, 2)  # layers [S, S, F, S*, F*]: 3 and 4 share 1 and 2
    seen = []
    orig = d.keys

    def keys(seq, pos):
        got = orig(seq, pos)
        ctx = gen.context
        for il, view in d._kv[seq].items():
            assert isinstance(view, TargetKV)
            k, v, p = view.read()
            assert np.array_equal(np.asarray(p), np.arange(pos))  # the accepted rows only
            ck, cv, _ = ctx.cache.kv(il).get(seq)
            assert np.array_equal(k, ck) and np.array_equal(v, cv)
        assert np.array_equal(d._kv[seq][2].read()[0], ctx.cache.kv(4).get(seq)[0])
        seen.append(pos)
        return got

    d.keys = keys
    gen = SpeculativeGenerator(m, [d], config=SpecConfig(n_max=3))
    gen.generate(PROMPTS[0], 8)
    assert seen and seen[0] == len(PROMPTS[0])


def test_refusals_are_one_named_line(pairs, tmp_path):
    from plinth.speculative.base import BaseDrafter, DrafterRequirements, check_compatible
    from plinth.testing.drafters import check_one_line_refusal
    from plinth_gemma.assistant import make_gemma4_assistant
    from plinth_gemma.testkit import TARGETS, write_target

    _, tg, _, ag = pairs[("plain", "plain")]
    m = target(tg)
    check_one_line_refusal(lambda: make_gemma4_assistant(m, {}), "needs its GGUF", "gemma4-assistant")
    check_one_line_refusal(lambda: make_gemma4_assistant(m, {"draft": str(ag), "backend": "cupy"}), "backend",
                           "gemma4-assistant")
    # an assistant made for another target: hidden size 64 vs a target of 96
    TARGETS["wide"] = dict(TARGETS["plain"], hidden_size=96)
    try:
        from plinth_gemma.convert import Gemma4Converter

        Gemma4Converter().convert(str(write_target(tmp_path / "wide", "wide")), str(tmp_path / "wide.gguf"), {})
    finally:
        del TARGETS["wide"]
    wide = target(tmp_path / "wide.gguf")
    check_one_line_refusal(lambda: make_gemma4_assistant(wide, {"draft": str(ag)}), "hidden size 64",
                           ag.name)

    class Reads(BaseDrafter):
        name = "reads-kv"

        def requirements(self):
            return DrafterRequirements(target_kv=(3,))

    check_one_line_refusal(lambda: check_compatible(m, Reads()), "layers 0..2", "reads-kv")


def test_a_file_key_it_does_not_read_is_refused(pairs, tmp_path):
    from plinth.convert import write_gguf
    from plinth.gguf import GGUFFile
    from plinth_gemma.assistant import load_assistant

    gf = GGUFFile(pairs[("plain", "plain")][3])
    md = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in gf.metadata.items()
          if not k.startswith("GGUF.")}
    md["gemma4-assistant.expert_count"] = 4
    tensors = {n: np.asarray(gf.raw(n)) for n in gf.tensors}
    write_gguf(tmp_path / "odd.gguf", md, tensors)
    with pytest.raises(UserError, match="expert_count"):
        load_assistant(tmp_path / "odd.gguf")


def test_centroid_tensors_only_on_request(tmp_path):
    """By default the converter leaves the centroid tensors out as llama.cpp's does (llama.cpp cannot open a file
    with them); ``--option centroids=yes`` keeps them."""
    from plinth.gguf import GGUFFile
    from plinth_gemma.assistant import Gemma4AssistantConverter
    from plinth_gemma.testkit import write_assistant

    folder = write_assistant(tmp_path / "hf", "ordered")
    notes = Gemma4AssistantConverter().convert(str(folder), str(tmp_path / "a.gguf"), {})
    assert any("masked_embedding tensors left out" in n for n in notes)
    assert not {"masked_embd_centroids.weight", "masked_embd_ordering"} & set(GGUFFile(tmp_path / "a.gguf").tensors)
    Gemma4AssistantConverter().convert(str(folder), str(tmp_path / "b.gguf"), {"centroids": "yes"})
    assert {"masked_embd_centroids.weight", "masked_embd_ordering"} <= set(GGUFFile(tmp_path / "b.gguf").tensors)
    with pytest.raises(UserError, match="centroids=yes|no"):
        Gemma4AssistantConverter().convert(str(folder), str(tmp_path / "c.gguf"), {"centroids": "maybe"})


@pytest.mark.interop
def test_llama_cpp_opens_plinths_assistant_file(tmp_path):
    """llama.cpp's own converter (Gemma4AssistantModel, vendored in the llama-cpp-python 0.3.36 sdist) writes the
    keys and tensors plinth's converter writes (default: no centroid tensors), plinth reads the same hyperparameters
    and weights from both files (so drafts the same), and llama.cpp loads plinth's file."""
    import json
    from pathlib import Path

    llama_cpp = pytest.importorskip("llama_cpp")
    pytest.importorskip("torch")  # (llama.cpp's converter imports it: make test-interop installs it)
    from plinth.testing import load_module, write_hf_folder
    from plinth_gemma import testkit as tk
    from plinth_gemma.assistant import Gemma4AssistantConverter

    golden = load_module(Path(__file__).resolve().parent / "golden" / "make_golden.py")
    t = dict(tk.TARGETS["plain"], vocab_size=300, vocab_size_per_layer_input=300)
    cfg = tk.assistant_config("ordered", t)
    cfg["num_centroids"] = 10
    folder = write_hf_folder(tmp_path / "hf", cfg, tk.assistant_state(cfg, 1), tokenizer=golden.gemma_tokenizer(300))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                              "pad_token": "<pad>", "unk_token": "<unk>"}))
    Gemma4AssistantConverter().convert(str(folder), str(tmp_path / "a.gguf"), {})
    from plinth.gguf import GGUFFile
    from plinth.testing.interop import convert_with_llama_cpp, llama_cpp_sources
    from plinth_gemma.assistant import load_assistant

    if llama_cpp_sources() is None:
        pytest.skip("llama.cpp sources (the llama-cpp-python 0.3.36 sdist) not available")
    theirs = convert_with_llama_cpp(folder, tmp_path / "llama_cpp.gguf")

    def contents(path):
        f = GGUFFile(path)
        keys = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in f.metadata.items()
                if k.startswith("gemma4-assistant.")}
        return keys, {n: tuple(i.shape) for n, i in f.tensors.items()}

    (k_ours, t_ours), (k_theirs, t_theirs) = contents(tmp_path / "a.gguf"), contents(theirs)
    assert t_ours == t_theirs
    assert sorted(k_ours) == sorted(k_theirs)
    for key, v in k_theirs.items():
        assert np.allclose(k_ours[key], v) if isinstance(v, float) else k_ours[key] == v, key
    a, b = load_assistant(tmp_path / "a.gguf"), load_assistant(theirs)
    assert a.hparams == b.hparams
    for name, w in a.weights.items():
        assert np.array_equal(w, b.weights[name]), name
    m = llama_cpp.llama_model_load_from_file(str(tmp_path / "a.gguf").encode(), llama_cpp.llama_model_default_params())
    assert m, "llama.cpp could not load plinth's gemma4-assistant file"
    llama_cpp.llama_model_free(m)


def test_batched_serving_with_the_assistant_equals_solo_greedy(pairs):
    """The server's scheduler hands the drafter the K/V of each request's own sequence (TargetOutput.kv): several
    requests decoding together with the assistant give each one's plain greedy output."""
    import threading

    from plinth.generate import Generator
    from plinth.sampling import SamplerConfig
    from plinth.serve.scheduler import Request, Scheduler
    from plinth.speculative.engine import SpecConfig
    from plinth_gemma.assistant import make_gemma4_assistant

    _, tg, _, ag = pairs[("shared", "ordered")]
    m = target(tg)
    drafter = make_gemma4_assistant(m, {"draft": str(ag)})
    prompts = [PROMPTS[0], [7, 8, 9], PROMPTS[0][:5] + [1, 2]]
    out: list[list[int]] = [[] for _ in prompts]
    done = threading.Semaphore(0)

    def emitter(i):
        def emit(ev):
            out[i].extend(t.token for t in ev.tokens)
            if ev.finish is not None:
                done.release()
        return emit

    sched = Scheduler(m, drafters=[drafter], spec=SpecConfig(n_max=3), max_batch=3, prefill_chunk=5)
    sched.start()
    try:
        with sched._cond:  # every request joins the first step
            for i, p in enumerate(prompts):
                sched.submit(Request(prompt_ids=p, max_tokens=10, sampling=SamplerConfig(temperature=0.0),
                                     emit=emitter(i)))
        for _ in prompts:
            assert done.acquire(timeout=120), "a request did not finish in time"
    finally:
        sched.stop()
    for p, toks in zip(prompts, out):
        assert toks == Generator(m).generate(p, 10), p
    assert sched.metrics.spec[drafter.name][0] > 0


def test_plinth_info_describes_the_file(pairs):
    from plinth.gguf import GGUFFile
    from plinth.testing import make_registry
    from plinth_gemma.plugin import plugin

    path = pairs[("shared", "ordered")][3]
    gf = GGUFFile(path)
    tensors = {n: (tuple(i.shape), i.type_name) for n, i in gf.tensors.items()}
    owner, lines = make_registry(plugin).describe_draft("gemma4-assistant", dict(gf.metadata), tensors, str(path))
    assert owner == "gemma" and lines[0].startswith("drafter          gemma4-assistant")
    assert any("S S F" in line for line in lines) and any("16 clusters" in line for line in lines)

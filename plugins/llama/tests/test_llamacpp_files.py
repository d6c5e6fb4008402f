"""Files written by llama.cpp's own converter run in plinth as transformers runs the model.

``llamacpp/<case>.gguf`` is what llama.cpp's ``convert_hf_to_gguf.py`` wrote for a tiny random
Hugging Face model and ``llamacpp/<case>.npz`` holds transformers' logits for it (both written
by ``llamacpp/make_fixtures.py``). Each case shows one feature of the files in the wild: Llama
3.1+ rope factors (``rope_freqs.weight``), biases, fused QKV, Mixtral MoE as arch llama, YaRN,
linear rope scaling, Gemma 3 sliding windows. No torch is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import plinth
from plinth.graph import Rope
from plinth.testing import check_prefill_then_decode, load_module

HERE = Path(__file__).resolve().parent / "llamacpp"
ATOL = 1e-4

fixtures = load_module(HERE / "make_fixtures.py")
CASES = sorted(fixtures.CASES)

# case -> what the file must hold for the case to show its feature (a tensor, or key = value)
FEATURE = {
    "llama3_rope": ("rope_freqs.weight", None),
    "llama_biases": ("blk.0.ffn_down.bias", None),
    "llama_fused_qkv": ("blk.0.attn_qkv.bias", None),
    "mixtral": ("llama.expert_count", 4),
    "qwen2_yarn": ("qwen2.rope.scaling.type", "yarn"),
    "qwen3_linear_rope": ("qwen3.rope.scaling.type", "linear"),
    "gemma3": ("gemma3.attention.sliding_window", 4),
    "gemma3_pattern": ("gemma3.rope.scaling.type", "linear"),
}


def reference(case):
    d = np.load(HERE / f"{case}.npz")
    return d["prompt"].tolist(), d["logits"], json.loads(str(d["config"]))


def with_metadata(src: Path, dst: Path, extra: dict) -> Path:
    """A copy of the GGUF ``src`` with the keys of ``extra`` added (values typed by gguf-py)."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, value in extra.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_every_case_has_its_files():
    assert CASES == sorted(FEATURE)
    for case in CASES:
        assert (HERE / f"{case}.gguf").is_file() and (HERE / f"{case}.npz").is_file(), case


@pytest.mark.parametrize("case", CASES)
def test_the_file_holds_the_feature(case):
    from plinth.gguf import GGUFFile

    gf = GGUFFile(HERE / f"{case}.gguf")
    name, value = FEATURE[case]
    if value is None:
        assert name in gf.tensors, f"{case}: llama.cpp's file has no {name}"
    else:
        got = gf.get(name)
        assert (got.tolist() if hasattr(got, "tolist") else got) == value, f"{case}: {name} = {got!r}"


@pytest.mark.parametrize("case", [c for c in CASES if c != "gemma3_pattern"])
def test_llamacpp_file_logits_match_transformers(case):
    ids, ref, _ = reference(case)
    model = plinth.load_model(HERE / f"{case}.gguf")
    got = model.logits(ids)
    assert got.shape == ref.shape
    diff = float(np.max(np.abs(got - ref)))
    assert diff <= ATOL, f"{case}: max |plinth - transformers| = {diff:.3g}"


@pytest.mark.parametrize("case", CASES)
def test_llamacpp_file_prefill_then_decode_equals_full_forward(case):
    model = plinth.load_model(HERE / f"{case}.gguf")
    ids, _, _ = reference(case)
    check_prefill_then_decode(model.graph, model.hparams.n_layer, ids[:12], 5, atol=1e-5)


@pytest.mark.parametrize("case", ["llama3_rope", "qwen2_yarn", "qwen3_linear_rope"])
def test_the_rope_scaling_matters(case):
    """Plain RoPE (no factors, no scaling) would be far off: the cases check what they claim."""
    ids, ref, _ = reference(case)
    model = plinth.load_model(HERE / f"{case}.gguf")
    hp, graph = model.hparams, model.graph
    graph.rope = Rope(hp.n_rot, [hp.rope_base] * hp.n_layer, graph.xp, mode=graph.rope_mode)
    assert float(np.max(np.abs(model.logits(ids) - ref))) > 1e-2


def test_gemma3_sliding_window_pattern_as_llama_cpp_reads_it(tmp_path):
    """llama.cpp's converter writes no pattern for gemma3: its file slides on every layer of a 2-layer
    model (period 6), unlike transformers' layer_types [sliding, full]. With the key added (per-layer
    booleans, or an integer period) plinth computes transformers' logits."""
    ids, ref, config = reference("gemma3_pattern")
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    src = HERE / "gemma3_pattern.gguf"
    wrong = float(np.max(np.abs(plinth.load_model(src).logits(ids) - ref)))
    assert wrong > 0.1
    for value in ([True, False], 2):
        path = with_metadata(src, tmp_path / f"pattern-{value}.gguf",
                             {"gemma3.attention.sliding_window_pattern": value})
        model = plinth.load_model(path)
        assert [w > 0 for w in model.hparams.sliding_window] == [True, False]
        diff = float(np.max(np.abs(model.logits(ids) - ref)))
        assert diff <= ATOL, f"pattern {value!r}: max |plinth - transformers| = {diff:.3g}"


@pytest.mark.parametrize("case", [c for c in CASES if c != "gemma3_pattern"])
def test_llamacpp_files_on_the_strict_device_stand_in(case):
    """Device discipline of the new paths (rope factors, biases, fused QKV, experts): the strict backend
    gives transformers' logits, and a decode step reads back only the sampled token."""
    from plinth.testing import decode_step_transfers, make_registry
    from plinth_llama.plugin import plugin

    ids, ref, _ = reference(case)
    model = plinth.load_model(HERE / f"{case}.gguf", backend="strict", registry=make_registry(plugin))
    diff = float(np.max(np.abs(model.logits(ids) - ref)))
    assert diff <= ATOL, f"{case} (strict): max |plinth - transformers| = {diff:.3g}"
    assert decode_step_transfers(model, ids[:6], n_steps=3) == [1, 1, 1]

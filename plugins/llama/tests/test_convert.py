"""plinth's converters (HF folder -> GGUF) for llama, Mixtral, qwen2, qwen3 and gemma3.

The Hugging Face folders are rebuilt, without torch, from llama.cpp's fixture files
(``llamacpp/<case>.gguf``: Q/K rows put back in transformers' order, Gemma norms back to ``w``,
experts and fused QKV split) with each case's ``config.json``. plinth's converter must give a
file whose logits are transformers' (``llamacpp/<case>.npz``) and whose architecture keys are
the ones llama.cpp's converter wrote, with the same values and GGUF types.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import plinth
from plinth.convert import convert as convert_folder
from plinth.errors import UserError
from plinth.testing import load_module
from plinth.testing.hf import write_safetensors
from plinth.testing.hf_weights import unpermute_rope_rows

HERE = Path(__file__).resolve().parent / "llamacpp"
ATOL = 1e-4

fixtures = load_module(HERE / "make_fixtures.py")
CASES = sorted(fixtures.CASES)

_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    **{f"attn_{p}.{k}": f"self_attn.{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias")},
    **{f"attn_output.{k}": f"self_attn.o_proj.{k}" for k in ("weight", "bias")},
    **{f"ffn_{p}.{k}": f"mlp.{p}_proj.{k}" for p in ("gate", "up", "down") for k in ("weight", "bias")},
}
_GEMMA = {"post_attention_norm.weight": "post_attention_layernorm.weight",
          "ffn_norm.weight": "pre_feedforward_layernorm.weight",
          "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}


def gguf_tensors(path: Path) -> tuple[dict, dict]:
    """(tensors as float32 numpy arrays, fields) of a GGUF file, read with gguf-py."""
    import gguf

    reader = gguf.GGUFReader(path)
    return ({t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors},
            {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")})


def hf_folder(case: str, folder: Path) -> dict:
    """The case's Hugging Face folder, rebuilt from llama.cpp's file; returns its config."""
    config = json.loads(str(np.load(HERE / f"{case}.npz")["config"]))
    w, fields = gguf_tensors(HERE / f"{case}.gguf")
    arch = str(fields["general.architecture"].contents())
    n_head, n_kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    norm = (lambda a: a - np.float32(1.0)) if arch == "gemma3" else (lambda a: a)
    sd = {"model.embed_tokens.weight": w.pop("token_embd.weight"),
          "model.norm.weight": norm(w.pop("output_norm.weight"))}
    if "output.weight" in w:
        sd["lm_head.weight"] = w.pop("output.weight")
    w.pop("rope_freqs.weight", None)  # the config's llama3 rope parameters hold it
    for name in list(w):
        il, suffix = name.split(".", 2)[1:]
        h = f"model.layers.{il}."
        a = w.pop(name)
        if suffix.startswith("attn_qkv."):
            nq, nk = n_head * hd, n_kv * hd
            parts = {"attn_q": a[:nq], "attn_k": a[nq:nq + nk], "attn_v": a[nq + nk:]}
            kind = suffix.split(".")[1]
            for p, v in parts.items():
                w[f"blk.{il}.{p}.{kind}"] = v
            continue
        if suffix.endswith("_exps.weight"):
            wid = {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3", "ffn_down_exps.weight": "w2"}[suffix]
            for e in range(a.shape[0]):
                sd[h + f"block_sparse_moe.experts.{e}.{wid}.weight"] = a[e]
            continue
        hf = (_GEMMA.get(suffix) if arch == "gemma3" else None) or _NAMES[suffix]
        if arch == "llama" and suffix.startswith(("attn_q.", "attn_k.")):
            heads = n_head if suffix.startswith("attn_q.") else n_kv
            a = unpermute_rope_rows(a.reshape(a.shape[0], -1), heads).reshape(a.shape)
        sd[h + hf] = norm(a) if suffix.endswith("norm.weight") else a
    for name in list(w):  # the split fused QKV
        il, suffix = name.split(".", 2)[1:]
        a = w.pop(name)
        if arch == "llama" and suffix.startswith(("attn_q.", "attn_k.")):
            a = unpermute_rope_rows(a.reshape(a.shape[0], -1), n_head if suffix.startswith("attn_q.") else n_kv
                                    ).reshape(a.shape)
        sd[f"model.layers.{il}." + _NAMES[suffix]] = a
    folder.mkdir(parents=True)
    write_safetensors(folder / "model.safetensors", sd)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text(json.dumps(byte_bpe(config["vocab_size"])))
    return config


def byte_bpe(n: int) -> dict:
    """A byte-level BPE tokenizer.json of ``n`` tokens: the first ``n - 1`` byte tokens and one merge
    (``a b`` -> ``ab``; llama.cpp refuses a BPE vocabulary without merges)."""
    from plinth.tokenizer.core import _BYTE_TO_CHAR

    vocab = {_BYTE_TO_CHAR[b]: b for b in range(n - 1)}
    vocab["ab"] = n - 1
    return {"model": {"type": "BPE", "vocab": vocab, "merges": ["a b"]},
            "pre_tokenizer": {"type": "ByteLevel"}, "added_tokens": []}


@pytest.fixture(scope="module")
def registry():
    from plinth.testing import make_registry
    from plinth_llama.plugin import plugin

    return make_registry(plugin)


def convert(case, tmp_path, registry, **options):
    folder = tmp_path / case
    hf_folder(case, folder)
    out = tmp_path / f"{case}.gguf"
    convert_folder(folder, out, registry, options)
    return out


@pytest.mark.parametrize("case", CASES)
def test_converted_logits_match_transformers(case, tmp_path, registry):
    d = np.load(HERE / f"{case}.npz")
    model = plinth.load_model(convert(case, tmp_path, registry), registry=registry)
    diff = float(np.max(np.abs(model.logits(d["prompt"].tolist()) - d["logits"])))
    assert diff <= ATOL, f"{case}: max |plinth - transformers| = {diff:.3g}"


def _value(field):
    v = field.contents()
    return [round(x, 6) if isinstance(x, float) else x for x in v] if isinstance(v, list) else (
        round(v, 6) if isinstance(v, float) else v)


@pytest.mark.parametrize("case", CASES)
def test_converted_keys_are_llama_cpps(case, tmp_path, registry):
    _, ours = gguf_tensors(convert(case, tmp_path, registry))
    theirs_t, theirs = gguf_tensors(HERE / f"{case}.gguf")
    arch = str(theirs["general.architecture"].contents())
    mine = {k: f for k, f in ours.items() if k.startswith(arch + ".")}
    ref = {k: f for k, f in theirs.items() if k.startswith(arch + ".")}
    # llama.cpp's converter writes no sliding pattern for gemma3 (it assumes a period of 6)
    assert set(mine) - set(ref) <= {"gemma3.attention.sliding_window_pattern"}
    assert set(ref) <= set(mine), f"{case}: plinth does not write {sorted(set(ref) - set(mine))}"
    for key, field in ref.items():
        assert _value(mine[key]) == _value(field), key
        assert list(mine[key].types) == list(field.types), f"{key}: GGUF type {mine[key].types} vs {field.types}"
    ours_t, _ = gguf_tensors(tmp_path / f"{case}.gguf")
    fused = {n for n in theirs_t if "attn_qkv" in n}
    split = {n.replace("attn_qkv", f"attn_{p}") for n in fused for p in "qkv"}
    assert set(ours_t) == (set(theirs_t) - fused) | split
    for name, a in theirs_t.items():
        if name in ours_t:
            np.testing.assert_allclose(ours_t[name], a, atol=2e-6, rtol=0, err_msg=name)


@pytest.mark.parametrize("case", CASES)
def test_f16_output_has_llama_cpps_tensor_types(case, tmp_path, registry):
    """``outtype=f16``: every tensor has the GGML type llama.cpp's converter gave it (its fixtures are f16)."""
    import gguf

    path = convert(case, tmp_path, registry, outtype="f16")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    theirs = {t.name: t.tensor_type.name for t in gguf.GGUFReader(HERE / f"{case}.gguf").tensors}
    assert {n: t for n, t in types.items() if n in theirs} == {n: t for n, t in theirs.items() if n in types}
    d = np.load(HERE / f"{case}.npz")
    diff = np.max(np.abs(plinth.load_model(tmp_path / f"{case}.gguf", registry=registry).logits(d["prompt"].tolist())
                         - d["logits"]))
    assert diff <= ATOL  # the fixture's weights are float16-exact


def test_refusals(tmp_path, registry):
    folder = tmp_path / "m"
    config = hf_folder("qwen3_linear_rope", folder)
    for change, match in ((dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e6}), "longrope"),
                          (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}), "dynamic"),
                          (dict(hidden_act="gelu"), "hidden_act")):
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(UserError, match=match):
            convert_folder(folder, tmp_path / "x.gguf", registry)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="outtype"):
        convert_folder(folder, tmp_path / "x.gguf", registry, {"outtype": "q4"})
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes(b"")
    with pytest.raises(UserError, match="SentencePiece"):
        convert_folder(folder, tmp_path / "x.gguf", registry)


def test_llama3_rope_factors_are_llama_cpps():
    """The factors plinth computes from the config equal the rope_freqs.weight llama.cpp's converter wrote."""
    from plinth_llama.convert import llama3_rope_factors, rope_parameters

    config = json.loads(str(np.load(HERE / "llama3_rope.npz")["config"]))
    theirs = gguf_tensors(HERE / "llama3_rope.gguf")[0]["rope_freqs.weight"]
    ours = llama3_rope_factors(rope_parameters(config), config["head_dim"])
    assert len(set(np.round(ours, 4))) > 2  # 1, the factor and blended values: the case shows all three
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


QWEN2_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
               "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


@pytest.mark.parametrize("pre, expected", [
    ({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, "gpt-2"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                            {"type": "ByteLevel", "use_regex": True}]}, "smollm"),
    ({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "behavior": "Isolated", "pattern": {"Regex": QWEN2_SPLIT}},
        {"type": "ByteLevel", "use_regex": False}]}, "qwen2"),
])
def test_pre_tokenizer_names(pre, expected):
    from plinth_llama.convert import pre_tokenizer_name

    assert pre_tokenizer_name({"pre_tokenizer": pre}, "t.json") == expected
    with pytest.raises(UserError, match="pre-tokenizer"):  # whole-word tokens: none of these names
        pre_tokenizer_name({"pre_tokenizer": pre, "model": {"ignore_merges": True}}, "t.json")


def test_an_unknown_pre_tokenizer_is_refused():
    from plinth_llama.convert import pre_tokenizer_name

    with pytest.raises(UserError, match="pre-tokenizer"):
        pre_tokenizer_name({"pre_tokenizer": {"type": "Whitespace"}}, "t.json")


@pytest.mark.ref
@pytest.mark.slow
@pytest.mark.parametrize("vocab", ["llama-bpe", "qwen2"])
def test_converted_tokenizer_encodes_as_transformers(vocab, tmp_path):
    """A tokenizer.json (transformers' own, from llama.cpp's vocabulary file) converted by plinth
    encodes llama.cpp's tokenizer test texts as transformers does."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from plinth.tokenizer import Tokenizer
    from plinth_llama.convert import DenseConverter

    models = Path("/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp/models")
    if not (models / f"ggml-vocab-{vocab}.gguf").is_file():
        from plinth.testing.interop import llama_cpp_sources

        src = llama_cpp_sources()
        if src is None:
            pytest.skip("the llama.cpp vocabulary files are not available")
        models = src / "models"
    AutoTokenizer.from_pretrained(str(models), gguf_file=f"ggml-vocab-{vocab}.gguf").save_pretrained(tmp_path)
    if vocab == "llama-bpe":  # Llama 3's own tokenizer.json has it; transformers' GGUF import drops it
        j = json.loads((tmp_path / "tokenizer.json").read_text())
        j["model"]["ignore_merges"] = True
        (tmp_path / "tokenizer.json").write_text(json.dumps(j))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    md = DenseConverter().tokenizer(str(tmp_path), {})
    tok = Tokenizer.from_metadata(md, "converted")
    texts = (models / f"ggml-vocab-{vocab}.gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    for text in texts:
        assert tok.encode(text, add_special=False) == hf.encode(text, add_special_tokens=False), repr(text)

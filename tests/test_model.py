"""Loading synthetic GGUFs through the plugin path: load_model, logits, named tensor errors, generation."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

import plinth
from plinth.graph import Batch
from plinth.errors import UserError
from plinth.tensors import TensorCheckError
from plinth.testing import byte_vocab, tiny_metadata, write_synthetic_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture
def registry(plinth_registry):
    from plinth_llama.plugin import plugin

    return plinth_registry(plugin)


@pytest.fixture
def tiny_path(tmp_path, registry):
    md = tiny_metadata("llama", n_vocab=257) | byte_vocab()
    return write_synthetic_gguf(tmp_path / "tiny-llama.gguf", "llama", md, registry, seed=4)


def gguf_tensors(path):
    """Every tensor of a GGUF as float32 in numpy order, read and dequantized by gguf-py (the oracle's reader)."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        shape = tuple(reversed([int(d) for d in t.shape]))
        out[t.name] = gguf.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(shape)
    return out


def reference_llama_logits(path, md, tokens):
    """Logits of a llama GGUF from its definition (llama.cpp semantics), in float64 numpy with gguf-py's tensors.

    Pre-norm blocks: RMSNorm, Q/K/V, RoPE on interleaved pairs ("normal" GGUF layout), causal
    grouped-query attention, output projection; RMSNorm, SwiGLU FFN; final RMSNorm; LM head
    (tied to token_embd when output.weight is absent).
    """
    w = gguf_tensors(path)
    a = md["general.architecture"]
    n_head, n_head_kv = md[f"{a}.attention.head_count"], md[f"{a}.attention.head_count_kv"]
    eps, base = md[f"{a}.attention.layer_norm_rms_epsilon"], md.get(f"{a}.rope.freq_base", 10000.0)
    x = w["token_embd.weight"][tokens]
    n, e = x.shape
    hd = e // n_head
    ang = np.arange(n)[:, None] * base ** (-np.arange(0, hd, 2) / hd)[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rms(v, weight):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * weight

    def rope(v):
        out = np.empty_like(v)
        out[..., 0::2] = v[..., 0::2] * cos - v[..., 1::2] * sin
        out[..., 1::2] = v[..., 0::2] * sin + v[..., 1::2] * cos
        return out

    hidden = np.triu(np.ones((n, n), bool), 1)
    for il in range(md[f"{a}.block_count"]):
        b = f"blk.{il}."
        h = rms(x, w[b + "attn_norm.weight"])
        q = rope((h @ w[b + "attn_q.weight"].T).reshape(n, n_head, hd))
        k = np.repeat(rope((h @ w[b + "attn_k.weight"].T).reshape(n, n_head_kv, hd)), n_head // n_head_kv, axis=1)
        v = np.repeat((h @ w[b + "attn_v.weight"].T).reshape(n, n_head_kv, hd), n_head // n_head_kv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        s[:, hidden] = -np.inf
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", p, v).reshape(n, e) @ w[b + "attn_output.weight"].T
        h = rms(x, w[b + "ffn_norm.weight"])
        g = h @ w[b + "ffn_gate.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ w[b + "ffn_up.weight"].T)) @ w[b + "ffn_down.weight"].T
    head = w.get("output.weight", w["token_embd.weight"])
    return rms(x, w["output_norm.weight"]) @ head.T


def test_load_model_logits_match_an_independent_reference(tmp_path, registry):
    md = tiny_metadata("llama", n_vocab=257) | byte_vocab()
    path = write_synthetic_gguf(tmp_path / "tiny-llama.gguf", "llama", md, registry, seed=4, scale=0.5,
                                drop=("output.weight",))  # a tied LM head
    model = plinth.load_model(path, registry=registry)
    assert model.arch == "llama" and model.plugin == "llama"
    tokens = [5, 9, 200, 17, 5, 64]
    logits = model.logits(tokens)
    assert logits.shape == (6, 257) and logits.dtype == np.float32
    ref = reference_llama_logits(path, md, tokens)
    assert np.abs(ref).max() > 1.0  # not a degenerate model: the comparison has something to see
    np.testing.assert_allclose(logits, ref, atol=2e-4, rtol=1e-4)
    # incremental decoding through a Context gives the same rows as the reference
    ctx = model.new_context()
    step = [ctx.decode(tokens[:2], output="all").logits] + [ctx.decode([t]).logits for t in tokens[2:]]
    np.testing.assert_allclose(np.concatenate(step), ref, atol=2e-4, rtol=1e-4)


def test_quantized_weights_load_as_gguf_py_dequantizes_them(tmp_path, registry, monkeypatch):
    import plinth.quant as quant
    from plinth.testing import write_gguf

    # the f32-activation kernels: the same arithmetic as the f32 model (the int8 path rounds
    # activations; tests/test_quant_kernels.py holds it to gguf-py's Q8_0)
    monkeypatch.setitem(quant._state, "i8", False)

    md = tiny_metadata("qwen3")
    qtypes = {f"blk.{i}.{n}.weight": gguf.GGMLQuantizationType.Q8_0 for i in range(2)
              for n in ("attn_q", "attn_k", "attn_v", "ffn_up")}
    path = write_synthetic_gguf(tmp_path / "q.gguf", "qwen3", md, registry, qtypes=qtypes)
    model = plinth.load_model(path, registry=registry)
    assert model.tensor_types["blk.0.attn_q.weight"] == "Q8_0"
    # the same model with gguf-py's dequantization of every tensor stored as F32
    dequantized = {name: t.astype(np.float32) for name, t in gguf_tensors(path).items()}
    assert any(not np.array_equal(dequantized[n], np.round(dequantized[n], 2)) for n in qtypes)
    f32 = plinth.load_model(write_gguf(tmp_path / "f32.gguf", md, dequantized), registry=registry)
    assert f32.tensor_types["blk.0.attn_q.weight"] == "F32"
    tokens = [1, 2, 3, 40, 7]
    np.testing.assert_allclose(model.logits(tokens), f32.logits(tokens), atol=1e-5, rtol=0)
    # and the quantization mattered: the file's pre-quantization weights give other logits
    exact = plinth.load_model(write_synthetic_gguf(tmp_path / "exact.gguf", "qwen3", md, registry), registry=registry)
    assert np.abs(exact.logits(tokens) - model.logits(tokens)).max() > 1e-4


def test_missing_and_misshaped_tensors_are_all_named(tmp_path, registry):
    md = tiny_metadata("llama")
    path = write_synthetic_gguf(tmp_path / "broken.gguf", "llama", md, registry,
                                drop=["blk.1.ffn_up.weight", "output_norm.weight"])
    with pytest.raises(TensorCheckError) as err:
        plinth.load_model(path, registry=registry)
    text = str(err.value)
    assert "broken.gguf" in text and "blk.1.ffn_up.weight" in text and "output_norm.weight" in text


def test_unknown_architecture_is_named(tmp_path, registry):
    from plinth.plugins import PluginError
    from plinth.testing import write_gguf

    path = write_gguf(tmp_path / "x.gguf", {"general.architecture": "mystery"}, {"w": np.zeros((1, 32), np.float32)})
    with pytest.raises(PluginError, match="architecture 'mystery'.*available: gemma3, llama, qwen2, qwen3"):
        plinth.load_model(path, registry=registry)


def test_taps_out_of_range(tiny_path, registry):
    model = plinth.load_model(tiny_path, registry=registry)
    with pytest.raises(ValueError, match="feature tap 3 out of range"):
        model.new_context(taps=[3])


def test_generation_greedy_matches_argmax_loop(tiny_path, registry):
    from plinth.generate import Generator

    model = plinth.load_model(tiny_path, registry=registry)
    prompt = model.tokenizer.encode("hello")
    gen = Generator(model)
    text = "".join(gen.stream(prompt, max_tokens=12))
    # an independent greedy loop over full forwards
    ids = list(prompt)
    expect = []
    for _ in range(12):
        nxt = int(np.argmax(model.logits(ids)[-1]))
        if nxt == 256:
            break
        expect.append(nxt)
        ids.append(nxt)
    assert gen.tokens_out == expect
    assert text == model.tokenizer.decode(expect)
    assert gen.stats.n_generated == len(expect)


def test_context_limit_is_a_clear_error(tiny_path, registry):
    model = plinth.load_model(tiny_path, registry=registry, n_ctx=8)
    with pytest.raises(UserError, match="context limit exceeded"):
        model.new_context().forward(Batch.from_tokens(list(range(9))))
    from plinth.generate import Generator

    with pytest.raises(UserError, match="the context holds 8"):
        list(Generator(model).stream(list(range(10))))


def test_stop_string(tiny_path, registry):
    from plinth.generate import Generator

    model = plinth.load_model(tiny_path, registry=registry)
    prompt = [104, 105]
    full = "".join(Generator(model).stream(prompt, max_tokens=16))
    assert len(full) >= 6, f"the tiny model must write enough text for this test: {full!r}"
    stop = full[3:5]  # a two-character stop string, first seen at some offset >= 1
    at = full.index(stop)
    assert at >= 1
    gen = Generator(model)
    cut = "".join(gen.stream(prompt, max_tokens=16, stop=[stop]))
    assert cut == full[:at]  # the text before the first occurrence, nothing of the stop string
    assert gen.stats.stop_reason == "stop string"
    # a stop string that never occurs changes nothing
    assert "".join(Generator(model).stream(prompt, max_tokens=16, stop=["\x00never\x00"])) == full


def test_heap_keeps_freed_memory_on_glibc() -> None:
    """The numpy backend raises glibc's mmap / trim thresholds (temporaries reused instead of
    page-faulted in again every forward); PLINTH_MALLOC=0 leaves them; a fresh process shows both:
    with the setting a freed 8 MiB temporary stays in the heap (mallinfo2's free bytes), without
    it glibc unmaps it."""
    libc_ok = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "mallinfo2")
    if not libc_ok:
        pytest.skip("not glibc >= 2.33")
    probe = (
        "import ctypes, numpy as np\n"
        "from plinth.backend import NumpyBackend\n"
        "from plinth.heap import keep_freed_memory\n"
        "NumpyBackend()\n"
        "class MI(ctypes.Structure):\n"
        "    _fields_ = [(n, ctypes.c_size_t) for n in ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks',"
        " 'fsmblks', 'uordblks', 'fordblks', 'keepcost')]\n"
        "f = ctypes.CDLL(None).mallinfo2\n"
        "f.restype = MI\n"
        "a = np.ones(8 << 18, np.float32)\n"
        "mapped = f().hblkhd\n"
        "del a\n"
        "print(keep_freed_memory(), mapped >= 8 << 20, f().fordblks >= 8 << 20)\n")
    for env, want in (({}, "True False True"), ({"PLINTH_MALLOC": "0"}, "False True False")):
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                             env={**os.environ, **env})
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[-3:] == want.split(), (env, out.stdout)

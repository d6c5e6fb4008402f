"""The optional pieces of llama.cpp's dflash graph (src/models/dflash.cpp), each against a hand computation.

Issue 40: a draft with post-norms, ``layer_output_scale``, ``rope_freqs``, ``hidden_activation``, a value
scale, an attention scale or an embedding scale was loaded and the piece dropped without a word. Each is
now computed where llama.cpp computes it, or refused by name. Seed #30945: ``fc.input_scale`` is NVFP4's
activation scale of fc: llama.cpp's graph multiplies fc's product by ``fc.scale`` only and never by the
input scale (this llama.cpp does not even create that tensor), so a float product is the same with any
valid input scale; a value that is no valid scale is refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest

from plinth import ops
from plinth import HParamsError, TensorCheckError

E, HD = 64, 16


def write(tmp_path, name, *, md=None, tensors=None, edit=None, **kw):
    """A tiny dflash draft for the qwen3 tiny target, with extra keys / tensors, or its tensors edited."""
    from plinth.convert import write_gguf
    from plinth_dflash.testkit import random_draft_tensors, tiny_draft_metadata

    kw.setdefault("n_vocab", 257)
    kw.setdefault("mask_token", 255)
    kw.setdefault("taps", (1, 3))
    meta = tiny_draft_metadata("dflash", **kw)
    meta.update({f"dflash.{k}": v for k, v in (md or {}).items()})
    ts = random_draft_tensors(meta, "dflash", seed=11, own_embd=True)
    if edit:
        edit(ts)
    ts.update(tensors or {})
    return write_gguf(tmp_path / f"{name}.gguf", meta, ts)


def graph(targets, path):
    from plinth_dflash.drafter import make_dflash

    return make_dflash(targets["qwen3"], {"draft": str(path)}).graph


def rms(x, w, eps=1e-6):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def block(g, tokens=(5, 255, 255, 255), pos=3):
    return np.asarray(g.forward_block(g.new_cache(), 0, list(tokens), np.arange(pos, pos + len(tokens))))


# ------------------------------------------------------------------ fc.input_scale (#30945)

def test_fc_product_uses_fc_scale_and_not_the_input_scale(targets, tmp_path):
    rng = np.random.default_rng(1)
    s = np.float32(0.37)
    path = write(tmp_path, "scaled", tensors={"fc.scale": np.array([s], np.float32),
                                              "fc.input_scale": np.array([0.25], np.float32)})
    g = graph(targets, path)
    from plinth.gguf import GGUFFile

    gf = GGUFFile(path)
    w_fc = np.asarray(gf.raw("fc.weight"), np.float64).reshape(E, 2 * E)
    enc = np.asarray(gf.raw("enc.output_norm.weight"), np.float64)
    f = rng.standard_normal((3, 2 * E)).astype(np.float32)
    want = rms(f.astype(np.float64) @ (w_fc * float(s)).T, enc)  # by hand: RMSNorm_enc(fc.scale * (fc . f))
    np.testing.assert_allclose(np.asarray(g.fuse(f)), want, rtol=2e-5, atol=2e-5)
    other = graph(targets, write(tmp_path, "other", tensors={"fc.scale": np.array([s], np.float32),
                                                             "fc.input_scale": np.array([3.0], np.float32)}))
    assert np.array_equal(np.asarray(other.fuse(f)), np.asarray(g.fuse(f)))


@pytest.mark.parametrize("value", [0.0, -0.5, np.nan, np.inf])
def test_an_input_scale_that_is_no_scale_is_refused_by_name(targets, tmp_path, value):
    from plinth_dflash.format import DFlashFormatError

    path = write(tmp_path, "bad", tensors={"fc.input_scale": np.array([value], np.float32)})
    with pytest.raises(DFlashFormatError, match="fc.input_scale"):
        graph(targets, path)


def test_an_input_scale_of_the_wrong_shape_is_refused_by_name(targets, tmp_path):
    path = write(tmp_path, "bad", tensors={"fc.input_scale": np.array([0.5, 0.5], np.float32)})
    with pytest.raises(TensorCheckError, match="fc.input_scale"):
        graph(targets, path)


# ------------------------------------------------------------------ issue 40: per-layer pieces

def test_post_norms_and_layer_output_scale_by_hand(targets, tmp_path):
    rng = np.random.default_rng(2)
    pa = (1 + 0.3 * rng.standard_normal(E)).astype(np.float32)
    pf = (1 + 0.3 * rng.standard_normal(E)).astype(np.float32)
    extra = {"blk.0.post_attention_norm.weight": pa, "blk.0.post_ffw_norm.weight": pf,
             "blk.0.layer_output_scale.weight": np.array([0.6], np.float32)}
    plain, g = graph(targets, write(tmp_path, "plain")), graph(targets, write(tmp_path, "extra", tensors=extra))
    h = rng.standard_normal((4, E)).astype(np.float32)
    pos = np.arange(4)
    w = plain.w
    # by hand, in llama.cpp's order: attention, post-attention norm, residual; FFN, post-FFN norm, residual; scale
    cache = plain.new_cache()
    a = np.asarray(plain._attention(0, ops.rms_norm(h, w["blk.0.attn_norm.weight"], 1e-6), cache, 0, pos))
    cache.rollback_pending()
    h1 = h + rms(a, pa)
    m = np.asarray(plain._ffn(0, rms(h1, w["blk.0.ffn_norm.weight"]).astype(np.float32)))
    want = (rms(m, pf) + h1) * 0.6
    cache = g.new_cache()
    got = np.asarray(g.layer(0, h, cache, 0, pos))
    cache.rollback_pending()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(got, np.asarray(plain.layer(0, h, plain.new_cache(), 0, pos)), atol=1e-3)


def test_value_scale_is_the_attention_output_times_it(targets, tmp_path):
    c = 0.45

    def scaled_output(ts):
        for il in range(2):
            ts[f"blk.{il}.attn_output.weight"] = ts[f"blk.{il}.attn_output.weight"] * np.float32(c)

    keyed = graph(targets, write(tmp_path, "keyed", md={"attention.value_scale": c}))
    folded = graph(targets, write(tmp_path, "folded", edit=scaled_output))
    np.testing.assert_allclose(block(keyed), block(folded), rtol=1e-4, atol=1e-5)
    assert not np.allclose(block(keyed), block(graph(targets, write(tmp_path, "plain"))), atol=1e-3)


def test_attention_scale_replaces_one_over_sqrt_head_dim(targets, tmp_path):
    s = 0.11  # scores q . k * s; the same as q scaled by s * sqrt(head_dim) under the default scale

    def scaled_q(ts):
        for il in range(2):
            ts[f"blk.{il}.attn_q_norm.weight"] = ts[f"blk.{il}.attn_q_norm.weight"] * np.float32(s * HD ** 0.5)

    keyed = graph(targets, write(tmp_path, "keyed", md={"attention.scale": s}))
    assert keyed.scales == pytest.approx([s, s])
    folded = graph(targets, write(tmp_path, "folded", edit=scaled_q))
    np.testing.assert_allclose(block(keyed), block(folded), rtol=1e-4, atol=1e-5)


def test_embedding_scale_multiplies_the_block_embeddings(targets, tmp_path):
    c = 2.5

    def scaled_embd(ts):
        ts["token_embd.weight"] = ts["token_embd.weight"] * np.float32(c)

    keyed = graph(targets, write(tmp_path, "keyed", md={"embedding_scale": c}))
    folded = graph(targets, write(tmp_path, "folded", edit=scaled_embd))
    np.testing.assert_allclose(block(keyed), block(folded), rtol=1e-4, atol=1e-5)


def test_rope_freqs_divide_each_pair_frequency(targets, tmp_path):
    factors = np.linspace(1.0, 4.0, HD // 2).astype(np.float32)
    g = graph(targets, write(tmp_path, "freqs", tensors={"rope_freqs.weight": factors}))
    cos, sin = (np.asarray(t) for t in g.ropes[0](np.arange(6)))
    i = np.arange(HD // 2)
    angle = np.arange(6)[:, None] * (10000.0 ** (-2.0 * i / HD))[None, :] / factors[None, :].astype(np.float64)
    np.testing.assert_allclose(cos, np.cos(angle), atol=1e-6)
    np.testing.assert_allclose(sin, np.sin(angle), atol=1e-6)
    assert not np.allclose(block(g), block(graph(targets, write(tmp_path, "plain"))), atol=1e-3)


@pytest.mark.parametrize("name", ["gelu", "gelu_pytorch_tanh"])
def test_gelu_hidden_activation_by_hand(targets, tmp_path, name):
    g = graph(targets, write(tmp_path, "gelu", md={"hidden_activation": name}))
    x = np.random.default_rng(3).standard_normal((3, E)).astype(np.float32)
    w = {k: np.asarray(v, np.float64) for k, v in g.w.items() if k.startswith("blk.0.ffn_")}
    gate, up = x @ w["blk.0.ffn_gate.weight"].T, x @ w["blk.0.ffn_up.weight"].T
    act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))
    np.testing.assert_allclose(np.asarray(g._ffn(0, x)), (act * up) @ w["blk.0.ffn_down.weight"].T, rtol=1e-4,
                               atol=1e-5)


def test_other_hidden_activations_and_bad_scales_are_refused_by_name(targets, tmp_path):
    with pytest.raises(HParamsError, match="hidden_activation"):
        graph(targets, write(tmp_path, "relu", md={"hidden_activation": "relu"}))
    with pytest.raises(HParamsError, match="value_scale"):
        graph(targets, write(tmp_path, "nan", md={"attention.value_scale": float("nan")}))


def test_a_tensor_no_part_of_the_draft_reads_is_refused_by_name(targets, tmp_path):
    from plinth_dflash.format import DFlashFormatError

    path = write(tmp_path, "extra", tensors={"blk.0.attn_gate.weight": np.ones((E, E), np.float32)})
    with pytest.raises(DFlashFormatError, match="blk.0.attn_gate.weight"):
        graph(targets, path)

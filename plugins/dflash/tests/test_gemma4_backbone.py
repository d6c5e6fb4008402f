"""Gemma 4 draft layers in a dflash GGUF: sliding layers with their own head size and RoPE, full layers with
K = V and proportional RoPE, per-layer KV heads, V norms, post norms, layer scale; lossless on tiny Gemma 4
and qwen3 targets (no torch: the transformers oracle is test_gemma4_reference.py)."""

from __future__ import annotations

import numpy as np
import pytest

from plinth.graph import HParamsError

GEMMA4_TARGET = dict(attention__key_length=32, attention__key_length_swa=16, attention__value_length=32,
                     attention__value_length_swa=16, attention__sliding_window=5, rope__freq_base=1e6,
                     rope__freq_base_swa=1e4, rope__dimension_count=32, rope__dimension_count_swa=16, n_layer=3,
                     attention__sliding_window_pattern=[True, True, False], final_logit_softcapping=30.0)
PROMPTS = [[3, 17, 42, 8, 23], [60, 2, 2, 2, 9, 31, 77, 4, 50, 12, 1]]


@pytest.fixture(scope="module")
def gemma4_target(tmp_path_factory):
    """A tiny random gemma4 target (plinth-gemma) with the byte-level test tokenizer."""
    return tiny_gemma4_target(tmp_path_factory.mktemp("g4") / "gemma4.gguf")


def tiny_gemma4_target(path, backend="numpy"):
    pytest.importorskip("plinth_gemma")
    import plinth
    from plinth.testing import byte_vocab, make_registry, tiny_metadata, write_synthetic_gguf

    reg = make_registry("gemma")
    md = tiny_metadata("gemma4", n_vocab=257, n_embd=64, n_ctx=1024, **GEMMA4_TARGET) | byte_vocab()
    p = path if path.exists() else write_synthetic_gguf(path, "gemma4", md, reg, seed=3, scale=0.2)
    return plinth.load_model(p, registry=reg, backend=backend)


def draft(tmp_path, name="g4", **kw):
    from plinth_dflash.testkit import write_tiny_gemma4_draft

    kw.setdefault("taps", (1, 3))
    kw.setdefault("mask_token", 255)
    kw.setdefault("block_size", 6)
    return write_tiny_gemma4_draft(tmp_path / f"{name}.gguf", **kw)


def rms(x, w=None, eps=1e-6):
    x = np.asarray(x, np.float64)
    y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return y if w is None else y * np.asarray(w, np.float64)


def test_hparams_of_a_gemma4_draft(tmp_path):
    from plinth.gguf import GGUFFile
    from plinth_dflash.format import load_hparams

    gf = GGUFFile(draft(tmp_path))
    hp = load_hparams(dict(gf.metadata), "g4", gf.tensors.keys())
    assert hp.swa_layers == (True, False) and hp.swa_rope and hp.value_norm
    assert [hp.hd(il) for il in range(2)] == [16, 32] and [hp.kv_heads(il) for il in range(2)] == [2, 1]
    assert [hp.rot(il) for il in range(2)] == [16, 32]
    assert (hp.rope_base_swa, hp.rope_base, hp.hidden_act, hp.attn_scale) == (1e4, 1e6, "gelu", 1.0)
    assert hp.embedding_scale == pytest.approx(8.0)
    assert "blk.1.attn_v.weight" not in gf.tensors and "blk.0.attn_v.weight" in gf.tensors


def test_sliding_geometry_keys_are_checked():
    from plinth_dflash.format import load_hparams
    from plinth_dflash.testkit import tiny_draft_metadata

    md = tiny_draft_metadata(taps=(1, 3))
    md["dflash.attention.key_length_swa"] = 8
    with pytest.raises(HParamsError, match="key_length_swa.*no sliding layer"):
        load_hparams(md, "x")
    md = tiny_draft_metadata(taps=(1, 3), sliding_window=4, swa_pattern=[True, False])
    md["dflash.rope.dimension_count_swa"] = 20
    with pytest.raises(HParamsError, match="dimension_count_swa' = 20: must be even and within"):
        load_hparams(md, "x")
    md = tiny_draft_metadata(taps=(1, 3))
    md["dflash.attention.value_length"] = 8
    with pytest.raises(HParamsError, match="value_length' = 8 differs from the key length 16"):
        load_hparams(md, "x")
    md = tiny_draft_metadata(taps=(1, 3))
    md["dflash.attention.head_count_kv"] = [2, 3]
    with pytest.raises(HParamsError, match=r"head_count 4 is not a multiple of head_count_kv 3 \(layer 1\)"):
        load_hparams(md, "x")
    md = tiny_draft_metadata(taps=(1, 3))
    md["dflash.attention.value_norm"] = 1
    with pytest.raises(HParamsError, match="value_norm' must be a bool"):
        load_hparams(md, "x")


def test_injected_kv_by_hand(tmp_path):
    """Sliding layer 0: K = RoPE_swa(k_norm(Wk g)), V = rms_norm(Wv g); full layer 1 (no attn_v): V =
    rms_norm(Wk g) (K is V), K rotated by the proportional RoPE (rope_freqs 1e30 = pairs that do not turn)."""
    from plinth_dflash.testkit import tiny_target
    from plinth_dflash.drafter import make_dflash

    t = tiny_target(tmp_path / "q.gguf", "qwen3", n_layer=3, seed=5)
    d = make_dflash(t, {"draft": str(draft(tmp_path))})
    g = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    pos = np.array([4, 5, 9])
    w = {k: np.asarray(v, np.float64) for k, v in d.graph.w.items()}

    def rope(x, n_rot, base, factors=None):
        half = x.shape[-1] // 2
        inv = base ** (-2.0 * np.arange(half) / n_rot)
        if factors is not None:
            inv = inv / factors
        ang = pos[:, None, None] * inv[None, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)

    k0, v0 = (np.asarray(a) for a in d.graph.context_kv(0, g, pos))
    kr = (g @ w["blk.0.attn_k.weight"].T).reshape(3, 2, 16)
    np.testing.assert_allclose(k0, rope(rms(kr, w["blk.0.attn_k_norm.weight"]), 16, 1e4), atol=2e-5)
    np.testing.assert_allclose(v0, rms((g @ w["blk.0.attn_v.weight"].T).reshape(3, 2, 16)), atol=2e-5)
    k1, v1 = (np.asarray(a) for a in d.graph.context_kv(1, g, pos))
    kr = (g @ w["blk.1.attn_k.weight"].T).reshape(3, 1, 32)
    np.testing.assert_allclose(v1, rms(kr), atol=2e-5)
    np.testing.assert_allclose(k1, rope(rms(kr, w["blk.1.attn_k_norm.weight"]), 32, 1e6, w["rope_freqs.weight"]),
                               atol=2e-5)
    # the proportional RoPE leaves the last 3/4 of each half unturned
    np.testing.assert_allclose(k1[..., 4:16], rms(kr, w["blk.1.attn_k_norm.weight"])[..., 4:16], atol=2e-5)


@pytest.mark.parametrize("head", ["target", "tied", "own"])
def test_lossless_on_a_tiny_gemma4_target(gemma4_target, tmp_path, head):
    from plinth.testing.drafters import check_drafter_contract
    from plinth_dflash.drafter import make_dflash

    p = str(draft(tmp_path, taps=(1, 2, 3), own_embd=head == "tied", own_head=head == "own",
                  **({"tied": True} if head == "tied" else {})))
    m = gemma4_target
    stats = check_drafter_contract(m, lambda: make_dflash(m, {"draft": p}), PROMPTS, max_tokens=20, n_max=5)
    assert all(s.n_drafts > 0 for s in stats)
    assert make_dflash(m, {"draft": p}).head_source == head


def test_lossless_full_layers_only_and_strict_backend(tmp_path):
    """llama.cpp's Gemma4DSparkModel shape (full layers only, K = V) on the strict device stand-in."""
    from plinth.testing.drafters import check_drafter_contract
    from plinth_dflash.drafter import make_dflash

    m = tiny_gemma4_target(tmp_path / "gemma4.gguf", backend="strict")
    p = str(draft(tmp_path, layer_types=("full_attention",) * 2))
    stats = check_drafter_contract(m, lambda: make_dflash(m, {"draft": p}), PROMPTS[:1], max_tokens=16, n_max=5)
    assert all(s.n_drafts > 0 for s in stats)

"""Gemma 4 draft layers in a dflash GGUF: sliding layers with their own head size and RoPE, full layers with
K = V and proportional RoPE, per-layer KV heads, V norms, post norms, layer scale; lossless on tiny Gemma 4
and qwen3 targets (no torch: the transformers oracle is test_gemma4_reference.py)."""

from __future__ import annotations

import numpy as np
import pytest

from plinth.graph import HParamsError

PROMPTS = [[3, 17, 42, 8, 23], [60, 2, 2, 2, 9, 31, 77, 4, 50, 12, 1]]


@pytest.fixture(scope="module")
def gemma4_target(tmp_path_factory):
    """A tiny random gemma4 target (plinth-gemma) with the byte-level test tokenizer."""
    return tiny_gemma4_target(tmp_path_factory.mktemp("g4") / "gemma4.gguf")


def tiny_gemma4_target(path, backend="numpy"):
    pytest.importorskip("plinth_gemma")
    from plinth_dflash.testkit import tiny_gemma4_target as make

    return make(path, backend=backend)


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


# ------------------------------------------------------------------ plinth convert of a gemma4_text backbone

def convert_gemma4(tmp_path, name="hf", **kw):
    from plinth.gguf import GGUFFile
    from plinth_dflash.convert import DFlashConverter
    from plinth_dflash.testkit import write_hf_gemma4_draft

    kw.setdefault("n_vocab", 257)
    kw.setdefault("mask_token", 255)
    hf = write_hf_gemma4_draft(tmp_path / name, **kw)
    out = tmp_path / f"{name}.gguf"
    DFlashConverter().convert(str(hf), str(out), {})
    return GGUFFile(out), out


def test_both_gemma4_config_styles_convert_alike(tmp_path):
    """The released keys (global_head_dim, num_global_key_value_heads) and transformers 5.24's per_layer_config."""
    a, _ = convert_gemma4(tmp_path, "released")
    b, _ = convert_gemma4(tmp_path, "per-layer", per_layer_config=True)
    ka = {k: np.asarray(v).tolist() for k, v in a.metadata.items() if k.startswith("dflash.")}
    kb = {k: np.asarray(v).tolist() for k, v in b.metadata.items() if k.startswith("dflash.")}
    assert ka == kb
    assert ka["dflash.attention.head_count_kv"] == [2, 1] and ka["dflash.attention.key_length"] == 32
    assert ka["dflash.attention.key_length_swa"] == 16 and ka["dflash.rope.dimension_count"] == 32
    np.testing.assert_array_equal(np.asarray(a.raw("rope_freqs.weight")), np.float32([1] * 4 + [1e30] * 12))
    assert "blk.1.attn_v.weight" not in a.tensors and "blk.0.attn_v.weight" in a.tensors


def test_gemma4_variants_convert(tmp_path, gemma4_target):
    from plinth.testing.drafters import check_drafter_contract
    from plinth_dflash.drafter import make_dflash

    gf, out = convert_gemma4(tmp_path, "no-keqv", k_eq_v=False, rope_type="default", partial_rotary=0.5,
                             layer_types=["full_attention", "sliding_attention", "full_attention"],
                             target_layer_ids=(0, 2), tie_word_embeddings=False, own_head=True)
    md = gf.metadata
    # transformers' Gemma 4 "default" RoPE turns the whole head: the partial factor only shapes "proportional"
    assert "rope_freqs.weight" not in gf.tensors and int(md["dflash.rope.dimension_count"]) == 32
    assert np.asarray(md["dflash.attention.head_count_kv"]).tolist() == 2  # one count: no k_eq_v override
    assert all(f"blk.{il}.attn_v.weight" in gf.tensors for il in range(3))
    m = gemma4_target
    dr = make_dflash(m, {"draft": str(out)})
    assert dr.head_source == "own" and dr.hp.target_layers == (1, 3)
    check_drafter_contract(m, lambda: make_dflash(m, {"draft": str(out)}), PROMPTS[:1], max_tokens=12, n_max=5)


@pytest.mark.parametrize("edit, match", [
    (dict(enable_moe_block=True), "enable_moe_block"),
    (dict(hidden_size_per_layer_input=8), "per-layer input embeddings"),
    (dict(num_kv_shared_layers=1), "KV sharing"),
    (dict(final_logit_softcapping=30.0), "soft-capping"),
    (dict(hidden_activation="silu"), "hidden_activation 'silu'"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(rope_type="yarn"), "rope_type 'yarn'"),
])
def test_gemma4_backbone_refusals_are_named(tmp_path, edit, match):
    from plinth.errors import UserError

    with pytest.raises(UserError, match=match):
        convert_gemma4(tmp_path, **edit)


def test_plinth_info_describes_gemma4_layers(tmp_path):
    from plinth.gguf import GGUFFile
    from plinth_dflash.format import describe

    gf = GGUFFile(draft(tmp_path))
    lines = describe(dict(gf.metadata), {n: (tuple(i.shape), i.type_name) for n, i in gf.tensors.items()}, "g4")
    text = "\n".join(lines)
    assert "sliding_layers   head_dim 16, RoPE base 10000 over 16 dims (no rope_freqs)" in text
    assert "kv_heads         per layer [2, 1]" in text
    assert "values           K = V (no attn_v) on layers [1]; every V through an RMSNorm" in text

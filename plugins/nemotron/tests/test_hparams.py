"""Per-layer expert hparams (NVIDIA Puzzle) and llama.cpp's required keys: checklist items 38-41.

38. expert_used_count / expert_feed_forward_length: a scalar broadcasts, an array is read
    per layer and must have n_layer entries.
39. n_ff_exp(il) / n_expert_used(il) refuse a layer out of range; every key keeps its own
    required flag (a file llama.cpp rejects for a missing key is rejected, naming the key).
40. The MoE of each layer routes to that layer's own top-k.
41. 88 layers: heterogeneous top-k is typed 75B.A9B (Puzzle), uniform 120B.A12B (Super 3),
    as ``plinth info`` shows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.graph import Batch, HParamsError
from plinth.testing import load_module, new_cache


tiny = load_module(Path(__file__).parent / "tiny.py")
ARCH = "nemotron_h_moe"


@pytest.fixture
def registry(plinth_registry):
    from plinth_nemotron.plugin import plugin

    return plinth_registry(plugin)


def hparams(registry, md, source="x.gguf"):
    return registry.arch_hparams(md["general.architecture"], md, source)


# ---------------------------------------------------------------------------- 38

def test_scalar_expert_keys_broadcast_to_every_moe_layer(registry):
    hp = hparams(registry, tiny.metadata("MEME", top_k=3, n_ff_exp=20))
    assert [hp.n_expert_used(il) for il in (1, 3)] == [3, 3]
    assert [hp.n_ff_exp(il) for il in (1, 3)] == [20, 20]
    assert hp.n_expert_used_arr.uniform


def test_array_expert_keys_are_read_per_layer(registry):
    hp = hparams(registry, tiny.metadata("MEME*E", top_k=[0, 2, 0, 4, 0, 1], n_ff_exp=[0, 24, 0, 40, 0, 16]))
    assert [hp.n_expert_used(il) for il in range(6)] == [0, 2, 0, 4, 0, 1]
    assert [hp.n_ff_exp(il) for il in range(6)] == [0, 24, 0, 40, 0, 16]


@pytest.mark.parametrize("key", ["expert_used_count", "expert_feed_forward_length"])
def test_array_of_the_wrong_length_is_refused(registry, key):
    md = tiny.metadata("MEME")
    md[f"{ARCH}.{key}"] = [2, 2, 2]
    with pytest.raises(HParamsError, match=f"x.gguf: key '{ARCH}.{key}' has 3 entries, expected n_layer = 4"):
        hparams(registry, md)


def test_uniform_array_behaves_exactly_like_the_scalar(registry):
    scalar = tiny.metadata("ME*E", top_k=2, n_ff_exp=16, n_ff_shexp=24)
    array = tiny.metadata("ME*E", top_k=[2] * 4, n_ff_exp=[16] * 4, n_ff_shexp=[24] * 4)
    hs, gs, _ = tiny.build(registry, scalar, seed=3)
    ha, ga, _ = tiny.build(registry, array, seed=3)
    assert hs == ha
    tokens = list(range(20))
    ls = gs.forward(Batch.from_tokens(tokens, output="all"), new_cache(gs, hs.n_layer)).logits
    la = ga.forward(Batch.from_tokens(tokens, output="all"), new_cache(ga, ha.n_layer)).logits
    np.testing.assert_array_equal(ls, la)


def test_expert_width_falls_back_to_n_ff_over_top_k(registry):
    md = tiny.metadata("MEME", top_k=[0, 2, 0, 4])
    del md[f"{ARCH}.expert_feed_forward_length"]
    md[f"{ARCH}.feed_forward_length"] = [0, 64, 0, 64]
    hp = hparams(registry, md)
    assert (hp.n_ff_exp(1), hp.n_ff_exp(3)) == (32, 16)


# ---------------------------------------------------------------------------- 39

@pytest.mark.parametrize("accessor", ["n_ff_exp", "n_expert_used"])
@pytest.mark.parametrize("il", [4, 88, -1])
def test_accessors_refuse_a_layer_out_of_range(registry, accessor, il):
    hp = hparams(registry, tiny.metadata("MEME"))
    with pytest.raises(IndexError, match=rf"{accessor}\({il}\): layer out of range \(n_layer = 4\)"):
        getattr(hp, accessor)(il)
    assert getattr(hp, accessor)() == getattr(hp, accessor)(0)  # no argument: layer 0, as in llama.cpp


REQUIRED = ["context_length", "embedding_length", "block_count", "attention.layer_norm_rms_epsilon",
            "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count"]


@pytest.mark.parametrize("key", REQUIRED)
def test_a_file_missing_a_required_key_is_refused_naming_it(registry, tmp_path, key):
    from plinth.model import load_model
    from plinth.testing import write_gguf

    md = tiny.metadata("M*E-", top_k=[0, 0, 2, 0], n_ff_exp=[0, 0, 16, 0])
    good = tiny.write(tmp_path / "good.gguf", registry, md)
    assert load_model(good, registry=registry).arch == ARCH
    from plinth.gguf import GGUFFile

    tensors = {n: np.asarray(GGUFFile(good).raw(n)) for n in GGUFFile(good).tensors}
    del md[f"{ARCH}.{key}"]
    bad = write_gguf(tmp_path / "bad.gguf", md, tensors)
    with pytest.raises(HParamsError, match=f"{bad}: missing required key '{ARCH}.{key}'"):
        load_model(bad, registry=registry)


def test_expert_used_count_is_required_when_the_file_has_experts(registry):
    md = tiny.metadata("MEME")
    del md[f"{ARCH}.expert_used_count"]
    with pytest.raises(HParamsError, match=f"missing required key '{ARCH}.expert_used_count'"):
        hparams(registry, md)
    # optional keys stay optional: no expert width (fallback), no shared expert, no latent
    md = tiny.metadata("MEME")
    for key in ("expert_feed_forward_length", "expert_shared_feed_forward_length"):
        del md[f"{ARCH}.{key}"]
    hp = hparams(registry, md)
    assert hp.n_ff_exp(1) == 32 // 2 and hp.n_ff_shexp[1] == 0


def test_top_k_above_expert_count_is_refused(registry):
    with pytest.raises(HParamsError, match="has a layer using 9 experts, more than 'nemotron_h_moe.expert_count' = 6"):
        hparams(registry, tiny.metadata("MEME", top_k=[0, 2, 0, 9]))


# ---------------------------------------------------------------------------- 40

def dense_moe_reference(w, il, x, k, scale=2.0, latent=False):
    """All experts computed densely, masked to the top-k chosen by biased sigmoid scores."""
    b = f"blk.{il}."
    scores = 1.0 / (1.0 + np.exp(-(x @ w[b + "ffn_gate_inp.weight"].T)))
    chosen = np.argsort(-(scores + w[b + "exp_probs_b.bias"]), axis=1)[:, :k]
    z = x @ w[b + "ffn_latent_down.weight"].T if latent else x
    out = np.zeros((x.shape[0], z.shape[1]))
    for t in range(x.shape[0]):
        wt = scores[t, chosen[t]]
        wt = wt / wt.sum() * scale
        for e, we in zip(chosen[t], wt):
            h = np.maximum(z[t] @ w[b + "ffn_up_exps.weight"][e].T, 0.0) ** 2
            out[t] += we * (h @ w[b + "ffn_down_exps.weight"][e].T)
    if latent:
        out = out @ w[b + "ffn_latent_up.weight"].T
    sh = np.maximum(x @ w[b + "ffn_up_shexp.weight"].T, 0.0) ** 2 @ w[b + "ffn_down_shexp.weight"].T
    return out + sh


@pytest.mark.parametrize("latent", [0, 12])
def test_each_moe_layer_uses_its_own_top_k(registry, latent):
    md = tiny.metadata("EEEE", top_k=[1, 4, 2, 6], n_ff_exp=[8, 16, 24, 12], n_ff_shexp=[24, 8, 16, 24],
                       latent=latent)
    hp, graph, w = tiny.build(registry, md, seed=5)
    x = np.random.default_rng(0).standard_normal((7, hp.n_embd)).astype(np.float32)
    for il, k in enumerate([1, 4, 2, 6]):
        got = graph.moe(il, x)
        np.testing.assert_allclose(got, dense_moe_reference(w, il, x, k, latent=bool(latent)), atol=2e-5, rtol=1e-5)
        # and the answer depends on k: with another top-k it would differ
        other = dense_moe_reference(w, il, x, 3 if k != 3 else 2, latent=bool(latent))
        assert np.abs(got - other).max() > 1e-3


# ---------------------------------------------------------------------------- 41

def typed(registry, top_k):
    pattern = ("ME" * 44)
    md = tiny.metadata(pattern, top_k=top_k, n_expert=512)
    return hparams(registry, md)


def test_88_layers_typed_from_the_top_k_array(registry):
    assert typed(registry, 22).model_type == "120B.A12B"  # uniform (scalar) top-k: Super 3
    assert typed(registry, [0, 22] * 44).model_type == "75B.A9B"  # an array that varies: Puzzle
    assert typed(registry, [22] * 88).model_type == "120B.A12B"  # a uniform array is still uniform
    puzzle = [0 if i % 2 == 0 else (4, 6, 18, 22)[(i // 2) % 4] for i in range(88)]
    assert typed(registry, puzzle).model_type == "75B.A9B"
    small = hparams(registry, tiny.metadata("MEME"))
    assert small.model_type == "?B"


def test_plinth_info_shows_the_type(tmp_path, capsys):
    from plinth.cli import main
    from plinth.testing import write_gguf

    for top_k, label in ((22, "120B.A12B"), ([0, 22, 0, 4] * 22, "75B.A9B")):
        md = tiny.metadata("ME" * 44, top_k=top_k, n_embd=8, n_expert=512)
        path = write_gguf(tmp_path / f"{label}.gguf", md, {"token_embd.weight": np.zeros((96, 8), np.float32)})
        assert main(["--plugins", "nemotron", "info", "-m", str(path)]) == 0
        out = capsys.readouterr().out
        assert "architecture: nemotron_h_moe (plugin 'nemotron')" in out
        assert any(line.split() == ["model_type", label] for line in out.splitlines()), out


def test_llama_cpp_epsilon_key_is_accepted(registry):
    """llama.cpp's converter writes ``attention.layer_norm_epsilon`` (its loader requires that key and
    falls back to it for ``layer_norm_rms_epsilon``); plinth reads either, the RMS one first."""
    md = tiny.metadata("M*E-", top_k=[0, 0, 2, 0], n_ff_exp=[0, 0, 16, 0])
    rms = md.pop(f"{ARCH}.attention.layer_norm_rms_epsilon")
    md[f"{ARCH}.attention.layer_norm_epsilon"] = 3e-4
    assert hparams(registry, md).norm_eps == pytest.approx(3e-4)
    md[f"{ARCH}.attention.layer_norm_rms_epsilon"] = rms
    assert hparams(registry, md).norm_eps == pytest.approx(rms)
    del md[f"{ARCH}.attention.layer_norm_rms_epsilon"], md[f"{ARCH}.attention.layer_norm_epsilon"]
    with pytest.raises(HParamsError, match=r"missing required key .*layer_norm_rms_epsilon.*\(or .*layer_norm_epsilon"):
        hparams(registry, md)

"""DSpark drafts on a Gemma 4 backbone: the Gemma4DSparkModel export (llama.cpp's converter name; DeepSpec's
flat schema over a gemma4_text config) and a speculators export whose transformer_layer_config is gemma4_text,
converted by ``plinth convert`` and lossless on a tiny gemma4 target."""

from __future__ import annotations

import json

import numpy as np
import pytest

PROMPTS = [[3, 17, 42, 8, 23], [60, 2, 2, 2, 9, 31, 77, 4, 50, 12, 1]]
V, E, R = 257, 64, 8


@pytest.fixture(scope="module")
def gemma4_target(tmp_path_factory):
    pytest.importorskip("plinth_gemma")
    from plinth_dflash.testkit import tiny_gemma4_target

    return tiny_gemma4_target(tmp_path_factory.mktemp("g4") / "gemma4.gguf")


def heads(seed=0, conf_name="confidence_proj"):
    rng = np.random.default_rng(seed)
    return {"markov_head.markov_w1.weight": (0.5 * rng.standard_normal((V, R))).astype(np.float32),
            "markov_head.markov_w2.weight": (0.5 * rng.standard_normal((V, R))).astype(np.float32),
            f"{conf_name}.weight": (0.3 * rng.standard_normal((1, E + R))).astype(np.float32),
            f"{conf_name}.bias": np.array([0.1], dtype=np.float32)}


def gemma4_dspark_dir(tmp_path, name="g4dspark", *, markov_in_dflash_config=True, **kw):
    """A Gemma4DSparkModel folder as llama.cpp's converter reads one: full layers with K = V (llama.cpp requires
    both), the Markov keys in dflash_config, ``confidence_proj.*``, a tied head."""
    from plinth_dflash.testkit import hf_gemma4_draft_config, hf_gemma4_draft_tensors, write_safetensors

    kw.setdefault("layer_types", ["full_attention", "full_attention"])
    cfg = hf_gemma4_draft_config(n_vocab=V, mask_token=255, architecture="Gemma4DSparkModel", block_size=6,
                                 target_layer_ids=(0, 2), **kw)
    markov = {"markov_rank": R, "markov_head_type": "vanilla", "enable_confidence_head": True}
    (cfg["dflash_config"] if markov_in_dflash_config else cfg).update(markov)
    d = tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    t = hf_gemma4_draft_tensors(cfg, seed=4, own_embd=True)
    t.update(heads())
    write_safetensors(d / "model.safetensors", t)
    return d


def convert(d, out, cls="Gemma4DSparkConverter"):
    import plinth_dspark.convert as conv

    getattr(conv, cls)().convert(str(d), str(out), {})
    return out


def test_gemma4_dspark_export_converts_and_is_lossless(tmp_path, gemma4_target):
    from plinth.graph import NumpyBackend
    from plinth.testing.drafters import check_drafter_contract
    from plinth_dspark.drafter import make_dspark
    from plinth_dspark.format import load_dspark

    out = convert(gemma4_dspark_dir(tmp_path), tmp_path / "g4.gguf")
    f = load_dspark(out, NumpyBackend())
    hp, ds = f.draft.hparams, f.dspark
    assert hp.tied and hp.target_layers == (1, 3) and hp.kv_heads(0) == 1 and hp.hd(0) == 32
    assert ds.sample_from_anchor and ds.has_confidence_head and ds.rank == R
    assert "blk.0.attn_v.weight" not in f.draft.weights and "rope_freqs.weight" in f.draft.weights
    m = gemma4_target
    stats = check_drafter_contract(m, lambda: make_dspark(m, {"draft": str(out)}), PROMPTS, max_tokens=20, n_max=5)
    assert all(s.n_drafts > 0 for s in stats)


def test_speculators_dspark_over_a_gemma4_backbone(tmp_path, gemma4_target):
    """speculators' layout (transformer_layer_config, aux ids) with a gemma4_text backbone: sliding + full layers."""
    from plinth.testing.drafters import check_drafter_contract
    from plinth_dflash.testkit import hf_gemma4_draft_config, hf_gemma4_draft_tensors, write_safetensors
    from plinth_dspark.drafter import make_dspark

    flat = hf_gemma4_draft_config(n_vocab=V, mask_token=255, block_size=6)
    dc = flat.pop("dflash_config")
    cfg = {"speculators_model_type": "dspark", "architectures": ["DSparkDraftModel"],
           "transformer_layer_config": {k: v for k, v in flat.items() if k != "architectures"},
           "draft_vocab_size": V, "block_size": 6, "aux_hidden_state_layer_ids": [1, 3],
           "mask_token_id": 255, "speculators_version": "0.9.0", "markov_rank": R, "markov_head_type": "vanilla",
           "enable_confidence_head": True, "sample_from_anchor": False}
    d = tmp_path / "spec"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    t = hf_gemma4_draft_tensors({**flat, "dflash_config": dc}, seed=5)
    t.update(heads(conf_name="confidence_head.proj"))
    write_safetensors(d / "model.safetensors", t)
    out = convert(d, tmp_path / "spec.gguf", "SpeculatorsConverter")
    m = gemma4_target
    dr = make_dspark(m, {"draft": str(out)})
    assert dr.hp.target_layers == (1, 3) and dr.hp.swa_layers == (True, False) and not dr.ds.sample_from_anchor
    assert dr.head_source == "target"
    check_drafter_contract(m, lambda: make_dspark(m, {"draft": str(out)}), PROMPTS[:1], max_tokens=16, n_max=5)


def test_gemma4_dspark_refusals_are_named(tmp_path):
    from plinth.errors import UserError

    d = gemma4_dspark_dir(tmp_path, markov_in_dflash_config=False)
    cfg = json.loads((d / "config.json").read_text())
    for edit, match in ((dict(markov_head_type="gated"), "markov_head_type = 'gated'"),
                        (dict(draft_vocab_size=100), "reduced draft vocabulary"),
                        (dict(model_type="qwen3"), "model_type 'qwen3'")):
        (d / "config.json").write_text(json.dumps({**cfg, **edit}))
        with pytest.raises(UserError, match=match):
            convert(d, tmp_path / "x.gguf")


# ------------------------------------------------------------------ mlx-dspark's gemma4 family as the oracle

MLX_GOLDEN = __import__("pathlib").Path(__file__).parent / "golden" / "mlx_dspark_gemma4.npz"
TOL = 1e-4


def plinth_gemma4_case(folder, target, out_dir):
    from plinth.speculative.base import TargetOutput
    from plinth_dspark.convert import Gemma4DSparkConverter
    from plinth_dspark.drafter import make_dspark

    out = out_dir / f"{folder.name}.gguf"
    Gemma4DSparkConverter().convert(str(folder), str(out), {})
    dr = make_dspark(target, {"draft": str(out)})
    feats = np.load(folder / "feats.npy")
    case = json.loads((folder / "case.json").read_text())
    e, p = feats.shape[1] // 2, feats.shape[0]
    taps = dr.hp.target_layers
    dr.process(TargetOutput(seq=0, phase="prefill", tokens=np.zeros(p, np.int64), positions=np.arange(p),
                            features={taps[0]: feats[:, :e], taps[1]: feats[:, e:]}))
    return dr.block_outputs(0, case["anchor"], p, case["block"])


def compare_with_mlx(arrays, folders, target, out_dir):
    worst = 0.0
    for folder in folders:
        got = plinth_gemma4_case(folder, target, out_dir)
        np.testing.assert_array_equal(got["tokens"], arrays[f"{folder.name}/tokens"], err_msg=folder.name)
        for key in ("logits", "conf"):
            if f"{folder.name}/{key}" in arrays:
                d = float(np.abs(got[key] - arrays[f"{folder.name}/{key}"]).max())
                assert d < TOL, (folder.name, key, d)
                worst = max(worst, d)
            else:
                assert key not in got, folder.name
    return worst


def test_matches_mlx_dspark_gemma4_family(tmp_path, gemma4_target):
    """mlx-dspark 0.20.3's gemma4 drafter family (full layers of global_head_dim, K = V or v_proj, V norms,
    proportional RoPE, sandwich norms, layer_scalar) on the same checkpoints: chained tokens identical, biased
    logits and confidences within 1e-4 (golden file from scripts/check_mlx_dspark.py --gemma4)."""
    from plinth_dspark.testkit import write_gemma4_mlx_cases

    folders = write_gemma4_mlx_cases(tmp_path / "cases")
    z = np.load(MLX_GOLDEN)
    compare_with_mlx({k: z[k] for k in z.files}, folders, gemma4_target, tmp_path)


@pytest.mark.mlx_dspark
def test_live_mlx_dspark_gemma4_family(tmp_path, gemma4_target):
    import os
    import subprocess
    from pathlib import Path

    from plinth_dspark.testkit import write_gemma4_mlx_cases

    exe = os.environ.get("PLINTH_MLX_DSPARK_PYTHON")
    if not exe or not Path(exe).exists():
        pytest.skip("no mlx-dspark environment: make test-ref-mlx-dspark (sets PLINTH_MLX_DSPARK_PYTHON)")
    folders = write_gemma4_mlx_cases(tmp_path / "cases")
    out = tmp_path / "mlx.npz"
    script = Path(__file__).parents[1] / "scripts" / "check_mlx_dspark.py"
    res = subprocess.run([exe, str(script), str(tmp_path / "cases"), str(out), "--gemma4"], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    z = np.load(out)
    compare_with_mlx({k: z[k] for k in z.files}, folders, gemma4_target, tmp_path)


# ------------------------------------------------------------------ llama.cpp's own converter (files in the wild)

@pytest.mark.interop
@pytest.mark.ref
def test_llama_cpp_written_gemma4_dspark_file_drafts_as_plinths(tmp_path):
    """llama.cpp's convert_hf_to_gguf.py (Gemma4DSparkModel, --target-model-dir for the tokenizer) on the K = V
    case folder; plinth loads its file and drafts exactly what it drafts from its own converter's file (block
    logits, confidences, tokens), and the two files hold the same dflash keys with the same values (plinth's
    adds a few, listed below) and the same tensors."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from plinth.gguf import GGUFFile
    from plinth.speculative.base import TargetOutput
    from plinth.testing import load_module
    from plinth.testing.interop import llama_cpp_sources
    from plinth_dflash.testkit import tiny_target
    from plinth_dspark.convert import Gemma4DSparkConverter
    from plinth_dspark.drafter import make_dspark
    from plinth_dspark.testkit import write_gemma4_mlx_cases

    src = llama_cpp_sources()
    gemma_golden = Path(__file__).parents[2] / "gemma" / "tests" / "golden" / "make_golden.py"
    if src is None or not gemma_golden.exists():
        pytest.skip("needs the llama.cpp sources (llama-cpp-python 0.3.36 sdist) and plinth-gemma's test folders")
    pytest.importorskip("torch")  # llama.cpp's converter
    g = load_module(gemma_golden)
    tok_dir, _ = g.write_gemma_folder(sorted(g.CASES)[0], tmp_path / "target")  # a Gemma 4 tokenizer folder
    folder = write_gemma4_mlx_cases(tmp_path / "cases", n_vocab=g.GEMMA_N_VOCAB)[0]
    theirs, ours = tmp_path / "llama_cpp.gguf", tmp_path / "plinth.gguf"
    script = Path(__file__).parents[1] / "scripts" / "llama_cpp_convert.py"
    r = subprocess.run([sys.executable, str(script), str(src), str(folder), "--outfile", str(theirs), "--outtype",
                        "f32", "--target-model-dir", str(tok_dir)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, (r.stderr or r.stdout)[-3000:]
    Gemma4DSparkConverter().convert(str(folder), str(ours), {})
    a, b = GGUFFile(theirs), GGUFFile(ours)
    keys = lambda gf: {k: np.asarray(v).tolist() for k, v in gf.metadata.items() if k.startswith("dflash.")}  # noqa: E731
    ka, kb = keys(a), keys(b)
    # plinth's file adds its V-norm and tied keys, the early converter's mask key, the informational
    # target_hidden_size and vocab_size (llama.cpp's carries the vocabulary in its tokenizer keys)
    assert set(kb) - set(ka) <= {"dflash.attention.value_norm", "dflash.tie_word_embeddings", "dflash.mask_token_id",
                                 "dflash.vocab_size", "dflash.target_hidden_size"}, sorted(set(kb) - set(ka))
    for k in set(ka) & set(kb):
        assert ka[k] == pytest.approx(kb[k]) if isinstance(ka[k], float) else ka[k] == kb[k], k
    assert {n: tuple(i.shape) for n, i in a.tensors.items()} == {n: tuple(i.shape) for n, i in b.tensors.items()}
    target = tiny_target(tmp_path / "t.gguf", "qwen3", n_vocab=g.GEMMA_N_VOCAB, n_embd=64, n_layer=3, seed=2)
    feats = np.load(folder / "feats.npy")
    case = json.loads((folder / "case.json").read_text())
    outs = []
    for path in (theirs, ours):
        dr = make_dspark(target, {"draft": str(path)})
        dr.process(TargetOutput(seq=0, phase="prefill", tokens=np.zeros(len(feats), np.int64),
                                positions=np.arange(len(feats)), features={1: feats[:, :64], 3: feats[:, 64:]}))
        outs.append(dr.block_outputs(0, case["anchor"], len(feats), case["block"]))
    for key in ("logits", "conf", "tokens"):
        np.testing.assert_array_equal(outs[0][key], outs[1][key], err_msg=key)


def test_plinth_convert_takes_gemma4_drafts(tmp_path, plinth_registry):
    """`plinth convert` (the registry's converters by `architectures`) on a Gemma4DSparkModel export and on a
    DFlashDraftModel whose decoder is gemma4_text (which plinth refused before: 'only the Qwen3-style DFlash
    backbone is supported')."""
    from plinth.convert import convert as plinth_convert
    from plinth.gguf import GGUFFile
    from plinth_dflash.plugin import plugin as dflash_plugin
    from plinth_dflash.testkit import write_hf_gemma4_draft
    from plinth_dspark.plugin import plugin as dspark_plugin

    reg = plinth_registry(dflash_plugin, dspark_plugin)
    out = plinth_convert(gemma4_dspark_dir(tmp_path), tmp_path / "dspark.gguf", registry=reg)
    assert "markov_w1.weight" in GGUFFile(out).tensors
    hf = write_hf_gemma4_draft(tmp_path / "dflash", n_vocab=V, mask_token=255)
    gf = GGUFFile(plinth_convert(hf, tmp_path / "dflash.gguf", registry=reg))
    assert bool(gf.metadata["dflash.attention.value_norm"]) and "rope_freqs.weight" in gf.tensors

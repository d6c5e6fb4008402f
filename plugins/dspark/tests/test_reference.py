"""Against speculators 0.9.0's DSparkDraftModel: biased draft logits, confidences and chained tokens.

The golden file (``tests/golden/speculators_dspark.npz``, made by ``scripts/make_golden.py`` in the speculators
environment) holds 24 cases: block sizes 4, 7, 16 x anchor-first / 1+N x full / reduced draft vocabulary x
with / without a confidence head, the weights under speculators' checkpoint names, random context features,
an anchor, and the oracle's outputs. Each case here: the weights written as a speculators checkpoint folder
-> ``plinth convert`` (SpeculatorsConverter) -> DSpark GGUF -> the drafter fed the same features -> one block.
The ``speculators`` test rebuilds the golden file with the live package and compares it with the committed one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).parent / "golden" / "speculators_dspark.npz"
SCRIPT = Path(__file__).parents[1] / "scripts" / "make_golden.py"
TOL = 1e-4


def load_golden(path: Path = GOLDEN) -> tuple[dict, dict]:
    z = np.load(path)
    meta = json.loads(bytes(z["meta_json"]).decode())
    return {k: z[k] for k in z.files if k != "meta_json"}, meta


@pytest.fixture(scope="module")
def golden():
    return load_golden()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from plinth_dflash.testkit import tiny_target

    return tiny_target(tmp_path_factory.mktemp("t") / "qwen3.gguf", "qwen3", n_vocab=64, n_embd=32, n_layer=3, seed=3)


def write_checkpoint(folder: Path, arrays: dict, meta: dict, case: str) -> Path:
    """The case as a speculators checkpoint folder (config.json + model.safetensors)."""
    from plinth_dflash.testkit import write_safetensors

    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(meta[case]["config"])
    (folder / "config.json").write_text(json.dumps(cfg))
    t = {}
    for prefix in ("backbone/w/", f"{case}/w/"):
        for k, v in arrays.items():
            if k.startswith(prefix):
                name = k[len(prefix):]
                if name.startswith("verifier_") or name == "t2d":
                    continue
                t[name] = v.astype(np.float32) if v.dtype == np.float16 else v.astype(np.int64)
    write_safetensors(folder / "model.safetensors", t)
    return folder


def run_case(tmp_path: Path, arrays: dict, meta: dict, case: str, target) -> dict:
    from plinth.speculative.base import TargetOutput
    from plinth_dspark.convert import SpeculatorsConverter
    from plinth_dspark.drafter import make_dspark

    ckpt = write_checkpoint(tmp_path / case, arrays, meta, case)
    out = tmp_path / f"{case}.gguf"
    SpeculatorsConverter().convert(str(ckpt), str(out), {})
    dr = make_dspark(target, {"draft": str(out)})
    feats = arrays[f"{case}/feats"]
    e = feats.shape[1] // 2
    p = feats.shape[0]
    taps = dr.hp.target_layers
    dr.process(TargetOutput(seq=0, phase="prefill", tokens=np.zeros(p, dtype=np.int64), positions=np.arange(p),
                            features={taps[0]: feats[:, :e], taps[1]: feats[:, e:]}))
    anchor = int(arrays[f"{case}/anchor"][0])
    n = int(arrays[f"{case}/tokens"].shape[0])
    return dr.block_outputs(0, anchor, p, n)


def test_golden_covers_the_matrix(golden):
    _, meta = golden
    seen = {(m["block_size"], m["sample_from_anchor"], m["draft_vocab_size"] < 64, m["conf"]) for m in meta.values()}
    assert seen == {(b, af, red, c) for b in (4, 7, 16) for af in (True, False) for red in (True, False)
                    for c in (True, False)}


def test_matches_speculators(tmp_path, golden, target):
    arrays, meta = golden
    worst = 0.0
    for case in sorted(meta):
        got = run_case(tmp_path, arrays, meta, case, target)
        want_tokens = arrays[f"{case}/tokens"]
        np.testing.assert_array_equal(got["tokens"], want_tokens, err_msg=case)
        d = float(np.abs(got["logits"] - arrays[f"{case}/logits"]).max())
        assert d < TOL, (case, d)
        worst = max(worst, d)
        if meta[case]["conf"]:
            dc = float(np.abs(got["conf"] - arrays[f"{case}/conf"]).max())
            assert dc < TOL, (case, dc)
        else:
            assert "conf" not in got
    print(f"max |logit diff| over {len(meta)} cases: {worst:.2e}")


def speculators_python() -> str | None:
    """The speculators environment's interpreter, from PLINTH_SPECULATORS_PYTHON (set by make test-ref-speculators);
    the live tests take a minute or two, so they never run by accident."""
    exe = os.environ.get("PLINTH_SPECULATORS_PYTHON")
    return exe if exe and Path(exe).exists() else None


def rebuild_golden(tmp_path: Path, flag: str) -> Path:
    """Run the golden maker with ``flag`` in the speculators environment; the file it wrote (skip without one)."""
    exe = speculators_python()
    if exe is None:
        pytest.skip("no speculators environment: make test-ref-speculators (sets PLINTH_SPECULATORS_PYTHON)")
    out = tmp_path / "golden.npz"
    subprocess.run([exe, str(SCRIPT), str(out), flag], check=True, timeout=600,
                   env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    return out


@pytest.mark.speculators
def test_live_speculators_rebuilds_the_golden_file(tmp_path):
    new, meta_new = load_golden(rebuild_golden(tmp_path, "--check-training"))
    old, meta_old = load_golden()
    assert meta_new.keys() == meta_old.keys()
    for k in old:
        if k.endswith("/tokens"):
            np.testing.assert_array_equal(new[k], old[k], err_msg=k)
        else:
            np.testing.assert_allclose(new[k].astype(np.float64), old[k].astype(np.float64), atol=TOL, err_msg=k)


# ---------------------------------------------------------------------------- speculators' DFlash / DFlash2

DFLASH_GOLDEN = Path(__file__).parent / "golden" / "speculators_dflash.npz"


def run_dflash_case(tmp_path: Path, arrays: dict, meta: dict, case: str, target) -> np.ndarray:
    """speculators checkpoint folder -> plinth-dflash's converter -> DFlashDrafter: logits of rows 1..B-1."""
    from plinth.speculative.base import TargetOutput
    from plinth_dflash.convert import DFlash2Converter, DFlashConverter
    from plinth_dflash.drafter import make_dflash

    folder = write_checkpoint(tmp_path / case, arrays, meta, case)
    out = tmp_path / f"{case}.gguf"
    (DFlash2Converter if meta[case]["kind"] == "dflash2" else DFlashConverter)().convert(str(folder), str(out), {})
    dr = make_dflash(target, {"draft": str(out)})
    feats = arrays[f"{case}/feats"]
    e, p = feats.shape[1] // 2, feats.shape[0]
    taps = dr.hp.target_layers
    dr.process(TargetOutput(seq=0, phase="prefill", tokens=np.zeros(p, dtype=np.int64), positions=np.arange(p),
                            features={taps[0]: feats[:, :e], taps[1]: feats[:, e:]}))
    b = meta[case]["block_size"]
    return np.asarray(dr.draft_logits(0, int(arrays[f"{case}/anchor"][0]), p, b - 1))


def test_plinth_dflash_matches_speculators_dflash_and_dflash2(tmp_path, target):
    """Block logits (1+N layout, full blocks) of speculators' DFlash and DFlash2 (before DFlash2's selector)."""
    arrays, meta = load_golden(DFLASH_GOLDEN)
    assert {m["kind"] for m in meta.values()} == {"dflash", "dflash2"}
    for case in sorted(meta):
        got = run_dflash_case(tmp_path, arrays, meta, case, target)
        want = arrays[f"{case}/logits"]
        assert float(np.abs(got - want).max()) < TOL, (case, float(np.abs(got - want).max()))
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1), err_msg=case)


@pytest.mark.speculators
def test_live_speculators_rebuilds_the_dflash_golden_file(tmp_path):
    new, _ = load_golden(rebuild_golden(tmp_path, "--dflash"))
    old, _ = load_golden(DFLASH_GOLDEN)
    for k in old:
        np.testing.assert_allclose(new[k].astype(np.float64), old[k].astype(np.float64), atol=TOL, err_msg=k)


@pytest.mark.mlx_dspark
def test_mlx_dspark_agrees_with_the_golden_file():
    """The second, independent oracle (mlx-dspark 0.20.3 on mlx[cpu] 0.32.4) on the same 24 cases."""
    exe = os.environ.get("PLINTH_MLX_DSPARK_PYTHON")
    if not exe or not Path(exe).exists():
        pytest.skip("no mlx-dspark environment: make test-ref-mlx-dspark (sets PLINTH_MLX_DSPARK_PYTHON)")
    script = Path(__file__).parents[1] / "scripts" / "check_mlx_dspark.py"
    res = subprocess.run([exe, str(script), str(GOLDEN)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "24/24 cases agree" in res.stdout


# ---------------------------------------------------------------------------- a Gemma 4 verifier's draft

GEMMA4_VERIFIER_GOLDEN = Path(__file__).parent / "golden" / "speculators_gemma4_verifier.npz"


def test_matches_speculators_drafts_for_a_gemma4_verifier(tmp_path, target):
    """speculators' draft for a Gemma 4 verifier (its own create_transformer_layer_config: Qwen3 layers with
    gelu_pytorch_tanh, the verifier's sliding head size 16 != E / heads, a sliding then a full layer) through
    speculators' own masks: the sliding layer causal within the block or not (sliding_window_non_causal),
    anchor-first and 1+N, full and reduced vocabularies. Tokens identical, logits and confidences within 1e-4."""
    arrays, meta = load_golden(GEMMA4_VERIFIER_GOLDEN)
    assert {m["config"]["transformer_layer_config"]["hidden_act"] for m in meta.values()} == {"gelu_pytorch_tanh"}
    assert {tuple(m["config"]["transformer_layer_config"]["layer_types"]) for m in meta.values()} == {
        ("sliding_attention", "full_attention")}
    for case in sorted(meta):
        got = run_case(tmp_path, arrays, meta, case, target)
        np.testing.assert_array_equal(got["tokens"], arrays[f"{case}/tokens"], err_msg=case)
        for key in ("logits", "conf"):
            d = float(np.abs(got[key] - arrays[f"{case}/{key}"]).max())
            assert d < TOL, (case, key, d)


@pytest.mark.speculators
def test_live_speculators_rebuilds_the_gemma4_verifier_golden_file(tmp_path):
    new, _ = load_golden(rebuild_golden(tmp_path, "--gemma4-verifier"))
    old, _ = load_golden(GEMMA4_VERIFIER_GOLDEN)
    assert new.keys() == old.keys()
    for k in old:
        np.testing.assert_allclose(new[k].astype(np.float64), old[k].astype(np.float64), atol=TOL, err_msg=k)

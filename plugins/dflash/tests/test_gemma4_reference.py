"""Gemma 4 draft backbones against transformers' Gemma 4 modules (:mod:`plinth_dflash.reference_gemma4`).

Each case: an HF draft folder of random weights (every norm, the layer scalar and the projections drawn; nothing
left at transformers' 0 / 1 initial values) -> ``plinth convert`` -> GGUF -> ``DFlashDrafter`` on a tiny gemma4
target, fed random target features for a prompt, then a verify batch of which part is accepted; each block's
draft logits against the reference given the rows plinth keeps: within 1e-4, the same argmax. Marker ``ref``
(torch + transformers); the default suite has the same cases' golden outputs (``golden/gemma4_reference.npz``,
``scripts/make_golden.py --gemma4``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth_dflash.reference_gemma4 import BLOCKS, CASES, build_case, plinth_rounds, reference_rounds, rounds_inputs

GOLDEN = Path(__file__).parent / "golden" / "gemma4_reference.npz"
TOL = 1e-4

@pytest.fixture(scope="module")
def gemma4_target(tmp_path_factory):
    pytest.importorskip("plinth_gemma")
    from plinth_dflash.testkit import tiny_gemma4_target

    return tiny_gemma4_target(tmp_path_factory.mktemp("g4ref") / "gemma4.gguf")


def _check(ours, theirs, where):
    worst = 0.0
    for (_, _, a), b in zip(ours, theirs):
        assert a.shape == b.shape, where
        worst = max(worst, float(np.abs(a - b).max()))
        np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1), err_msg=where)
    assert worst < TOL, f"{where}: max |logit difference| {worst:.2e}"
    return worst


@pytest.mark.ref
@pytest.mark.parametrize("name, cfg_kw, extra", CASES, ids=[c[0] for c in CASES])
def test_live_gemma4_reference(tmp_path, gemma4_target, name, cfg_kw, extra):
    pytest.importorskip("torch")
    pytest.importorskip("transformers.models.gemma4")
    from plinth_dflash.reference_gemma4 import Gemma4DraftReference

    hf, path = build_case(tmp_path, name, cfg_kw, extra)
    ref = Gemma4DraftReference(hf)
    for bi, block in enumerate(BLOCKS):
        inputs = rounds_inputs(100 * bi + len(name))
        _check(plinth_rounds(gemma4_target, path, block, inputs), reference_rounds(ref, gemma4_target, block, inputs),
               f"{name} block {block}")


@pytest.mark.parametrize("name, cfg_kw, extra", CASES, ids=[c[0] for c in CASES])
def test_golden_gemma4_reference(tmp_path, gemma4_target, name, cfg_kw, extra):
    """The reference's logits stored by scripts/make_golden.py --gemma4 (no torch needed)."""
    g = np.load(GOLDEN)
    _, path = build_case(tmp_path, name, cfg_kw, extra)
    for bi, block in enumerate(BLOCKS):
        inputs = rounds_inputs(100 * bi + len(name))
        theirs = [g[f"{name}/b{block}/r{r}"] for r in range(2)]
        _check(plinth_rounds(gemma4_target, path, block, inputs), theirs, f"{name} block {block} (golden)")

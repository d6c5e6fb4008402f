"""Regenerate tests/golden/reference_*.npz: the z-lab ``dflash`` torch reference on tiny random weights.

    pip install torch==2.13.0 transformers==5.24.0 && pip install --no-deps dflash==0.1.0
    python plugins/dflash/scripts/make_golden.py

For DFlash and DFlash2 drafts (converted by plinth's converter from the HF folder the
reference loads), 5 prompts and block sizes 4, 8, 16, 3 draft/verify rounds each: the
reference's draft logits, drafted tokens and accepted lengths. The default test suite
replays the same rounds in plinth and compares (logits to 1e-4, tokens exactly).

    python plugins/dflash/scripts/make_golden.py --gemma4

writes tests/golden/gemma4_reference.npz instead: the Gemma 4 backbone cases of
``plinth_dflash.reference_gemma4`` (transformers' Gemma 4 modules; needs plinth-gemma for the target).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def gemma4() -> int:
    from plinth_dflash.reference_gemma4 import (BLOCKS, CASES, Gemma4DraftReference, build_case, reference_rounds,
                                                rounds_inputs)
    from plinth_dflash.testkit import tiny_gemma4_target

    path = HERE.parent / "tests" / "golden" / "gemma4_reference.npz"
    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        target = tiny_gemma4_target(Path(tmp) / "gemma4.gguf")
        for name, cfg_kw, extra in CASES:
            hf, _ = build_case(Path(tmp), name, cfg_kw, extra)
            ref = Gemma4DraftReference(hf)
            for bi, block in enumerate(BLOCKS):
                for r, logits in enumerate(reference_rounds(ref, target, block, rounds_inputs(100 * bi + len(name)))):
                    arrays[f"{name}/b{block}/r{r}"] = logits.astype(np.float32)
    np.savez_compressed(path, **arrays)
    print(f"{path}: {len(arrays)} arrays, {path.stat().st_size} bytes")
    return 0


def main() -> int:
    if "--gemma4" in sys.argv[1:]:
        return gemma4()
    import plinth
    from plinth.testing import make_registry
    from plinth_dflash.reference import hf_draft, hf_target, reference_rounds
    from plinth_dflash.testkit import REF_BLOCKS, REF_ROUNDS, reference_case, reference_prompts

    out_dir = HERE.parent / "tests" / "golden"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("dflash", "dflash2"):
            case = reference_case(tmp, variant)
            tgt = plinth.load_model(case["target"], registry=make_registry("llama"))
            ht, hd = hf_target(tgt), hf_draft(case["hf"])
            arrays: dict[str, np.ndarray] = {}
            for pi, prompt in enumerate(reference_prompts()):
                arrays[f"p{pi}.prompt"] = np.asarray(prompt, dtype=np.int64)
                for b in REF_BLOCKS:
                    for ri, r in enumerate(reference_rounds(ht, hd, prompt, b, REF_ROUNDS)):
                        key = f"p{pi}.b{b}.r{ri}"
                        arrays[key + ".logits"] = r["logits"].astype(np.float32)
                        arrays[key + ".tokens"] = r["tokens"].astype(np.int64)
                        arrays[key + ".meta"] = np.asarray([r["accepted"], r["start"]], dtype=np.int64)
            path = out_dir / f"reference_{variant}.npz"
            np.savez_compressed(path, **arrays)
            print(f"{path}: {len(arrays)} arrays, {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Second oracle: mlx-dspark 0.20.3 (mlx[cpu] 0.32.4, its own venv) on the speculators golden cases.

    python3 -m venv .venv-mlx && .venv-mlx/bin/pip install "mlx[cpu]==0.32.4" mlx-dspark==0.20.3
    .venv-mlx/bin/python plugins/dspark/scripts/check_mlx_dspark.py plugins/dspark/tests/golden/speculators_dspark.npz

Each case of the golden file (made from speculators' DSparkDraftModel) is written as a speculators
checkpoint folder, loaded with ``mlx_dspark.load.load_drafter(path, quantize=False)`` and run through
mlx-dspark's own pieces (update_context -> embed -> backbone -> head_slice -> compute_logits ->
sample_block -> markov step_bias -> confidence_logits); its chained tokens must equal the golden ones and
its biased logits / confidences lie within 1e-4. plinth-dspark is checked against the same golden file in
tests/test_reference.py, so agreement here makes the three implementations agree. Prints one line per case
and exits non-zero on a mismatch.

    .venv-mlx/bin/python plugins/dspark/scripts/check_mlx_dspark.py FOLDERS OUT.npz --gemma4

runs mlx-dspark's Gemma 4 drafter family on the checkpoint folders plinth-dspark's test writes and stores
its outputs (tests/test_gemma4.py compares plinth with them).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

TOL = 1e-4


def main(golden: str) -> int:
    import mlx.core as mx
    from mlx_dspark.load import load_drafter

    z = np.load(golden)
    meta = json.loads(bytes(z["meta_json"]).decode())
    worst, bad = 0.0, 0
    tmp = Path(tempfile.mkdtemp())
    for case in sorted(meta):
        folder = tmp / case
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(meta[case]["config"]))
        w = {}
        for prefix in ("backbone/w/", f"{case}/w/"):
            for k in z.files:
                if k.startswith(prefix):
                    v = z[k]
                    w[k[len(prefix):]] = mx.array(v.astype(np.float32) if v.dtype == np.float16 else v)
        mx.save_safetensors(str(folder / "model.safetensors"), w)
        drafter, _ = load_drafter(str(folder), quantize=False)
        feats = z[f"{case}/feats"]
        anchor = int(z[f"{case}/anchor"][0])
        want_tokens, want_logits = z[f"{case}/tokens"], z[f"{case}/logits"]
        n = int(want_tokens.shape[0])
        caches = drafter.make_ctx_cache()
        drafter.update_context(mx.array(feats)[None], 0, caches)
        b = int(meta[case]["block_size"])
        ids = [anchor] + [int(meta[case]["config"]["mask_token_id"])] * (b - 1)
        hidden = drafter.backbone(drafter.embed(mx.array(ids)[None]), feats.shape[0], caches)
        hs = drafter.head_slice(hidden, n)[0]
        base = drafter.compute_logits(hs)
        toks = np.array(drafter.sample_block(base, anchor)).astype(np.int64)
        prev = mx.array(np.concatenate([[anchor], toks[:-1]]).astype(np.int32))
        logits = np.array(base + drafter.markov_head.step_bias(prev))
        d = float(np.abs(logits - want_logits).max())
        ok = np.array_equal(toks, want_tokens) and d < TOL
        msg = f"{case}: tokens {'identical' if np.array_equal(toks, want_tokens) else 'DIFFER'}, max |logit diff| {d:.2e}"
        if meta[case]["conf"]:
            conf = np.array(mx.sigmoid(drafter.confidence_logits(hs, prev)))
            dc = float(np.abs(conf - z[f"{case}/conf"]).max())
            ok = ok and dc < TOL
            msg += f", max |conf diff| {dc:.2e}"
        print(msg)
        worst = max(worst, d)
        bad += not ok
    print(f"{len(meta) - bad}/{len(meta)} cases agree; max |logit diff| {worst:.2e}")
    return 1 if bad else 0


def gemma4(folders: str, out: str) -> int:
    """mlx-dspark's gemma4 family (DeepSpec-schema Gemma 4 DSpark heads: full layers of ``global_head_dim``,
    K = V or not, V norms, proportional RoPE, sandwich norms, layer_scalar, embeddings times sqrt(E)) on the
    checkpoint folders plinth's test writes (``plinth_dspark.testkit.write_gemma4_mlx_cases``; each holds
    ``feats.npy`` and ``case.json`` with the anchor and the block length). Writes ``<case>/logits`` (biased),
    ``<case>/tokens`` and ``<case>/conf`` to ``out``."""
    import mlx.core as mx
    from mlx_dspark.load import load_drafter

    arrays = {}
    for folder in sorted(Path(folders).iterdir()):
        if not (folder / "case.json").exists():
            continue
        case = json.loads((folder / "case.json").read_text())
        drafter, _ = load_drafter(str(folder), quantize=False)
        assert drafter.config.family == "gemma4", drafter.config.family
        feats = np.load(folder / "feats.npy")
        anchor, b = int(case["anchor"]), int(case["block"])
        caches = drafter.make_ctx_cache()
        drafter.update_context(mx.array(feats)[None], 0, caches)
        ids = [anchor] + [int(case["mask"])] * (b - 1)
        hidden = drafter.backbone(drafter.embed(mx.array(ids)[None]), feats.shape[0], caches)
        hs = drafter.head_slice(hidden, b)[0]
        base = drafter.compute_logits(hs)
        toks = np.array(drafter.sample_block(base, anchor)).astype(np.int64)
        prev = mx.array(np.concatenate([[anchor], toks[:-1]]).astype(np.int32))
        arrays[f"{folder.name}/logits"] = np.array(base + drafter.markov_head.step_bias(prev))
        arrays[f"{folder.name}/tokens"] = toks
        if drafter.confidence_head is not None:
            arrays[f"{folder.name}/conf"] = np.array(mx.sigmoid(drafter.confidence_logits(hs, prev)))
        print(f"{folder.name}: {b} rows, tokens {toks.tolist()}")
    np.savez_compressed(out, **arrays)
    print(f"wrote {out}: {len({k.split('/')[0] for k in arrays})} gemma4 cases")
    return 0


if __name__ == "__main__":
    if "--gemma4" in sys.argv:
        sys.exit(gemma4(sys.argv[1], sys.argv[2]))
    sys.exit(main(sys.argv[1]))

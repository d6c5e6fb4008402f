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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""Nemotron-H part 2: the MTP head as a drafter, and image input (preprocessing + vision tower).

Usage: python benchmarks/bench_nemotron_vl.py [--threads 2] [--runs 3]

MTP: the random ~100M-parameter Nemotron-H MoE of bench_nemotron.py plus an MTP head (attention
+ MoE, Puzzle-style ``mtp_block_configs``), written as an HF folder and converted by ``plinth
convert``. Printed: one target decode step, one MTP head step (a draft token) and their ratio,
and plain greedy decode speed. (Acceptance with random weights says nothing about a trained
head, so it is not measured here; the head-step cost is the figure that carries over.)

Image: a 1024x768 PNG made here goes through Pillow preprocessing (resize to a 48x64 patch grid
of 16-pixel patches) and a random RADIO-style tower (hidden 384, 6 layers, 6 heads; the
released tower is 1280 wide with 32 layers) plus the projector, giving 768 embedding rows of
width 768. Printed: preprocessing time, tower time, and the prefill of those rows in the text
model (a mixed batch of 768 image rows + 8 token rows).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import numpy as np

    from plinth.convert import convert
    from plinth.graph import Batch
    from plinth.model import load_model
    from plinth.testing import make_registry
    from plinth_nemotron.vision import VisionConfig, VisionTower, image_prompt, load_image, preprocess, tensor_shapes

    import bench_nemotron as bn

    golden = bn._maker()
    config = dict(bn.CONFIG, architectures=["NemotronHPuzzleForCausalLM"], num_nextn_predict_layers=1,
                  block_configs=[{"block_type": {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}[c]}
                                 for c in bn.CONFIG["hybrid_override_pattern"]],
                  mtp_block_configs=[{"block_type": "attention"}, {"block_type": "moe"}])
    reg = make_registry("nemotron")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        folder.mkdir()
        import json

        (folder / "config.json").write_text(json.dumps(config))
        golden.write_safetensors(folder / "model.safetensors", golden.hf_random_state(config, 1))
        convert(folder, Path(tmp) / "m.gguf", registry=reg)
        model = load_model(Path(tmp) / "m.gguf", registry=reg)
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, 24000, 64).tolist()

        # one target step and one head step
        ctx = model.new_context(taps=(model.hparams.n_layer,))
        head = model.target_view().draft_head("mtp")
        out = ctx.forward(Batch.from_tokens(prompt, output="all"))
        feats = out.features[model.hparams.n_layer]
        hcache = head.new_cache()
        head.run(Batch.from_tokens(prompt[1:] + [1], output="all"), head.target_rows(feats), hcache)
        best_t = best_h = float("inf")
        for _ in range(args.runs):
            snap, hs = ctx.cache.snapshot(0), hcache.snapshot(0)
            t0 = time.perf_counter()
            ctx.decode([5])
            best_t = min(best_t, time.perf_counter() - t0)
            ctx.cache.restore(snap)
            t0 = time.perf_counter()
            head.run(Batch.from_tokens([5], start=64), head.target_rows(feats[-1:]), hcache)
            best_h = min(best_h, time.perf_counter() - t0)
            hcache.restore(hs)
        print(f"target decode step {best_t * 1e3:.1f} ms; MTP head step {best_h * 1e3:.1f} ms "
              f"({best_h / best_t:.2f} target steps)")

        n = 32
        ctx2 = model.new_context()
        tok = int(np.argmax(ctx2.decode(prompt).logits[-1]))
        t0 = time.perf_counter()
        for _ in range(n):
            tok = int(np.argmax(ctx2.decode([tok]).logits[-1]))
        print(f"plain greedy decode: {n / (time.perf_counter() - t0):.1f} tok/s")

    # image input
    cfg = VisionConfig(n_embd=384, n_layer=6, n_head=6, n_ff=1536, patch_size=16, n_prefix=10, max_grid=128,
                       text_n_embd=768, projector_n_ff=1536, final_norm=True)
    wrng = np.random.default_rng(3)
    tower = VisionTower(cfg, {k: (0.05 * wrng.standard_normal(s) + (1.0 if "ln" in k or "norm" in k else 0.0))
                              .astype(np.float32) for k, s in tensor_shapes(cfg).items()})
    from PIL import Image

    with tempfile.TemporaryDirectory() as tmp:
        yy, xx = np.mgrid[0:768, 0:1024]
        Image.fromarray(np.stack([xx % 256, yy % 256, (xx + yy) % 256], -1).astype(np.uint8)).save(f"{tmp}/a.png")
        best_p = best_v = best_f = float("inf")
        for _ in range(args.runs):
            t0 = time.perf_counter()
            x = preprocess(load_image(f"{tmp}/a.png"), cfg)
            best_p = min(best_p, time.perf_counter() - t0)
            t0 = time.perf_counter()
            rows = tower.embed(x)
            best_v = min(best_v, time.perf_counter() - t0)
            t0 = time.perf_counter()
            model.new_context().forward(image_prompt([1, 2, 3, 4], rows, [5, 6, 7, 8], n_ctx=4096))
            best_f = min(best_f, time.perf_counter() - t0)
    print(f"image 1024x768 -> grid {x.grid[0]}x{x.grid[1]} -> {rows.shape[0]} rows: preprocess {best_p * 1e3:.0f} ms, "
          f"tower + projector {best_v:.2f} s, text prefill of the mixed prompt {best_f:.2f} s")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()

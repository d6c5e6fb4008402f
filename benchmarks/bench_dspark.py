"""DSpark on SmolLM2-135M: the draft step against DFlash at the same block size (what the Markov chain and
the confidence head add), and the end-to-end speedup under synthetic acceptance with and without
confidence pruning.

    OPENBLAS_NUM_THREADS=2 python benchmarks/bench_dspark.py [--runs 7] [--blocks 4,8,16]
    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_dspark.py --clock cpu   # on a loaded machine

Both drafters are random (no trained draft for SmolLM2 exists) and share one backbone: the target's width
(576), ``--draft-layers`` Qwen3-style layers, 9 query / 3 KV heads, taps [2, 10, 20, 30]; DSpark adds a
rank ``--rank`` Markov head over the full vocabulary (49152) and a confidence head. The two draft steps are
timed interleaved (dflash, dspark, dflash, ...), best of ``--runs``, at a 64-token context, so load from
other jobs hits both alike; the figure that matters is the ratio.

End to end: ``SpeculativeGenerator`` with ``SpecConfig(synthetic_accept=rate)`` (each drafted position kept
with probability ``rate``; costs are real, the output is not the model's) against plain greedy decoding,
DSpark anchor-first with n_max = B, once with p_min = 0 and once with ``--p-min`` (the confidence head cuts
drafts, so fewer rows are verified).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

CLOCK = time.perf_counter


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--rank", type=int, default=64, help="Markov rank (default 64: R/E ~ 0.11 as in DeepSpec's "
                    "Qwen3-4B draft, R 256 / E 2560)")
    ap.add_argument("--head-scale", type=float, default=0.05,
                    help="std of the random Markov tables (0.05: the bias corrects the backbone's logits, as a "
                    "trained head does; 0.5: the bias dominates, every guess of the chain is wrong)")
    ap.add_argument("--draft-layers", type=int, default=3)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--rates", default="0.7,0.9")
    ap.add_argument("--p-min", type=float, default=None,
                    help="pruning threshold (default: the median confidence of a probe draft, so about half the "
                    "positions of a draft fall below it)")
    ap.add_argument("--e2e-block", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: process CPU time (robust on a shared, loaded machine; run with OPENBLAS_NUM_THREADS=1)")
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter

    import numpy as np

    import plinth
    from plinth.graph import Batch
    from plinth.generate import Generator
    from plinth.speculative.base import TargetOutput
    from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
    from plinth_dflash.drafter import make_dflash
    from plinth_dflash.testkit import write_tiny_draft
    from plinth_dspark.drafter import make_dspark
    from plinth_dspark.testkit import write_tiny_dspark

    print(f"clock: {args.clock}; load average at start: {os.getloadavg()[0]:.2f} (machine shared with other jobs)")
    model = plinth.load_model(args.model)
    hp = model.hparams
    blocks = [int(b) for b in args.blocks.split(",")]
    prompt = model.tokenizer.encode("Write a short story about a lighthouse keeper who finds a message in a "
                                    "bottle. The story should be about one paragraph long and end well.")
    prompt = (prompt * 4)[:64]
    tmp = Path(tempfile.mkdtemp())
    geo = dict(n_embd=hp.n_embd, n_vocab=model.n_vocab, n_layer=args.draft_layers, n_head=9, n_head_kv=3,
               n_ff=int(hp.n_ff[0]), taps=(2, 10, 20, hp.n_layer), block_size=max(blocks), mask_token=0, scale=0.05)
    p_flash = write_tiny_draft(tmp / "dflash.gguf", "dflash", seed=1, **geo)
    p_spark = write_tiny_dspark(tmp / "dspark.gguf", seed=1, rank=args.rank, sample_from_anchor=False,
                               head_scale=args.head_scale, **geo)
    drafters = {"dflash": make_dflash(model, {"draft": str(p_flash)}),
                "dspark": make_dspark(model, {"draft": str(p_spark)})}
    ctx = model.new_context(taps=drafters["dflash"].requirements().taps)
    out = ctx.forward(Batch.from_tokens(prompt, output="last"))
    for dr in drafters.values():
        dr.begin(0, prompt)
        dr.process(TargetOutput(seq=0, phase="prefill", tokens=np.asarray(prompt), positions=np.arange(len(prompt)),
                                features=out.features))
    pos = len(prompt)
    history = prompt + [int(np.argmax(model.backend.to_numpy(out.logits[-1])))]
    print(f"target {model.path.name}: n_embd {hp.n_embd}, n_vocab {model.n_vocab}; draft {args.draft_layers} layers, "
          f"Markov rank {args.rank}; best of {args.runs}, interleaved")
    print("\n| block b (1+N, n = b-1 drafts) | DFlash draft step | DSpark draft step | DSpark / DFlash |")
    print("|---|---|---|---|")
    for b in blocks:
        n = b - 1
        best = {k: float("inf") for k in drafters}
        for k, dr in drafters.items():
            dr.draft(0, n, history=history, pos=pos)  # warm-up
        for _ in range(args.runs):
            for k, dr in drafters.items():
                t0 = CLOCK()
                dr.draft(0, n, history=history, pos=pos)
                best[k] = min(best[k], CLOCK() - t0)
        print(f"| {b} | {best['dflash'] * 1e3:.1f} ms | {best['dspark'] * 1e3:.1f} ms | "
              f"{best['dspark'] / best['dflash']:.3f} |")

    # end to end: anchor-first DSpark, n_max = B
    p_e2e = write_tiny_dspark(tmp / "dspark-e2e.gguf", seed=1, rank=args.rank, head_scale=args.head_scale,
                             **{**geo, "block_size": args.e2e_block})
    if args.p_min is None:
        probe = make_dspark(model, {"draft": str(p_e2e)})
        probe.begin(0, prompt)
        probe.process(TargetOutput(seq=0, phase="prefill", tokens=np.asarray(prompt),
                                   positions=np.arange(len(prompt)), features=out.features))
        args.p_min = round(float(np.median(probe.draft(0, args.e2e_block, history=history, pos=pos).confidences)), 3)
    plain = Generator(model)
    t0 = CLOCK()
    plain.generate(prompt, args.tokens)
    plain_tps = plain.stats.n_generated / (CLOCK() - t0)
    print(f"\nend to end: DSpark anchor-first block {args.e2e_block} (n_max {args.e2e_block}), {args.tokens} tokens, "
          "synthetic acceptance (output is not the model's); plain greedy "
          f"{plain_tps:.1f} tok/s")
    print("| acceptance rate | p_min | tau | drafted / step | pruned positions | tok/s | speedup vs plain |")
    print("|---|---|---|---|---|---|---|")
    for rate in (float(r) for r in args.rates.split(",")):
        for p_min in (0.0, args.p_min):
            dr = make_dspark(model, {"draft": str(p_e2e), "p_min": p_min})
            gen = SpeculativeGenerator(model, [dr], config=SpecConfig(n_max=args.e2e_block, p_min=p_min,
                                                                      synthetic_accept=rate, seed=0))
            t0 = CLOCK()
            gen.generate(prompt, args.tokens)
            el = CLOCK() - t0
            st = gen.stats
            figs = st.drafter_figures.get("dspark", {})
            tps = st.n_generated / el
            print(f"| {rate} | {p_min} | {st.tau:.2f} | {st.n_drafted / max(st.n_drafts, 1):.2f} | "
                  f"{figs.get('pruned positions', 0):.0f} | {tps:.1f} | {tps / plain_tps:.2f}x |")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

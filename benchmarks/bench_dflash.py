"""DFlash-family drafters on SmolLM2-135M: draft-step and verify-step cost per block size, and the
end-to-end speedup a trained drafter of a given quality would give (synthetic acceptance).

    OPENBLAS_NUM_THREADS=2 python benchmarks/bench_dflash.py [--kinds dflash,dflash2] [--runs 5]

The drafter is random (no trained DFlash draft for SmolLM2 exists) with the target's
hidden size (576), ``--draft-layers`` Qwen3-style layers (default 3), 9 query / 3 KV heads
and the target's FFN width; it reads taps [2, 10, 20, 30] (30 = the pre-final-norm
residual). Costs are medians of ``--runs`` repetitions at a 64-token context:

* draft step: one ``drafter.draft`` of a block of b rows (injection excluded);
* verify step: one target forward of the b-row verify batch with every row's logits
  and the drafter's taps, plus the drafter's ``process`` of it (the injection) and the
  rollback of a full rejection;
* end to end: ``SpeculativeGenerator`` with ``SpecConfig(synthetic_accept=rate)``
  (each drafted position kept with probability ``rate``, the costs are real) against
  plain greedy decoding of the same number of tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


CLOCK = time.perf_counter


def median_time(fn, runs: int) -> float:
    ts = []
    for _ in range(runs):
        t0 = CLOCK()
        fn()
        ts.append(CLOCK() - t0)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--kinds", default="dflash,dflash2")
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--rates", default="0.5,0.7,0.9")
    ap.add_argument("--e2e-block", type=int, default=8, help="block size of the end-to-end runs (n_max = b - 1)")
    ap.add_argument("--draft-layers", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per end-to-end run")
    ap.add_argument("--backend", default="numpy")
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

    model = plinth.load_model(args.model, backend=args.backend)
    hp = model.hparams
    blocks = [int(b) for b in args.blocks.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    prompt = model.tokenizer.encode("Write a short story about a lighthouse keeper who finds a message in a "
                                    "bottle. The story should be about one paragraph long and end well.")
    prompt = (prompt * 4)[:64]
    print(f"clock: {args.clock}")
    print(f"target {model.path.name}: n_embd {hp.n_embd}, n_layer {hp.n_layer}, n_vocab {model.n_vocab}; "
          f"backend {args.backend}; context {len(prompt)} tokens")
    tmp = Path(tempfile.mkdtemp())
    rows = []
    e2e = []
    for kind in args.kinds.split(","):
        path = write_tiny_draft(tmp / f"{kind}.gguf", kind, n_embd=hp.n_embd, n_vocab=model.n_vocab,
                                n_layer=args.draft_layers, n_head=9, n_head_kv=3, n_ff=int(hp.n_ff[0]),
                                taps=(2, 10, 20, hp.n_layer), block_size=max(blocks), mask_token=0, conv_group=16,
                                selector_top_k=8, selector_rank=64, scale=0.05)
        dr = make_dflash(model, {"draft": str(path)})
        ctx = model.new_context(taps=dr.requirements().taps)
        out = ctx.forward(Batch.from_tokens(prompt, output="last"))
        dr.begin(0, prompt)
        dr.process(TargetOutput(seq=0, phase="prefill", tokens=np.asarray(prompt), positions=np.arange(len(prompt)),
                                features=out.features))
        pos = len(prompt)
        history = prompt + [int(np.argmax(model.backend.to_numpy(out.logits[-1])))]
        for b in blocks:
            n = b - 1
            dr.draft(0, n, history=history, pos=pos)  # warm-up
            t_draft = median_time(lambda: dr.draft(0, n, history=history, pos=pos), args.runs)
            d = dr.draft(0, n, history=history, pos=pos)
            verify = [history[-1], *d.tokens]

            def verify_step():
                vo = ctx.forward(Batch.from_tokens(verify, start=pos, output="all"))
                model.backend.to_numpy(vo.logits).argmax(-1)
                dr.process(TargetOutput(seq=0, phase="verify", tokens=np.asarray(verify),
                                        positions=np.arange(pos, pos + len(verify)), features=vo.features))
                ctx.cache.seq_rm(0, pos + 1)
                dr.accept(0, 0)

            verify_step()
            t_verify = median_time(verify_step, args.runs)
            ctx.cache.seq_rm(0, pos)
            dr.cache.seq_rm(0, pos)
            t_one = median_time(lambda: (ctx.forward(Batch.from_tokens([history[-1]], start=pos)),
                                         ctx.cache.seq_rm(0, pos)), args.runs)
            rows.append((kind, b, t_draft, t_verify, t_one))
        dr.end(0)

        n_max = args.e2e_block - 1
        plain_gen = Generator(model)
        t0 = CLOCK()
        plain_gen.generate(prompt, args.tokens)
        plain_tps = plain_gen.stats.n_generated / (CLOCK() - t0)
        for rate in rates:
            gen = SpeculativeGenerator(model, [make_dflash(model, {"draft": str(path)})],
                                       config=SpecConfig(n_max=n_max, synthetic_accept=rate, seed=0))
            t0 = CLOCK()
            gen.generate(prompt, args.tokens)
            el = CLOCK() - t0
            st = gen.stats
            tps = st.n_generated / el
            e2e.append((kind, rate, st.tau, st.acceptance_rate, tps, plain_tps, st.draft_s, st.verify_s))

    print("\n| drafter | block b | draft step | verify step (b rows + inject + rollback) | 1-token decode |")
    print("|---|---|---|---|---|")
    for kind, b, td, tv, t1 in rows:
        print(f"| {kind} | {b} | {td * 1e3:.1f} ms | {tv * 1e3:.1f} ms | {t1 * 1e3:.1f} ms |")
    print("\npredicted from the step costs (tokens per step tau = sum_{i<=n} r^i for n = b - 1 drafts; "
          "speedup = tau * 1-token decode / (draft step + verify step)):")
    print("| drafter | block b | " + " | ".join(f"r={r}: tau / speedup" for r in rates) + " |")
    print("|---|---|" + "---|" * len(rates))
    for kind, b, td, tv, t1 in rows:
        cells = []
        for r in rates:
            tau = sum(r ** i for i in range(b))
            cells.append(f"{tau:.2f} / {tau * t1 / (td + tv):.2f}x")
        print(f"| {kind} | {b} | " + " | ".join(cells) + " |")
    print(f"\nend to end, block {args.e2e_block} (n_max {args.e2e_block - 1}), {args.tokens} tokens, synthetic "
          "acceptance (output is not the model's):")
    print("| drafter | acceptance rate | tau | measured rate | tok/s (prompt incl.) | plain tok/s | speedup | draft s (wall) "
          "| verify s (wall) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, rate, tau, ar, tps, ptps, ds, vs in e2e:
        print(f"| {kind} | {rate} | {tau:.2f} | {ar:.2f} | {tps:.1f} | {ptps:.1f} | {tps / ptps:.2f}x | {ds:.2f} |"
              f" {vs:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

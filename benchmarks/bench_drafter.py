"""A trained drafter on held-out prompts: tau, per-position acceptance, speed-up against plain decoding, and
byte-identical output, in one run.

    PLINTH_THREADS=2 python benchmarks/bench_drafter.py [--draft NAME|FILE] [--n 24] [--max-tokens 128]
    PLINTH_THREADS=1 python benchmarks/bench_drafter.py --clock cpu          # on a loaded machine
    python benchmarks/bench_drafter.py --curve DRAFT.gguf.ckpt --n 8         # tau against training tokens

``plinth bench --spec NAME`` runs the same evaluation (:mod:`plinth.train.evaluate`); this script adds
``--ngram`` and ``--curve``. Prompts: :func:`plinth.train.prompts.eval_prompts` for ``chat``, ``code`` (write / complete a function) and
``summarise`` (summarise / rewrite a given passage), ``--n`` each, from subjects the training set never holds.
Each prompt is rendered with the chat template and decoded greedily, batch 1, twice in a row: plain
(:class:`plinth.generate.Generator`) and speculative (``--spec``, default dspark, with the shipped drafter
for the model unless ``--draft``), alternating so that load from other jobs hits both alike. Reported per
kind: tau (1 + accepted / drafts), acceptance per draft position, tokens/s of both and the speed-up
(total plain time / total speculative time; ``--clock cpu`` counts this process's CPU time, robust on a
shared machine), and how many outputs are byte-identical (every one must be). ``--ngram`` adds the n-gram
drafter on the same prompts. ``--curve DIR`` runs the chat prompts through every ``draft-*.gguf`` of a
training checkpoint directory (named by the answer tokens trained) and prints tau against tokens (speculative
decoding only: no plain runs, no identity check).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def run_kind(model, prompts, make_spec, max_tokens, clock, tok, label="dspark", plain=True):
    from plinth.train.evaluate import run_prompts

    return run_prompts(model, [p.text for p in prompts], make_spec, max_tokens, label=label, plain=plain, clock=clock)


def show(kind, r):
    r.kind = kind
    print(r.line(), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=None, help="draft GGUF or a shipped drafter's name (default: the shipped one)")
    ap.add_argument("--spec", default="dspark")
    ap.add_argument("--n", type=int, default=24, help="prompts per kind (default 24)")
    ap.add_argument("--kinds", default="chat,code,summarise")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--n-max", type=int, default=None, help="most drafted tokens per step (default: the block's)")
    ap.add_argument("--p-min", type=float, default=0.0, help="confidence cut (DSpark; default 0: none)")
    ap.add_argument("--ngram", action="store_true", help="also the n-gram drafter on the same prompts")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--curve", default=None, metavar="CKPT_DIR",
                    help="tau on the chat prompts for every draft-*.gguf in a train-drafter checkpoint directory")
    args = ap.parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    import plinth
    from plinth.plugins import default_registry
    from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
    from plinth.train.prompts import eval_prompts

    reg = default_registry()
    model = plinth.load_model(args.model, registry=reg)
    tok = model.tokenizer
    model.prepare() if hasattr(model, "prepare") else None
    print(f"# {model.path.name}, PLINTH_THREADS={os.environ.get('PLINTH_THREADS', '-')}, clock {args.clock}, "
          f"load {os.getloadavg()[0]:.1f}, max_tokens {args.max_tokens}", flush=True)

    def spec_factory(name, draft):
        def make():
            opts = {"draft": draft, "p_min": args.p_min, "temperature": 0.0}
            if args.n_max or name == "ngram":
                opts["n_max"] = args.n_max or 8
            d = reg.make_drafter(name, model, opts)
            n_max = args.n_max or d.requirements().max_draft or 8
            return SpeculativeGenerator(model, [d], config=SpecConfig(n_max=n_max, p_min=args.p_min), registry=reg)
        return make

    if args.curve:
        files = sorted(Path(args.curve).glob("draft-*.gguf"))
        prompts = eval_prompts("chat", args.n)
        print("# answer tokens trained -> tau on chat (greedy)")
        for f in files:
            r = run_kind(model, prompts, spec_factory(args.spec, str(f)), args.max_tokens, clock, tok, plain=False)
            k = int(f.stem.split("-")[1].rstrip("k"))
            print(f"{k:>8d}k tokens  tau {r.tau:.3f}  per position "
                  f"{' '.join(f'{x:.2f}' for x in r.per_pos)}", flush=True)
        return 0
    bad = 0
    for kind in args.kinds.split(","):
        prompts = eval_prompts(kind, args.n)
        r = run_kind(model, prompts, spec_factory(args.spec, args.draft), args.max_tokens, clock, tok, args.spec)
        show(kind, r)
        bad += r.n - r.same
        if args.ngram:
            r = run_kind(model, prompts, spec_factory("ngram", None), args.max_tokens, clock, tok, "ngram")
            show(kind, r)
            bad += r.n - r.same
    print(f"# load after: {os.getloadavg()[0]:.1f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

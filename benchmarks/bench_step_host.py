"""The scheduler's host time a step: CPU milliseconds outside the forward, at N concurrent requests.

Usage::

    PLINTH_THREADS=1 python benchmarks/bench_step_host.py [-m MODEL] [--requests 1,16] [--tokens 48]
        [--temperature 0.7] [--top-p 1.0] [--reps 3] [--profile] [--spec NAME[,NAME...]]

In process and single-threaded, without HTTP: N chat requests (seeded sampling at ``--temperature``)
are admitted into one :class:`plinth.serve.scheduler.Scheduler`, prefilled, then decoded step by step
on this thread. Each step's CPU time (``time.process_time``, which other processes' load barely moves)
is split into the forward's and the rest: sampling, the sampler's filters, grammar and penalty hooks,
emission, the step's planning. Printed per level: the rest in ms a step (each run and the best), the
forward's ms a step, and a hash of every request's tokens (the same tokens before and after a change
of the host code: the draws are unchanged). ``--profile`` prints cProfile's view of the last run.
``--spec`` makes the requests speculative with those drafters (``--spec-policy auto``, as ``plinth serve``):
the rest then holds the policy's decisions, the drafters' calls and their work on the rows.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec_policy import question_ids  # noqa: E402  (the same chat questions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=os.path.expanduser("~/.cache/plinth/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--requests", default="1,16", help="concurrent requests per level (default 1,16)")
    ap.add_argument("--tokens", type=int, default=48, help="tokens a request (default 48)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--spec", default="", metavar="NAME[,NAME...]", help="speculative requests with these drafters")
    args = ap.parse_args()

    import plinth
    from plinth.sampling import SamplerConfig
    from plinth.serve.scheduler import Request, Scheduler

    model = plinth.load_model(args.model)
    tok = model.tokenizer
    drafters, spec = [], None
    if args.spec:
        from plinth.plugins import default_registry
        from plinth.speculative.engine import SpecConfig

        reg = default_registry()
        drafters = [reg.make_drafter(name, model, {"draft": None}) for name in args.spec.split(",")]
        spec = SpecConfig(n_max=8)
    sched = Scheduler(model, drafters=drafters, spec=spec, max_batch=max(int(x) for x in args.requests.split(",")),
                      prompt_cache=0)
    model.prepare()
    forward = sched.ctx.forward
    spent = {"forward": 0.0}

    def timed(batch):
        c = time.process_time()
        out = forward(batch)
        spent["forward"] += time.process_time() - c
        return out

    sched.ctx.forward = timed

    def run(n: int) -> tuple[float, float, dict[int, list[int]]]:
        outs: dict[int, list[int]] = {}
        for i in range(n):
            ids = question_ids(tok, i)
            sched.submit(Request(prompt_ids=ids, max_tokens=args.tokens, speculative=bool(drafters),
                                 emit=lambda ev, i=i: outs.setdefault(i, []).extend(t.token for t in ev.tokens),
                                 sampling=SamplerConfig(temperature=args.temperature, top_p=args.top_p, seed=i)))
        with sched._cond:
            sched._admit()
        while any(r.prefilling for r in sched._active):  # (the prefill steps are not counted)
            sched._step()
        spent["forward"], steps = 0.0, 0
        c0 = time.process_time()
        while sched._active:
            sched._reap()
            sched._step()
            steps += 1
        total = time.process_time() - c0
        return 1e3 * (total - spent["forward"]) / steps, 1e3 * spent["forward"] / steps, outs

    print(f"{model.path.name}; load average {os.getloadavg()[0]:.2f}; temperature {args.temperature}, top_p "
          f"{args.top_p}, {args.tokens} tokens a request", flush=True)
    for n in (int(x) for x in args.requests.split(",")):
        runs = []
        prof = cProfile.Profile() if args.profile else None
        for rep in range(args.reps):
            if prof is not None and rep == args.reps - 1:
                prof.enable()
            host, fwd, outs = run(n)
            if prof is not None and rep == args.reps - 1:
                prof.disable()
            runs.append((host, fwd))
        digest = hash(tuple(tuple(outs[i]) for i in sorted(outs)))
        print(f"  {n:3d} requests: outside the forward {' / '.join(f'{h:.3f}' for h, _ in runs)} CPU ms a step "
              f"(best {min(h for h, _ in runs):.3f}); forward {min(f for _, f in runs):.2f} ms a step; tokens' hash "
              f"{digest}", flush=True)
        if prof is not None:
            pstats.Stats(prof).sort_stats("cumulative").print_stats("serve|sampling|generate|speculative", 30)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()

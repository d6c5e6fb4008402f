"""Speculative decoding in a full batch: N concurrent requests through the server's scheduler, plain vs a
drafter under ``--spec-policy`` auto / always, in one process.

Usage::

    PLINTH_THREADS=1 python benchmarks/bench_spec_policy.py [-m MODEL] [--spec dspark] [--draft FILE]
        [--requests 16] [--tokens 64] [--temperature 0.7] [--reps 2] [--arms plain,auto,always]

Each arm is its own :class:`plinth.serve.scheduler.Scheduler` on the same model (the drafter shared): the
N requests (chat questions, seeded, the end token biased away so every request decodes ``--tokens``) are
submitted together and run to the end; the arms alternate ``--reps`` times. Printed: generated tokens a
second by the wall clock and by this process's CPU time (which the load of other processes barely moves),
the best of each arm and its ratio to plain, the policy's decisions and the drafter's acceptance; at
temperature 0, whether every arm's tokens equal plain decoding's.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

QUESTIONS = ["What is the capital of France?", "Explain photosynthesis briefly.", "Name three prime numbers.",
             "Why is the sky blue?", "Write a haiku about rain.", "What does a CPU do?", "How do bees make honey?",
             "Give me a tip for learning Python."]


def question_ids(tok, i: int) -> list[int]:
    """Request i's prompt: question i (cycling) in the model's chat template."""
    from plinth.train.prompts import prompt_ids

    return prompt_ids(tok, QUESTIONS[i % len(QUESTIONS)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=os.path.expanduser("~/.cache/plinth/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--spec", default="dspark")
    ap.add_argument("--draft", default=None, help="the drafter's file (default: the one shipped for the model)")
    ap.add_argument("--spec-n-max", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--arms", default="plain,auto,always")
    args = ap.parse_args()

    import plinth
    from plinth.plugins import default_registry
    from plinth.sampling import SamplerConfig
    from plinth.serve.scheduler import Request, Scheduler
    from plinth.speculative.engine import SpecConfig

    registry = default_registry()
    model = plinth.load_model(args.model, registry=registry)
    tok = model.tokenizer
    model.prepare()
    drafter = registry.make_drafter(args.spec, model, {"draft": args.draft, "n_max": args.spec_n_max, "n_min": 0,
                                                       "p_min": 0.0, "backend": None, "ngram_max": 3, "ngram_min": 2,
                                                       "progress": False, "temperature": 0.0})
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    scheds = {a: Scheduler(model, max_batch=args.requests, prompt_cache=0) if a == "plain" else
              Scheduler(model, drafters=[drafter], spec=SpecConfig(n_max=args.spec_n_max), max_batch=args.requests,
                        prompt_cache=0, spec_policy=a) for a in arms}
    for s in scheds.values():
        s.start()
    bias = {t: -100.0 for t in tok.eog_ids}

    def run(sched) -> tuple[float, float, dict[int, list[int]]]:
        done = threading.Semaphore(0)
        count = [0]
        outs: dict[int, list[int]] = {}

        def emitter(i: int):
            def emit(ev) -> None:
                count[0] += len(ev.tokens)
                outs.setdefault(i, []).extend(t.token for t in ev.tokens)
                if ev.finish is not None:
                    done.release()
            return emit

        reqs = []
        for i in range(args.requests):
            ids = question_ids(tok, i)
            reqs.append(Request(prompt_ids=ids, max_tokens=args.tokens, emit=emitter(i),
                                sampling=SamplerConfig(temperature=args.temperature, seed=i, logit_bias=bias)))
        t0, c0 = time.perf_counter(), time.process_time()
        with sched._cond:  # (all of them join the first step together)
            for r in reqs:
                sched.submit(r)
        for _ in reqs:
            done.acquire()
        return count[0] / (time.perf_counter() - t0), count[0] / (time.process_time() - c0), outs

    print(f"{model.path.name}, --spec {args.spec}; {args.requests} requests x {args.tokens} tokens, temperature "
          f"{args.temperature}; load average {os.getloadavg()[0]:.2f}", flush=True)
    results: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}
    outs = {}
    try:
        for rep in range(args.reps):
            for a in arms:
                wall, cpu, outs[a] = run(scheds[a])
                results[a].append((wall, cpu))
                print(f"  pass {rep + 1} {a}: {wall:.1f} tok/s wall, {cpu:.1f} tok/s CPU", flush=True)
    finally:
        for s in scheds.values():
            s.stop()
    best = {a: (max(w for w, _ in r), max(c for _, c in r)) for a, r in results.items()}
    for a in arms:
        line = f"{a}: best {best[a][0]:.1f} tok/s wall, {best[a][1]:.1f} tok/s CPU"
        if a != "plain" and "plain" in best:
            s = scheds[a]
            line += (f"; / plain {best[a][0] / best['plain'][0]:.3f} wall, {best[a][1] / best['plain'][1]:.3f} CPU; "
                     f"decisions {s.policy.counts}; [drafts, drafted, accepted] {s.metrics.spec}")
        print(line)
    if args.temperature == 0 and "plain" in outs:
        print("tokens equal plain decoding's:", {a: outs[a] == outs["plain"] for a in arms if a != "plain"})
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()

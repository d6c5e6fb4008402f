"""The server's continuous batching without HTTP: N in-process clients against one Scheduler.

Usage::

    python benchmarks/bench_scheduler.py [-m smollm2-135m-instruct] [--clients 1,16] [--requests 3]
        [--max-tokens 64] [--threads 2] [--prompt-cache 32]

Each client submits ``--requests`` greedy requests one after the other (prompts from a fixed list
of eight, so later requests repeat earlier prompts) and waits for each to finish. Printed per level:
generated tokens/s, steps, tokens a step, and the forward's share of a step. Against
``bench_server.py`` this leaves out the HTTP server's event loop and the load generator, which
share the same cores there: the difference between the two is what streaming costs.
"""

from __future__ import annotations

import argparse
import threading
import time

PROMPTS = ["Once upon a time, in a small village by the sea, there lived", "The history of the Roman empire begins",
           "def fibonacci(n):", "In a galaxy far away", "The recipe for bread is simple:", "My favourite colour is",
           "Water boils at", "The quick brown fox"]


def level(sched, tokenizer, n_clients: int, n_requests: int, max_tokens: int) -> dict:
    from plinth.sampling import SamplerConfig
    from plinth.serve.scheduler import Request

    count = [0]
    lock = threading.Lock()

    def client(i: int) -> None:
        for r in range(n_requests):
            done = threading.Event()

            def emit(ev, done=done) -> None:
                with lock:
                    count[0] += len(ev.tokens)
                if ev.finish is not None:
                    done.set()

            sched.submit(Request(prompt_ids=tokenizer.encode(PROMPTS[(i + r) % len(PROMPTS)]), max_tokens=max_tokens,
                                 sampling=SamplerConfig(temperature=0.0), emit=emit))
            if not done.wait(600):
                raise SystemExit("a request did not finish in 600 s")

    s0, f0 = sched.metrics.steps, sched.metrics.forward_s
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    steps = sched.metrics.steps - s0
    return {"tokens": count[0], "wall": wall, "steps": steps, "forward_s": sched.metrics.forward_s - f0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--clients", default="1,16")
    ap.add_argument("--requests", type=int, default=3, help="requests per client, one after the other (default 3)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-cache", type=int, default=32)
    args = ap.parse_args()

    import os

    import plinth
    import plinth.quant
    from plinth import hub
    from plinth.serve.scheduler import Scheduler

    plinth.quant.set_threads(args.threads)
    model = plinth.load_model(hub.resolve_model(args.model, progress=True))
    levels = [int(x) for x in args.clients.split(",")]
    sched = Scheduler(model, max_batch=max(levels), prompt_cache=args.prompt_cache, prepare=True)
    sched.start()  # (the warm-up forward on the scheduler thread, as plinth serve does)
    print(f"{model.path.name}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; {args.threads} threads, "
          f"max_tokens {args.max_tokens}, {args.requests} requests a client, prompt cache {args.prompt_cache}")
    results = {}
    try:
        for n in levels:
            r = results[n] = level(sched, model.tokenizer, n, args.requests, args.max_tokens)
            steps = max(r["steps"], 1)
            print(f"  {n:3d} clients: {r['tokens'] / r['wall']:7.1f} tok/s; {r['steps']} steps, "
                  f"{r['tokens'] / steps:.1f} tokens a step, forward {1e3 * r['forward_s'] / steps:.1f}"
                  f" ms a step ({100 * r['forward_s'] / r['wall']:.0f}% of the wall time)", flush=True)
    finally:
        sched.stop()
    if 1 in results and len(results) > 1:
        one = results[1]["tokens"] / results[1]["wall"]
        for n, r in results.items():
            if n != 1:
                print(f"  {n} clients / 1 client: {r['tokens'] / r['wall'] / one:.2f}x")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()

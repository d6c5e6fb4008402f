"""Throughput of `plinth serve` against llama.cpp's own `llama-server` (continuous batching), plain and with
a JSON schema, on the same GGUF and threads, in one run (issue 35).

Usage::

    make peer-server                          # builds llama-server once (~15 min on 2 cores)
    python benchmarks/bench_serve_peer.py [-m PATH] [--clients 1,4,16,64] [--constrained 1,16] [--duration 30]
        [--threads 2] [--max-tokens 64] [--temperature 0.7] [--engines plinth,llama-server] [--repeat N]

Both servers run on 127.0.0.1 at once (an idle one takes no CPU): ``plinth serve --max-batch 16`` and
``llama-server --parallel 16`` (its per-slot context: ``--n-ctx`` each), both with ``--threads`` threads.
For each client count N, N clients each send streaming chat completions (``--max-tokens``, temperature
``--temperature``, questions from a fixed list, each asking for an answer in JSON) back to back for
``--duration`` seconds; tokens streamed inside the window count. ``--constrained`` levels send the same
messages with ``response_format: json_schema`` (a schema with free strings and a list, :data:`SCHEMA`) to
both; plinth's constrained / plain ratio at the same client count is
the grammar mask's cost (llama-server converts the schema to its own grammar). Every streamed reply of a
constrained level that finished (not cut by max_tokens) is parsed as JSON: the count of invalid ones is printed.

Before the servers, the grammar's cost is measured in process (:func:`mask_cost`): the server's scheduler
decodes 1 and 16 requests of 64 tokens with and without a JSON schema, interleaved, every request running
to its 64 tokens in both arms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_server import QUESTIONS, RawHTTP  # noqa: E402  (the load generator's HTTP client)
from build_llama_server import binary  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string"},
        "summary": {"type": "string"},
        "facts": {"type": "array", "items": {"type": "string"}},
        "confidence": {"type": "number"},
    },
    "required": ["topic", "summary", "facts", "confidence"],
    "additionalProperties": False,
}


def body(args, k: int, constrained: bool) -> dict:
    # the same messages with and without the schema: the constrained / plain ratio is the grammar's cost alone
    q = QUESTIONS[k % len(QUESTIONS)] + " Answer in JSON with a topic, a summary, a list of facts and a confidence."
    b = {"model": "bench", "messages": [{"role": "user", "content": q}],
         "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True}
    if constrained:
        b["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA,
                                                                       "strict": True}}
    return b


async def _client(http, url: str, idx: int, args, constrained: bool, out: dict) -> None:
    k = idx
    while True:
        req = body(args, k, constrained)
        k += 1
        text, finish, n_tok = [], None, 0
        try:
            async with http.stream("POST", url + "/v1/chat/completions", json=req) as r:
                if r.status_code != 200:
                    out["errors"] += 1
                    out["why"].append(f"{r.status_code}: {(await r.aread())[:200]!r}")
                    await asyncio.sleep(0.5)
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    ch = json.loads(data).get("choices") or []
                    if not ch:
                        continue
                    c = ch[0].get("delta", {}).get("content")
                    if c:
                        text.append(c)
                        out["tokens"] += 1
                        n_tok += 1
                    if ch[0].get("finish_reason"):
                        finish = ch[0]["finish_reason"]
        except asyncio.CancelledError:
            raise
        except ConnectionError as exc:
            if "before answering" in str(exc):  # a kept-alive connection the server had closed: ask again
                out["reconnects"] += 1
                continue
            out["errors"] += 1
            out["why"].append(f"{type(exc).__name__}: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - a broken stream
            out["errors"] += 1
            out["why"].append(f"{type(exc).__name__}: {exc}")
            continue
        out["completed"] += 1
        out["lengths"].append(n_tok)
        if constrained and finish == "stop":
            try:
                v = json.loads("".join(text))
                ok = isinstance(v, dict) and set(v) == set(SCHEMA["required"])
            except json.JSONDecodeError:
                ok = False
            out["json_ok" if ok else "json_bad"] += 1


async def _level(url: str, n: int, args, constrained: bool) -> dict:
    out = {"tokens": 0, "completed": 0, "errors": 0, "why": [], "lengths": [], "json_ok": 0, "json_bad": 0,
           "reconnects": 0}
    http = RawHTTP()
    tasks = [asyncio.create_task(_client(http, url, i, args, constrained, out)) for i in range(n)]
    await asyncio.sleep(args.duration)
    n_tokens = out["tokens"]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await http.aclose()
    out["tps"] = n_tokens / args.duration
    await asyncio.sleep(1.0)
    return out


def _start(engine: str, path: str, port: int, args, log: Path):
    from plinth.testing.server import served

    env = {"OPENBLAS_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads),
           "PLINTH_THREADS": str(args.threads)}
    if engine == "plinth":
        cmd = [sys.executable, "-m", "plinth", "serve", "-m", path, "--port", str(port), "--model-alias", "bench",
               "--max-batch", "16", "--max-queue", "64", "--n-ctx", str(args.n_ctx)]
    else:
        exe = binary()
        if not exe.is_file():
            raise SystemExit(f"{exe} is missing: run `make peer-server` first")
        cmd = [str(exe), "-m", path, "--host", "127.0.0.1", "--port", str(port), "--alias", "bench",
               "--threads", str(args.threads), "--threads-batch", str(args.threads), "--parallel", "16",
               "--ctx-size", str(16 * args.n_ctx), "--cont-batching", "--no-webui"]
    return served(cmd, port, timeout=300, log=log, env=env)


def mask_cost(path: str, reps: int = 3) -> None:
    """The grammar's share of decode time, in process and the same run: the server's scheduler decodes N = 1
    and 16 requests of 64 tokens with and without a JSON schema, interleaved ``reps`` times (tokens/s medians).
    The schema holds a string of at least 1000 characters and the end token is biased away (-100) in both
    arms, so every request decodes all 64 tokens in both and the arms differ by the grammar alone. Reported by the
    wall clock and by the process's CPU time (steadier on a machine other processes load)."""
    import threading

    import plinth
    from plinth import grammar as G
    from plinth.generate import render_chat
    from plinth.sampling import SamplerConfig
    from plinth.serve.request import Request
    from plinth.serve.scheduler import Scheduler

    model = plinth.load_model(path)
    tok = model.tokenizer
    long = {"type": "object", "properties": {"summary": {"type": "string", "minLength": 1000}},
            "required": ["summary"], "additionalProperties": False}
    con = G.Constraint(G.json_schema(long), tok, model.n_vocab)
    sched = Scheduler(model, max_batch=16, prompt_cache=0, prepare=True)
    sched.start()
    bias = {t: -100.0 for t in tok.eog_ids}
    try:
        def run(n: int, constrained: bool) -> float:
            done = threading.Semaphore(0)
            count = [0]

            def emit(ev) -> None:
                count[0] += len(ev.tokens)
                if ev.finish is not None:
                    done.release()

            reqs = []
            for i in range(n):
                q = QUESTIONS[i % len(QUESTIONS)] + " Answer in JSON with a summary."
                ids = tok.encode(render_chat(tok.chat_template, [{"role": "user", "content": q}], tok),
                                 add_special=False, parse_special=True)
                reqs.append(Request(prompt_ids=ids, max_tokens=64, emit=emit,
                                    sampling=SamplerConfig(temperature=0.7, seed=i, logit_bias=bias),
                                    constraint=con.start() if constrained else None))
            t0, c0 = time.perf_counter(), time.process_time()
            for r in reqs:
                sched.submit(r)
            for _ in reqs:
                done.acquire()
            assert count[0] == 64 * n, count[0]
            # (tok/s by the wall clock, and by this process's CPU time: the latter barely moves with the load
            # other processes put on the machine)
            return count[0] / (time.perf_counter() - t0), count[0] / (time.process_time() - c0)

        for n in (1, 16):
            plain, js = [], []
            for _ in range(reps):
                plain.append(run(n, False))
                js.append(run(n, True))
            for k, what in ((0, "wall-clock"), (1, "CPU-time")):
                p, j = statistics.median(x[k] for x in plain), statistics.median(x[k] for x in js)
                print(f"in process, {n} request(s) x 64 tokens (prefill included), median of {reps} interleaved runs, "
                      f"{what} tok/s: {p:.1f} plain, {j:.1f} json_schema: {j / p:.3f} (runs: "
                      f"{', '.join(f'{a[k]:.1f}/{b[k]:.1f}' for a, b in zip(plain, js))})", flush=True)
    finally:
        sched.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=os.path.expanduser("~/.cache/plinth/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--clients", default="1,4,16,64")
    ap.add_argument("--constrained", default="1,16", help="client counts of the json_schema levels")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--n-ctx", type=int, default=1024, help="context per sequence / slot")
    ap.add_argument("--engines", default="plinth,llama-server")
    ap.add_argument("--repeat", type=int, default=1, help="passes over the levels (medians reported)")
    ap.add_argument("--skip-mask-cost", action="store_true")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import tempfile

    from plinth.testing.server import free_port

    path = args.model
    print(f"model {Path(path).name}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start; "
          f"{args.threads} threads; chat, max_tokens {args.max_tokens}, temperature {args.temperature}, "
          f"{args.duration:.0f} s a level", flush=True)
    if not args.skip_mask_cost:
        mask_cost(path)
    engines = [e for e in args.engines.split(",") if e]
    levels = [(int(n), False) for n in args.clients.split(",") if n] + \
             [(int(n), True) for n in args.constrained.split(",") if n]
    log_dir = Path(tempfile.mkdtemp(prefix="bench_serve_peer_"))
    runs: dict[tuple[str, int, bool], list[float]] = {}
    print("| engine | clients | json_schema | tok/s | completed | mean tokens a reply | JSON ok / bad | errors | load |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    with contextlib.ExitStack() as stack:
        urls = {e: stack.enter_context(_start(e, path, free_port(), args, log_dir / f"{e}.log")).url
                for e in engines}
        warm = argparse.Namespace(**{**vars(args), "duration": 3.0, "max_tokens": 8})
        for e in engines:
            asyncio.run(_level(urls[e], 2, warm, False))
        for _ in range(max(1, args.repeat)):
            for n, c in levels:
                for e in engines:
                    r = asyncio.run(_level(urls[e], n, args, c))
                    runs.setdefault((e, n, c), []).append(r["tps"])
                    mean_len = statistics.fmean(r["lengths"]) if r["lengths"] else float("nan")
                    print(f"| {e} | {n} | {'yes' if c else 'no'} | {r['tps']:.1f} | {r['completed']} | {mean_len:.1f} | "
                          f"{r['json_ok']} / {r['json_bad']} | {r['errors']} | {os.getloadavg()[0]:.1f} |", flush=True)
                    for why in r["why"][:3]:
                        print(f"    error: {why}")
    tps = {k: statistics.median(v) for k, v in runs.items()}
    print(f"load average {os.getloadavg()[0]:.2f} at the end; logs in {log_dir}")
    for n, c in levels:
        if ("plinth", n, c) in tps and ("llama-server", n, c) in tps:
            print(f"plinth / llama-server, {n} clients{' json_schema' if c else ''}: "
                  f"{tps[('plinth', n, c)] / tps[('llama-server', n, c)]:.2f}x")
    for n, c in levels:
        if c and ("plinth", n, False) in tps and ("plinth", n, True) in tps:
            print(f"plinth json_schema / plain, {n} clients: {tps[('plinth', n, True)] / tps[('plinth', n, False)]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

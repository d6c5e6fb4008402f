"""Load test: concurrent streaming clients against `plinth serve` and llama-cpp-python's server.

Usage::

    python benchmarks/bench_server.py [-m smollm2-135m-instruct] [--clients 1,4,16,64] [--duration 30]
        [--engines plinth,llama-cpp] [--max-tokens 128] [--threads 2] [--max-batch 16] [--max-queue 32]
        [--prompt-cache N] [--repeat N] [--client raw|httpx] [--spec NAME [--spec-policy auto|always]]
    python benchmarks/bench_server.py --soak 600 --clients 8 --engines plinth     # the 10-minute soak

Each engine is started as its own server process on 127.0.0.1 (a free port), on the
same GGUF file: ``plinth serve`` and ``python -m llama_cpp.server`` (the ``peer`` extra:
``pip install -e '.[peer]'``), both with ``--threads`` threads. For each client count N,
N clients each send streaming chat completions (greedy, ``--max-tokens``, prompts from a
fixed list) back to back for ``--duration`` seconds, then every client stops (closing the
streams still running). Printed per level: aggregate generated tokens/s (tokens streamed
inside the window over its length), p50/p99 time to first token and inter-token latency,
requests completed, still running at the deadline, lost (a stream that broke or ended
without ``[DONE]``: must be 0), refused (429/503, expected only above the server's queue
bound) and other errors. A refused client waits the Retry-After the server sent and tries
again. llama-cpp-python's server runs with ``--interrupt_requests False``, so that it
queues concurrent requests instead of ending the running one early (its default).

``--soak SECONDS`` runs one level of ``--clients`` for that long against plinth only and
prints the server's resident memory at the start, every minute, and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "Write a short paragraph about the sea.",
    "Explain what a compiler does, in simple words.",
    "List five uses of a plinth in architecture.",
    "Tell me a story about a lighthouse keeper.",
    "Why is the sky blue? Answer in a few sentences.",
    "Describe how bread is made, step by step.",
    "What are the planets of the solar system?",
    "Give me some advice for learning to play the piano.",
]


def _rss_mb(pid: int) -> float:
    from plinth.testing.server import rss_mb

    return rss_mb(pid)


class RawHTTP:
    """A minimal HTTP/1.1 client on asyncio streams for the load: what ``_client`` uses of
    ``httpx.AsyncClient`` (``stream("POST", url, json=...)`` -> status_code, headers, aiter_lines,
    aread), with kept-alive connections and chunked or sized bodies. It spends a fraction of httpx's
    CPU per streamed line (httpx + httpcore + h11 + anyio: ~150 us a token on this machine), CPU that
    the load generator takes from the server it measures when both share the machine's cores.
    ``--client httpx`` keeps httpx for comparison."""

    def __init__(self) -> None:
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    def stream(self, method: str, url: str, json: dict) -> "contextlib.AbstractAsyncContextManager":
        return self._stream(method, url, json)

    @contextlib.asynccontextmanager
    async def _stream(self, method: str, url: str, body_obj: dict):
        from urllib.parse import urlsplit

        u = urlsplit(url)
        body = json.dumps(body_obj).encode()
        head = (f"{method} {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        conn = self._idle.pop() if self._idle else await asyncio.open_connection(u.hostname, u.port)
        resp = _RawResponse(*conn)
        try:
            conn[1].write(head + body)
            await resp.read_head()
            yield resp
            if not resp.finished:
                await resp.aread()
        except BaseException:
            conn[1].close()
            raise
        if resp.keep_alive:
            self._idle.append(conn)
        else:
            conn[1].close()

    async def aclose(self) -> None:
        for _, w in self._idle:
            w.close()
        self._idle.clear()


class _RawResponse:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self.finished = False
        self.keep_alive = True

    async def read_head(self) -> None:
        line = await self.reader.readline()
        if not line:
            raise ConnectionError("the server closed the connection before answering")
        self.status_code = int(line.split()[1])
        while (line := await self.reader.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            self.headers[k.strip().lower()] = v.strip()
        self.keep_alive = self.headers.get("connection", "").lower() != "close"

    async def _pieces(self):
        r = self.reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await r.readline()).split(b";")[0], 16)
                if size == 0:
                    while (await r.readline()) not in (b"\r\n", b"\n", b""):  # (trailers)
                        pass
                    break
                piece = await r.readexactly(size)
                await r.readexactly(2)
                yield piece
        elif "content-length" in self.headers:
            n = int(self.headers["content-length"])
            if n:
                yield await r.readexactly(n)
        else:  # the body ends with the connection
            self.keep_alive = False
            while piece := await r.read(65536):
                yield piece
        self.finished = True

    async def aiter_lines(self):
        rest = b""
        async for piece in self._pieces():
            rest += piece
            *lines, rest = rest.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if rest:
            yield rest.rstrip(b"\r").decode()

    async def aread(self) -> bytes:
        return b"".join([p async for p in self._pieces()])


async def _client(http, url: str, model: str, idx: int, max_tokens: int, out: dict) -> None:
    """Send requests back to back until cancelled (at the level's deadline)."""
    k = idx
    while True:
        body = {"model": model, "messages": [{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True}
        k += 1
        t0 = time.perf_counter()
        last = None
        done = False
        out["in_flight"] += 1
        try:
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code in (429, 503):
                    out["refused"] += 1
                    await r.aread()
                    out["in_flight"] -= 1
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                    continue
                if r.status_code != 200:
                    out["errors"] += 1
                    await r.aread()
                    out["in_flight"] -= 1
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    ch = obj.get("choices") or []
                    delta = ch[0].get("delta", {}) if ch else {}
                    # a token chunk: text (possibly empty for half a character), not the opening role chunk
                    if ch and ch[0].get("finish_reason") is None and delta.get("content") is not None and \
                            (delta["content"] or "role" not in delta):
                        now = time.perf_counter()
                        if last is None:
                            out["ttft"].append(now - t0)
                        else:
                            out["itl"].append(now - last)
                        last = now
                        out["tokens"] += 1
        except asyncio.CancelledError:
            out["in_flight"] -= 1
            out["cut"] += 1  # still running at the deadline: neither lost nor completed
            raise
        except Exception as exc:  # a broken connection is a lost request
            out["in_flight"] -= 1
            out["lost"] += 1
            out["why"].append(f"{type(exc).__name__}: {exc}")
            continue
        out["in_flight"] -= 1
        if done:
            out["completed"] += 1
        else:
            out["lost"] += 1
            out["why"].append("stream ended without [DONE]")


async def _counters(http, url: str) -> dict[str, float]:
    """plinth's step counters from /metrics (empty for a server without them)."""
    try:
        r = await http.get(url + "/metrics")
    except Exception:  # noqa: BLE001 - another engine's server, or none
        return {}
    found = {}
    for line in r.text.splitlines() if r.status_code == 200 else []:
        name, _, value = line.partition(" ")
        if name in ("plinth_steps_total", "plinth_forward_seconds_total", "plinth_generated_tokens_total"):
            found[name] = float(value)
    return found


async def _level(url: str, model: str, n: int, duration: float, max_tokens: int, client: str = "raw") -> dict:
    """``n`` clients for ``duration`` seconds; tokens are counted as they arrive inside the window."""
    import httpx

    out = {"completed": 0, "lost": 0, "refused": 0, "errors": 0, "tokens": 0, "ttft": [], "itl": [], "why": [],
           "cut": 0, "in_flight": 0}
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    raw = RawHTTP() if client == "raw" else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        before = await _counters(http, url)
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_client(raw or http, url, model, i, max_tokens, out)) for i in range(n)]
        await asyncio.sleep(duration)
        n_tokens = out["tokens"]
        after = await _counters(http, url)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        out["tokens"] = n_tokens
        out["wall"] = time.perf_counter() - t0 if duration <= 0 else duration
        if raw is not None:
            await raw.aclose()
        if before and after:  # plinth: how much of the window its batched forwards took
            out["steps"] = after["plinth_steps_total"] - before["plinth_steps_total"]
            out["forward_s"] = after["plinth_forward_seconds_total"] - before["plinth_forward_seconds_total"]
            out["generated"] = after["plinth_generated_tokens_total"] - before["plinth_generated_tokens_total"]
    await asyncio.sleep(1.0)  # let the server see the closed streams before the next level
    return out


async def _soak(url: str, pid: int, n: int, duration: float, max_tokens: int, client: str = "raw") -> dict:
    """``n`` clients for ``duration`` seconds, printing the server's RSS and the counts every minute."""
    import httpx

    out = {"completed": 0, "lost": 0, "refused": 0, "errors": 0, "tokens": 0, "ttft": [], "itl": [], "why": [],
           "cut": 0, "in_flight": 0}
    print(f"soak: {n} clients for {duration:.0f} s; server RSS at start {_rss_mb(pid):.1f} MiB", flush=True)
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    raw = RawHTTP() if client == "raw" else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_client(raw or http, url, "bench", i, max_tokens, out)) for i in range(n)]
        while (left := duration - (time.perf_counter() - t0)) > 0:
            await asyncio.sleep(min(60.0, left))
            print(f"  {time.perf_counter() - t0:.0f} s: {out['completed']} completed, {out['lost']} lost, "
                  f"{out['errors']} errors, {out['tokens']} tokens; RSS {_rss_mb(pid):.1f} MiB", flush=True)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if raw is not None:
            await raw.aclose()
        # the streams cut at the end must leave the server idle with an empty cache
        for _ in range(300):
            health = (await http.get(url + "/health")).json()
            if not health["active"] and not health["cache_tokens"]:
                break
            await asyncio.sleep(0.1)
        print(f"after the clients stopped: {health['active']} active, {health['cache_tokens']} cache rows", flush=True)
    return out


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1000 if xs else float("nan")


def _report(engine: str, n: int, r: dict) -> str:
    tps = r["tokens"] / r["wall"]
    return (f"| {engine} | {n} | {tps:.1f} | {_pct(r['ttft'], 50):.0f} | {_pct(r['ttft'], 99):.0f} | "
            f"{_pct(r['itl'], 50):.1f} | {_pct(r['itl'], 99):.1f} | {r['completed']} | {r['cut']} | {r['lost']} | "
            f"{r['refused']} | {r['errors']} |")


def _start(engine: str, path: str, port: int, args: argparse.Namespace, log: Path):
    from plinth.testing.server import served

    env = {"OPENBLAS_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads),
           "PLINTH_THREADS": str(args.threads)}  # plinth's kernel threads too, as llama.cpp's --threads
    if engine == "plinth":
        cmd = [sys.executable, "-m", "plinth", "serve", "-m", path, "--port", str(port), "--model-alias", "bench",
               "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue), "--n-ctx", str(args.n_ctx)]
        if args.spec:
            cmd += ["--spec", args.spec, "--spec-policy", args.spec_policy]
        if args.prompt_cache is not None:
            cmd += ["--prompt-cache", str(args.prompt_cache)]
    else:
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", path, "--model_alias", "bench", "--host",
               "127.0.0.1", "--port", str(port), "--n_threads", str(args.threads), "--n_threads_batch",
               str(args.threads), "--n_ctx", str(args.n_ctx), "--verbose", "False",
               # queue concurrent requests instead of cutting the running one short (its default)
               "--interrupt_requests", "False"]
    return served(cmd, port, timeout=300, log=log, env=env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--clients", default="1,4,16,64")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per client level (default 30)")
    ap.add_argument("--engines", default="plinth,llama-cpp")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=16, help="plinth's --max-batch (default 16)")
    ap.add_argument("--max-queue", type=int, default=32, help="plinth's --max-queue (default 32)")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--spec", default=None, help="plinth's --spec (default: none)")
    ap.add_argument("--spec-policy", default="auto", choices=("auto", "always"),
                    help="plinth's --spec-policy with --spec (default auto)")
    ap.add_argument("--prompt-cache", type=int, default=None, metavar="N",
                    help="plinth's --prompt-cache (default: the server's; 0: off)")
    ap.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                    help="run one level of --clients for this long against plinth, printing RSS")
    ap.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run the client levels N times over, interleaved (1, 16, 1, 16, ...), and report each "
                         "level's median: on a shared machine whose speed drifts over tens of seconds, the "
                         "ratios of interleaved runs are steadier than one pass (default 1)")
    ap.add_argument("--client", choices=("raw", "httpx"), default="raw",
                    help="the load generator's HTTP client: raw (asyncio streams, default) or httpx (several times "
                         "the CPU a streamed token, taken from the servers on a small machine)")
    args = ap.parse_args(argv)
    # a SIGTERM (timeout, Ctrl-C from a wrapper) still runs the `finally` that stops the servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import tempfile

    from plinth import hub
    from plinth.testing.server import free_port

    path = str(hub.resolve_model(args.model, progress=True))
    levels = [int(x) for x in args.clients.split(",")]
    engines = ["plinth"] if args.soak else [e.strip() for e in args.engines.split(",") if e.strip()]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_server_"))
    print(f"model {Path(path).name}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start; "
          f"max_tokens {args.max_tokens}, greedy chat, {args.duration:.0f} s per level; plinth --max-batch "
          f"{args.max_batch} --max-queue {args.max_queue}{' --spec ' + args.spec + ' --spec-policy ' + args.spec_policy if args.spec else ''}"
          f"{'' if args.prompt_cache is None else f' --prompt-cache {args.prompt_cache}'}; {args.client} client")
    if args.soak:
        n = levels[0]
        with _start("plinth", path, free_port(), args, log_dir / "plinth-soak.log") as srv:
            asyncio.run(_level(srv.url, "bench", n, 5.0, args.max_tokens, args.client))  # warm up
            r = asyncio.run(_soak(srv.url, srv.pid, n, args.soak, args.max_tokens, args.client))
            print(f"soak done: {r['completed']} completed, {r['cut']} running at the end, {r['lost']} lost, "
                  f"{r['refused']} refused, {r['errors']} errors, {r['tokens'] / args.soak:.1f} tok/s; "
                  f"RSS at end {_rss_mb(srv.pid):.1f} MiB")
            for why in r["why"][:5]:
                print(f"    lost: {why}")
        return 0 if r["lost"] == 0 and r["errors"] == 0 else 1

    print("| engine | clients | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | completed | "
          "running at the end | lost | refused (429/503) | errors | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    results: dict[tuple[str, int], dict] = {}
    runs: dict[tuple[str, int], list[float]] = {}  # every pass's tok/s
    with contextlib.ExitStack() as stack:
        # both servers up at once (an idle one takes no CPU), each level run on one engine then the
        # other, so that the machine's load changes as little as possible between the two
        urls = {e: stack.enter_context(_start(e, path, free_port(), args, log_dir / f"{e}.log")).url for e in engines}
        for e in engines:
            asyncio.run(_level(urls[e], "bench", 2, 3.0, 8, args.client))  # warm up
        for n in levels * max(1, args.repeat):  # (1, 16, 1, 16, ...: the passes interleaved)
            for e in engines:
                r = results[(e, n)] = asyncio.run(_level(urls[e], "bench", n, args.duration, args.max_tokens,
                                                         args.client))
                runs.setdefault((e, n), []).append(r["tokens"] / r["wall"])
                print(_report(e, n, r) + f" {os.getloadavg()[0]:.1f} |", flush=True)
                if r.get("steps"):
                    print(f"    plinth: {r['steps']:.0f} steps, {r['generated'] / r['steps']:.1f} tokens a step, "
                          f"forward {1e3 * r['forward_s'] / r['steps']:.1f} ms a step, forwards "
                          f"{100 * r['forward_s'] / r['wall']:.0f}% of the wall time", flush=True)
                for why in r["why"][:3]:
                    print(f"    lost: {why}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    tps = {k: float(np.median(v)) for k, v in runs.items()}  # (one pass: its only figure)
    if args.repeat > 1:
        for (e, n), v in runs.items():
            print(f"{e}, {n} clients: median {tps[(e, n)]:.1f} tok/s over {len(v)} passes "
                  f"({', '.join(f'{x:.1f}' for x in v)})")
    for engine in engines:
        if (engine, 1) in tps and (engine, 16) in tps:
            pairs = [b / a for a, b in zip(runs[(engine, 1)], runs[(engine, 16)])]
            print(f"{engine}: 16 clients / 1 client aggregate tok/s = {tps[(engine, 16)] / tps[(engine, 1)]:.2f}x"
                  + (f" (medians; pass by pass {', '.join(f'{x:.2f}' for x in pairs)})" if len(pairs) > 1 else ""))
    if ("plinth", 16) in tps and ("llama-cpp", 16) in tps:
        print(f"plinth / llama-cpp-python server at 16 clients: {tps[('plinth', 16)] / tps[('llama-cpp', 16)]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""plinth on Ray: replicas behind Ray Serve under concurrent clients, and a model split by layers.

Two parts, each on a Ray cluster started here (head + one more node process, both on 127.0.0.1):

* replicas: ``plinth serve --ray R`` for each R in ``--replicas``, driven by ``--clients``
  streaming chat clients for ``--duration`` seconds (the load loop of bench_server.py):
  aggregate tok/s, time to first token, inter-token latency, lost requests;
* pipeline: the model in one process vs split over ``--stages`` Ray actors: logits agreement,
  prefill and decode tok/s (best of ``--runs``), the latency of one stage-to-stage hop, and
  each process's resident memory.

Ray's services bind every interface; run it where that is acceptable or, as the tests do, in a
network namespace with only loopback:
``unshare -rn sh -c 'ip link set lo up && python benchmarks/bench_ray.py'``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_server import _level, _report  # noqa: E402


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def bench_replicas(args: argparse.Namespace, address: str, path: str) -> None:
    from plinth.testing.server import free_port, served

    print(f"\n## replicas: {args.clients} streaming chat clients, {args.duration:.0f} s, max_tokens "
          f"{args.max_tokens}, --max-batch {args.max_batch} per replica (load {_load()})\n")
    print("| engine | clients | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | completed | running "
          "at the end | lost | refused (429/503) | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r, t in args.replicas:
        env = {**os.environ, "OPENBLAS_NUM_THREADS": str(t), "PLINTH_THREADS": str(t), "PLINTH_PLUGINS": "llama"}
        port = free_port()
        log = Path(args.log_dir or "/tmp") / f"bench_ray_serve_{r}.log"
        cmd = [sys.executable, "-m", "plinth", "serve", "-m", path, "--ray", str(r), "--ray-address", address,
               "--port", str(port), "--model-alias", "bench", "--max-batch", str(args.max_batch), "--max-queue", "32",
               "--n-ctx", "2048", "--ray-cpus", str(t)]
        with served(cmd, port, timeout=300, log=log, env=env) as srv:
            asyncio.run(_level(srv.url, "bench", 2, 5.0, 8))  # warm-up: every replica answers once
            res = asyncio.run(_level(srv.url, "bench", args.clients, args.duration, args.max_tokens))
            print(_report(f"plinth, {r} replica{'s' if r > 1 else ''} x {t} thread{'s' if t > 1 else ''}",
                          args.clients, res) + f" load {_load()}",
                  flush=True)
            if res["why"]:
                print("   lost:", res["why"][:3])


def bench_pipeline(args: argparse.Namespace, path: str) -> None:
    from plinth.generate import time_prefill_decode
    from plinth.model import load_model
    from plinth.pipeline import _rss, load_pipeline, mapped_rss

    print(f"\n## pipeline: {args.stages} stages vs one process (load {_load()})\n")
    rss0 = _rss()
    single = load_model(path)
    pm = load_pipeline(path, args.stages, threads=1, plugins={"plugins": "llama"})
    try:
        ids = single.tokenizer.encode("The pipeline splits the model by layers over Ray actors, stage by stage.")
        diff = float(np.max(np.abs(pm.logits(ids) - single.logits(ids))))
        hop = pm.hop_latency(200)
        print(f"layers per stage: {pm.ranges}; max |logit difference| vs one process: {diff:.2e}")
        print(f"one stage-to-stage hop ([1, {pm.hparams.n_embd}] float32, actor call through the object store): "
              f"{hop * 1e3:.2f} ms (median of 200)")
        print("\n| model | prompt tok/s | decode tok/s | decode ms/token | resident: process / added by the load "
              "(model, kernels, cache) / pages of the model file |")
        print("|---|---|---|---|---|")
        for name, m in (("one process", single), (f"{args.stages} stages", pm)):
            pp, tg = time_prefill_decode(m, args.prompt_tokens, args.decode_tokens, runs=args.runs)
            if m is single:
                mem = (f"{_rss() / 2**20:.0f} MiB / {(_rss() - rss0) / 2**20:.0f} MiB / "
                       f"{mapped_rss(path) / 2**20:.0f} MiB")
            else:
                mem = "; ".join(f"{a / 2**20:.0f} / {b / 2**20:.0f} / {c / 2**20:.0f} MiB" for a, b, c in pm.stage_rss())
            print(f"| {name} | {pp:.1f} | {tg:.1f} | {1e3 / tg:.1f} | {mem} |", flush=True)
        print(f"\n(prompt {args.prompt_tokens} tokens, decode {args.decode_tokens} tokens, best of {args.runs}; "
              f"load {_load()})")
    finally:
        pm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--parts", default="pipeline,replicas")
    ap.add_argument("--replicas", default="1x1,1x2,2x1", type=lambda s: [tuple(map(int, x.split("x"))) for x in
                                                                          s.split(",")],
                    help="deployments to compare, REPLICASxTHREADS each (default 1x1,1x2,2x1)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=8, help="each replica's --max-batch (its share of the clients)")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--node-cpus", type=int, default=4, help="logical CPUs each of the two Ray nodes offers")
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("PLINTH_THREADS", "1")

    import ray
    from ray.cluster_utils import Cluster

    from plinth import hub

    path = str(hub.resolve_model(args.model))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.node_cpus, "include_dashboard": False})
    cluster.add_node(num_cpus=args.node_cpus)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, logging_level="warning")
    print(f"Ray {ray.__version__} cluster: 2 nodes x {args.node_cpus} CPUs at {cluster.address}; machine: "
          f"{os.cpu_count()} cores, load {_load()}; model {Path(path).name}")
    try:
        parts = args.parts.split(",")
        if "pipeline" in parts:
            bench_pipeline(args, path)
        if "replicas" in parts:
            bench_replicas(args, cluster.address, path)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

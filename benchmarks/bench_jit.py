"""The kernels' first compile and a later process's start, on an empty numba cache.

Usage::

    python benchmarks/bench_jit.py [--runs 3] [--models smollm2-135m-instruct gemma3-270m] [--against DIR]

Per run, each in a fresh process with its own empty ``NUMBA_CACHE_DIR``:

* **all kernels**: ``plinth.ops.warm_up()`` (every kept type's products, row gathers, the
  attention tasks, RMSNorm, RoPE): its seconds, and the process's wall and CPU time;
* **second process**: the same call again on the cache the first one filled: its seconds (the kernels
  loaded), and the process's wall time (the interpreter's start and numpy's and numba's imports too);
* **first generate** per ``--models``: ``plinth generate -n 8`` on an empty cache (what a first run
  compiles for that model), then again on the filled cache.

``--against DIR`` also times another checkout's ``core`` (a ``git worktree`` of an older commit:
``DIR/core`` goes first on ``PYTHONPATH``), alternating with this one run by run, since the
machine's speed drifts by 20-30% over minutes: read each pair against each other.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cache: str, tree: Path | None) -> tuple[float, float, str]:
    """Wall and CPU seconds of a child process, and its stdout."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    if tree is not None:
        env["PYTHONPATH"] = str(tree / "core") + os.pathsep + env.get("PYTHONPATH", "")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        sys.exit(f"bench_jit: {' '.join(cmd[:4])} ... failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stdout


def one_run(label: str, tree: Path | None, models: list[str]) -> None:
    warm = [sys.executable, "-c", "import plinth.ops as o; print(round(o.warm_up(), 2))"]
    with tempfile.TemporaryDirectory(prefix="plinth-jit-") as cache:
        wall, cpu, out = _run(warm, cache, tree)
        again, _, out2 = _run(warm, cache, tree)
        print(f"{label}: all kernels warm_up {out.strip()} s (process wall {wall:.2f} s, CPU {cpu:.2f} s); "
              f"second process warm_up {out2.strip()} s (process wall {again:.2f} s)", flush=True)
    for m in models:
        gen = [sys.executable, "-m", "plinth", "generate", "-m", m, "-n", "8", "--threads", "2", "The capital of France is"]
        with tempfile.TemporaryDirectory(prefix="plinth-jit-") as cache:
            wall, cpu, _ = _run(gen, cache, tree)
            again, _, _ = _run(gen, cache, tree)
        print(f"{label}: first generate {m}: {wall:.2f} s wall ({cpu:.2f} s CPU); with the cache {again:.2f} s",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs (alternating with --against's tree)")
    ap.add_argument("--models", nargs="*", default=[], help="models to time a first `plinth generate` for")
    ap.add_argument("--against", type=Path, help="another checkout whose core to time too (a git worktree)")
    args = ap.parse_args()
    if args.against is not None and not (args.against / "core" / "plinth").is_dir():
        sys.exit(f"bench_jit: --against {args.against}: no core/plinth there (give a checkout's root)")
    print(f"cores: {os.cpu_count()}; load average at start: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    for _ in range(max(1, args.runs)):
        if args.against is not None:
            one_run(f"{args.against.name}", args.against, args.models)
        one_run("this tree", None, args.models)
    print(f"load average at end: {', '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()

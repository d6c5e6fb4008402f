"""Wall time of `plinth plugins` (a fresh process, all installed plugins discovered).

Usage: python benchmarks/bench_plugins.py [--runs N]
Prints the best and median of N runs, and whether importing plinth pulled numpy in.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "plinth", "plugins"], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    python_only = []
    for _ in range(args.runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        python_only.append(time.perf_counter() - start)
    code = "import sys, plinth.cli, plinth.plugins; plinth.plugins.discover(); print('numpy' in sys.modules)"
    numpy_loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
    print(f"plinth plugins: best {min(times):.3f} s, median {statistics.median(times):.3f} s over {args.runs} runs")
    print(f"python -c pass: best {min(python_only):.3f} s (interpreter start-up alone)")
    print(f"numpy imported by discovery: {numpy_loaded}")


if __name__ == "__main__":
    main()

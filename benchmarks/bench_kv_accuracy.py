"""Accuracy of quantized K/V caches: teacher-forced top-1 agreement with the unquantized cache.

For each model, the first ``--ctx`` tokens of a real text are run through plinth with a float32
cache, and the argmax at the last ``--positions`` positions kept; then again with each cache type
(``-ctk T -ctv T``), with the Hadamard rotation on and off (``PLINTH_ATTN_ROT_DISABLE``), and the
share of positions whose argmax is the float32 run's reported. llama.cpp (llama-cpp-python, the
same GGUF) is run the same way against its own f16 cache (its default), rotation on and off
(``LLAMA_ATTN_ROT_DISABLE``), flash attention on (llama.cpp needs it for a quantized V cache).

    .venv/bin/python benchmarks/bench_kv_accuracy.py                       # SmolLM2 and Gemma-3, q8_0 and q4_0
    .venv/bin/python benchmarks/bench_kv_accuracy.py --models smollm2 --types q4_0 --ctx 2048

Besides top-1 agreement, the mean KL divergence of each run's next-token distribution from its
reference run's (nats, llama.cpp's ``perplexity --kl-divergence`` measure): top-1 agreement over a
thousand positions moves by a point or two with any rounding (near-tie positions), the KLD far less.

The text: ``--text FILE [FILE ...]`` (each a sample), default the GPL-3 text of /usr/share/common-licenses (English prose,
over 8000 tokens), else the llama.cpp README of the vendored sources. Prints one line per run and
a JSON summary. The prefix is prefilled in one forward (plinth: the BLAS path over the unpacked
cache rows), the scored positions run in forwards of ``--chunk`` rows (plinth: the kernel that reads
the stored blocks; llama.cpp: one token at a time, as its scores are then kept for the last row only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}
GGML = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


LICENSES = Path("/usr/share/common-licenses")


def default_text() -> str:
    """The GPL-3 text (English prose, over 8000 tokens), else the llama.cpp README of the vendored sources."""
    if (LICENSES / "GPL-3").is_file():
        return (LICENSES / "GPL-3").read_text()
    from plinth.testing.interop import llama_cpp_sources

    src = llama_cpp_sources()
    if src is None:
        sys.exit("no text: pass --text FILE")
    return (src / "README.md").read_text()


def default_corpus() -> list[str]:
    """The texts windows are drawn from: GPL-3 first, then the other license texts of the system (distinct files,
    ~60k tokens of English prose in all), else :func:`default_text` alone."""
    if not (LICENSES / "GPL-3").is_file():
        return [default_text()]
    rest = sorted(p for p in LICENSES.iterdir() if p.is_file() and not p.is_symlink() and p.name != "GPL-3")
    return [default_text()] + [p.read_text() for p in rest]


def windows(tokenizer, texts: list[str], ctx: int, n: int, n_pos: int) -> list[list[int]]:
    """``n`` windows of ``ctx`` token ids (each starting with the tokenizer's BOS where it has one) over the
    texts' tokens end to end, their scored last ``n_pos`` positions disjoint where the corpus allows: the
    first window at its start, the last at its end (a short corpus repeats)."""
    bos = tokenizer.encode("", add_special=True)
    stream: list[int] = []
    for t in texts:
        stream += tokenizer.encode(t, add_special=False)
    body = ctx - len(bos)
    while len(stream) < body + (n - 1) * n_pos:
        stream = stream + stream
    step = (len(stream) - body) // max(n - 1, 1)
    return [bos + [int(i) for i in stream[i * step:i * step + body]] for i in range(n)]


def plinth_logprobs(model, ids: list[int], n_pos: int, cache_type: str, rotate: bool, chunk: int) -> np.ndarray:
    """plinth's log-probabilities at the last ``n_pos`` positions of ``ids`` ([n_pos, vocab]), teacher-forced."""
    from plinth.ops import log_softmax

    os.environ["PLINTH_ATTN_ROT_DISABLE"] = "0" if rotate else "1"
    ctx = model.new_context(cache_type_k=cache_type, cache_type_v=cache_type)
    start = len(ids) - n_pos
    ctx.decode(ids[:start], output="last")
    out = []
    for s in range(start, len(ids), chunk):
        out.append(log_softmax(ctx.decode(ids[s:min(s + chunk, len(ids))], output="all").logits))
    return np.concatenate(out)


def llama_logprobs(path: Path, ids: list[int], n_pos: int, cache_type: str, rotate: bool, threads: int) -> np.ndarray:
    """llama.cpp's (llama-cpp-python, flash attention on) log-probabilities, the same way, a token at a time."""
    os.environ["LLAMA_ATTN_ROT_DISABLE"] = "0" if rotate else "1"
    from llama_cpp import Llama

    from plinth.ops import log_softmax

    llm = Llama(str(path), n_ctx=len(ids) + 16, n_batch=512, n_threads=threads, n_threads_batch=threads,
                type_k=GGML[cache_type], type_v=GGML[cache_type], flash_attn=True, verbose=False)
    start = len(ids) - n_pos
    llm.eval(ids[:start])
    n_vocab = llm.n_vocab()
    out = []
    for t in ids[start:]:
        llm.eval([t])
        out.append(log_softmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))
    del llm
    return np.stack(out)


def compare(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement, mean KL divergence KL(ref || got) in nats) of two runs' log-probabilities."""
    agree = float((ref.argmax(-1) == got.argmax(-1)).mean())
    r = ref.astype(np.float64)
    kld = float((np.exp(r) * (r - got)).sum(-1).mean())
    return agree, kld


def mean_se(x: list[float]) -> tuple[float, float]:
    """The mean of per-window figures and its standard error (0 for one window)."""
    a = np.asarray(x, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1) / np.sqrt(len(a))) if len(a) > 1 else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--types", nargs="+", default=["q8_0", "q4_0"])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--positions", type=int, default=512, help="scored positions a window (its last ones)")
    ap.add_argument("--windows", type=int, default=1,
                    help="windows of --ctx tokens over the texts, each scored on its last --positions")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", nargs="+", default=None,
                    help="text files (end to end) to draw the windows from (default: the system's license texts, "
                    "GPL-3 first)")
    ap.add_argument("--rotation", choices=["both", "on", "off"], default="both")
    ap.add_argument("--only", choices=["plinth", "llama"], default=None, help="run one side only")
    ap.add_argument("--unpacked", action="store_true",
                    help="plinth's scored positions through the general path (the cache rows unpacked, BLAS) "
                    "instead of the kernel that reads the blocks: the same stored values, much faster on a "
                    "loaded machine")
    args = ap.parse_args()

    import plinth
    from plinth import quant

    quant.set_threads(args.threads)
    if args.unpacked:
        import plinth.graph

        sys.modules["plinth.ops.attention"].KERNEL_MAX_Q = 0
        plinth.graph._rows_path = lambda kv, shared, step: False
    texts = [Path(t).read_text() for t in args.text] if args.text else default_corpus()
    cache = Path(os.environ.get("PLINTH_CACHE", Path.home() / ".cache" / "plinth"))
    rots = {"both": (True, False), "on": (True,), "off": (False,)}[args.rotation]
    configs = [(t, rot) for t in args.types for rot in rots]
    engines = [e for e in ("plinth", "llama.cpp") if args.only is None or e.startswith(args.only)]
    per_window: dict[str, dict[str, list[list[float]]]] = {}
    summary: dict[str, dict[str, float]] = {}
    print(f"load: {os.getloadavg()}", flush=True)
    for key in args.models:
        path = cache / MODELS[key]
        model = plinth.load_model(path, tokenizer=True)
        samples = windows(model.tokenizer, texts, args.ctx, args.windows, args.positions)
        rows = per_window.setdefault(key, {})
        for engine in engines:
            t0 = time.perf_counter()
            for w, ids in enumerate(samples):
                if engine == "plinth":
                    def run(t, rot):
                        return plinth_logprobs(model, ids, args.positions, t, rot, args.chunk)
                    ref = run("f32", True)
                else:
                    def run(t, rot):
                        return llama_logprobs(path, ids, args.positions, t, rot, args.threads)
                    ref = run("f16", True)
                for t, rot in configs:
                    agree, kld = compare(ref, run(t, rot))
                    rows.setdefault(f"{engine} {t} rot {'on' if rot else 'off'}", []).append([agree, kld])
                    print(f"{key} window {w}: {engine} {t} rotation {'on ' if rot else 'off'}: top-1 {agree:.2%}, "
                          f"KLD {kld:.5f}", flush=True)
            print(f"{key} {engine}: {time.perf_counter() - t0:.1f} s", flush=True)
        model = None  # (its memory, before the next model loads)
        res = summary.setdefault(key, {})
        n = args.windows * args.positions
        print(f"\n{key}, {args.windows} window(s) x {args.positions} positions at {args.ctx} tokens; mean over "
              f"windows +- its standard error; plinth against its f32 cache, llama.cpp against its f16 cache:")
        for name, vals in rows.items():
            (a, ae), (k, ke) = mean_se([v[0] for v in vals]), mean_se([v[1] for v in vals])
            res[name], res[name + " kld"] = a, k
            print(f"  {name:26s} top-1 {a:.2%} +- {ae:.2%}  KLD {k:.5f} +- {ke:.5f}  ({n} positions)")
        for t, rot in configs:
            name = f"{t} rot {'on' if rot else 'off'}"
            if f"plinth {name}" in rows and f"llama.cpp {name}" in rows:
                p_, l_ = np.array(rows[f"plinth {name}"]), np.array(rows[f"llama.cpp {name}"])
                (da, dae), (dk, dke) = mean_se(list(p_[:, 0] - l_[:, 0])), mean_se(list(p_[:, 1] - l_[:, 1]))
                print(f"  plinth - llama.cpp, {name:12s} top-1 {da:+.2%} +- {dae:.2%}  KLD {dk:+.5f} +- {dke:.5f}")
    print(f"load: {os.getloadavg()}")
    print(json.dumps({"summary": summary, "per_window": per_window}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

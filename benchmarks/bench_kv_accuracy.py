"""Accuracy of quantized K/V caches: teacher-forced top-1 agreement with the unquantized cache.

For each model, the first ``--ctx`` tokens of a real text are run through plinth with a float32
cache, and the argmax at the last ``--positions`` positions kept; then again with each cache type
(``-ctk T -ctv T``), with the Hadamard rotation on and off (``PLINTH_ATTN_ROT_DISABLE``), and the
share of positions whose argmax is the float32 run's reported. llama.cpp (llama-cpp-python, the
same GGUF) is run the same way against its own f16 cache (its default), rotation on and off
(``LLAMA_ATTN_ROT_DISABLE``), flash attention on (llama.cpp needs it for a quantized V cache).

    .venv/bin/python benchmarks/bench_kv_accuracy.py                       # SmolLM2 and Gemma-3, q8_0 and q4_0
    .venv/bin/python benchmarks/bench_kv_accuracy.py --models smollm2 --types q4_0 --ctx 2048

The text: ``--text FILE``, default the GPL-3 text of /usr/share/common-licenses (English prose,
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


def default_text() -> str:
    for p in (Path("/usr/share/common-licenses/GPL-3"),):
        if p.is_file():
            return p.read_text()
    from plinth.testing.interop import llama_cpp_sources

    src = llama_cpp_sources()
    if src is None:
        sys.exit("no text: pass --text FILE")
    return (src / "README.md").read_text()


def plinth_top1(model, ids: list[int], n_pos: int, cache_type: str, rotate: bool, chunk: int) -> np.ndarray:
    os.environ["PLINTH_ATTN_ROT_DISABLE"] = "0" if rotate else "1"
    ctx = model.new_context(cache_type_k=cache_type, cache_type_v=cache_type)
    start = len(ids) - n_pos
    ctx.decode(ids[:start], output="last")
    out = []
    for s in range(start, len(ids), chunk):
        logits = ctx.decode(ids[s:min(s + chunk, len(ids))], output="all").logits
        out.append(np.asarray(logits).argmax(-1))
    return np.concatenate(out)


def llama_top1(path: Path, ids: list[int], n_pos: int, cache_type: str, rotate: bool, threads: int) -> np.ndarray:
    os.environ["LLAMA_ATTN_ROT_DISABLE"] = "0" if rotate else "1"
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=len(ids) + 16, n_batch=512, n_threads=threads, n_threads_batch=threads,
                type_k=GGML[cache_type], type_v=GGML[cache_type], flash_attn=True, verbose=False)
    start = len(ids) - n_pos
    llm.eval(ids[:start])
    n_vocab = llm.n_vocab()
    out = []
    for t in ids[start:]:
        llm.eval([t])
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        out.append(int(np.argmax(logits)))
    del llm
    return np.array(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--types", nargs="+", default=["q8_0", "q4_0"])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", default=None)
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
    text = Path(args.text).read_text() if args.text else default_text()
    cache = Path(os.environ.get("PLINTH_CACHE", Path.home() / ".cache" / "plinth"))
    summary: dict[str, dict[str, float]] = {}
    print(f"load: {os.getloadavg()}", flush=True)
    for key in args.models:
        path = cache / MODELS[key]
        model = plinth.load_model(path, tokenizer=True)
        ids = model.tokenizer.encode(text, add_special=True)
        while len(ids) < args.ctx:
            ids = ids + ids[1:]
        ids = [int(i) for i in ids[: args.ctx]]
        res = summary.setdefault(key, {})
        if args.only == "llama":
            del model
        t0 = time.perf_counter()
        for t in ([] if args.only == "llama" else ["f32"] + args.types):
            if t == "f32":
                ref = plinth_top1(model, ids, args.positions, "f32", True, args.chunk)
                print(f"{key} plinth f32: {time.perf_counter() - t0:.1f} s", flush=True)
                continue
            for rot in (True, False):
                t0 = time.perf_counter()
                got = plinth_top1(model, ids, args.positions, t, rot, args.chunk)
                rate = float((got == ref).mean())
                res[f"plinth {t} rot {'on' if rot else 'off'}"] = rate
                print(f"{key} plinth {t} rotation {'on ' if rot else 'off'}: {rate:.2%} of {args.positions} "
                      f"agree with its f32 cache ({time.perf_counter() - t0:.1f} s)", flush=True)
        if args.only != "llama":
            del model
        if args.only == "plinth":
            continue
        ref = llama_top1(path, ids, args.positions, "f16", True, args.threads)
        for t in args.types:
            for rot in (True, False):
                t0 = time.perf_counter()
                got = llama_top1(path, ids, args.positions, t, rot, args.threads)
                rate = float((got == ref).mean())
                res[f"llama.cpp {t} rot {'on' if rot else 'off'}"] = rate
                print(f"{key} llama.cpp {t} rotation {'on ' if rot else 'off'}: {rate:.2%} of {args.positions} "
                      f"agree with its f16 cache ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"load: {os.getloadavg()}")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""plinth against llama.cpp (llama-cpp-python) on the same GGUF: agreement and speed.

Usage::

    python benchmarks/bench_peer.py [-m MODEL ...] [--threads 2] [--positions 512] [--runs 5] [--transformers]
    python benchmarks/bench_peer.py --synthetic-1b [--prompt-tokens 64] [--runs 3]

Needs llama-cpp-python (``pip install 'plinth[peer]'``); ``--transformers`` also
needs torch==2.13.0 and transformers (``pip install 'plinth[ref]'``). Models
default to both real models (``smollm2-135m-instruct``, ``gemma3-270m``).

* Teacher-forced top-1 agreement over ``--positions`` positions of
  ``tests/golden/real/peer_corpus.txt`` (prose and code written for this
  purpose): how often plinth's argmax equals llama.cpp's, and with
  ``--transformers`` how often transformers' does on the same positions
  (transformers runs on the GGUF weights dequantized to f32, built by
  ``tests/golden/make_real_golden.py``). llama.cpp quantizes activations for its
  quantized dot products, so the bar is relative.
* Prompt processing (``--prompt-tokens`` random ids, one batch each; default 128
  and 512) and greedy decode (``--decode-tokens`` steps) tokens/s of both engines
  with the same thread count in one process, best of ``--runs``, the two engines'
  runs alternating; printed with the ratio plinth / llama.cpp. llama.cpp keeps logits for the last row only, as in a
  normal generation; plinth does the same.
* plinth's resident set after load and after its first forward (which repacks the weights)
  against the file size (the baseline taken with the compiled kernels already loaded), and the cost of a
  k-token verify forward (k = 4, 8; the mean of 4 in a row) after a 128-token context and one decoded token
  (the steady state of speculative decoding) relative to k = 1,
  for both engines; ``--verify-pairs N`` adds N back-to-back (k = 1, k = 8) pairs per engine and the
  spread of their ratios (a shared machine's state moves a compute-bound k = 8 forward far more than
  a one-token one, so one best-of pair can land on either side of a goal).
* ``--synthetic-1b``: the speed part only, on a random ~1.1B-parameter llama in llama.cpp's Q4_K_M
  mix written by the test kit (:func:`plinth.testing.synthetic.write_quantized_llama`: TinyLlama-1.1B's
  shape, hidden 2048, 22 layers, FFN 5632, 32 / 4 heads; ~640 MiB, kept at ``--synthetic-path`` and
  written there first when missing): where the weights, not the Python of a step, set the pace.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "golden" / "real" / "peer_corpus.txt"
MAKER = ROOT / "tests" / "golden" / "make_real_golden.py"
DEFAULT_MODELS = ["smollm2-135m-instruct", "gemma3-270m"]
SYNTHETIC_1B = Path.home() / ".cache" / "plinth" / "synthetic-llama-1b-q4_k_m.gguf"


def _golden():
    spec = importlib.util.spec_from_file_location("plinth_make_real_golden_bench", MAKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _top2_margin(a):
    import numpy as np

    part = np.partition(a, -2, axis=-1)
    return part[..., -1] - part[..., -2]


def _last_logits(llm, n_vocab):
    """llama.cpp's logits of the last evaluated row (llama-cpp-python keeps no copy without logits_all)."""
    import numpy as np

    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))


def agreement(name, path, args, llama_cpp):
    import numpy as np

    import plinth

    model = plinth.load_model(path)
    ids = model.tokenizer.encode(CORPUS.read_text(), add_special=True)[: args.positions]
    ctx = model.new_context()
    ours = np.concatenate([np.asarray(model.backend.to_numpy(ctx.decode(ids[s:s + 128], output="all").logits)).argmax(-1)
                           for s in range(0, len(ids), 128)])
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids) + 8, n_batch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, logits_all=True, verbose=False, type_k=0, type_v=0)
    llm.eval(ids)
    scores = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    peer_top, margin = scores.argmax(-1), _top2_margin(scores)
    del llm, scores
    dis = ours != peer_top
    print(f"{name}: {len(ids)} teacher-forced positions of {CORPUS.name}")
    print(f"  top-1 agreement plinth vs llama.cpp:       {(~dis).mean() * 100:.1f}% ({int(dis.sum())} disagree; "
          f"llama.cpp top-2 margin there: max {margin[dis].max() if dis.any() else 0:.3f})")
    if args.transformers:
        import torch

        torch.set_num_threads(args.threads)
        golden = _golden()
        key = next(k for k, v in golden.MODELS.items() if v["name"] == name or golden.gguf_path(k) == path)
        net, _ = golden.hf_model(key)
        hf_top = golden.hf_logits(net, ids).argmax(-1)
        del net
        print(f"  top-1 agreement transformers vs llama.cpp: {(hf_top == peer_top).mean() * 100:.1f}%")
        print(f"  top-1 agreement plinth vs transformers:    {(hf_top == ours).mean() * 100:.1f}%")


def _rss_mb():
    """This process's resident set now, MiB (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


#: verify forwards timed one after the other per measurement (their mean: one forward of ~10 ms alone
#: swings with a shared machine's noise, and the ratios with it)
VERIFY_REPS = 4
#: the context a verify forward follows (tokens)
VERIFY_CTX = 128


def _plinth_verify(model, k, n_ctx=VERIFY_CTX):
    """Seconds of one forward of k tokens after an n_ctx-token context and one decoded token (the mean
    of VERIFY_REPS such forwards in a row): the steady state of speculative decoding, where verify
    follows verify, not a prompt (right after a prompt batch, BLAS threads still spin while the first
    small forward runs)."""
    import numpy as np

    prompt = np.random.default_rng(1).integers(0, model.n_vocab, n_ctx).tolist()
    ctx = model.new_context()
    ctx.decode(prompt)
    ctx.decode(prompt[:1])
    t = time.perf_counter()
    for i in range(VERIFY_REPS):
        ctx.decode(prompt[k * i:k * (i + 1)], output="all")
    return (time.perf_counter() - t) / VERIFY_REPS


def _peer_verify(llm, n_vocab, k, n_ctx=VERIFY_CTX):
    import numpy as np

    prompt = np.random.default_rng(1).integers(0, n_vocab, n_ctx).tolist()
    llm.reset()
    llm.eval(prompt)
    llm.eval(prompt[:1])
    t = time.perf_counter()
    for i in range(VERIFY_REPS):
        llm.eval(prompt[k * i:k * (i + 1)])
    return (time.perf_counter() - t) / VERIFY_REPS


def _peer_prefill_decode(llm, n_vocab, n, n_decode, clock=time.perf_counter):
    """llama.cpp's (prompt tok/s, decode tok/s) for one run, as plinth's time_prefill_decode runs."""
    import numpy as np

    prompt = np.random.default_rng(0).integers(0, n_vocab, n).tolist()  # as time_prefill_decode
    llm.reset()
    t = clock()
    llm.eval(prompt)
    token = int(np.argmax(_last_logits(llm, n_vocab)))
    pp = clock() - t
    t = clock()
    for _ in range(n_decode):
        llm.eval([token])
        token = int(np.argmax(_last_logits(llm, n_vocab)))
    return n / pp, n_decode / (clock() - t)


def _plinth_prefill_decode(model, n, n_decode, clock):
    """plinth's (prompt tok/s, decode tok/s) for one run on ``clock`` (time_prefill_decode's run)."""
    import numpy as np

    prompt = np.random.default_rng(0).integers(0, model.n_vocab, n).tolist()
    ctx = model.new_context()
    t = clock()
    out = ctx.decode(prompt)
    pp = clock() - t
    token = int(np.argmax(model.backend.to_numpy(out.logits[-1])))
    t = clock()
    for _ in range(n_decode):
        out = ctx.decode([token])
        token = int(np.argmax(model.backend.to_numpy(out.logits[-1])))
    return n / pp, n_decode / (clock() - t)


def speed(name, path, args, llama_cpp):
    """Both engines loaded side by side; every measurement alternates one run of plinth and one of
    llama.cpp, ``--runs`` times, and keeps each engine's best: a machine whose speed drifts during
    the benchmark (a shared one) moves both engines alike instead of biasing the ratio."""
    import plinth
    from plinth.generate import time_prefill_decode

    import plinth.ops

    plinth.ops.warm_up()  # the compiled kernels' code in memory: part of the baseline, not of the model
    rss0 = _rss_mb()
    t = time.perf_counter()
    model = plinth.load_model(path)
    load_s = time.perf_counter() - t
    rss1 = _rss_mb()
    t = time.perf_counter()
    model.new_context().decode([1, 2, 3, 4])  # the first product of each weight repacks it (plinth.quant)
    first_s = time.perf_counter() - t
    rss2 = _rss_mb()
    n_vocab = model.n_vocab
    n_max = max(args.prompt_tokens)
    n_ctx = max(n_max + args.decode_tokens, VERIFY_CTX + 1 + VERIFY_REPS * max(VERIFY_KS)) + 16
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)
    ours, peer = {}, {}
    for n in args.prompt_tokens:
        best = [0.0, 0.0, 0.0, 0.0]  # plinth prompt, decode; llama.cpp prompt, decode (tok/s, best)
        for _ in range(args.runs):
            if args.cpu_time:
                pp, tg = _plinth_prefill_decode(model, n, args.decode_tokens, time.process_time)
                ppp, ptg = _peer_prefill_decode(llm, n_vocab, n, args.decode_tokens, time.process_time)
            else:
                pp, tg = time_prefill_decode(model, n, args.decode_tokens, runs=1)
                ppp, ptg = _peer_prefill_decode(llm, n_vocab, n, args.decode_tokens)
            best = [max(a, b) for a, b in zip(best, (pp, tg, ppp, ptg))]
        ours[n], peer[n] = tuple(best[:2]), tuple(best[2:])
    size = path.stat().st_size / 2**20
    print(f"{name}: {args.threads} threads, best of {args.runs}"
          + (" (tokens per second of this process's CPU time)" if args.cpu_time else ""))
    print(f"  plinth load {load_s:.2f} s; resident set {rss1:.0f} MiB after load ({rss1 - rss0:.0f} MiB added by "
          f"the load), file {size:.0f} MiB: added / file = {(rss1 - rss0) / size:.2f}")
    print(f"  first forward (4 tokens, weights repacked) {first_s:.2f} s; resident set after it {rss2:.0f} MiB: "
          f"added / file = {(rss2 - rss0) / size:.2f}")
    for n in args.prompt_tokens:
        (pp, tg), (ppp, ptg) = ours[n], peer[n]
        print(f"  prompt ({n} tokens) tok/s: plinth {pp:.1f}, llama.cpp {ppp:.1f}, ratio {pp / ppp:.2f}")
    pp, tg = ours[args.prompt_tokens[0]]
    ppp, ptg = peer[args.prompt_tokens[0]]
    print(f"  decode ({args.decode_tokens} tokens) tok/s: plinth {tg:.1f}, llama.cpp {ptg:.1f}, "
          f"ratio {tg / ptg:.2f}", flush=True)
    if args.no_verify:
        return
    ours_verify = {k: float("inf") for k in VERIFY_KS}
    peer_verify = dict(ours_verify)
    for _ in range(args.runs):
        for k in VERIFY_KS:
            ours_verify[k] = min(ours_verify[k], _plinth_verify(model, k))
            peer_verify[k] = min(peer_verify[k], _peer_verify(llm, n_vocab, k))
    pairs = _verify_pairs(model, llm, n_vocab, args.verify_pairs) if args.verify_pairs else None
    del model, llm
    for label, v in (("plinth", ours_verify), ("llama.cpp", peer_verify)):
        print(f"  verify forward after 128 tokens, cost / k=1 ({label}): "
              + ", ".join(f"k={k} {v[k] * 1e3:.1f} ms ({v[k] / v[1]:.2f}x)" for k in VERIFY_KS))
    for label, got in (pairs or {}).items():
        ratios = sorted(k8 / k1 for k1, k8 in got)
        mid = statistics.median(ratios)
        print(f"  verify k=8 / k=1 in {len(ratios)} back-to-back pairs ({label}): min {ratios[0]:.2f}x, "
              f"median {mid:.2f}x, max {ratios[-1]:.2f}x; pairs at or under 2.0x: "
              f"{sum(r <= 2.0 for r in ratios)} of {len(ratios)}; k=8 forward {min(k8 for _, k8 in got) * 1e3:.1f}-"
              f"{max(k8 for _, k8 in got) * 1e3:.1f} ms, k=1 {min(k1 for k1, _ in got) * 1e3:.1f}-"
              f"{max(k1 for k1, _ in got) * 1e3:.1f} ms")


def _verify_pairs(model, llm, n_vocab, n):
    """``n`` pairs per engine of a k=1 then a k=8 verify measurement (each as :func:`_plinth_verify` /
    :func:`_peer_verify` take it), one engine's pair after the other's: {engine: [(k1 s, k8 s), ...]}. A
    pair's two forwards run within ~50 ms of each other, so its ratio is the cost of the k=8 forward at one
    moment of the machine; the spread of the ratios over the pairs shows how far the machine's state moves it
    (the best-of figures above take each k's best at different moments)."""
    out = {"plinth": [], "llama.cpp": []}
    for _ in range(n):
        out["plinth"].append((_plinth_verify(model, 1), _plinth_verify(model, 8)))
        out["llama.cpp"].append((_peer_verify(llm, n_vocab, 1), _peer_verify(llm, n_vocab, 8)))
    return out


VERIFY_KS = (1, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", action="append", default=None, help="model name or .gguf (repeatable)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3, help="repetitions of the speed runs; the best is reported")
    parser.add_argument("--transformers", action="store_true", help="also transformers vs llama.cpp agreement")
    parser.add_argument("--no-agreement", action="store_true")
    parser.add_argument("--no-speed", action="store_true")
    parser.add_argument("--no-verify", action="store_true", help="speed without the verify forwards")
    parser.add_argument("--verify-pairs", type=int, default=0, metavar="N",
                        help="also N back-to-back (k=1, k=8) verify pairs per engine: the spread of the k=8 / k=1 "
                             "ratio over the machine's moments (min, median, max, pairs at or under 2.0x)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="prompt and decode speed on this process's CPU time (with --threads 1 only: a "
                             "loaded machine's figure that does not count the time other processes held the core)")
    parser.add_argument("--synthetic-1b", action="store_true",
                        help="speed only, on a random ~1.1B llama in the Q4_K_M mix (written first when missing)")
    parser.add_argument("--synthetic-path", type=Path, default=SYNTHETIC_1B,
                        help=f"where --synthetic-1b's file is kept (default {SYNTHETIC_1B})")
    args = parser.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)  # before numpy is imported
    os.environ["PLINTH_THREADS"] = str(args.threads)  # plinth's kernels run as many threads as llama.cpp's
    if args.cpu_time and args.threads != 1:
        sys.exit("--cpu-time counts CPU time: it compares the engines at --threads 1 only")

    from plinth import hub

    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is not installed: pip install 'plinth[peer]'")

    print(f"llama-cpp-python {llama_cpp.__version__}; cores: {os.cpu_count()}; "
          f"load average at start: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.synthetic_1b:
        path = args.synthetic_path
        if not path.is_file():
            from plinth.testing.synthetic import write_quantized_llama

            print(f"writing {path} (a random ~1.1B llama, Q4_K_M mix)...", flush=True)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".partial")
            write_quantized_llama(tmp)
            tmp.replace(path)
        speed("synthetic llama 1.1B Q4_K_M", path, args, llama_cpp)
        print(f"load average at end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
        return
    for name in args.model or DEFAULT_MODELS:
        path = hub.resolve_model(name)
        if not args.no_agreement:
            agreement(name, path, args, llama_cpp)
        if not args.no_speed:
            speed(name, path, args, llama_cpp)
    print(f"load average at end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

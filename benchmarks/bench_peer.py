"""plinth against llama.cpp (llama-cpp-python) on the same GGUF: agreement and speed.

Usage: python benchmarks/bench_peer.py [-m MODEL] [--threads 2] [--positions 512] [--transformers]

Needs llama-cpp-python (pip install 'plinth[peer]'); --transformers also needs
torch==2.13.0, transformers and accelerate (pip install 'plinth[ref]').

* Teacher-forced top-1 agreement over --positions positions of real text (the
  Python license text shipped with the interpreter): how often plinth's argmax
  equals llama.cpp's, and, with --transformers, how often transformers' does on
  the same positions (llama.cpp's quantized dot products move logits, so the bar
  is relative).
* Prompt processing and decode tokens/s of both, same thread count, one process.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from pathlib import Path


def corpus_text() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for cand in (stdlib / "LICENSE.txt", stdlib.parent / "LICENSE.txt"):
        if cand.exists():
            return cand.read_text()
    import this  # noqa: F401  (fallback: the Zen of Python)

    return "".join(chr(ord(c)) for c in "Beautiful is better than ugly. " * 100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--transformers", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))

    import numpy as np

    import plinth
    from plinth import hub
    from plinth.generate import time_prefill_decode

    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is not installed: pip install 'plinth[peer]'")

    path = hub.resolve_model(args.model)
    model = plinth.load_model(path)
    tok = model.tokenizer
    ids = tok.encode(corpus_text(), add_special=True)[: args.positions + 1]

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(1024, len(ids) + 8), n_threads=args.threads,
                          n_threads_batch=args.threads, logits_all=True, verbose=False, n_batch=512)
    llm.reset()
    llm.eval(ids[:-1])
    peer_logits = np.array(llm.scores[: len(ids) - 1], dtype=np.float32)
    ours = model.logits(ids[:-1])
    peer_top = peer_logits.argmax(-1)
    our_top = ours.argmax(-1)
    agree = float((peer_top == our_top).mean())
    srt = np.sort(peer_logits, axis=-1)
    margin = srt[:, -1] - srt[:, -2]
    dis = peer_top != our_top
    print(f"model: {path.name}, {len(ids) - 1} teacher-forced positions")
    print(f"top-1 agreement plinth vs llama.cpp: {agree * 100:.1f}% "
          f"({int(dis.sum())} disagreements; llama.cpp top-2 margin there: max "
          f"{margin[dis].max() if dis.any() else 0:.3f})")
    print(f"max |logit| difference plinth vs llama.cpp: {np.abs(ours - peer_logits).max():.3f}")

    if args.transformers:
        import torch
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
        hf.eval()
        with torch.no_grad():
            ref = hf(torch.tensor([ids[:-1]])).logits[0].numpy()
        hf_top = ref.argmax(-1)
        print(f"top-1 agreement transformers vs llama.cpp: {(hf_top == peer_top).mean() * 100:.1f}%")
        print(f"top-1 agreement plinth vs transformers:    {(hf_top == our_top).mean() * 100:.1f}%; "
              f"max |logit| diff {np.abs(ref - ours).max():.2e}")

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.n_vocab, args.prompt_tokens).tolist()
    pp, tg = time_prefill_decode(model, args.prompt_tokens, args.decode_tokens, runs=2)
    # llama.cpp (logits for the last row only, as a normal generation would)
    peer = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads,
                           verbose=False, n_batch=512)
    peer_pp = peer_tg = float("inf")
    for _ in range(2):
        peer.reset()
        t = time.perf_counter()
        peer.eval(prompt)
        peer_pp = min(peer_pp, time.perf_counter() - t)
        token = int(np.argmax(peer.scores[peer.n_tokens - 1]))
        t = time.perf_counter()
        for _ in range(args.decode_tokens):
            peer.eval([token])
            token = int(np.argmax(peer.scores[peer.n_tokens - 1]))
        peer_tg = min(peer_tg, time.perf_counter() - t)
    ppp, ptg = args.prompt_tokens / peer_pp, args.decode_tokens / peer_tg
    print(f"prompt tok/s: plinth {pp:.1f}, llama.cpp {ppp:.1f}, ratio {pp / ppp:.2f}")
    print(f"decode tok/s: plinth {tg:.1f}, llama.cpp {ptg:.1f}, ratio {tg / ptg:.2f}")


if __name__ == "__main__":
    main()

"""Speculative decoding benchmarks on SmolLM2-135M-Instruct.

1. ``ngram`` (prompt lookup) vs plain greedy decoding on input-grounded tasks
   (edit this code, repeat and fix this text, ...): wall-clock speedup, identical
   output, tau and acceptance.
2. The cost of verifying a block of k tokens relative to one token (k = 1, 2, 4, 8, 16).
3. With ``--peer``: the same tasks through llama-cpp-python, plain and with its
   prompt-lookup decoding, side by side (speedups and absolute tokens/s).

    OPENBLAS_NUM_THREADS=2 python benchmarks/bench_spec.py [--tokens 128] [--peer] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

CODE = '''import json


def load_users(path):
    with open(path) as f:
        data = json.load(f)
    users = []
    for item in data["users"]:
        if item.get("active"):
            users.append({"name": item["name"], "email": item["email"]})
    return users


def print_users(users):
    for user in users:
        print(user["name"], "<" + user["email"] + ">")
'''

TEXT = ("The lighthouse stood on the northern cliff for more then two hundred years. Every night its keeper "
        "climbed the spiral stairs, trimed the wick and polished the great lens until it shone. Sailors "
        "said that the light could be seen from fourty miles away, and many of them owed their lives to it. "
        "When the keeper grew old, his daugther took over the work, and she kept the lamp burning through "
        "the worst storm the coast had ever seen.")

TASKS = {
    "edit-code": "Rename the function load_users to read_active_users in this code and print the whole "
                 "updated code:\n\n" + CODE,
    "fix-text": "Repeat the following text exactly, fixing only the spelling mistakes:\n\n" + TEXT,
    "add-docstrings": "Add a one-line docstring to each function in this code and print the whole code:\n\n" + CODE,
}


def chat_ids(model, text):
    from plinth.generate import render_chat

    tok = model.tokenizer
    return tok.encode(render_chat(tok.chat_template, [{"role": "user", "content": text}], tok),
                      add_special=False, parse_special=True)


def bench_ngram(model, n_tokens: int, n_max: int, runs: int) -> list[dict]:
    from plinth.generate import Generator
    from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
    from plinth.speculative.ngram import NgramDrafter

    rows = []
    for name, text in TASKS.items():
        ids = chat_ids(model, text)
        best_plain = best_spec = float("inf")
        for _ in range(runs):
            g = Generator(model)
            t0 = time.perf_counter()
            plain = g.generate(ids, n_tokens)
            best_plain = min(best_plain, time.perf_counter() - t0)
            s = SpeculativeGenerator(model, [NgramDrafter()], config=SpecConfig(n_max=n_max))
            t0 = time.perf_counter()
            spec = s.generate(ids, n_tokens)
            best_spec = min(best_spec, time.perf_counter() - t0)
        st = s.stats
        rows.append({"task": name, "prompt_tokens": len(ids), "tokens": len(plain), "identical": spec == plain,
                     "plain_s": best_plain, "spec_s": best_spec, "speedup": best_plain / best_spec,
                     "tau": st.tau, "acceptance": st.acceptance_rate, "drafts": st.n_drafts,
                     "steps": st.n_steps, "plain_text": model.tokenizer.decode(plain)[:120]})
        print(f"{name:<15} prompt {len(ids):4d}  {len(plain):4d} tokens  plain {best_plain:6.2f} s  "
              f"ngram {best_spec:6.2f} s  speedup {best_plain / best_spec:4.2f}x  identical {spec == plain}  "
              f"tau {st.tau:4.2f}  acceptance {st.acceptance_rate:.2f}")
    return rows


def bench_verify_cost(model, n_ctx: int = 128, ks=(1, 2, 4, 8, 16), runs: int = 5) -> dict[int, float]:
    from plinth.graph import Batch

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.n_vocab, n_ctx).tolist()
    ctx = model.new_context()
    ctx.decode(prompt)
    times = {}
    for k in ks:
        best = float("inf")
        for _ in range(runs):
            toks = rng.integers(0, model.n_vocab, k).tolist()
            t0 = time.perf_counter()
            out = ctx.forward(Batch.from_tokens(toks, start=n_ctx, output="all"))
            np.asarray(model.backend.to_numpy(out.logits)).argmax(axis=-1)
            best = min(best, time.perf_counter() - t0)
            ctx.cache.seq_rm(0, n_ctx)
        times[k] = best
    base = times[ks[0]]
    print("verify cost (block of k tokens after a 128-token context, relative to k = 1):")
    for k in ks:
        print(f"  k = {k:2d}: {times[k] * 1000:7.1f} ms  {times[k] / base:5.2f}x  ({times[k] / base / k:.2f}x per token)")
    return {k: times[k] / base for k in ks}


def bench_peer(path: str, model, n_tokens: int, n_max: int) -> list[dict]:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    rows = []
    plain_llm = Llama(model_path=path, n_ctx=2048, n_threads=2, n_batch=512, verbose=False)
    spec_llm = Llama(model_path=path, n_ctx=2048, n_threads=2, n_batch=512, verbose=False,
                     draft_model=LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=n_max))
    for name, text in TASKS.items():
        ids = chat_ids(model, text)
        res = {}
        for label, llm in (("plain", plain_llm), ("lookup", spec_llm)):
            llm.reset()
            out = []
            t0 = time.perf_counter()
            for t in llm.generate(ids, temp=0.0, top_k=1, reset=True):
                if t == llm.token_eos() or len(out) >= n_tokens:
                    break
                out.append(t)
            res[label] = (time.perf_counter() - t0, out)
        sp = res["plain"][0] / res["lookup"][0]
        rows.append({"task": name, "plain_s": res["plain"][0], "lookup_s": res["lookup"][0], "speedup": sp,
                     "identical": res["plain"][1] == res["lookup"][1], "tokens": len(res["plain"][1])})
        print(f"llama.cpp {name:<15} plain {res['plain'][0]:6.2f} s  prompt-lookup {res['lookup'][0]:6.2f} s  "
              f"speedup {sp:4.2f}x  identical {res['plain'][1] == res['lookup'][1]}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--n-max", type=int, default=8)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--peer", action="store_true", help="also run llama-cpp-python's prompt lookup")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import plinth

    model = plinth.load_model(args.model)
    print(f"model {model.path.name}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}")
    result = {"ngram": bench_ngram(model, args.tokens, args.n_max, args.runs),
              "verify_cost": bench_verify_cost(model)}
    if args.peer:
        result["peer"] = bench_peer(str(model.path), model, args.tokens, args.n_max)
        for mine, theirs in zip(result["ngram"], result["peer"]):
            print(f"{mine['task']:<15} plinth ngram speedup {mine['speedup']:.2f}x vs llama.cpp prompt-lookup "
                  f"{theirs['speedup']:.2f}x; absolute: plinth {mine['tokens'] / mine['spec_s']:.1f} tok/s, "
                  f"llama.cpp {theirs['tokens'] / theirs['lookup_s']:.1f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

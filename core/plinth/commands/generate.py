"""``plinth generate``, ``plinth chat``, ``plinth tokenize`` and ``plinth bench``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from .argtypes import int_range, nonempty
from .models import MODEL_HELP
from .options import (cache_type_args, cache_types, check_args, pipeline_args, sampling_args, set_threads, spec_args,
                      spec_names, threads_arg)

def clean_text(text: str, what: str) -> str:
    """``text`` from argv or stdin as valid UTF-8: undecodable bytes (kept by surrogateescape) become U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as exc:
        try:
            raw = text.encode("utf-8", "surrogateescape")  # the bytes the user gave
        except UnicodeEncodeError:
            raw = text.encode("utf-8", "replace")
        print(f"plinth: warning: {what} is not valid UTF-8 (at character {exc.start}); undecodable bytes "
              "were replaced with U+FFFD", file=sys.stderr)
        return raw.decode("utf-8", "replace")


def image_rows(args: argparse.Namespace, model: Any) -> Any:
    """The embedding rows of ``--image`` (None without it), from the architecture's image encoder.

    A graph that takes images has ``image_encoder(mmproj)`` returning ``encode(path, max_rows) -> [n, n_embd]``
    (``mmproj``: the ``--mmproj`` file holding the vision tower, or None); any other model is refused.
    """
    from ..errors import UserError

    path = getattr(args, "image", None)
    if path is None:
        if getattr(args, "mmproj", None):
            raise UserError("--mmproj without --image: give the image to read")
        return None
    encoder = getattr(model.graph, "image_encoder", None)
    if encoder is None:
        raise UserError(f"{model.path}: the architecture '{model.arch}' is text-only in plinth; --image needs a "
                        "model whose plugin has an image encoder")
    return encoder(getattr(args, "mmproj", None))(path, max(1, model.n_ctx - 1))


def make_generator(args: argparse.Namespace, model: Any) -> Any:
    """A plain or speculative generator from the parsed options."""
    from ..errors import UserError
    from ..generate import Generator

    sampler = _sampler(args)
    names = spec_names(args)
    if getattr(args, "image", None) is not None and names:
        raise UserError("--image with --spec: speculative decoding of a prompt with image rows is not supported yet")
    rows = image_rows(args, model)
    if not names:
        return Generator(model, sampler, prefix_embeddings=rows)
    from ..speculative.engine import SpecConfig, SpeculativeGenerator

    options = {"draft": args.draft, "n_max": args.spec_n_max, "n_min": args.spec_n_min,
               "p_min": args.spec_p_min, "backend": getattr(args, "backend", "numpy"),
               "ngram_max": args.spec_ngram_max, "ngram_min": args.spec_ngram_min, "progress": True,
               "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
               "seed": args.seed}
    drafters = [args.registry.make_drafter(n, model, options) for n in names]
    config = SpecConfig(n_max=args.spec_n_max, n_min=args.spec_n_min, p_min=args.spec_p_min,
                        verifier=args.spec_verify, synthetic_accept=args.spec_synthetic, seed=args.seed,
                        policy=args.spec_policy)
    return SpeculativeGenerator(model, drafters, config=config, sampler=sampler, registry=args.registry)


def run_bench_spec(args: argparse.Namespace) -> int:
    """``plinth bench --spec``: a drafter on held-out prompts against plain decoding."""
    from ..errors import UserError
    from ..train.evaluate import held_out, run_prompts

    if getattr(args, "ray_stages", None):
        raise UserError("--spec with --ray-stages: the drafter evaluation runs in one process")
    if args.spec_synthetic is not None:
        raise UserError("--spec-synthetic with --spec: plinth bench --spec measures the drafter's real acceptance "
                        "(use plinth generate --spec-synthetic for a synthetic rate)")
    kinds = [k.strip() for k in args.prompts.split(",") if k.strip()]
    texts = {k: held_out(k, args.n_prompts) for k in kinds}  # unknown kinds are refused before the model loads
    for name, value in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("repeat_penalty", 1.0),
                        ("seed", 0)):
        setattr(args, name, value)  # greedy: the speculative output must equal the plain one token for token
    model = _load(args)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"model:  {model.path.name}; --spec {args.spec}{' --draft ' + args.draft if args.draft else ''}, "
          f"n_max {args.spec_n_max}, p_min {args.spec_p_min}, policy {args.spec_policy}; {args.n_prompts} held-out "
          f"prompts a kind, at most "
          f"{args.decode_tokens} tokens, greedy, batch 1, {args.clock} clock", flush=True)
    bad = 0
    for kind in kinds:
        r = run_prompts(model, texts[kind], lambda: make_generator(args, model), args.decode_tokens, kind=kind,
                        label=args.spec, clock=clock)
        print(r.line(), flush=True)
        bad += r.n - r.same
    if bad:
        print(f"error: {bad} speculative output(s) differ from plain decoding (a losslessness bug: please report it)",
              file=sys.stderr)
    return 1 if bad else 0


def register(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streamed)",
                       description="Generate a continuation of PROMPT and stream it to stdout. With --chat the "
                       "prompt is wrapped in the model's chat template as one user message.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    p.add_argument("-n", "--max-tokens", type=int_range(1), default=128, help="most tokens to generate (default 128)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--stop", action="append", default=[], type=nonempty,
                   help="stop when this string appears (repeatable)")
    p.add_argument("--stats", action="store_true", help="print load time, tokens/s and timing split to stderr")
    p.add_argument("--backend", default="numpy", help="compute backend (numpy or cupy)")
    p.add_argument("--image", default=None, metavar="FILE",
                   help="an image (PNG, JPEG... read with Pillow) placed before the prompt, for models with an "
                   "image encoder")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="the vision tower's own GGUF, for models that keep it apart (llama.cpp's mmproj convention)")
    threads_arg(p)
    cache_type_args(p)
    sampling_args(p)
    from ..grammar import add_cli_args as grammar_args

    grammar_args(p)
    spec_args(p)
    pipeline_args(p)
    p.set_defaults(func=run_generate, check_args=check_args)

    p = sub.add_parser("chat", help="interactive chat with history",
                       description="Chat with the model in the terminal. Each turn is rendered with the model's "
                       "chat template together with the history. Empty line or Ctrl-D ends.")
    p.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    p.add_argument("-n", "--max-tokens", type=int_range(1), default=256, help="most tokens per reply (default 256)")
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--stats", action="store_true", help="print tokens/s after each reply")
    p.add_argument("--backend", default="numpy", help="compute backend (numpy or cupy)")
    threads_arg(p)
    cache_type_args(p)
    sampling_args(p)
    spec_args(p)
    pipeline_args(p)
    p.set_defaults(func=run_chat, check_args=check_args)

    p = sub.add_parser("tokenize", help="print the token ids of a text",
                       description="Tokenize TEXT with the model's GGUF tokenizer.")
    p.add_argument("text")
    p.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    p.add_argument("--json", action="store_true", help="print ids and pieces as JSON")
    p.add_argument("--no-bos", action="store_true", help="do not add BOS/EOS even if the model asks for it")
    p.add_argument("--parse-special", action="store_true", help="turn special token texts into their ids")
    p.set_defaults(func=run_tokenize)

    p = sub.add_parser("bench", help="measure prompt and decode tokens/s, or a drafter's acceptance and speed-up",
                       description="Time a prefill of --prompt-tokens tokens and --decode-tokens greedy decode "
                       "steps; print tokens/s for both. With --spec: decode held-out prompts (chat, code, "
                       "summarise; subjects plinth's drafter training never uses) plainly and speculatively, "
                       "greedy, batch 1, alternating, and print per kind tau (tokens a verify step keeps), the "
                       "acceptance of each draft position, both speeds and the speed-up, and how many outputs are "
                       "byte-identical (all must be: the exit status is 1 otherwise).")
    p.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    p.add_argument("--prompt-tokens", type=int_range(1), default=128)
    p.add_argument("--decode-tokens", type=int_range(1), default=64,
                   help="greedy decode steps (with --spec: most tokens an answer; default 64)")
    p.add_argument("--runs", type=int_range(1), default=3, help="repetitions; the best is reported")
    p.add_argument("--backend", default="numpy")
    threads_arg(p)
    cache_type_args(p)
    pipeline_args(p)
    spec_args(p)
    e = p.add_argument_group("drafter evaluation (with --spec)")
    e.add_argument("--prompts", default="chat,code,summarise", metavar="KIND[,KIND...]",
                   help="held-out prompt kinds: chat, code (write / complete a function), summarise (summarise / "
                   "rewrite a passage); default all three")
    e.add_argument("--n-prompts", type=int_range(1), default=20, help="prompts per kind (default 20)")
    e.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time by the wall clock or by this process's CPU time (steadier on a shared machine)")
    p.set_defaults(func=run_bench, check_args=check_args)


def _load(args: argparse.Namespace, tokenizer: bool = True) -> Any:
    """The model; with ``tokenizer`` its tokenizer is built (and any fault in it reported) before the weights load."""
    from .. import hub
    from ..model import load_model

    set_threads(args)
    t0 = time.perf_counter()
    if getattr(args, "ray_stages", None):
        from ..pipeline import load_pipeline
        from .options import plugin_selection

        model = load_pipeline(args.model or hub.DEFAULT_MODEL, args.ray_stages, address=args.ray_address,
                              split=args.ray_split, backend=getattr(args, "backend", "numpy"),
                              plugins=plugin_selection(args),
                              threads=args.threads, cpus=args.ray_cpus)
        if tokenizer:
            model.tokenizer
        if getattr(args, "stats", False):
            print(f"[loaded {model.describe()} in {time.perf_counter() - t0:.2f} s]", file=sys.stderr)
        return model
    model = load_model(args.model or hub.DEFAULT_MODEL, backend=getattr(args, "backend", "numpy"),
                       registry=args.registry, progress=True, tokenizer=tokenizer, **cache_types(args))
    model.prepare()  # the weights' one-time repacking belongs to the load, not to the prompt's speed
    if getattr(args, "stats", False):
        print(f"[loaded {model.path.name} ({model.arch}) in {time.perf_counter() - t0:.2f} s]", file=sys.stderr)
    return model


def _sampler(args: argparse.Namespace) -> Any:
    from ..sampling import Sampler, SamplerConfig

    return Sampler(SamplerConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                 min_p=args.min_p, repetition_penalty=args.repeat_penalty, seed=args.seed))


def run_generate(args: argparse.Namespace) -> int:
    from ..generate import render_chat

    prompt = clean_text(args.prompt, "the prompt")
    spec_names(args)
    model = _load(args)
    tok = model.tokenizer
    if args.chat:
        text = render_chat(tok.chat_template, [{"role": "user", "content": prompt}], tok)
        ids = tok.encode(text, add_special=False, parse_special=True)
    else:
        ids = tok.encode(prompt, add_special=True)
    gen = make_generator(args, model)
    if args.json_schema or args.grammar:
        from ..grammar import constraint_from_args

        gen.constraint = constraint_from_args(args, tok, model.n_vocab)
    for chunk in gen.stream(ids, max_tokens=args.max_tokens, stop=args.stop):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats:
        from ..cache import format_bytes_by_kind

        print(f"[{gen.stats.summary()}]", file=sys.stderr)
        types = getattr(gen.context.cache, "types", None)  # (a pipeline's cache: f32 only)
        typed = "" if types is None or types.plain else f"; k {types.k.name}, v {types.v.name}"
        print(f"[cache: {format_bytes_by_kind(gen.context.cache.nbytes_by_kind())}{typed}]", file=sys.stderr)
    if gen.stats.n_generated == 0 and gen.stats.stop_reason == "end of generation token" and not args.chat:
        hint = " (the model has a chat template: try --chat)" if tok.chat_template else ""
        print(f"plinth: the model ended the text at once{hint}", file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from ..generate import render_chat

    spec_names(args)
    model = _load(args)
    tok = model.tokenizer
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    gen = make_generator(args, model)
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or not line.strip():
            return 0
        messages.append({"role": "user", "content": clean_text(line.strip(), "the input line")})
        text = render_chat(tok.chat_template, messages, tok)
        ids = tok.encode(text, add_special=False, parse_special=True)
        reply = []
        for chunk in gen.stream(ids, max_tokens=args.max_tokens):
            reply.append(chunk)
            sys.stdout.write(chunk)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
        if args.stats:
            print(f"[{gen.stats.summary()}]", file=sys.stderr)


def run_tokenize(args: argparse.Namespace) -> int:
    from .. import hub
    from ..gguf import GGUFFile
    from ..tokenizer import Tokenizer

    path = hub.resolve_model(args.model or hub.DEFAULT_MODEL, progress=True)
    with GGUFFile(path) as gf:
        tok = Tokenizer.from_metadata(dict(gf.metadata), source=str(path))
    ids = tok.encode(clean_text(args.text, "the text"), add_special=not args.no_bos, parse_special=args.parse_special)
    if args.json:
        pieces = [tok.token_to_piece(i).decode("utf-8", errors="replace") for i in ids]
        print(json.dumps({"ids": ids, "pieces": pieces}, ensure_ascii=False))
    else:
        print(" ".join(str(i) for i in ids))
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from ..generate import time_prefill_decode

    if args.spec:
        return run_bench_spec(args)
    model = _load(args, tokenizer=False)
    pp, tg = time_prefill_decode(model, args.prompt_tokens, args.decode_tokens, runs=args.runs)
    if getattr(args, "ray_stages", None):
        print(f"model:  {model.describe()}")
    else:
        print(f"model:  {model.path.name} ({model.arch}, {model.stats.n_params / 1e6:.1f} M params, backend "
              f"{model.backend.name})")
    print(f"prompt: {args.prompt_tokens} tokens, {pp:.1f} tok/s")
    print(f"decode: {args.decode_tokens} tokens, {tg:.1f} tok/s")
    return 0



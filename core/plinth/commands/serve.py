"""``plinth serve``: the OpenAI-compatible server (see docs/serving.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .argtypes import float_range, require, subparser_of
from .models import MODEL_HELP
from .options import cache_type_args, check_args, plugin_selection, spec_args, threads_arg


def _int_in(lo: int, hi: int | None = None) -> Any:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
        return v

    return parse


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API, with a chat page",
                       description="Serve MODEL at http://HOST:PORT/: /v1/completions and /v1/chat/completions (SSE "
                       "streaming), /v1/embeddings, /tokenize, /detokenize, /v1/models[/ID], /health, /metrics "
                       "(Prometheus) and a chat page at /. Every request field is honoured or refused by name. "
                       "Concurrent requests decode together in one batch. Needs `pip install 'plinth[serve]'`.")
    p.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_int_in(1, 65535), default=8080, help="port (default 8080)")
    p.add_argument("--model-alias", default=None,
                   help="the model id clients name (default: the model file's name without .gguf)")
    p.add_argument("--n-ctx", type=_int_in(16), default=None,
                   help="context length per sequence (default: the model's training context)")
    p.add_argument("--max-batch", type=_int_in(1, 1024), default=16,
                   help="requests decoding together at most (default 16)")
    p.add_argument("--max-queue", type=_int_in(0), default=64,
                   help="requests waiting for a place at most; more get 429 (default 64)")
    p.add_argument("--prefill-chunk", type=_int_in(1), default=256,
                   help="prompt tokens run per step over all new requests (default 256)")
    p.add_argument("--prompt-cache", type=_int_in(0), default=32, metavar="N",
                   help="whole prompts kept for reuse, least recently used first out: a request whose prompt "
                        "tokens equal a kept one's skips its prefill (default 32; 0: off; speculative requests "
                        "always prefill)")
    p.add_argument("--prompt-cache-tokens", type=_int_in(0), default=16384, metavar="N",
                   help="prompt tokens the prompt cache keeps over all its prompts (default 16384)")
    p.add_argument("--backend", default="numpy", help="compute backend (numpy or cupy)")
    p.add_argument("--lenient", action="store_true",
                   help="log and drop request fields the server does not know (default: a 400 naming the field); a "
                        "known field the server does not serve is refused either way")
    p.add_argument("--allowed-origins", default=None, metavar="ORIGIN[,ORIGIN...]",
                   help="origins a browser page may call the API from (CORS), e.g. http://localhost:3000; '*' for any "
                        "(default: none, CORS off)")
    p.add_argument("--pooling", default="model", choices=["model", "mean", "cls", "last"],
                   help="the pooling of /v1/embeddings: the model file's own (default; mean where it declares none), "
                        "or mean, cls, last")
    threads_arg(p)
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning)")
    cache_type_args(p)
    spec_args(p)
    g = p.add_argument_group("Ray Serve", "run replicas of this server on a Ray cluster behind Ray Serve's HTTP "
                             "proxy (needs `pip install 'plinth[ray]'`; see docs/scale-out.md)")
    g.add_argument("--ray", type=_int_in(1), default=None, metavar="REPLICAS",
                   help="serve with this many Ray Serve replicas, each loading the model once, on --host/--port")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="an existing Ray cluster (e.g. 127.0.0.1:6379 or auto); default: start a local one")
    g.add_argument("--ray-max-replicas", type=_int_in(1), default=None, metavar="N",
                   help="autoscale between --ray and this many replicas by queued requests")
    g.add_argument("--ray-cpus", type=float_range(0.0, lo_open=True), default=1.0, metavar="CPUS",
                   help="CPUs Ray reserves for each replica (default 1)")
    p.set_defaults(func=run_serve, check_args=check_serve_args)


def check_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_args(parser, args)
    sub = subparser_of(parser, args)
    if args.ray is None:
        for flag, value in (("--ray-address", args.ray_address), ("--ray-max-replicas", args.ray_max_replicas)):
            require(sub, value is None, f"{flag} needs --ray REPLICAS")
    elif args.ray_max_replicas is not None:
        require(sub, args.ray_max_replicas >= args.ray,
                f"--ray-max-replicas {args.ray_max_replicas} is smaller than --ray {args.ray}")


def run_serve(args: argparse.Namespace) -> int:
    if args.ray is not None:
        from ..serve.ray import serve_on_ray

        return serve_on_ray(args, plugin_selection(args))
    try:
        import uvicorn
    except ImportError as exc:
        from ..errors import missing_extra

        raise missing_extra("plinth serve", "serve", exc) from None
    from ..serve.app import build_app
    from ..serve.build import build_server

    server = build_server(args, progress=True)  # (--threads: set there, and taken by the scheduler thread)
    print(f"plinth serve: {describe(server, args)} on http://{args.host}:{args.port}/", file=sys.stderr, flush=True)
    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_graceful_shutdown=5)
    return 0


def describe(server: Any, args: argparse.Namespace) -> str:
    m = server.model
    names = server.spec_names
    return (f"{server.model_id} ({m.arch}, n_ctx {m.n_ctx}, batch {args.max_batch}, queue "
            f"{args.max_queue}{', speculative ' + ','.join(names) if names else ''})")

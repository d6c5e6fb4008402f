"""Option groups and rules shared by several commands (generate, chat, bench, serve).

Each ``*_args(parser)`` adds one group; :func:`check_args` holds the rules between options and the
names plugins provide, run before any model loads.
"""

from __future__ import annotations

import argparse

from .argtypes import float_range, int_range, require, subparser_of

SEED_MAX = 2**64 - 1


def sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float_range(0.0), default=0.0, help="0 = greedy (default 0)")
    g.add_argument("--top-k", type=int_range(0), default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float_range(0.0, 1.0, lo_open=True), default=1.0,
                   help="nucleus sampling mass, in (0, 1] (1.0 = off)")
    g.add_argument("--min-p", type=float_range(0.0, 1.0), default=0.0,
                   help="drop tokens below min_p x the top probability, in [0, 1]")
    g.add_argument("--repeat-penalty", type=float_range(0.0, lo_open=True), default=1.0,
                   help="penalty on recent tokens, > 0 (1.0 = off)")
    g.add_argument("--seed", type=int_range(0, SEED_MAX), default=None, help="seed for reproducible sampling")


def spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding", "draft several tokens per step and verify them in one "
                             "target forward; greedy output is unchanged, sampled output keeps its distribution")
    g.add_argument("--spec", default=None, metavar="NAME[,NAME...]",
                   help="drafter(s): ngram (prompt lookup), draft (a smaller model, see --draft), or a plugin "
                   "drafter such as dflash (`plinth plugins` lists them); several, comma-separated, are tried "
                   "in order each step and the first that proposes a draft drafts it")
    g.add_argument("--draft", default=None, metavar="MODEL",
                   help="the draft model / drafter file for --spec draft (or a plugin drafter that needs a file)")
    g.add_argument("--spec-n-max", type=int_range(1), default=8, help="longest draft per step (default 8)")
    g.add_argument("--spec-n-min", type=int_range(0), default=0, help="drop drafts shorter than this (default 0)")
    g.add_argument("--spec-p-min", type=float_range(0.0, 1.0), default=0.0,
                   help="cut a draft at its first token whose draft probability is below this (default 0)")
    g.add_argument("--spec-verify", default="auto",
                   help="verification rule: auto (greedy at temperature 0, else rejection), greedy, rejection")
    g.add_argument("--spec-ngram-max", type=int_range(1), default=3,
                   help="ngram: longest suffix to look up (default 3)")
    g.add_argument("--spec-ngram-min", type=int_range(1), default=2,
                   help="ngram: shortest suffix to look up (default 2)")
    g.add_argument("--spec-policy", default="auto", choices=["auto", "always"],
                   help="when and how long to draft: auto (default) drafts only where the drafter's measured "
                        "acceptance pays for the verify rows and the drafter's own time, decoding plainly otherwise "
                        "and re-trying a draft now and then; alone (generate, chat, bench) it also picks the draft "
                        "length expected to give the most tokens a second, in a server it stops drafting under a "
                        "full batch (/metrics counts the decisions: plinth_spec_policy_decisions_total). always: "
                        "every step drafts up to --spec-n-max tokens. Greedy output is the same either way; seeded "
                        "sampled output keeps its distribution, its exact tokens follow the steps that drafted")
    g.add_argument("--spec-synthetic", type=float_range(0.0, 1.0), default=None, metavar="RATE",
                   help="benchmark only: accept each drafted position with this probability instead of "
                   "verifying (the text is then NOT the model's output)")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The rules between options and the names plugins provide, checked before any model loads."""
    from ..plugins import PluginError

    sub = subparser_of(parser, args)
    if hasattr(args, "ray_stages"):
        _check_pipeline_args(sub, args)
        require(sub, not args.ray_stages or (getattr(args, "cache_type_k", "f32") == "f32"
                                             and getattr(args, "cache_type_v", "f32") == "f32"),
                "--cache-type-k / --cache-type-v are not carried to --ray-stages pipeline stages yet (f32 only)")
    if hasattr(args, "spec_n_max"):
        require(sub, args.spec_n_min <= args.spec_n_max,
                f"--spec-n-min {args.spec_n_min} is larger than --spec-n-max {args.spec_n_max}")
        require(sub, args.spec_ngram_min <= args.spec_ngram_max,
                f"--spec-ngram-min {args.spec_ngram_min} is larger than --spec-ngram-max {args.spec_ngram_max}")
        verifiers = ["auto", *args.registry.names("verifiers")]
        require(sub, args.spec_verify in verifiers,
                f"--spec-verify {args.spec_verify!r} is unknown (choose from {', '.join(verifiers)})")
        try:
            spec_names(args)
        except PluginError as exc:
            sub.error(f"--spec: {exc}")
    if hasattr(args, "backend"):
        backends = args.registry.names("backends")
        require(sub, args.backend in backends,
                f"--backend {args.backend!r} is unknown (choose from {', '.join(backends)})")
        try:
            args.registry.make_backend(args.backend)
        except (PluginError, RuntimeError) as exc:
            sub.error(f"--backend {args.backend}: {exc}")


def spec_names(args: argparse.Namespace) -> list[str]:
    """The --spec drafter names, each checked against the registry before any model is loaded."""
    from ..speculative.engine import drafter_names

    return drafter_names(getattr(args, "spec", None), args.registry)


def plugin_selection(args: argparse.Namespace) -> dict[str, object]:
    """The :func:`plinth.plugins.discover` arguments of the global plugin options in ``args``."""
    return {"plugins": args.plugins, "disable": args.disable_plugins, "strict": args.strict_plugins,
            "prefer": args.prefer}


def pipeline_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray pipeline", "split the model by layers over Ray actors (pipeline stages), e.g. "
                             "across machines of a Ray cluster; needs `pip install 'plinth[ray]'` (see "
                             "docs/scale-out.md)")
    g.add_argument("--ray-stages", type=int_range(1), default=None, metavar="N",
                   help="run the model as N pipeline stages, each a Ray actor holding its layers and their cache")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="an existing Ray cluster (e.g. 127.0.0.1:6379 or auto); default: start a local one")
    g.add_argument("--ray-split", type=_int_list, default=None, metavar="L1[,L2...]",
                   help="first layer of stages 2..N (default: layers split evenly)")
    g.add_argument("--ray-cpus", type=float_range(0.0, lo_open=True), default=1.0, metavar="CPUS",
                   help="CPUs Ray reserves for each stage (default 1)")


def _check_pipeline_args(sub: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.ray_stages is None:
        for flag, value in (("--ray-address", args.ray_address), ("--ray-split", args.ray_split)):
            require(sub, value is None, f"{flag} needs --ray-stages N")
        return
    require(sub, getattr(args, "image", None) is None, "--image with --ray-stages: a pipeline takes token prompts "
            "only (the image encoder needs the model in one process)")
    if args.ray_split is not None:
        require(sub, len(args.ray_split) == args.ray_stages - 1,
                f"--ray-split gives {len(args.ray_split)} first layer(s); {args.ray_stages} stages need "
                f"{args.ray_stages - 1}")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer numbers") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: layer numbers start at 1 (stage 1 starts at layer 0)")
    return values


def threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int_range(1), default=None, metavar="N",
                   help="threads for the quantized-weight kernels (default: $PLINTH_THREADS, else the physical cores)")


def _cache_type(text: str) -> str:
    from ..kvtypes import CACHE_TYPES

    if text.lower() not in CACHE_TYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a cache type (choose from {', '.join(CACHE_TYPES)})")
    return text.lower()


def cache_type_args(p: argparse.ArgumentParser) -> None:
    """``-ctk`` / ``--cache-type-k`` and ``-ctv`` / ``--cache-type-v``: the K/V cache's storage types."""
    from ..kvtypes import CACHE_TYPES

    names = ", ".join(CACHE_TYPES)
    p.add_argument("-ctk", "--cache-type-k", type=_cache_type, default="f32", metavar="TYPE",
                   help=f"how the cache stores keys (and MLA latents, indexer keys): {names} (default f32). The "
                   "q types are GGUF blocks, turned by a Hadamard rotation first (PLINTH_ATTN_ROT_DISABLE=1: off)")
    p.add_argument("-ctv", "--cache-type-v", type=_cache_type, default="f32", metavar="TYPE",
                   help=f"how the cache stores values: {names} (default f32)")


def cache_types(args: argparse.Namespace) -> dict[str, str]:
    """``load_model``'s cache type keywords from the parsed options."""
    return {"cache_type_k": getattr(args, "cache_type_k", "f32"), "cache_type_v": getattr(args, "cache_type_v", "f32")}


def set_threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None) is not None:
        from .. import quant

        quant.set_threads(args.threads)

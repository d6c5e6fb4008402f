"""The ``plinth`` command line.

Subcommands are registered, not hard-wired: the core adds its own from
:data:`CORE_COMMANDS` and every loaded plugin may add more through the
``plinth_add_commands`` hook. Each command module keeps its heavy imports inside
the function that runs it, so ``plinth --help`` and ``plinth plugins`` stay fast.
"""

from __future__ import annotations

# Only modules the interpreter has already loaded are imported at the top, so that a
# Ctrl-C lands inside main()'s handler from its first instruction (argparse, typing and
# the rest are imported inside it).
import os
import sys

from ._version import PLUGIN_API_VERSION, __version__

#: Modules under plinth.commands, each with ``register(subparsers)``.
CORE_COMMANDS = ["plugins", "models", "generate", "convert", "serve", "embed", "train_drafter"]


def _global_parser(add_help: bool) -> argparse.ArgumentParser:  # noqa: F821
    import argparse

    parser = argparse.ArgumentParser(
        prog="plinth",
        add_help=add_help,
        description="plinth: run GGUF language models with numpy or cupy; every architecture "
        "and speculative-decoding drafter is a plugin.",
        epilog="Environment: PLINTH_PLUGINS (only these entry-point names; empty = none), "
        "PLINTH_DISABLE_PLUGINS, PLINTH_PREFER, PLINTH_STRICT_PLUGINS=1, PLINTH_ALLOW_UNUSED=1, "
        "PLINTH_CACHE (model cache). "
        "Run `plinth COMMAND --help` for each command.",
    )
    parser.add_argument("--version", action="version",
                        version=f"plinth {__version__} (plugin API {PLUGIN_API_VERSION})")
    parser.add_argument("--plugins", metavar="A,B", default=None,
                        help="load only these plugins (entry-point names); '' loads none (default: $PLINTH_PLUGINS or all)")
    parser.add_argument("--disable-plugins", metavar="A,B", default=None,
                        help="never load these plugins (added to $PLINTH_DISABLE_PLUGINS)")
    parser.add_argument("--prefer", metavar="A,B", default=None,
                        help="plugins that win when two provide the same name (added to $PLINTH_PREFER)")
    parser.add_argument("--strict-plugins", action="store_true", default=None,
                        help="fail if any plugin fails to load (as PLINTH_STRICT_PLUGINS=1)")
    parser.add_argument("--allow-unused", action="store_true", default=None,
                        help="load model files holding tensors or architecture keys that the architecture does "
                        "not read (refused by default: the result may be wrong; as PLINTH_ALLOW_UNUSED=1)")
    return parser


def build_parser(registry: object | None = None, strict: bool = False) -> argparse.ArgumentParser:  # noqa: F821
    """The full parser: global options, core commands and plugin commands (a failing plugin's are skipped)."""
    import importlib

    parser = _global_parser(add_help=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in CORE_COMMANDS:
        importlib.import_module(f"plinth.commands.{name}").register(sub)
    if registry is not None:
        registry.add_commands(sub, strict=strict)  # type: ignore[attr-defined]
    return parser


def _one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      file: object = None, line: str | None = None) -> None:
    """Warnings from plinth and its plugins print as one line, without a source path."""
    text = " ".join(str(message).split())
    try:
        print(f"plinth: warning: {text}", file=file or sys.stderr)
    except OSError:  # stderr closed
        pass


def main(argv: Sequence[str] | None = None) -> int:  # noqa: F821
    """Run the CLI; Ctrl-C anywhere exits 130 with one blank line, a closed pipe exits quietly."""
    try:
        try:
            code = _main(argv)
            sys.stdout.flush()  # a closed pipe shows here, inside the handler
            return code
        except BrokenPipeError:
            # the Python docs' recipe: point stdout at devnull so the interpreter's final flush is quiet
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 1
    except KeyboardInterrupt:
        try:
            print("", file=sys.stderr)
        except OSError:
            pass
        return 130


def parse_command(argv: Sequence[str]) -> argparse.Namespace:  # noqa: F821
    """Parse a command line as ``plinth`` does (plugin discovery from the global options and the
    environment, every option and rule checked) without running it: ``args.func(args)`` runs it.

    A usage error exits (``SystemExit(2)``) as the CLI does; a broken plugin set raises
    :class:`~plinth.plugins.PluginError`. ``args.func`` is None when no command was given.
    Ray Serve replicas rebuild their ``plinth serve`` options with this.
    """
    # global options may stand anywhere; read them first, since they decide which
    # plugins (and so which subcommands) exist
    pre, rest = _global_parser(add_help=False).parse_known_args(list(argv))
    if pre.allow_unused:  # read by every load (plinth.model.load_model), Ray actors' included
        os.environ["PLINTH_ALLOW_UNUSED"] = "1"

    from .commands.options import plugin_selection
    from .plugins import discover

    registry = discover(**plugin_selection(pre))
    parser = build_parser(registry, strict=bool(registry.strict))
    args = parser.parse_args(rest)
    for key in ("plugins", "disable_plugins", "prefer", "strict_plugins", "allow_unused"):
        setattr(args, key, getattr(pre, key))
    args.parser = parser
    if not getattr(args, "func", None):
        args.func = None
        return args
    args.registry = registry
    check = getattr(args, "check_args", None)
    if check is not None:  # cross-option rules, still before any model loads
        check(parser, args)
    return args


def _main(argv: Sequence[str] | None = None) -> int:  # noqa: F821
    argv = list(sys.argv[1:] if argv is None else argv)
    import warnings

    from .plugins import PluginError

    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        try:
            args = parse_command(argv)
        except PluginError as exc:
            print(f"plinth: error: {exc}", file=sys.stderr)
            return 2
        if args.func is None:
            args.parser.print_help()
            return 0
        try:
            return int(args.func(args) or 0)
        except Exception as exc:
            from .errors import UserError

            if isinstance(exc, (UserError, PluginError)):
                print(f"plinth: error: {exc}", file=sys.stderr)
                return 1
            raise


def ray_serve_app(config: dict[str, object]) -> object:
    """Ray Serve's entry for ``serve run plinth.cli:ray_serve_app args="-m MODEL ..." replicas=2
    [max_replicas=4] [cpus=1]``: ``args`` is a ``plinth serve`` command line (see docs/scale-out.md)."""
    import shlex

    from .commands.options import plugin_selection
    from .pipeline import carried_env
    from .serve.ray import deployment, replica_fields

    args = parse_command(["serve", *shlex.split(str(config.get("args", "")))])
    replicas = int(config.get("replicas", args.ray or 1))  # type: ignore[call-overload]
    max_replicas = config.get("max_replicas", args.ray_max_replicas)
    fields = replica_fields(args, plugin_selection(args))
    fields["ray"] = None  # a replica is a plain server
    return deployment(fields, replicas=replicas,
                      max_replicas=int(max_replicas) if max_replicas is not None else None,  # type: ignore
                      cpus=float(config.get("cpus", args.ray_cpus)), env=carried_env())  # type: ignore[arg-type]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

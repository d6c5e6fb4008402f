"""The ``plinth`` command line.

Subcommands are registered, not hard-wired: the core adds its own from
:data:`CORE_COMMANDS` and every loaded plugin may add more through the
``plinth_add_commands`` hook. Each command module keeps its heavy imports inside
the function that runs it, so ``plinth --help`` and ``plinth plugins`` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from ._version import PLUGIN_API_VERSION, __version__

#: Modules under plinth.commands, each with ``register(subparsers)``.
CORE_COMMANDS = ["plugins", "models", "generate", "convert", "serve"]


def _global_parser(add_help: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plinth",
        add_help=add_help,
        description="plinth: run GGUF language models with numpy or cupy; every architecture "
        "and speculative-decoding drafter is a plugin.",
        epilog="Environment: PLINTH_PLUGINS (only these entry-point names; empty = none), "
        "PLINTH_DISABLE_PLUGINS, PLINTH_PREFER, PLINTH_STRICT_PLUGINS=1, PLINTH_CACHE (model cache). "
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
    return parser


def build_parser(registry: object | None = None) -> argparse.ArgumentParser:
    """The full parser: global options, core commands and plugin commands."""
    parser = _global_parser(add_help=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in CORE_COMMANDS:
        importlib.import_module(f"plinth.commands.{name}").register(sub)
    if registry is not None:
        registry.add_commands(sub)  # type: ignore[attr-defined]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # global options may stand anywhere; read them first, since they decide which
    # plugins (and so which subcommands) exist
    pre, rest = _global_parser(add_help=False).parse_known_args(argv)

    from .plugins import PluginError, discover

    try:
        registry = discover(plugins=pre.plugins, disable=pre.disable_plugins,
                            strict=pre.strict_plugins, prefer=pre.prefer)
    except PluginError as exc:
        print(f"plinth: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser(registry)
    args = parser.parse_args(rest)
    for key in ("plugins", "disable_plugins", "prefer", "strict_plugins"):
        setattr(args, key, getattr(pre, key))
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    args.registry = registry
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except Exception as exc:
        from .errors import UserError

        if isinstance(exc, (UserError, PluginError)):
            print(f"plinth: error: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

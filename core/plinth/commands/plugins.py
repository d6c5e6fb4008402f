"""``plinth plugins``: list every discovered plugin and how its loading went."""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "plugins",
        help="list discovered plugins, what they provide and their load status",
        description="List every plugin found in the 'plinth.plugins' entry-point group (and the built-in one): "
        "name, distribution, version, plugin API version, what it provides and whether it loaded. "
        "A plugin that failed to load is shown with its error and a hint; the others keep working.",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    p.add_argument("--check", action="store_true",
                   help="also import every path each loaded plugin's manifest declares; exit 1 if any fails")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    registry = args.registry
    rows = [rec.as_dict() for rec in registry.records]
    conflicts = [
        {"kind": kind[:-1], "name": name, "plugins": owners} for (kind, name), owners in registry.conflicts().items()
    ]
    problems = registry.check_manifests() if args.check else []
    for row in rows:
        row["check"] = [f"{kind} '{item}': {err}" for plugin, kind, item, err in problems if plugin == row["name"]]
        if args.check and row["check"]:
            row["status"] = "broken"
    code = 1 if problems else 0
    if args.json:
        print(json.dumps({"plugins": rows, "unknown_selected": registry.unknown_selected,
                          "conflicts": conflicts}, indent=2))
        return code
    for row in rows:
        dist = f"{row['distribution'] or '?'} {row['version'] or ''}".strip()
        api = row["api_version"] or "-"
        print(f"{row['name']:<14} {row['status']:<9} {dist:<28} api {api}")
        for kind, names in row["provides"].items():
            print(f"    {kind}: {', '.join(names)}")
        if row["error"]:
            print(f"    error: {row['error']}")
        if row["hint"]:
            print(f"    hint: {row['hint']}")
        if row["warning"]:
            print(f"    warning: {row['warning']}")
        for problem in row["check"]:
            print(f"    check failed: {problem}")
    for name in registry.unknown_selected:
        print(f"unknown plugin selected: {name} (no entry point of that name is installed)")
    for c in conflicts:
        print(f"conflict: the {c['kind']} '{c['name']}' is provided by {' and '.join(c['plugins'])}; "
              f"choose one with --prefer or PLINTH_PREFER")
    if args.check:
        print(f"check: {len(problems)} manifest import path(s) failed" if problems else
              "check: every manifest import path imports")
    return code

"""What plugin code may import of the core, and the import graph of the core itself.

:data:`PUBLIC_MODULES` is the public API for plugins (docs/writing-a-plugin.md states the same list):
a plugin imports these modules (and ``plinth.testing``'s submodules, in its tests and test kits) and
nothing else of ``plinth``. :func:`private_imports` lists the imports of a plugin's sources that break
that rule; plinth's own test runs it over every bundled plugin, and a third-party plugin can run it
over its own package.

:func:`import_cycles` finds cycles among a package's modules by reading their ``import`` statements
(no code runs): module-level imports only by default, as those are what import order depends on.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable, Iterator

#: the core modules plugin code may import
PUBLIC_MODULES = (
    "plinth",  # load_model, Model, Context, Generator, hookimpl, Manifest, ManifestPlugin, the errors
    "plinth.graph",  # everything a forward is built from, the tensor checks, QuantWeight, NumpyBackend
    "plinth.ops",  # the maths
    "plinth.manifest",  # Manifest, ManifestPlugin (plugin.py)
    "plinth.errors",  # UserError
    "plinth.convert",  # converters: read_config, SafetensorsDir, write_gguf, map_names, ...
    "plinth.gguf",  # reading GGUF files (GGUFFile, quants): draft formats, converters' checks
    "plinth.speculative.base",  # drafters: BaseDrafter, Draft, DrafterRequirements, TargetOutput
    "plinth.speculative.draft_head",  # HeadDrafter, for draft heads shipped in target files
    "plinth.testing",  # tests and test kits (with its submodules)
)


def is_public(module: str) -> bool:
    """Whether plugin code may import ``module`` (a ``plinth`` module, or anything outside plinth)."""
    if module != "plinth" and not module.startswith("plinth."):
        return True
    if module in PUBLIC_MODULES:
        return True
    return module.startswith(("plinth.testing.", "plinth.gguf."))


def module_name(path: Path, root: Path) -> str:
    """``root/plinth/quant/__init__.py`` -> ``plinth.quant``; ``root/plinth/ops/ffn.py`` -> ``plinth.ops.ffn``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _import_nodes(tree: ast.Module, nested: bool) -> Iterator[ast.AST]:
    """The import statements run when the module loads (under ``if``/``try`` too, not under
    ``if TYPE_CHECKING``), and with ``nested`` those inside functions and classes as well."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif _type_checking(node):
            continue
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            if nested:
                todo.extend(ast.iter_child_nodes(node))
        else:
            todo.extend(ast.iter_child_nodes(node))


def imports(path: Path, module: str, *, nested: bool = False, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, imported name) for each import in the file ``path`` of module ``module``; relative imports
    resolved; ``from X import y`` gives ``X.y`` (a submodule or a name in X: see :func:`resolve`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if is_package or path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in _import_nodes(tree, nested):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
            continue
        assert isinstance(node, ast.ImportFrom)
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        out.extend((node.lineno, f"{base}.{a.name}" if a.name != "*" else base) for a in node.names)
    return sorted(out, key=lambda t: t[0])


def resolve(name: str, modules: Iterable[str]) -> str | None:
    """The longest module among ``modules`` that ``name`` is or lies in (``plinth.quant.QuantWeight`` ->
    ``plinth.quant``), or None."""
    known = set(modules)
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``root`` (``root/package/**.py``), by name."""
    return {module_name(p, root): p for p in sorted((root / package.replace(".", "/")).rglob("*.py"))}


def import_graph(root: Path, package: str, *, nested: bool = False) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports (itself and its own parent packages left out)."""
    mods = package_modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for _, imported in imports(path, name, nested=nested):
            target = resolve(imported, mods)
            if target is not None and target != name and not name.startswith(target + "."):
                deps.add(target)
        graph[name] = deps
    return graph


def import_cycles(root: Path, package: str, *, nested: bool = False) -> list[list[str]]:
    """The import cycles among ``package``'s modules: each strongly connected group of two or more
    modules, sorted (empty when the imports form layers)."""
    graph = import_graph(root, package, nested=nested)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def private_imports(package_dir: Path, *, nested: bool = True) -> list[str]:
    """``file:line: module`` for each import of a non-public plinth module (see :data:`PUBLIC_MODULES`)
    in the Python files under ``package_dir`` (a plugin's sources; function-level imports included)."""
    found = []
    for path in sorted(Path(package_dir).rglob("*.py")):
        name = module_name(path, Path(package_dir).parent)
        for line, imported in imports(path, name, nested=nested):
            if not imported.startswith("plinth.") and imported != "plinth":
                continue
            target = _public_target(imported)
            if not is_public(target) and f"{path}:{line}: {target}" not in found:
                found.append(f"{path}:{line}: {target}")
    return found


def _public_target(imported: str) -> str:
    """The plinth module an imported name belongs to, by plinth's files: ``plinth.graph.Batch`` ->
    ``plinth.graph``; ``plinth.ops.ssm.ssm_scan`` -> ``plinth.ops.ssm``."""
    root = Path(__file__).resolve().parents[2]  # the directory holding the plinth package
    name = imported
    while "." in name:
        rel = Path(*name.split("."))
        if (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file():
            return name
        name = name.rpartition(".")[0]
    return name

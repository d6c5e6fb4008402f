"""Test kit for plugin authors: isolated plugin registries (and, later, synthetic GGUFs).

Installed as a pytest plugin (entry point group ``pytest11``), so a plugin's own
test suite gets the fixtures without any conftest:

* ``plinth_registry``: a factory fixture; ``plinth_registry(my_plugin)`` returns a
  fresh :class:`plinth.PluginRegistry` holding the built-in plugin and only the
  plugins named, never whatever else happens to be installed.

Outside pytest, :func:`make_registry` does the same.
"""

from __future__ import annotations

from importlib import metadata as importlib_metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from ..manifest import Manifest, ManifestPlugin
from ..plugins import ENTRY_POINT_GROUP, PluginError, PluginRegistry, discover

from .synthetic import byte_vocab, random_tensors, tiny_metadata, write_gguf, write_safetensors, write_synthetic_gguf

__all__ = [
    "check_prefill_then_decode",
    "greedy_through_cache",
    "load_module",
    "make_registry",
    "plugin_from_manifest",
    "byte_vocab",
    "random_tensors",
    "tiny_metadata",
    "write_gguf",
    "write_safetensors",
    "write_synthetic_gguf",
]


def check_prefill_then_decode(graph: Any, n_layer: int, tokens: list[int], n_prefill: int,
                              atol: float = 1e-5) -> None:
    """Contract: prefilling ``tokens[:n_prefill]`` then decoding the rest one token at a time
    gives the logits of one full forward (within ``atol``), and those logits are finite."""
    import numpy as np

    from ..context import Batch, KVCache

    full = graph.forward(Batch.from_tokens(tokens, output="all"), KVCache(n_layer)).logits
    assert np.isfinite(np.asarray(full)).all(), "the full forward gives non-finite logits"
    cache = KVCache(n_layer)
    parts = [graph.forward(Batch.from_tokens(tokens[:n_prefill], output="all"), cache).logits]
    for i in range(n_prefill, len(tokens)):
        parts.append(graph.forward(Batch.from_tokens(tokens[i:i + 1], start=i), cache).logits)
    np.testing.assert_allclose(np.concatenate(parts), full, atol=atol, rtol=0)


def greedy_through_cache(graph: Any, n_layer: int, prompt: list[int], n_new: int) -> list[int]:
    """Greedy tokens after ``prompt``: one prefill, then one token at a time through the cache."""
    import numpy as np

    from ..context import Batch, KVCache

    cache = KVCache(n_layer)
    logits = graph.forward(Batch.from_tokens(prompt), cache).logits
    out: list[int] = []
    for i in range(n_new):
        out.append(int(np.argmax(np.asarray(logits[-1]))))
        if i < n_new - 1:
            logits = graph.forward(Batch.from_tokens([out[-1]], start=len(prompt) + i), cache).logits
    return out


def load_module(path: str | Path, name: str | None = None) -> ModuleType:
    """Import a helper script by file path (a golden-file maker, a tiny-model builder beside the tests).

    Tests run with ``--import-mode=importlib`` have no package to import siblings from;
    ``name`` defaults to one derived from the path, so two test files loading the same
    script get the same module object.
    """
    import importlib.util
    import sys

    path = Path(path).resolve()
    if name is None:  # unique per file: two plugins may both have tests/golden/make_golden.py
        import hashlib

        name = f"plinth_testing_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def plugin_from_manifest(manifest: Manifest) -> ManifestPlugin:
    """Wrap a manifest into a registrable plugin object (for in-test plugins)."""
    return ManifestPlugin(manifest)


def make_registry(*plugins: Any, builtin: bool = True, strict: bool = True,
                  prefer: tuple[str, ...] = ()) -> PluginRegistry:
    """A registry holding only ``plugins``.

    Each item may be:
      * an installed entry-point name (``"llama"``): that entry point alone is loaded;
      * a ``(name, plugin_object)`` pair;
      * a plugin object (a :class:`ManifestPlugin`, a module with hookimpls...),
        registered under its manifest's name.

    ``strict`` (default on, as tests want) raises on a plugin that fails to load.
    Environment selection (``PLINTH_PLUGINS``...) is ignored.
    """
    names = [p for p in plugins if isinstance(p, str)]
    if names:
        installed = {ep.name: ep for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)}
        missing = [n for n in names if n not in installed]
        if missing:
            raise PluginError(f"no installed plugin entry point named {', '.join(missing)} "
                              f"(installed: {', '.join(sorted(installed)) or 'none'})")
        registry = discover(plugins=names, disable=(), strict=strict, prefer=prefer,
                            entry_points=[installed[n] for n in names], builtin=builtin)
    else:
        registry = discover(plugins=[], disable=(), strict=strict, prefer=prefer, entry_points=[], builtin=builtin)
    for item in plugins:
        if isinstance(item, str):
            continue
        if isinstance(item, tuple):
            name, obj = item
        else:
            obj = item
            manifest = obj.plinth_register() if hasattr(obj, "plinth_register") else None
            name = manifest.name if isinstance(manifest, Manifest) else getattr(obj, "__name__", repr(obj))
        registry.add(obj, name, value="in-test", strict=strict)
    return registry

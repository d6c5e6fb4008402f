"""Test kit for plugin authors: isolated registries, synthetic GGUFs and HF folders, contract checks.

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

from .._version import PLUGIN_API_VERSION
from ..manifest import Manifest, ManifestPlugin
from ..plugins import ENTRY_POINT_GROUP, PluginError, PluginRegistry, discover

from . import strict
from .roundtrips import SpecTransfers, decode_step_transfers, speculative_step_transfers
from .arch import check_architecture
from .hf import byte_bpe_tokenizer, write_hf_folder, write_safetensors
from .strict import StrictBackend, count_transfers, to_host
from .synthetic import (byte_vocab, quantized_rows, random_tensors, synthetic_specs, tiny_metadata, write_gguf,
                        write_synthetic_gguf)

#: backends every contract test runs on: the CPU backend and the strict device stand-in
CONTRACT_BACKENDS = ("numpy", "strict")

#: the test kit's own plugin: the ``strict`` backend (strict device stand-in, see plinth.testing.strict)
TESTKIT_PLUGIN = ManifestPlugin(Manifest(
    name="plinth-testing",
    api_version=PLUGIN_API_VERSION,
    backends={"strict": "plinth.testing.strict:StrictBackend"},
    description="test kit: the strict device stand-in backend",
))

__all__ = [
    "CONTRACT_BACKENDS",
    "SpecTransfers",
    "StrictBackend",
    "TESTKIT_PLUGIN",
    "byte_bpe_tokenizer",
    "check_architecture",
    "check_prefill_then_decode",
    "count_transfers",
    "decode_step_transfers",
    "greedy_through_cache",
    "load_golden",
    "make_backend",
    "new_cache",
    "strict",
    "write_hf_folder",
    "write_safetensors",
    "load_module",
    "make_registry",
    "plugin_from_manifest",
    "byte_vocab",
    "quantized_rows",
    "random_tensors",
    "speculative_step_transfers",
    "tiny_metadata",
    "to_host",
    "write_gguf",
    "synthetic_specs",
    "write_synthetic_gguf",
]


def make_backend(name: str = "numpy") -> Any:
    """A backend by name without a registry: ``"numpy"``, ``"strict"`` (or ``"cupy"`` on a GPU)."""
    if name == "strict":
        return StrictBackend()
    from ..backend import CupyBackend, NumpyBackend

    if name == "numpy":
        return NumpyBackend()
    if name == "cupy":
        return CupyBackend()
    raise ValueError(f"unknown backend {name!r}; use numpy, strict or cupy")


def check_prefill_then_decode(graph: Any, n_layer: int, tokens: list[int], n_prefill: int,
                              atol: float = 1e-5, backend: Any = None, max_decode_transfers: int = 0) -> None:
    """Contract: prefilling ``tokens[:n_prefill]`` then decoding the rest one token at a time
    gives the logits of one full forward (within ``atol``), and those logits are finite.

    ``backend``: the backend the graph was built on (default: ``graph.backend``, else numpy);
    the caches live on it and logits come back through its ``to_numpy``. On the strict
    backend a decode forward may make at most ``max_decode_transfers`` host round trips
    (default 0: the graph itself reads nothing back; the caller's sampler reads the logits).
    """
    import numpy as np

    from ..batch import Batch

    backend = backend or getattr(graph, "backend", None) or make_backend("numpy")
    xp, host = backend.xp, backend.to_numpy
    full = host(graph.forward(Batch.from_tokens(tokens, output="all"), new_cache(graph, n_layer, xp)).logits)
    assert np.isfinite(full).all(), "the full forward gives non-finite logits"
    cache = new_cache(graph, n_layer, xp)
    parts = [host(graph.forward(Batch.from_tokens(tokens[:n_prefill], output="all"), cache).logits)]
    for i in range(n_prefill, len(tokens)):
        with count_transfers() as n:
            logits = graph.forward(Batch.from_tokens(tokens[i:i + 1], start=i), cache).logits
        assert n.count <= max_decode_transfers, (
            f"a decode forward made {n.count} host round trips (at most {max_decode_transfers}): {n.sites}")
        parts.append(host(logits))
    np.testing.assert_allclose(np.concatenate(parts), full, atol=atol, rtol=0)


def new_cache(graph: Any, n_layer: int, xp: Any = None) -> Any:
    """An empty :class:`plinth.graph.Cache` with ``graph``'s cache layout, on ``xp`` (default: the graph's
    array module, else numpy)."""
    import numpy as np

    from ..cache import Cache

    xp = xp if xp is not None else getattr(graph, "xp", None)
    return Cache(n_layer, xp if xp is not None else np, graph.cache_layout())


def greedy_through_cache(graph: Any, n_layer: int, prompt: list[int], n_new: int) -> list[int]:
    """Greedy tokens after ``prompt``: one prefill, then one token at a time through the cache
    (kept on the graph's backend; logits come back through its ``to_numpy``)."""
    import numpy as np

    from ..batch import Batch

    backend = getattr(graph, "backend", None) or make_backend("numpy")
    cache = new_cache(graph, n_layer, backend.xp)
    logits = graph.forward(Batch.from_tokens(prompt), cache).logits
    out: list[int] = []
    for i in range(n_new):
        out.append(int(np.argmax(backend.to_numpy(logits[-1]))))
        if i < n_new - 1:
            logits = graph.forward(Batch.from_tokens([out[-1]], start=len(prompt) + i), cache).logits
    return out


def load_golden(path: str | Path) -> tuple[dict[str, Any], list[tuple[list[int], Any, list[int]]]]:
    """A golden record (``.npz``): its ``info`` JSON and, per prompt i, (``prompt_i``, ``logits_i``,
    ``greedy_i``) — the layout the bundled plugins' ``make_golden.py`` scripts write."""
    import json

    import numpy as np

    with np.load(path) as z:
        rec = {k: z[k] for k in z.files}
    n = sum(k.startswith("prompt_") for k in rec)
    runs = [(rec[f"prompt_{i}"].astype(np.int64).tolist(), rec[f"logits_{i}"],
             rec[f"greedy_{i}"].astype(np.int64).tolist()) for i in range(n)]
    return json.loads(str(rec["info"])), runs


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
                  prefer: tuple[str, ...] = (), testkit: bool = True) -> PluginRegistry:
    """A registry holding only ``plugins`` (and, with ``testkit``, the test kit's ``strict`` backend).

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
    if testkit:
        registry.add(TESTKIT_PLUGIN, TESTKIT_PLUGIN.manifest.name, value="plinth.testing", strict=strict)
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

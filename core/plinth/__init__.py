"""plinth: a hackable GGUF inference engine where every architecture and drafter is a plugin.

Importing :mod:`plinth` is cheap: it pulls in neither numpy nor any plugin code.
The heavier parts of the public API are imported on first attribute access.
Architecture plugins build their graphs from :mod:`plinth.graph` (the documented
graph API) and :mod:`plinth.ops`.
"""

from __future__ import annotations

import importlib

from ._version import PLUGIN_API_VERSION, __version__

# public name -> module that defines it (imported lazily)
_LAZY = {
    "hookimpl": "plinth.hookspecs",
    "hookspec": "plinth.hookspecs",
    "Manifest": "plinth.manifest",
    "ManifestPlugin": "plinth.manifest",
    "PluginRegistry": "plinth.plugins",
    "PluginRecord": "plinth.plugins",
    "PluginError": "plinth.plugins",
    "PluginConflictError": "plinth.plugins",
    "discover": "plinth.plugins",
    "load_model": "plinth.model",
    "Model": "plinth.model",
    "Context": "plinth.model",
    "UserError": "plinth.errors",
    "TensorCheckError": "plinth.tensors",
    "HParamsError": "plinth.hparams",
    "Generator": "plinth.generate",
}

__all__ = ["PLUGIN_API_VERSION", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'plinth' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

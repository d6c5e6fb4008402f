"""The built-in plugin: what the core itself provides through the plugin contract.

It is registered by :func:`plinth.discover` under the name ``plinth``, before any
entry point, and is built exactly like a third-party plugin.
"""

from __future__ import annotations

from ._version import PLUGIN_API_VERSION
from .manifest import Manifest, ManifestPlugin

plugin = ManifestPlugin(
    Manifest(
        name="plinth",
        api_version=PLUGIN_API_VERSION,
        backends={
            "numpy": "plinth.backend:NumpyBackend",
            "cupy": "plinth.backend:CupyBackend",
        },
        description="core backends",
    )
)

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
        drafters={
            "ngram": "plinth.speculative.ngram:make_ngram",
            "ngram-cache": "plinth.speculative.ngram_cache:make_ngram_cache",
            "draft": "plinth.speculative.draft_model:make_draft_model",
        },
        verifiers={
            "greedy": "plinth.speculative.verify:GreedyVerifier",
            "rejection": "plinth.speculative.verify:RejectionVerifier",
        },
        description="core backends, the ngram, ngram-cache and draft-model drafters, greedy and rejection verification",
    )
)

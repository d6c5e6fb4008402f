"""The entry point: a manifest of what this plugin provides, with lazy import paths.

Nothing here imports numpy or model code; ``plinth plugins`` imports only this module.
"""

from plinth.manifest import Manifest, ManifestPlugin

plugin = ManifestPlugin(
    Manifest(
        name="example",
        api_version="1.0",
        architectures={"toy-bigram": "plinth_example.toy:ToyBigram"},
        drafters={"toy-repeat": "plinth_example.toy:RepeatDrafter"},
        description="toy bigram architecture and a repeat-last-token drafter",
    )
)

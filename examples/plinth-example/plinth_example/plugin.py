"""The entry point: a manifest of what this plugin provides, with lazy import paths.

Nothing here imports numpy or model code; ``plinth plugins`` imports only this module.
"""

from plinth.manifest import Manifest, ManifestPlugin

plugin = ManifestPlugin(
    Manifest(
        name="example",
        api_version="2.0",
        architectures={"minidense": "plinth_example.model:MiniDense"},
        converters={"MiniDenseForCausalLM": "plinth_example.convert:MiniDenseConverter"},
        drafters={"toy-repeat": "plinth_example.drafter:RepeatDrafter"},
        description="a small dense decoder (architecture + converter) and a repeat-last-token drafter",
    )
)

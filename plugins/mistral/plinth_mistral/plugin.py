"""Entry point of plinth-mistral: names and lazy import paths only."""

from plinth.manifest import Manifest, ManifestPlugin

plugin = ManifestPlugin(
    Manifest(
        name="mistral",
        api_version="2.0",
        architectures={"mistral_large4": "plinth_mistral.mistral_large4:MistralLarge4"},
        converters={"MistralLarge4ForConditionalGeneration": "plinth_mistral.convert:MistralLarge4Converter"},
        description="Mistral Large 4 (MLA, DSA sparse indexer, KV sharing, MoE) and its DSpark draft head",
    )
)

"""Entry point of plinth-gemma: names and lazy import paths only."""

from plinth.manifest import Manifest, ManifestPlugin

plugin = ManifestPlugin(
    Manifest(
        name="gemma",
        api_version="2.1",
        architectures={"gemma4": "plinth_gemma.gemma4:Gemma4"},
        converters={
            "Gemma4ForCausalLM": "plinth_gemma.convert:Gemma4Converter",
            "Gemma4ForConditionalGeneration": "plinth_gemma.convert:Gemma4MultimodalConverter",
            "Gemma4AssistantForCausalLM": "plinth_gemma.assistant:Gemma4AssistantConverter",
        },
        drafters={"gemma4-assistant": "plinth_gemma.assistant:make_gemma4_assistant"},
        draft_formats={"gemma4-assistant": "plinth_gemma.assistant:describe"},
        description="Gemma 4 text models: gemma4; the Gemma 4 assistant drafter (gemma4-assistant)",
    )
)

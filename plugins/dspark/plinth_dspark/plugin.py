"""Entry point of plinth-dspark: names and lazy import paths only."""

from plinth.manifest import Manifest, ManifestPlugin

plugin = ManifestPlugin(
    Manifest(
        name="dspark",
        api_version="2.1",
        drafters={"dspark": "plinth_dspark.drafter:make_dspark"},
        converters={
            "Qwen3DSparkModel": "plinth_dspark.convert:DeepSpecConverter",
            "Gemma4DSparkModel": "plinth_dspark.convert:Gemma4DSparkConverter",
            "DSparkDraftModel": "plinth_dspark.convert:SpeculatorsConverter",
            "DSparkSpeculator": "plinth_dspark.convert:SpeculatorsConverter",
        },
        draft_formats={"dflash": "plinth_dspark.format:describe"},
        description="the DSpark drafter: DFlash backbone + Markov head + confidence head ('dflash' GGUFs)",
    )
)

"""Entry point of plinth-nemotron: names and lazy import paths only."""

from plinth.manifest import Manifest, ManifestPlugin

plugin = ManifestPlugin(
    Manifest(
        name="nemotron",
        api_version="2.0",
        architectures={
            "nemotron_h": "plinth_nemotron.nemotron_h:NemotronH",
            "nemotron_h_moe": "plinth_nemotron.nemotron_h:NemotronHMoE",
        },
        drafters={"mtp": "plinth_nemotron.mtp:make_mtp_drafter"},
        converters={
            "NemotronHForCausalLM": "plinth_nemotron.convert:NemotronHConverter",
            "NemotronHPuzzleForCausalLM": "plinth_nemotron.convert:NemotronHPuzzleConverter",
            "NemotronH_Omni_Reasoning_V3": "plinth_nemotron.convert:NemotronHOmniConverter",
        },
        description="Nemotron-H hybrids (Mamba-2 + attention + MLP/MoE), LatentMoE, Puzzle per-layer experts, "
                    "MTP drafter, VL image input",
    )
)

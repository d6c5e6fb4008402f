"""Entry point of plinth-mimo: names and lazy import paths only."""

from plinth.manifest import Manifest, ManifestPlugin

plugin = ManifestPlugin(
    Manifest(
        name="mimo",
        api_version="2.0",
        architectures={"mimo2": "plinth_mimo.mimo2:MiMo2"},
        converters={"MiMoV2FlashForCausalLM": "plinth_mimo.convert:MiMo2Converter"},
        drafters={"mtp": "plinth_mimo.mtp:make_mtp_drafter"},
        description="MiMo-V2-Flash (mimo2): hybrid sliding / global attention, value scale, MoE; its MTP blocks as the mtp drafter",
    )
)

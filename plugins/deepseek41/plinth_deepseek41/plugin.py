"""Entry point of plinth-deepseek41: names and lazy import paths only."""

from plinth.manifest import Manifest, ManifestPlugin

plugin = ManifestPlugin(
    Manifest(
        name="deepseek41",
        api_version="2.0",
        architectures={"deepseek4": "plinth_deepseek41.deepseek4:DeepSeek4"},
        drafters={"mtp": "plinth_deepseek41.mtp:make_mtp_drafter"},
        converters={"DeepseekV4ForCausalLM": "plinth_deepseek41.convert:DeepseekV4Converter"},
        description="DeepSeek V4 Flash (deepseek4): mHC streams, CSA/HCA compressed attention, hash MoE, MTP drafter",
    )
)

"""Entry point of plinth-deepseek41: names and lazy import paths only."""

from plinth.manifest import Manifest, ManifestPlugin

plugin = ManifestPlugin(
    Manifest(
        name="deepseek41",
        api_version="2.0",
        architectures={"deepseek4": "plinth_deepseek41.deepseek4:DeepSeek4",
                       "deepseek41": "plinth_deepseek41.deepseek41:DeepSeek41"},
        drafters={"mtp": "plinth_deepseek41.mtp:make_mtp_drafter"},
        converters={"DeepseekV4ForCausalLM": "plinth_deepseek41.convert:DeepseekV4Converter"},
        description="DeepSeek V4 / V4.1 Flash (deepseek4, deepseek41): mHC streams (lagged in V4.1), CSA/HCA compressed "
                    "attention, hash MoE, Engram, MTP drafter",
    )
)

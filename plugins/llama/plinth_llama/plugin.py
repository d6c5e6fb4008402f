"""Entry point of plinth-llama: names and lazy import paths only."""

from plinth.manifest import Manifest, ManifestPlugin

plugin = ManifestPlugin(
    Manifest(
        name="llama",
        api_version="2.0",
        architectures={
            "llama": "plinth_llama.llama:Llama",
            "qwen2": "plinth_llama.llama:Qwen2",
            "qwen3": "plinth_llama.llama:Qwen3",
            "gemma3": "plinth_llama.gemma3:Gemma3",
        },
        converters={
            "LlamaForCausalLM": "plinth_llama.convert:LlamaConverter",
            "MixtralForCausalLM": "plinth_llama.convert:MixtralConverter",
            "Qwen2ForCausalLM": "plinth_llama.convert:Qwen2Converter",
            "Qwen3ForCausalLM": "plinth_llama.convert:Qwen3Converter",
            "Gemma3ForCausalLM": "plinth_llama.convert:Gemma3Converter",
        },
        description="dense decoders: llama (SmolLM2, Llama 3, Mixtral), qwen2, qwen3, gemma3; their HF converters",
    )
)

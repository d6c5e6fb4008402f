"""plinth-llama: the dense decoder targets (llama/SmolLM2, qwen2, qwen3, gemma3)."""

"""plinth-deepseek41: DeepSeek V4 Flash (``deepseek4``) and its HF converter."""

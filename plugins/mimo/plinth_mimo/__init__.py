"""plinth-mimo: MiMo-V2-Flash text models (GGUF architecture ``mimo2``)."""

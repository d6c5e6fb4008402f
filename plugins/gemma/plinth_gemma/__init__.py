"""plinth-gemma: Gemma 4 text models for plinth (architecture ``gemma4`` and its HF converter)."""

"""plinth-gemma: Gemma 4 text models for plinth (architecture ``gemma4`` and its HF converter) and Gemma 4's
assistant drafter (``gemma4-assistant``: :mod:`plinth_gemma.assistant`)."""

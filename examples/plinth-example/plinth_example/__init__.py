"""plinth-example: a small dense decoder, its HF converter and a toy drafter, written the way any plugin is."""

"""plinth-mistral: Mistral Large 4 ("le chonk") for plinth."""

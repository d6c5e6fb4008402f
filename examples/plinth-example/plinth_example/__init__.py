"""plinth-example: a toy architecture and a toy drafter, written the way any plugin is."""

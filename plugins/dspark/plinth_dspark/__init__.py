"""plinth-dspark: the DSpark drafter on top of plinth-dflash."""

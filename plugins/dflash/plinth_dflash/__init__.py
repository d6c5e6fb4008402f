"""plinth-dflash: DFlash, DFlash2 and LiLiCorr block drafters for plinth."""

"""Entry point of plinth-dflash: names and lazy import paths only."""

from plinth.manifest import Manifest, ManifestPlugin

plugin = ManifestPlugin(
    Manifest(
        name="dflash",
        api_version="2.1",
        drafters={
            "dflash": "plinth_dflash.drafter:make_dflash",
            "dflash2": "plinth_dflash.drafter:make_dflash2",
            "lilicorr": "plinth_dflash.drafter:make_lilicorr",
        },
        converters={
            "DFlashDraftModel": "plinth_dflash.convert:DFlashConverter",
            "DFlash2DraftModel": "plinth_dflash.convert:DFlash2Converter",
            "LiLiCorrDraftModel": "plinth_dflash.convert:LiLiCorrConverter",
        },
        draft_formats={"dflash": "plinth_dflash.format:describe"},
        description="block drafters: DFlash, DFlash2, LiLiCorr (arch 'dflash' GGUFs)",
    )
)

"""Trained DSpark drafters shipped with plinth-dspark, and how ``--spec dspark`` finds them.

Each ``*.gguf`` here was made by ``plinth train-drafter`` (its model card, ``<name>.md``, says how) and
names its target in ``plinth.train.target_name`` (the target's ``general.name``) with the target's
vocabulary and width. ``--spec dspark`` without ``--draft`` uses the one made for the loaded target;
``--draft NAME`` accepts a shipped drafter's name (the file name without ``.gguf``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plinth.errors import UserError

HERE = Path(__file__).parent
KEY_TARGET = "plinth.train.target_name"


def shipped() -> list[Path]:
    return sorted(HERE.glob("*.gguf"))


def _matches(path: Path, target: Any) -> bool:
    from plinth.gguf import GGUFFile

    md = GGUFFile(path).metadata
    name = getattr(target, "metadata", {}).get("general.name")
    return (name is not None and md.get(KEY_TARGET) == name and int(md.get("dflash.vocab_size", -1)) == int(target.n_vocab)
            and int(md.get("dflash.embedding_length", -1)) == int(target.hparams.n_embd))


def resolve(draft: str | None, target: Any) -> str:
    """The draft file for ``--draft`` (a path, or a shipped drafter's name), or the shipped one for ``target``."""
    names = {p.stem: p for p in shipped()}
    if draft:
        if Path(draft).is_file() or draft not in names and draft.removesuffix(".gguf") not in names:
            return draft
        return str(names[draft.removesuffix(".gguf")])
    found = [p for p in shipped() if _matches(p, target)]
    if found:
        return str(found[0])
    have = ", ".join(names) or "none"
    raise UserError("the dspark drafter needs a draft GGUF: pass --draft FILE.gguf (option 'draft'); no shipped "
                    f"drafter is made for this model (shipped: {have})")

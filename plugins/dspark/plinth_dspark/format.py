"""A DSpark draft: a ``dflash`` GGUF that also holds the Markov head (and usually a confidence head).

There is no DSpark architecture: the draft is detected by ``markov_w1.weight`` (llama.cpp's
``common_speculative_types_from_gguf``). What this module adds to the DFlash format
(:mod:`plinth_dflash.format`, loaded through its ``extension`` hook):

* ``markov_w1.weight`` [V, R]: one row per **target** token (R, the rank, comes from the shape);
* ``markov_w2.weight`` [V_d, R] (``output`` rows; V_d = V without ``d2t``), optional ``markov_w2.scale``
  (folded into the weight at load: ``w2 . e * s == (s w2) . e``);
* ``conf_proj.weight`` [1, E + R] (or [1, E]: a confidence head that does not see the Markov embedding),
  optional ``conf_proj.bias`` [1];
* ``d2t`` [V_d] (I64, absolute target ids) with the draft's own ``output.weight`` [V_d, E] for a reduced
  draft vocabulary;
* keys ``dflash.sample_from_anchor`` (bool, missing = true) and ``dflash.has_confidence_head`` (bool,
  missing = true).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import attrs
import numpy as np

from plinth.errors import UserError
from plinth.graph import TensorSpec
from plinth_dflash import constants as DC
from plinth_dflash.format import DFlashHParams, DraftFile, load_draft

T_W1 = "markov_w1.weight"
T_W2 = "markov_w2.weight"
T_CONF = "conf_proj.weight"
T_CONF_B = "conf_proj.bias"
T_D2T = DC.T_D2T
KEY_FROM_ANCHOR = "sample_from_anchor"
KEY_HAS_CONF = "has_confidence_head"
CLAIMED = (T_W1, T_D2T)


class DSparkFormatError(UserError):
    """A DSpark draft that plinth-dspark cannot use, with the reason."""


@attrs.frozen
class DSparkHParams:
    rank: int  # R
    n_vocab: int  # V: rows of markov_w1 (must be the target's vocabulary)
    draft_vocab: int  # V_d: rows of markov_w2 / the head
    sample_from_anchor: bool  # True: anchor-first (row 0 predicts); False: 1+N bonus anchor
    has_confidence_head: bool  # the file's declaration (missing = true)
    conf_with_markov: bool  # conf_proj sees [h ; e] (E + R inputs) rather than h alone
    reduced: bool  # d2t present

    @property
    def first_row(self) -> int:
        """s: the first prediction row of a block (0 anchor-first, 1 bonus-anchor)."""
        return 0 if self.sample_from_anchor else 1


def is_dspark(tensor_names: Any) -> bool:
    return T_W1 in set(tensor_names)


def dspark_specs(hp: DFlashHParams, present: Mapping[str, tuple[tuple[int, ...], str]], source: str = "") -> list[TensorSpec]:
    """The DSpark tensors of a dflash draft whose file holds ``present`` (shapes checked here, by name)."""
    if T_W1 not in present:
        raise DSparkFormatError(f"{source}: not a DSpark draft (no '{T_W1}'); use --spec dflash")
    w1 = present[T_W1][0]
    if len(w1) != 2:
        raise DSparkFormatError(f"{source}: '{T_W1}' must be 2-D [V, R], found shape {list(w1)}")
    v, r = int(w1[0]), int(w1[1])
    if T_D2T in present:
        d2t = present[T_D2T]
        if len(d2t[0]) != 1 or d2t[1] not in ("I64", "I32"):
            raise DSparkFormatError(f"{source}: 'd2t' must be a 1-D integer tensor of absolute target ids, found "
                                    f"{d2t[1]} {list(d2t[0])}")
        vd = int(d2t[0][0])
        if DC.T_OUTPUT not in present:
            raise DSparkFormatError(f"{source}: a reduced draft vocabulary ('d2t', {vd} ids) needs the draft's own "
                                    f"'{DC.T_OUTPUT}' with {vd} rows")
    else:
        vd = hp.n_vocab if hp.n_vocab is not None else v  # the full vocabulary (w1's rows are checked at runtime)
    e = hp.n_embd
    conf_cols = int(present[T_CONF][0][-1]) if T_CONF in present else e + r
    if conf_cols not in (e, e + r):
        raise DSparkFormatError(f"{source}: '{T_CONF}' has {conf_cols} inputs; expected E + R = {e + r} (hidden and "
                                f"Markov embedding) or E = {e}")
    specs = [
        TensorSpec(T_W1, (v, r)),
        TensorSpec(T_W2, (vd, r), scale=True),
        TensorSpec(T_CONF, (1, conf_cols), required=False, scale=True),
        TensorSpec(T_CONF_B, (1,), required=False),
        TensorSpec(DC.T_OUTPUT, (vd, e), required=False, scale=True),
    ]
    if T_D2T in present:
        specs.append(TensorSpec(T_D2T, (vd,), dtypes=("I64", "I32")))
    return specs


def read_dspark_hparams(md: Mapping[str, Any], present: Mapping[str, tuple[tuple[int, ...], str]], hp: DFlashHParams,
                        source: str) -> DSparkHParams:
    def flag(key: str) -> bool:
        full = f"{DC.ARCH}.{key}"
        value = md.get(full, True)  # a missing key means true (llama.cpp)
        if not isinstance(value, (bool, np.bool_)):
            raise DSparkFormatError(f"{source}: '{full}' must be a bool, found {value!r}")
        return bool(value)

    v, r = (int(x) for x in present[T_W1][0])
    reduced = T_D2T in present
    vd = int(present[T_D2T][0][0]) if reduced else int(present[T_W2][0][0])
    has_conf = flag(KEY_HAS_CONF)
    if has_conf and T_CONF not in present:
        raise DSparkFormatError(f"{source}: '{DC.ARCH}.{KEY_HAS_CONF}' is true (or missing) but the draft has no "
                                f"'{T_CONF}'; set the key to false or add the head")
    conf_cols = int(present[T_CONF][0][-1]) if T_CONF in present else hp.n_embd + r
    return DSparkHParams(rank=r, n_vocab=v, draft_vocab=vd, sample_from_anchor=flag(KEY_FROM_ANCHOR),
                         has_confidence_head=has_conf and T_CONF in present,
                         conf_with_markov=conf_cols == hp.n_embd + r, reduced=reduced)


@attrs.frozen
class DSparkFile:
    draft: DraftFile  # the DFlash part (weights include the DSpark tensors)
    dspark: DSparkHParams


def load_dspark(path: str | Path, backend: Any) -> DSparkFile:
    """Load a DSpark draft: the dflash backbone plus the heads, every tensor checked."""
    from plinth.gguf import GGUFFile

    path = Path(path)
    if not path.is_file():
        raise DSparkFormatError(f"draft file {path} does not exist")
    gf = GGUFFile(path)
    present = {n: (tuple(int(d) for d in i.shape), i.type_name) for n, i in gf.tensors.items()}
    md = dict(gf.metadata)
    if T_W1 not in present:
        raise DSparkFormatError(f"{path}: not a DSpark draft (no '{T_W1}'); use --spec dflash for plain DFlash drafts")
    draft = load_draft(path, backend, claimed=CLAIMED,
                       extension=lambda hp, pres: dspark_specs(hp, pres, str(path)))
    if draft.hparams.variant != "dflash":
        raise DSparkFormatError(f"{path}: a DSpark draft has a plain DFlash backbone; this one is also "
                                f"{draft.hparams.variant} (tensors of both variants)")
    return DSparkFile(draft=draft, dspark=read_dspark_hparams(md, present, draft.hparams, str(path)))


#: ``plinth info``'s name for a DSpark draft (there is no DSpark architecture).
DRAFT_LABEL = "dflash draft with DSpark heads"


def describe(metadata: Mapping[str, Any], tensors: Mapping[str, tuple[tuple[int, ...], str]],
             source: str) -> list[str] | None:
    """``plinth info`` lines for a DSpark draft (``markov_w1.weight`` present), else ``None``.

    The backbone is described by plinth-dflash (its tensors minus :data:`CLAIMED`), the heads here.
    """
    from plinth_dflash.format import describe as describe_backbone
    from plinth_dflash.format import load_hparams

    if not is_dspark(tensors):
        return None
    backbone = describe_backbone(metadata, tensors, source, claimed=CLAIMED)
    hp = load_hparams(metadata, source, [n for n in tensors if n not in CLAIMED])
    if backbone is None or hp.variant != "dflash":
        raise DSparkFormatError(f"{source}: a DSpark draft has a plain DFlash backbone; this one is also {hp.variant} "
                                "(tensors of both variants)")
    present = {n: (tuple(int(d) for d in shape), t) for n, (shape, t) in tensors.items()}
    dspark_specs(hp, present, source)  # the heads' shapes, each problem named
    if T_W2 not in present:
        raise DSparkFormatError(f"{source}: a DSpark draft needs '{T_W2}' next to '{T_W1}'")
    dh = read_dspark_hparams(metadata, present, hp, source)
    conf = ("yes, sees the hidden state and the Markov embedding" if dh.conf_with_markov else
            "yes, sees the hidden state only") if dh.has_confidence_head else "no"
    vocab = (f"yes, d2t: {dh.draft_vocab} draft ids of {dh.n_vocab} target ids" if dh.reduced
             else f"no (full vocabulary, {dh.n_vocab})")
    anchor = ("true (anchor-first: row 0 predicts)" if dh.sample_from_anchor
              else "false (bonus anchor: rows 1.. predict)")
    lines = [f"drafter          {DRAFT_LABEL}"]
    lines += [line for line in backbone[1:] if not line.startswith("reduced_vocab ")]
    lines += [f"markov_rank      {dh.rank}",
              f"confidence_head  {conf}",
              f"reduced_vocab    {vocab}",
              f"sample_from_anchor {anchor}"]
    return lines

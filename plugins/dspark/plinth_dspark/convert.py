"""``plinth convert`` for DSpark drafts: the DeepSpec flat config and the speculators format.

* DeepSpec (``architectures = ["Qwen3DSparkModel"]``): a Qwen3 config with ``block_size``,
  ``target_layer_ids``, ``num_target_layers``, ``markov_rank``, ``markov_head_type`` (must be "vanilla"),
  ``enable_confidence_head``, ``confidence_head_with_markov``; ``sample_from_anchor`` defaults to **true**.
* speculators (``speculators_model_type = "dspark"``; ``DSparkDraftModel`` / ``DSparkSpeculator``): the
  backbone under ``transformer_layer_config``, taps in ``aux_hidden_state_layer_ids``, ``mask_token_id``,
  ``draft_vocab_size`` < vocabulary -> ``d2t`` (speculators' offsets written as absolute I64 ids; ``t2d``
  dropped) with the draft's own ``lm_head``; ``sample_from_anchor`` is read from the config (pydantic
  default true). A flat config without ``speculators_*`` fields (SpecForge) defaults to **false** (1+N), as
  llama.cpp #26275 settled: the export format decides, not the presence of speculators fields alone.

The backbone goes through plinth-dflash's converter pieces (+1 tap rule, layer map, refusals); the heads map
``markov_head.markov_w{1,2}`` -> ``markov_w{1,2}``, ``confidence_head[.proj].{weight,bias}`` -> ``conf_proj.*``.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from plinth.convert import SafetensorsDir, read_config, write_gguf
from plinth.errors import UserError
from plinth_dflash import constants as DC
from plinth_dflash.convert import (DFlashConverter, config_to_metadata, flatten_speculators_config, gemma4_tensor,
                                   generated_tensors, is_speculators_config, map_tensor_name, speculators_d2t)

from .format import KEY_FROM_ANCHOR, KEY_HAS_CONF, T_CONF, T_CONF_B, T_D2T, T_W1, T_W2, load_dspark

A = DC.ARCH
HEAD_MAP = {
    "markov_head.markov_w1.weight": T_W1,
    "markov_head.markov_w2.weight": T_W2,
    "confidence_head.proj.weight": T_CONF,
    "confidence_head.proj.bias": T_CONF_B,
    "confidence_head.weight": T_CONF,
    "confidence_head.bias": T_CONF_B,
    "confidence_proj.weight": T_CONF,  # Gemma 4 DSpark exports (llama.cpp's Gemma4DSparkModel renames them)
    "confidence_proj.bias": T_CONF_B,
}
DEEPSPEC_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                 "sample_from_anchor")


def _refuse(model_dir: Any, why: str) -> UserError:
    return UserError(f"{model_dir}: cannot convert this DSpark draft: {why}")


def dspark_settings(cfg: Mapping[str, Any], model_dir: Any, *, default_from_anchor: bool) -> dict[str, Any]:
    head = cfg.get("markov_head_type", "vanilla")
    if head != "vanilla":
        raise _refuse(model_dir, f"markov_head_type = {head!r}; only the 'vanilla' Markov head (a bias w2 . w1[prev]) "
                      "has a GGUF layout (the gated and rnn heads are training variants)")
    if int(cfg.get("markov_rank", 1) or 0) <= 0:
        raise _refuse(model_dir, "markov_rank = 0: no Markov head, so this is a plain DFlash draft (convert it as "
                      "DFlashDraftModel)")
    return {f"{A}.{KEY_FROM_ANCHOR}": bool(cfg.get("sample_from_anchor", default_from_anchor)),
            f"{A}.{KEY_HAS_CONF}": bool(cfg.get("enable_confidence_head", True))}


class SpeculatorsConverter:
    """speculators / SpecForge DSpark exports (and, through :meth:`flat_config`, DeepSpec's flat config)."""

    hf_arch = "DSparkDraftModel"

    def flat_config(self, cfg: Mapping[str, Any], model_dir: Any) -> tuple[dict[str, Any], dict[str, Any], int]:
        """(flat z-lab-shaped config, DSpark keys, draft vocabulary size)."""
        if is_speculators_config(cfg):
            flat = flatten_speculators_config(cfg, model_dir)
            default = True if "speculators_model_type" in cfg else False
            keys = dspark_settings(cfg, model_dir, default_from_anchor=default)
            vocab = int(flat["vocab_size"])
            return flat, keys, int(cfg.get("draft_vocab_size") or vocab)
        # a flat schema without speculators fields (SpecForge): 1+N unless it says otherwise
        flat = {k: v for k, v in cfg.items() if k not in DEEPSPEC_KEYS}
        keys = dspark_settings(cfg, model_dir, default_from_anchor=False)
        return flat, keys, int(cfg.get("draft_vocab_size") or cfg["vocab_size"])

    def convert(self, model_dir: str, out_path: str, options: Mapping[str, Any]) -> None:
        cfg = read_config(model_dir)
        flat, keys, vd = self.flat_config(cfg, model_dir)
        flat.pop("draft_vocab_size", None)
        md = config_to_metadata(flat, model_dir, "dflash")
        md.update(keys)
        backbone = flat.get("model_type", "qwen3")
        vocab = int(md[f"{A}.vocab_size"])
        st = SafetensorsDir(model_dir)
        tensors: dict[str, np.ndarray] = generated_tensors(md)
        for name in st.names():
            n = name[len("model."):] if name.startswith("model.") else name
            if n in HEAD_MAP:
                tensors[HEAD_MAP[n]] = st.get(name)
            elif n == "t2d":
                continue
            elif n == "d2t":
                if vd < vocab:
                    tensors[T_D2T] = speculators_d2t(st.get(name, dtype=np.int64), vocab, model_dir)
            else:
                gname = map_tensor_name(name, backbone)
                if gname is not None:
                    tensors[gname] = gemma4_tensor(gname, st.get(name))
        if T_W1 not in tensors or T_W2 not in tensors:
            raise _refuse(model_dir, "no markov_head.markov_w1 / markov_w2 tensors")
        if vd < vocab:
            if T_D2T not in tensors:
                raise _refuse(model_dir, f"draft_vocab_size {vd} < vocab_size {vocab} but no d2t tensor")
            if DC.T_OUTPUT not in tensors:
                raise _refuse(model_dir, "a reduced draft vocabulary needs the draft's own lm_head")
        if T_CONF not in tensors:
            md[f"{A}.{KEY_HAS_CONF}"] = False
        if backbone == "gemma4_text" and flat.get("tie_word_embeddings") and DC.T_TOKEN_EMBD in tensors \
                and DC.T_OUTPUT not in tensors:
            md[f"{A}.{DC.KEY_TIED}"] = True  # a Gemma 4 draft's head is its embedding unless it ships lm_head
        elif DC.T_TOKEN_EMBD in tensors or DC.T_OUTPUT in tensors:
            md[f"{A}.{DC.KEY_TIED}"] = False
        target = options.get("target")
        if target:
            md.update(DFlashConverter._from_target(target, md, model_dir))
        write_gguf(out_path, md, tensors)
        from plinth.graph import NumpyBackend

        load_dspark(out_path, NumpyBackend())  # a converted file must load: checked now, not at first use


class DeepSpecConverter(SpeculatorsConverter):
    """DeepSpec's ``Qwen3DSparkModel`` flat config: sample_from_anchor defaults to true."""

    hf_arch = "Qwen3DSparkModel"

    def flat_config(self, cfg: Mapping[str, Any], model_dir: Any) -> tuple[dict[str, Any], dict[str, Any], int]:
        keys = dspark_settings(cfg, model_dir, default_from_anchor=True)
        flat = {k: v for k, v in cfg.items() if k not in DEEPSPEC_KEYS}
        d = dict(flat.get("dflash_config") or {})
        for k in ("target_layer_ids", "block_size", "mask_token_id"):
            if k in flat and k not in d:
                d[k] = flat.pop(k)
        flat["dflash_config"] = d
        return flat, keys, int(cfg["vocab_size"])


class Gemma4DSparkConverter(DeepSpecConverter):
    """A Gemma 4 DSpark export (``Gemma4DSparkModel``, as llama.cpp's converter names it): DeepSpec's flat schema
    over a ``gemma4_text`` backbone config (the Markov keys may also sit in ``dflash_config``);
    ``sample_from_anchor`` defaults to true, ``confidence_proj.*`` is the confidence head."""

    hf_arch = "Gemma4DSparkModel"

    def flat_config(self, cfg: Mapping[str, Any], model_dir: Any) -> tuple[dict[str, Any], dict[str, Any], int]:
        cfg = dict(cfg)
        d = dict(cfg.get("dflash_config") or {})
        for k in DEEPSPEC_KEYS:
            if k in d:
                cfg.setdefault(k, d.pop(k))
        cfg["dflash_config"] = d
        mt = cfg.setdefault("model_type", "gemma4_text")
        if mt != "gemma4_text":
            raise _refuse(model_dir, f"a Gemma4DSparkModel config with model_type {mt!r} (expected 'gemma4_text')")
        if int(cfg.get("draft_vocab_size") or cfg["vocab_size"]) != int(cfg["vocab_size"]):
            raise _refuse(model_dir, "a reduced draft vocabulary on a Gemma 4 DSpark export (llama.cpp's converter "
                          "refuses it too)")
        cfg.pop("draft_vocab_size", None)
        return super().flat_config(cfg, model_dir)

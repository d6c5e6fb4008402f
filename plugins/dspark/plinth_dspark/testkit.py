"""Tiny synthetic DSpark drafts for tests and benchmarks (a tiny DFlash draft plus the DSpark heads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from plinth_dflash import constants as DC
from plinth_dflash.testkit import random_draft_tensors, tiny_draft_metadata

from .format import KEY_FROM_ANCHOR, KEY_HAS_CONF, T_CONF, T_CONF_B, T_D2T, T_W1, T_W2


def dspark_tensors(n_vocab: int, n_embd: int, *, rank: int = 16, draft_vocab: int | None = None,
                   conf: bool = True, conf_with_markov: bool = True, w2_scale: float | None = None, seed: int = 0,
                   scale: float = 0.5) -> dict[str, np.ndarray]:
    """Random Markov / confidence heads at O(1) scale (and ``d2t`` + own head for a reduced vocabulary)."""
    rng = np.random.default_rng(seed + 100)
    vd = draft_vocab or n_vocab
    t = {T_W1: (scale * rng.standard_normal((n_vocab, rank))).astype(np.float32),
         T_W2: (scale * rng.standard_normal((vd, rank))).astype(np.float32)}
    if w2_scale is not None:
        t[T_W2] = (t[T_W2] / np.float32(w2_scale)).astype(np.float32)
        t["markov_w2.scale"] = np.array([w2_scale], dtype=np.float32)
    if conf:
        cols = n_embd + rank if conf_with_markov else n_embd
        t[T_CONF] = (0.3 * rng.standard_normal((1, cols))).astype(np.float32)
        t[T_CONF_B] = np.array([0.5], dtype=np.float32)
    if draft_vocab is not None and draft_vocab < n_vocab:
        t[T_D2T] = np.sort(rng.choice(n_vocab, size=draft_vocab, replace=False)).astype(np.int64)
        t[DC.T_OUTPUT] = (0.2 * rng.standard_normal((draft_vocab, n_embd))).astype(np.float32)
    return t


def write_tiny_dspark(path: str | Path, *, seed: int = 0, rank: int = 16, draft_vocab: int | None = None,
                      conf: bool = True, conf_with_markov: bool = True, sample_from_anchor: bool | None = None,
                      has_confidence_head: bool | None = None, w2_scale: float | None = None, scale: float = 0.2,
                      head_scale: float = 0.5, extra_tensors: Any = None, **md_kw: Any) -> Path:
    """A random DSpark draft: ``sample_from_anchor`` / ``has_confidence_head`` None leave the key out."""
    from plinth.convert import write_gguf

    md = tiny_draft_metadata("dflash", **md_kw)
    if sample_from_anchor is not None:
        md[f"{DC.ARCH}.{KEY_FROM_ANCHOR}"] = bool(sample_from_anchor)
    if has_confidence_head is not None:
        md[f"{DC.ARCH}.{KEY_HAS_CONF}"] = bool(has_confidence_head)
    tensors = random_draft_tensors(md, "dflash", seed=seed, scale=scale)
    n_vocab, n_embd = int(md[f"{DC.ARCH}.vocab_size"]), int(md[f"{DC.ARCH}.embedding_length"])
    tensors.update(dspark_tensors(n_vocab, n_embd, rank=rank, draft_vocab=draft_vocab, conf=conf,
                                  conf_with_markov=conf_with_markov, w2_scale=w2_scale, seed=seed, scale=head_scale))
    tensors.update(extra_tensors or {})
    return write_gguf(path, md, tensors)


#: Gemma 4 DSpark heads in DeepSpec's schema, as mlx-dspark's gemma4 family reads them (full layers only):
#: (name, block size, attention_k_eq_v, partial_rotary_factor, confidence head)
GEMMA4_MLX_CASES = [("keqv-b6-conf", 6, True, 0.25, True), ("vproj-b4-noconf", 4, False, 0.5, False)]


def write_gemma4_mlx_cases(root: str | Path, n_vocab: int = 257, n_ctx: int = 9) -> list[Path]:
    """Checkpoint folders of random Gemma 4 DSpark heads (``Gemma4DSparkModel``, DeepSpec's flat schema over
    ``gemma4_text``: top-level taps, block size, mask and Markov keys; own ``embed_tokens`` and ``lm_head``; no
    soft-capping), each with ``feats.npy`` (context features) and ``case.json`` (anchor, block length, mask)
    for mlx-dspark (scripts/check_mlx_dspark.py --gemma4) and plinth (tests/test_gemma4.py). Deterministic."""
    import json

    from plinth_dflash.testkit import hf_gemma4_draft_config, hf_gemma4_draft_tensors, write_safetensors

    root = Path(root)
    out = []
    for ci, (name, block, keqv, partial, conf) in enumerate(GEMMA4_MLX_CASES):
        rng = np.random.default_rng(500 + ci)
        cfg = hf_gemma4_draft_config(n_vocab=n_vocab, mask_token=n_vocab - 2, architecture="Gemma4DSparkModel",
                                     layer_types=["full_attention"] * 2, k_eq_v=keqv, partial_rotary=partial,
                                     block_size=block, target_layer_ids=(0, 2), tie_word_embeddings=False)
        d = cfg.pop("dflash_config")
        cfg.update(d)  # DeepSpec's schema: the DFlash keys at the top
        cfg.update(markov_rank=8, markov_head_type="vanilla", enable_confidence_head=conf,
                   confidence_head_with_markov=True, num_target_layers=3)
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(cfg, indent=1))
        t = hf_gemma4_draft_tensors({**cfg, "dflash_config": d}, seed=600 + ci, own_embd=True, own_head=True)
        e, r = cfg["hidden_size"], 8
        t["markov_head.markov_w1.weight"] = (0.5 * rng.standard_normal((n_vocab, r))).astype(np.float32)
        t["markov_head.markov_w2.weight"] = (0.5 * rng.standard_normal((n_vocab, r))).astype(np.float32)
        if conf:
            t["confidence_head.proj.weight"] = (0.3 * rng.standard_normal((1, e + r))).astype(np.float32)
            t["confidence_head.proj.bias"] = np.array([0.1], dtype=np.float32)
        write_safetensors(folder / "model.safetensors", t)
        np.save(folder / "feats.npy", rng.standard_normal((n_ctx, 2 * e)).astype(np.float32))
        (folder / "case.json").write_text(json.dumps({"anchor": int(rng.integers(0, n_vocab - 2)), "block": block,
                                                      "mask": n_vocab - 2}))
        out.append(folder)
    return out

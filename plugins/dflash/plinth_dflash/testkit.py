"""Tiny synthetic DFlash / DFlash2 / LiLiCorr GGUFs (and tiny targets) for tests and benchmarks.

``write_tiny_draft(path, "dflash2", n_embd=64, n_target_layer=2, n_vocab=96)`` writes a
random draft whose tensors are exactly what :func:`plinth_dflash.format.tensor_specs`
declares, so every test builds its files the way a converter would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from . import constants as C
from .format import load_hparams, tensor_specs


def default_taps(n_target_layer: int, n: int = 2) -> list[int]:
    """Evenly spread taps over 1..n_target_layer (GGUF ids, after the +1 rule)."""
    return sorted({max(1, round(1 + i * (n_target_layer - 1) / max(n - 1, 1))) for i in range(n)})


def tiny_draft_metadata(variant: str = "dflash", *, n_embd: int = 64, n_vocab: int = 96, n_layer: int = 2,
                        n_head: int = 4, n_head_kv: int = 2, head_dim: int | None = None, n_ff: int = 96,
                        taps: Any = (1, 2), block_size: int = 8, mask_token: int | None = None,
                        sliding_window: int = 0, swa_pattern: Any = None, causal: bool | None = None,
                        tied: bool | None = None, conv_kernel: int = 2, conv_group: int = 8, selector_rank: int = 8,
                        selector_top_k: int = 4, logit_scale: float = 0.0, softcap: float = 0.0,
                        lilicorr: Mapping[str, Any] | None = None, rope_base: float = 10000.0,
                        mask_key: str = C.KEY_MASK_TOKEN_TOK) -> dict[str, Any]:
    a = C.ARCH
    md: dict[str, Any] = {
        "general.architecture": a,
        "general.name": f"tiny-{variant}",
        f"{a}.vocab_size": n_vocab,
        f"{a}.embedding_length": n_embd,
        f"{a}.block_count": n_layer,
        f"{a}.attention.head_count": n_head,
        f"{a}.attention.head_count_kv": n_head_kv,
        f"{a}.attention.key_length": head_dim or n_embd // n_head,
        f"{a}.attention.value_length": head_dim or n_embd // n_head,
        f"{a}.feed_forward_length": n_ff,
        f"{a}.context_length": 4096,
        f"{a}.rope.freq_base": float(rope_base),
        f"{a}.{C.KEY_EPS}": 1e-6,
        f"{a}.{C.KEY_TARGET_LAYERS}": [int(t) for t in taps],
        f"{a}.{C.KEY_BLOCK_SIZE}": block_size,
    }
    mask = n_vocab - 1 if mask_token is None else mask_token
    md[mask_key if mask_key.startswith("tokenizer.") else f"{a}.{mask_key}"] = mask
    if sliding_window:
        md[f"{a}.{C.KEY_SWA}"] = sliding_window
        md[f"{a}.{C.KEY_SWA_PATTERN}"] = list(swa_pattern) if swa_pattern is not None else [True] * n_layer
    if causal is not None:
        md[f"{a}.{C.KEY_CAUSAL}"] = bool(causal)
    if tied is not None:  # absent: llama.cpp's rule (an own embedding without an own head is the head)
        md[f"{a}.{C.KEY_TIED}"] = bool(tied)
    if logit_scale:
        md[f"{a}.{C.KEY_LOGIT_SCALE}"] = float(logit_scale)
    if softcap:
        md[f"{a}.{C.KEY_SOFTCAP}"] = float(softcap)
    if variant in ("dflash2",) or (variant == "lilicorr" and lilicorr and lilicorr.get("conv")):
        md[f"{a}.{C.KEY_CONV_KERNEL}"] = conv_kernel
        md[f"{a}.{C.KEY_CONV_GROUP}"] = conv_group
    if variant == "dflash2":
        md[f"{a}.{C.KEY_SEL_RANK}"] = selector_rank
        md[f"{a}.{C.KEY_SEL_TOP_K}"] = selector_top_k
    if variant == "lilicorr":
        lc = dict(top_k=4, hidden=32, n_layer=1, n_head=2, mlp_ratio=2.0, factor_dim=16, vector_eps=1e-6,
                  logit_scale=8.0)
        lc.update({k: v for k, v in (lilicorr or {}).items() if k != "conv"})
        md[f"{a}.{C.KEY_LILI_TOP_K}"] = int(lc["top_k"])
        md[f"{a}.{C.KEY_LILI_HIDDEN}"] = int(lc["hidden"])
        md[f"{a}.{C.KEY_LILI_LAYERS}"] = int(lc["n_layer"])
        md[f"{a}.{C.KEY_LILI_HEADS}"] = int(lc["n_head"])
        md[f"{a}.{C.KEY_LILI_MLP_RATIO}"] = float(lc["mlp_ratio"])
        md[f"{a}.{C.KEY_LILI_FACTOR}"] = int(lc["factor_dim"])
        md[f"{a}.{C.KEY_LILI_VEC_EPS}"] = float(lc["vector_eps"])
        md[f"{a}.{C.KEY_LILI_LAMBDA}"] = float(lc["logit_scale"])
    return md


def _marker_names(variant: str) -> list[str]:
    if variant == "dflash2":
        return [C.T_SEL_HIDDEN]
    if variant == "lilicorr":
        return ["lilicorr.pass_hidden_proj.weight"]
    return []


def random_draft_tensors(md: Mapping[str, Any], variant: str, *, seed: int = 0, scale: float = 0.2,
                         own_embd: bool = False, own_head: bool = False, k_eq_v: Any = (),
                         gemma_norms: bool = False) -> dict[str, np.ndarray]:
    """Random weights for every tensor the metadata declares (norm weights around 1, optional tensors
    only when asked: ``own_embd`` / ``own_head``; every layer has ``attn_v`` except those in ``k_eq_v``;
    ``gemma_norms``: the post-attention / post-FFN norms and the layer output scale of Gemma 4 layers)."""
    hp = load_hparams(md, "tiny-draft", _marker_names(variant))
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    gemma = (C.T_POST_ATTN_NORM, C.T_POST_FFN_NORM, C.T_LAYER_OUT_SCALE)
    for spec in tensor_specs(hp):
        name = spec.name
        if not spec.required:
            if name == C.T_TOKEN_EMBD and not (own_embd or hp.tied):
                continue
            if name == C.T_OUTPUT and not own_head:
                continue
            if name.endswith(".attn_v.weight"):
                if int(name.split(".")[1]) in set(k_eq_v):
                    continue
            elif name.endswith(gemma) and name.startswith("blk."):
                if not gemma_norms:
                    continue
            elif name not in (C.T_TOKEN_EMBD, C.T_OUTPUT):
                continue  # sinks, input scales, biases, rope_freqs: not by default
        shape = tuple(spec.shape)
        if name.endswith(C.T_LAYER_OUT_SCALE):
            out[name] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        elif name.endswith("norm.weight") and len(shape) == 1:
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith(("_conv_base",)):
            out[name] = (0.3 * rng.standard_normal(shape)).astype(np.float32)
        elif name in (C.T_SEL_PRED, C.T_SEL_SUCC):
            out[name] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    if variant == "lilicorr":  # the optional biases of the head exist in the (assumed) reference layout
        for spec in tensor_specs(hp):
            if spec.name.startswith(C.LILI_PREFIX) and spec.name.endswith(".bias") and spec.name not in out:
                out[spec.name] = (0.05 * rng.standard_normal(spec.shape)).astype(np.float32)
    return out


def with_scales(tensors: Mapping[str, np.ndarray], seed: int = 1) -> dict[str, np.ndarray]:
    """The same model written NVFP4-style: every scalable projection W stored as W / s plus ``<name>.scale`` = s."""
    rng = np.random.default_rng(seed)
    out = dict(tensors)
    for name, arr in tensors.items():
        base = name[:-len(".weight")] if name.endswith(".weight") else None
        if base is None or arr.ndim != 2:
            continue
        short = base.split(".")[-1]
        if short in C.SCALED or base in ("fc", "output", "selector_hidden"):
            s = np.float32(rng.uniform(0.25, 4.0))
            out[name] = (arr / s).astype(np.float32)
            out[base + ".scale"] = np.array([s], dtype=np.float32)
    out[C.T_FC_INPUT_SCALE] = np.array([0.5], dtype=np.float32)
    return out


def write_tiny_draft(path: str | Path, variant: str = "dflash", *, seed: int = 0, own_embd: bool = False,
                     own_head: bool = False, scales: bool = False, extra_tensors: Mapping[str, np.ndarray] | None = None,
                     scale: float = 0.2, extra_metadata: Mapping[str, Any] | None = None, **md_kw: Any) -> Path:
    from plinth.convert import write_gguf

    md = tiny_draft_metadata(variant, **md_kw)
    md.update(extra_metadata or {})
    tensors = random_draft_tensors(md, variant, seed=seed, own_embd=own_embd, own_head=own_head, scale=scale)
    if scales:
        tensors = with_scales(tensors)
    tensors.update(extra_tensors or {})
    return write_gguf(path, md, tensors)


def gemma4_draft_metadata(*, n_embd: int = 64, n_vocab: int = 257, n_head: int = 4, head_dim: int = 32,
                          head_dim_swa: int = 16, n_head_kv: int = 2, n_head_kv_full: int = 1,
                          layer_types: Any = ("sliding_attention", "full_attention"), sliding_window: int = 4,
                          partial_rotary: float = 0.25, rope_base: float = 1e6, rope_base_swa: float = 1e4,
                          **kw: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Metadata of a Gemma-4-backbone dflash draft (as plinth's converter writes one from a ``gemma4_text``
    backbone: sliding layers of head size ``head_dim_swa`` with their own RoPE, full layers of ``head_dim``
    with proportional RoPE and K = V, V norms, GELU, embeddings times sqrt(E), attention scale 1) and its
    ``rope_freqs`` tensor."""
    a = C.ARCH
    swa = [t == "sliding_attention" for t in layer_types]
    md = tiny_draft_metadata("dflash", n_embd=n_embd, n_vocab=n_vocab, n_layer=len(swa), n_head=n_head,
                             n_head_kv=n_head_kv, head_dim=head_dim, rope_base=rope_base,
                             sliding_window=sliding_window if any(swa) else 0, swa_pattern=swa, **kw)
    md[f"{a}.attention.head_count_kv"] = [n_head_kv if s else n_head_kv_full for s in swa]
    md[f"{a}.{C.KEY_EMBD_SCALE}"] = float(n_embd) ** 0.5
    md[f"{a}.{C.KEY_ATTN_SCALE}"] = 1.0
    md[f"{a}.{C.KEY_HIDDEN_ACT}"] = "gelu_pytorch_tanh"
    md[f"{a}.{C.KEY_VALUE_NORM}"] = True
    if any(swa):
        md[f"{a}.attention.key_length_swa"] = head_dim_swa
        md[f"{a}.attention.value_length_swa"] = head_dim_swa
        md[f"{a}.rope.freq_base_swa"] = float(rope_base_swa)
        md[f"{a}.rope.dimension_count_swa"] = head_dim_swa
    n_rot = int(head_dim * partial_rotary) // 2
    factors = np.array([1.0] * n_rot + [1e30] * (head_dim // 2 - n_rot), dtype=np.float32)
    return md, {C.T_ROPE_FREQS: factors}


def write_tiny_gemma4_draft(path: str | Path, *, seed: int = 0, own_embd: bool = False, own_head: bool = False,
                            k_eq_v: bool = True, scale: float = 0.2, extra_tensors: Any = None,
                            **kw: Any) -> Path:
    """A random Gemma-4-backbone DFlash draft (:func:`gemma4_draft_metadata`); ``k_eq_v``: the full layers
    have no ``attn_v`` (Gemma 4's attention_k_eq_v)."""
    from plinth.convert import write_gguf

    md, extra = gemma4_draft_metadata(**kw)
    swa = md[f"{C.ARCH}.{C.KEY_SWA_PATTERN}"] if f"{C.ARCH}.{C.KEY_SWA_PATTERN}" in md else []
    n_layer = int(md[f"{C.ARCH}.block_count"])
    full = [il for il in range(n_layer) if not (swa and swa[il])] if k_eq_v else []
    tensors = random_draft_tensors(md, "dflash", seed=seed, own_embd=own_embd, own_head=own_head, scale=scale,
                                   k_eq_v=full, gemma_norms=True)
    tensors.update(extra)
    tensors.update(extra_tensors or {})
    return write_gguf(path, md, tensors)


def tiny_target(path: str | Path, arch: str = "qwen3", *, n_vocab: int = 257, n_embd: int = 64, n_layer: int = 3,
                seed: int = 0, scale: float = 0.2, registry: Any = None, backend: str = "numpy") -> Any:
    """Write and load a tiny random target of ``arch`` (needs plinth-llama installed); with the default
    257-token vocabulary it carries plinth's byte-level test tokenizer, so the generation loop can run it."""
    import plinth
    from plinth.testing import byte_vocab, make_registry, tiny_metadata, write_synthetic_gguf

    reg = registry or make_registry("llama")
    md = tiny_metadata(arch, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_ctx=1024)
    if n_vocab == 257:
        md |= byte_vocab()
    p = write_synthetic_gguf(path, arch, md, reg, seed=seed, scale=scale, drop=("output.weight",))
    return plinth.load_model(p, registry=reg, backend=backend)


#: a tiny gemma4 target: sliding, sliding, full; sliding head 16 with its own RoPE, full head 32; soft-capping
GEMMA4_TARGET = dict(attention__key_length=32, attention__key_length_swa=16, attention__value_length=32,
                     attention__value_length_swa=16, attention__sliding_window=5, rope__freq_base=1e6,
                     rope__freq_base_swa=1e4, rope__dimension_count=32, rope__dimension_count_swa=16, n_layer=3,
                     attention__sliding_window_pattern=[True, True, False], final_logit_softcapping=30.0)


def tiny_gemma4_target(path: str | Path, *, seed: int = 3, backend: str = "numpy", **over: Any) -> Any:
    """Write (once) and load a tiny random gemma4 target (needs plinth-gemma) with plinth's byte-level test
    tokenizer (257 ids), n_embd 64."""
    import plinth
    from plinth.testing import byte_vocab, make_registry, tiny_metadata, write_synthetic_gguf

    reg = make_registry("gemma")
    path = Path(path)
    if not path.exists():
        md = tiny_metadata("gemma4", n_vocab=257, n_embd=64, n_ctx=1024, **{**GEMMA4_TARGET, **over}) | byte_vocab()
        write_synthetic_gguf(path, "gemma4", md, reg, seed=seed, scale=0.2)
    return plinth.load_model(path, registry=reg, backend=backend)


# ---------------------------------------------------------------------- HF-layout drafts (converter input)


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray]) -> Path:
    """A safetensors file without torch (the test kit's writer)."""
    from plinth.testing import write_safetensors as write

    return write(path, tensors)


def hf_draft_config(variant: str = "dflash", *, n_embd: int = 64, n_vocab: int = 96, n_layer: int = 2, n_head: int = 4,
                    n_head_kv: int = 2, n_ff: int = 96, target_layer_ids: Any = (0, 1), n_target_layer: int = 3,
                    block_size: int = 16, mask_token: int | None = None, rope_theta: float = 10000.0,
                    layer_types: Any = None, sliding_window: int | None = None, conv_kernel: int = 2,
                    conv_group: int = 8, selector_rank: int = 8, selector_top_k: int = 4,
                    output_multiplier: float | None = None, softcap: float | None = None,
                    lilicorr: Mapping[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    arch = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "lilicorr": "LiLiCorrDraftModel"}[variant]
    d: dict[str, Any] = {"target_layer_ids": list(target_layer_ids), "block_size": block_size,
                         "mask_token_id": n_vocab - 1 if mask_token is None else mask_token}
    if variant == "dflash2":
        d.update(conv_kernel_size=conv_kernel, conv_group_size=conv_group, selector_rank=selector_rank,
                 selector_top_k=selector_top_k)
    if output_multiplier is not None:
        d["output_multiplier"] = output_multiplier
    if softcap is not None:
        d["final_logit_softcapping"] = softcap
    if variant == "lilicorr":
        lc = dict(lilicorr_enabled=True, lilicorr_candidate_topk=4, lilicorr_hidden_size=32, lilicorr_num_layers=1,
                  lilicorr_num_heads=2, lilicorr_mlp_ratio=2.0, lilicorr_factor_dim=16, lilicorr_vector_eps=1e-6,
                  lilicorr_logit_scale=8.0)
        lc.update(lilicorr or {})
        d.update(lc)
    cfg: dict[str, Any] = {
        "architectures": [arch], "model_type": "qwen3", "hidden_size": n_embd, "intermediate_size": n_ff,
        "num_hidden_layers": n_layer, "num_attention_heads": n_head, "num_key_value_heads": n_head_kv,
        "head_dim": n_embd // n_head, "vocab_size": n_vocab, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta}, "attention_bias": False,
        "tie_word_embeddings": True, "num_target_layers": n_target_layer, "block_size": block_size,
        "layer_types": list(layer_types) if layer_types is not None else ["full_attention"] * n_layer,
        "dflash_config": d,
    }
    if sliding_window is not None:
        cfg["sliding_window"] = sliding_window
    cfg.update(extra)
    return cfg


def hf_draft_tensors(cfg: Mapping[str, Any], *, seed: int = 0, scale: float = 0.2) -> dict[str, np.ndarray]:
    """Random weights under the HF (z-lab) tensor names of the draft described by ``cfg``."""
    rng = np.random.default_rng(seed)
    e, ff, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    d = cfg["dflash_config"]
    n_taps = len(d["target_layer_ids"])
    arch = cfg["architectures"][0]

    def r(*shape: int, s: float = scale) -> np.ndarray:
        return (s * rng.standard_normal(shape)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t: dict[str, np.ndarray] = {"fc.weight": r(e, n_taps * e), "hidden_norm.weight": norm(e), "norm.weight": norm(e)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        t.update({
            p + "input_layernorm.weight": norm(e), p + "post_attention_layernorm.weight": norm(e),
            p + "self_attn.q_proj.weight": r(nq, e), p + "self_attn.k_proj.weight": r(nkv, e),
            p + "self_attn.v_proj.weight": r(nkv, e), p + "self_attn.o_proj.weight": r(e, nq),
            p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
            p + "mlp.gate_proj.weight": r(ff, e), p + "mlp.up_proj.weight": r(ff, e),
            p + "mlp.down_proj.weight": r(e, ff),
        })
        if arch == "DFlash2DraftModel" or "conv_kernel_size" in d:
            kc, g = d["conv_kernel_size"], e // d["conv_group_size"]
            for side in ("attention_conv", "mlp_conv"):
                t[p + side + ".base_kernel"] = r(2, kc, e, s=0.3)
                t[p + side + ".kernel_projection.weight"] = r(2 * kc * g, e)
    if arch == "DFlash2DraftModel":
        v, rk = cfg["vocab_size"], d["selector_rank"]
        t["candidate_selector.predecessor_codebook.weight"] = r(v, rk, s=0.5)
        t["candidate_selector.successor_codebook.weight"] = r(v, rk, s=0.5)
        t["candidate_selector.hidden_projection.weight"] = r(rk, e)
    if arch == "LiLiCorrDraftModel":
        dh = d["lilicorr_hidden_size"] or e
        k, f, nl = d["lilicorr_candidate_topk"], d["lilicorr_factor_dim"], d["lilicorr_num_layers"]
        h, mr, b = d["lilicorr_num_heads"], int(round(d["lilicorr_mlp_ratio"] * dh)), d["block_size"]
        q = "lilicorr."
        if dh != e:
            t.update({q + "token_proj.weight": r(dh, e), q + "token_proj.bias": r(dh, s=0.05)})
        t.update({q + "pass_hidden_proj.weight": r(dh, e), q + "pass_hidden_proj.bias": r(dh, s=0.05),
                  q + "feature_mlp.0.weight": norm(5), q + "feature_mlp.0.bias": r(5, s=0.05),
                  q + "feature_mlp.1.weight": r(dh, 5), q + "feature_mlp.1.bias": r(dh, s=0.05),
                  q + "feature_mlp.3.weight": r(dh, dh), q + "feature_mlp.3.bias": r(dh, s=0.05),
                  q + "slot_embedding.weight": r(b - 1, dh), q + "rank_embedding.weight": r(k, dh)})
        for i in range(nl):
            p = f"{q}layers.{i}."
            t.update({p + "attn_norm.weight": norm(dh), p + "attn.in_proj_weight": r(3 * dh, dh),
                      p + "attn.in_proj_bias": r(3 * dh, s=0.05), p + "attn.out_proj.weight": r(dh, dh),
                      p + "attn.out_proj.bias": r(dh, s=0.05), p + "relative_slot_bias": r(h, 2 * b - 1),
                      p + "same_slot_bias": r(h), p + "mlp_norm.weight": norm(dh), p + "mlp.0.weight": r(mr, dh),
                      p + "mlp.0.bias": r(mr, s=0.05), p + "mlp.2.weight": r(dh, mr), p + "mlp.2.bias": r(dh, s=0.05)})
        for name, shape in (("output_norm", None), ("anchor_norm", None), ("context_proj", (dh, e)),
                            ("factor_in", (dh, 3 * dh)), ("out_head", (f, dh)), ("in_head", (f, dh)),
                            ("anchor_out_head", (f, dh))):
            if shape is None:
                t[q + name + ".weight"] = norm(dh)
            else:
                t[q + name + ".weight"] = r(*shape)
                t[q + name + ".bias"] = r(shape[0], s=0.05)
    return t


def write_hf_draft(model_dir: str | Path, variant: str = "dflash", *, seed: int = 0, extra_tensors: Any = None,
                   **cfg_kw: Any) -> Path:
    """An HF-layout draft folder (config.json + model.safetensors) of random weights."""
    import json

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = hf_draft_config(variant, **cfg_kw)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    t = hf_draft_tensors(cfg, seed=seed)
    t.update(extra_tensors or {})
    write_safetensors(model_dir / "model.safetensors", t)
    return model_dir



# ---------------------------------------------------------------------- the reference-comparison case

REF_PROMPT_SEED = 1234
REF_BLOCKS = (4, 8, 16)
REF_ROUNDS = 3


def reference_prompts(n: int = 5, n_vocab: int = 96, mask: int = 95) -> list[list[int]]:
    rng = np.random.default_rng(REF_PROMPT_SEED)
    out = []
    for i in range(n):
        p = rng.integers(0, n_vocab - 1, 5 + 2 * i).tolist()
        out.append([t for t in p if t != mask])
    return out


def reference_case(workdir: str | Path, variant: str) -> dict[str, Path]:
    """Deterministic files of the reference comparison: a tiny qwen3 target GGUF, the HF draft folder and the
    draft converted by ``plinth convert``. Same numpy seeds everywhere, so the golden outputs regenerate."""
    from .convert import DFlash2Converter, DFlashConverter

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    target = workdir / "target-qwen3.gguf"
    if not target.exists():
        from plinth.testing import make_registry, tiny_metadata, write_synthetic_gguf

        md = tiny_metadata("qwen3", n_vocab=96, n_embd=64, n_layer=3, n_ctx=1024)
        write_synthetic_gguf(target, "qwen3", md, make_registry("llama"), seed=11, scale=0.2,
                             drop=("output.weight",))
    kw: dict[str, Any] = dict(target_layer_ids=(0, 1), n_target_layer=3, block_size=16)
    if variant == "dflash2":
        kw.update(output_multiplier=1.5, softcap=30.0, conv_kernel=3)
    hf_dir = write_hf_draft(workdir / f"hf-{variant}", variant, seed=21, **kw)
    gguf_path = workdir / f"draft-{variant}.gguf"
    conv = {"dflash": DFlashConverter, "dflash2": DFlash2Converter}[variant]()
    conv.convert(str(hf_dir), str(gguf_path), {"target": str(target)})
    return {"target": target, "hf": hf_dir, "draft": gguf_path}


# ---------------------------------------------------------------------- Gemma 4 backbones (HF layout)


def hf_gemma4_draft_config(*, n_embd: int = 64, n_vocab: int = 96, n_head: int = 4, head_dim: int = 16,
                           global_head_dim: int = 32, n_head_kv: int = 2, n_head_kv_global: int = 1, n_ff: int = 96,
                           layer_types: Any = ("sliding_attention", "full_attention"), sliding_window: int = 4,
                           k_eq_v: bool = True, partial_rotary: float = 0.25, rope_type: str = "proportional",
                           target_layer_ids: Any = (0, 1), block_size: int = 8, mask_token: int | None = None,
                           tie_word_embeddings: bool = True, architecture: str = "DFlashDraftModel",
                           per_layer_config: bool = False, **extra: Any) -> dict[str, Any]:
    """A ``gemma4_text`` draft config (the released key style: ``global_head_dim``, ``num_global_key_value_heads``;
    ``per_layer_config=True`` writes transformers 5.24's per-layer overrides instead)."""
    types = list(layer_types)
    cfg: dict[str, Any] = {
        "architectures": [architecture], "model_type": "gemma4_text", "hidden_size": n_embd,
        "intermediate_size": n_ff, "num_hidden_layers": len(types), "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv, "head_dim": head_dim, "vocab_size": n_vocab, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 4096, "attention_bias": False,
        "attention_k_eq_v": k_eq_v, "layer_types": types, "sliding_window": sliding_window,
        "final_logit_softcapping": None, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
        "enable_moe_block": False, "tie_word_embeddings": tie_word_embeddings,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": rope_type, "partial_rotary_factor": partial_rotary,
                                               "rope_theta": 1_000_000.0}},
        "dflash_config": {"target_layer_ids": list(target_layer_ids), "block_size": block_size,
                          "mask_token_id": n_vocab - 1 if mask_token is None else mask_token},
    }
    if per_layer_config:
        over = {"head_dim": global_head_dim, **({"num_key_value_heads": n_head_kv_global} if k_eq_v else {})}
        cfg["per_layer_config"] = {f"{il:02d}": over for il, t in enumerate(types) if t == "full_attention"}
    else:
        cfg["global_head_dim"] = global_head_dim
        cfg["num_global_key_value_heads"] = n_head_kv_global
    cfg.update(extra)
    return cfg


def hf_gemma4_draft_tensors(cfg: Mapping[str, Any], *, seed: int = 0, scale: float = 0.2, own_embd: bool = False,
                            own_head: bool = False) -> dict[str, np.ndarray]:
    """Random weights under the HF names of a Gemma 4 draft backbone (``layers.N.*``, ``fc``, ``hidden_norm``,
    ``norm``): every norm and the layer scalar drawn away from 1."""
    from .convert import gemma4_layer_geometry

    rng = np.random.default_rng(seed)
    e, ff, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    dims, kvs = gemma4_layer_geometry(cfg, "cfg", n)
    taps = len(cfg["dflash_config"]["target_layer_ids"])

    def r(*shape: int) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def norm(k: int) -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(k)).astype(np.float32)

    t = {"fc.weight": r(e, taps * e), "hidden_norm.weight": norm(e), "norm.weight": norm(e)}
    for il in range(n):
        p, hd, nq, nkv = f"layers.{il}.", dims[il], cfg["num_attention_heads"] * dims[il], kvs[il] * dims[il]
        t.update({p + "input_layernorm.weight": norm(e), p + "post_attention_layernorm.weight": norm(e),
                  p + "pre_feedforward_layernorm.weight": norm(e), p + "post_feedforward_layernorm.weight": norm(e),
                  p + "self_attn.q_proj.weight": r(nq, e), p + "self_attn.k_proj.weight": r(nkv, e),
                  p + "self_attn.o_proj.weight": r(e, nq), p + "self_attn.q_norm.weight": norm(hd),
                  p + "self_attn.k_norm.weight": norm(hd), p + "mlp.gate_proj.weight": r(ff, e),
                  p + "mlp.up_proj.weight": r(ff, e), p + "mlp.down_proj.weight": r(e, ff),
                  p + "layer_scalar": rng.uniform(0.5, 1.5, 1).astype(np.float32)})
        if not (cfg.get("attention_k_eq_v") and cfg["layer_types"][il] == "full_attention"):
            t[p + "self_attn.v_proj.weight"] = r(nkv, e)
    if own_embd:
        t["embed_tokens.weight"] = r(cfg["vocab_size"], e)
    if own_head:
        t["lm_head.weight"] = r(cfg["vocab_size"], e)
    return t


def write_hf_gemma4_draft(model_dir: str | Path, *, seed: int = 0, own_embd: bool = False, own_head: bool = False,
                          extra_tensors: Any = None, **cfg_kw: Any) -> Path:
    """An HF-layout Gemma 4 draft folder (config.json + model.safetensors) of random weights."""
    import json

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = hf_gemma4_draft_config(**cfg_kw)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    t = hf_gemma4_draft_tensors(cfg, seed=seed, own_embd=own_embd, own_head=own_head)
    t.update(extra_tensors or {})
    write_safetensors(model_dir / "model.safetensors", t)
    return model_dir

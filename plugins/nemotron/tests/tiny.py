"""Tiny synthetic Nemotron-H files for the contract, hparams and speculative tests.

``metadata(pattern)`` gives GGUF metadata for a layer pattern (``M`` Mamba-2, ``*`` attention,
``-`` MLP, ``E`` MoE) in llama.cpp's keys; ``weights(hp)`` draws weights with the SSM
parameters in their valid ranges (``ssm_a < 0``), so long sequences stay finite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from plinth.testing import random_tensors
from plinth.testing.synthetic import byte_vocab


def metadata(pattern: str, *, arch: str | None = None, n_embd: int = 32, n_vocab: int = 96, top_k: Any = 2,
             n_expert: int = 6, n_ff_exp: Any = 16, n_ff_shexp: Any = 24, latent: Any = 0, n_ff: int = 48,
             vocab: bool = False, **extra: Any) -> dict[str, Any]:
    """Metadata of a tiny Nemotron-H; scalars or per-layer lists for the expert keys."""
    arch = arch or ("nemotron_h_moe" if "E" in pattern else "nemotron_h")
    n = len(pattern)
    a = arch
    md: dict[str, Any] = {
        "general.architecture": arch,
        "general.name": f"tiny-{arch}",
        f"{a}.context_length": 512,
        f"{a}.embedding_length": n_embd,
        f"{a}.block_count": n,
        f"{a}.vocab_size": 257 if vocab else n_vocab,
        f"{a}.feed_forward_length": [n_ff if c == "-" else 32 if c == "E" else 0 for c in pattern],
        f"{a}.attention.head_count": 4,
        f"{a}.attention.head_count_kv": [2 if c == "*" else 0 for c in pattern],
        f"{a}.attention.key_length": 8,
        f"{a}.attention.value_length": 8,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{a}.ssm.conv_kernel": 4,
        f"{a}.ssm.inner_size": 32,
        f"{a}.ssm.state_size": 8,
        f"{a}.ssm.time_step_rank": 4,
        f"{a}.ssm.group_count": 2,
    }
    if "E" in pattern:
        md.update({
            f"{a}.expert_count": n_expert,
            f"{a}.expert_used_count": top_k,
            f"{a}.expert_feed_forward_length": n_ff_exp,
            f"{a}.expert_shared_feed_forward_length": n_ff_shexp,
            f"{a}.expert_weights_norm": True,
            f"{a}.expert_weights_scale": 2.0,
        })
        if latent:
            md[f"{a}.moe_latent_size"] = latent
    for key, value in extra.items():
        md[f"{a}.{key.replace('__', '.')}"] = value
    if vocab:
        md.update(byte_vocab())
    return md


def weights(specs: Any, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights for ``specs`` with a stable SSM (A < 0, modest dt)."""
    w = random_tensors(specs, seed=seed, scale=0.3)
    rng = np.random.default_rng(seed + 1000)
    for name in list(w):
        if name.endswith("ssm_a"):
            w[name] = -rng.uniform(1.0, 8.0, w[name].shape).astype(np.float32)
        elif name.endswith("ssm_dt.bias"):
            w[name] = (0.5 * rng.standard_normal(w[name].shape)).astype(np.float32)
        elif name == "token_embd.weight":
            w[name] = rng.standard_normal(w[name].shape).astype(np.float32)
    return w


def build(registry: Any, md: dict[str, Any], seed: int = 0,
          backend: str = "numpy") -> tuple[Any, Any, dict[str, np.ndarray]]:
    """(hparams, graph, host weights) of a tiny model, in memory; the graph's weights live on ``backend``."""
    arch = md["general.architecture"]
    hp = registry.arch_hparams(arch, md, f"tiny-{arch}.gguf")
    w = weights(registry.arch_tensors(arch, hp), seed)
    be = registry.make_backend(backend)
    graph = registry.arch_build(arch, hp, {k: be.asarray(v) for k, v in w.items()}, be)
    return hp, graph, w


def write(path: Path, registry: Any, md: dict[str, Any], seed: int = 0, drop: tuple[str, ...] = ()) -> Path:
    """A tiny GGUF file."""
    from plinth.testing import write_gguf

    arch = md["general.architecture"]
    hp = registry.arch_hparams(arch, md, str(path))
    w = weights(registry.arch_tensors(arch, hp), seed)
    for name in drop:
        w.pop(name)
    return write_gguf(path, md, w)

"""Neural-network building blocks shared by every architecture.

All functions take arrays from numpy or cupy (the module is inferred from the inputs with
:func:`array_module`) and compute in float32. Weights use the GGUF layout: a matrix maps
n_in -> n_out and has array shape [n_out, n_in]; ``linear(x, w)`` is ``x @ w.T``.
"""

from ._xp import array_module, as_f32
from .activations import (
    ACTIVATIONS,
    erf,
    gelu,
    gelu_erf,
    get_activation,
    log_softmax,
    relu2,
    sigmoid,
    silu,
    softmax,
    softplus,
)
from .attention import attention, attention_bias, attention_groups, attention_mask, attention_rows
from .ffn import geglu, glu_ffn, linear, linear_t, relu2_mlp, swiglu
from .misc import TopK, gather_rows, pad, top_k
from .moe import MoeRoute, moe_ffn, moe_route
from .norm import head_layer_norm, head_rms_norm, layer_norm, rms_norm
from .ssm import causal_conv1d, gated_group_rms_norm, ssm_scan, ssm_step
from .rope import (
    RopeCache,
    RopeFreqs,
    apply_rope,
    rope_cos_sin,
    rope_freqs,
    yarn_corr_dim,
    yarn_corr_dims,
)


def warm_up() -> float:
    """Compile (or load from the on-disk cache) every compiled kernel: the quantized products of every
    kept type (:func:`plinth.quant.warm_up`) and the host ops (decode attention, RMSNorm, RoPE, silu, the
    fused dense block);
    seconds taken (0 where the compiled kernels are off)."""
    import time

    import numpy as np

    from .. import quant

    t0 = time.perf_counter()
    if not quant.warm_up():
        return 0.0
    # decode attention (the vector kernel: hd 64; the plain loop: hd 8), RMSNorm, RoPE
    q64 = np.zeros((1, 1, 64), dtype=np.float32)
    attention(q64, q64, q64, causal=False)
    q = np.zeros((1, 1, 8), dtype=np.float32)
    attention(q, q, q, causal=False)
    rms_norm(q[0], np.ones(8, dtype=np.float32), 1e-6)
    cs = np.ones((1, 4), dtype=np.float32)
    apply_rope(q, cos_sin=(cs, cs))
    apply_rope(q[:, :, ::2], cos_sin=(cs[:, :2], cs[:, :2]))  # the strided view a fused QKV gives
    silu(q[0])
    if quant.compiled_i8() is not None:  # a llama-style layer's one call (plinth.graph.DenseBlocks)
        from . import fused

        fused.warm_up()
    return time.perf_counter() - t0


__all__ = [
    "ACTIVATIONS",
    "MoeRoute",
    "RopeCache",
    "RopeFreqs",
    "TopK",
    "apply_rope",
    "array_module",
    "as_f32",
    "attention",
    "attention_bias",
    "attention_groups",
    "attention_mask",
    "attention_rows",
    "causal_conv1d",
    "erf",
    "gated_group_rms_norm",
    "gather_rows",
    "geglu",
    "gelu",
    "gelu_erf",
    "get_activation",
    "glu_ffn",
    "head_layer_norm",
    "head_rms_norm",
    "layer_norm",
    "linear",
    "linear_t",
    "log_softmax",
    "moe_ffn",
    "moe_route",
    "pad",
    "relu2",
    "relu2_mlp",
    "rms_norm",
    "rope_cos_sin",
    "rope_freqs",
    "sigmoid",
    "silu",
    "softmax",
    "softplus",
    "ssm_scan",
    "ssm_step",
    "swiglu",
    "top_k",
    "warm_up",
    "yarn_corr_dim",
    "yarn_corr_dims",
]

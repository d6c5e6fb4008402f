"""Neural-network building blocks shared by every architecture.

All functions take arrays from numpy or cupy (the module is inferred from the inputs with
:func:`array_module`) and compute in float32. Weights use the GGUF layout: a matrix maps
n_in -> n_out and has array shape [n_out, n_in]; ``linear(x, w)`` is ``x @ w.T``.
"""

from ._xp import array_module, as_f32
from .activations import (
    ACTIVATIONS,
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
    "yarn_corr_dim",
    "yarn_corr_dims",
]

"""Linear layers and feed-forward blocks.

Weight layout: GGUF layout throughout. A GGUF tensor with ggml dims (n_in, n_out) loads
as a numpy array of shape [n_out, n_in], or as a :class:`plinth.quant.QuantWeight` of that
shape that keeps the file's quantized blocks; ``linear`` computes x @ W.T for either.
"""

from __future__ import annotations

from typing import Any

from ..quant import WEIGHT_TYPES
from ._xp import F32, array_module, as_f32
from .activations import gelu, get_activation, relu2, silu

def _invariant_kernels(xp: Any, m: int) -> Any:
    """The compiled kernel module when a float32 host product of ``m`` rows goes through the
    batch-invariant kernels (:func:`plinth.quant.kernels.matmul_f32`: each row dotted with each weight
    row in one fixed order, so a row's bits do not depend on its batch, as for quantized weights),
    else None (a device array, no numba, or more than ``plinth.quant.KERNEL_MAX_ROWS`` rows: BLAS)."""
    from .. import quant

    if xp.__name__ != "numpy" or not 0 < m <= quant.F32_KERNEL_MAX_ROWS:
        return None
    return quant.compiled()


def linear(x: Any, w: Any, bias: Any = None) -> Any:
    """y = x @ w.T (+ bias).

    x: [..., n_in]
    w: [n_out, n_in]  (GGUF layout; float32 C-contiguous for the fast BLAS sgemm path, or a
       :class:`plinth.quant.QuantWeight`, multiplied from its quantized blocks)
    bias: [n_out] or None
    Returns [..., n_out] float32.
    """
    return _product(x, w, bias, transposed=False)


def linear_t(x: Any, w_t: Any, bias: Any = None) -> Any:
    """y = x @ w_t (+ bias) for a weight stored transposed.

    x: [..., n_in];  w_t: [n_in, n_out] (float32, rows contiguous);  bias: [n_out] or None.
    Returns [..., n_out] float32. Same product as ``linear(x, w_t.T)``; OpenBLAS runs its
    matrix-vector product faster in this layout when n_out >= n_in.
    """
    return _product(x, w_t, bias, transposed=True)


def _product(x: Any, w: Any, bias: Any, transposed: bool) -> Any:
    """x @ w (transposed: w is [n_in, n_out]) or x @ w.T (w is [n_out, n_in]), plus bias."""
    if isinstance(w, WEIGHT_TYPES):
        if transposed:
            raise TypeError("ops.linear_t takes a float32 [n_in, n_out] array; pass a QuantWeight to ops.linear")
        x = as_f32(x)
        y = w.matmul(x.reshape(-1, x.shape[-1]))
        if bias is not None:
            y += as_f32(bias)
        return y.reshape(*x.shape[:-1], w.shape[0])
    xp = array_module(x, w)
    x = as_f32(x, xp)
    if w.dtype != F32:
        w = w.astype(F32)
    n_out = w.shape[1] if transposed else w.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.flags.c_contiguous:
        x2 = xp.ascontiguousarray(x2)
    k = _invariant_kernels(xp, x2.shape[0])
    if k is not None:
        from .. import quant

        quant.blas.use(1)
        if not w.flags.c_contiguous:
            w = xp.ascontiguousarray(w)
        y = xp.empty((x2.shape[0], n_out), dtype=F32)
        chunk = max(1, min(64, n_out // (8 * quant.threads())))
        (k.matmul_f32_t if transposed else k.matmul_f32)(w, x2, y, chunk)
    else:
        # w.T of a C-contiguous w is an F-contiguous view: BLAS takes it as a transposed operand
        y = x2 @ w if transposed else x2 @ w.T
    if bias is not None:
        y += as_f32(bias, xp)
    return y.reshape(*lead, n_out)


def glu_ffn(x: Any, w_gate: Any, w_up: Any, w_down: Any, act: str | Any = "silu") -> Any:
    """Gated FFN: down( act(x @ gate.T) * (x @ up.T) ).

    x: [n_tokens, n_embd];  w_gate, w_up: [n_ff, n_embd];  w_down: [n_embd, n_ff].
    act: activation name or callable.
    Returns [n_tokens, n_embd] float32.
    """
    fn = get_activation(act) if isinstance(act, str) else act
    h = fn(linear(x, w_gate))
    h *= linear(x, w_up)
    return linear(h, w_down)


def swiglu(x: Any, w_gate: Any, w_up: Any, w_down: Any) -> Any:
    """SwiGLU FFN (llama): down(silu(x @ gate.T) * (x @ up.T)).

    x: [n_tokens, n_embd];  w_gate, w_up: [n_ff, n_embd];  w_down: [n_embd, n_ff].
    Returns [n_tokens, n_embd].
    """
    return glu_ffn(x, w_gate, w_up, w_down, silu)


def geglu(x: Any, w_gate: Any, w_up: Any, w_down: Any) -> Any:
    """GeGLU FFN (Gemma): down(gelu_tanh(x @ gate.T) * (x @ up.T)).

    x: [n_tokens, n_embd];  w_gate, w_up: [n_ff, n_embd];  w_down: [n_embd, n_ff].
    Returns [n_tokens, n_embd].
    """
    return glu_ffn(x, w_gate, w_up, w_down, gelu)


def relu2_mlp(x: Any, w_up: Any, w_down: Any) -> Any:
    """Ungated squared-ReLU MLP (Nemotron-H): down(relu(x @ up.T) ** 2).

    x: [n_tokens, n_embd];  w_up: [n_ff, n_embd];  w_down: [n_embd, n_ff].
    Returns [n_tokens, n_embd].
    """
    return linear(relu2(linear(x, w_up)), w_down)

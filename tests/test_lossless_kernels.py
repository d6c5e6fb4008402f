"""Batch invariance of the host kernels: a row's result bits never depend on its batch.

A decode row (a lone token, a verify row, a server step's row, a pipeline stage's row) must give the
same bits whatever else is in the forward (docs/performance.md, "Batch invariance"). Here each kernel a
forward reaches is run on one row alone and on batches of 1..256 rows with random neighbours, the row
at a random place, and the row's output must be bit for bit the lone one: the quantized products of
every kept type on both activation paths (int8 and f32: PLINTH_INT8=0, a CPU without AVX2, and
MXFP4 / F16 / BF16 always), the float32-weight products (both layouts), the LM head's f32 refinement,
attention (causal, sliding window, grouped heads, soft-capping, a verify batch of up to 256 rows),
RMSNorm, LayerNorm and the activations.
"""

from __future__ import annotations

import numpy as np
import pytest

import plinth.quant as quant
from plinth import ops
from plinth.gguf.constants import GGMLType
from plinth.quant import QuantWeight
from plinth.testing import quantized_rows

pytestmark = pytest.mark.skipif(quant.compiled() is None, reason="the compiled kernels are off here")

N_OUT, N_IN = 72, 512
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "F16", "BF16"]
#: batch sizes around the kernels' group sizes (4, 8), thread splits and the old bounds (5, 16), up to 256
SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 255, 256]


def _batches(rng: np.random.Generator, row: np.ndarray, sizes=SIZES):
    """(batch, index of ``row`` in it) for each size: random neighbours of mixed scale, the row at a
    random place."""
    for m in sizes:
        x = (rng.standard_normal((m, row.shape[-1])) * rng.choice([0.01, 1.0, 30.0], (m, 1))).astype(np.float32)
        at = int(rng.integers(m))
        x[at] = row
        yield x, at


def _check_rows(fn, row: np.ndarray, rng: np.random.Generator, what: str, sizes=SIZES) -> None:
    alone = fn(row[None])[0]
    for x, at in _batches(rng, row, sizes):
        got = fn(x)[at]
        assert np.array_equal(got.view(np.uint32), alone.view(np.uint32)), \
            f"{what}: the row's bits changed in a batch of {x.shape[0]} (row {at})"


@pytest.fixture(params=["int8", "f32"])
def activations(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both activation paths: the int8 kernels (where the CPU has them) and the f32 kernel."""
    if request.param == "int8":
        if quant.compiled_i8() is None:
            pytest.skip("no int8 kernels on this CPU")
    else:
        monkeypatch.setitem(quant._state, "i8", False)
    return request.param


@pytest.mark.parametrize("type_name", TYPES)
def test_quantized_product_row_bits_do_not_depend_on_the_batch(type_name: str, activations: str) -> None:
    w = QuantWeight(quantized_rows(type_name, N_OUT, N_IN, 3), int(GGMLType[type_name]), (N_OUT, N_IN))
    rng = np.random.default_rng(7)
    row = rng.standard_normal(N_IN).astype(np.float32)
    _check_rows(w.matmul, row, rng, f"{type_name} ({activations} activations)")


def test_stacked_product_row_bits_do_not_depend_on_the_batch(activations: str) -> None:
    """A fused weight of parts of different types (Q4_K q and k with a Q6_K v, as Gemma-3's files)."""
    parts = [QuantWeight(quantized_rows(t, n, N_IN, i), int(GGMLType[t]), (n, N_IN))
             for i, (t, n) in enumerate([("Q4_K", 64), ("Q4_K", 16), ("Q6_K", 24)])]
    w = quant.stack(parts)
    rng = np.random.default_rng(8)
    _check_rows(w.matmul, rng.standard_normal(N_IN).astype(np.float32), rng, f"stacked ({activations})")


def test_lm_head_refinement_row_bits_do_not_depend_on_the_batch() -> None:
    """A precise (LM head) weight: the top logits recomputed from f32 activations, per row."""
    if quant.compiled_i8() is None:
        pytest.skip("no int8 kernels on this CPU")
    n_vocab = 2048  # a multiple of 1024: the padded output rows too
    w = QuantWeight(quantized_rows("Q6_K", n_vocab, 256, 5), int(GGMLType["Q6_K"]), (n_vocab, 256))
    w.precise = True
    rng = np.random.default_rng(9)
    row = rng.standard_normal(256).astype(np.float32)
    _check_rows(w.matmul, row, rng, "LM head refine", sizes=[1, 2, 8, 9, 17, 64, 256])


@pytest.mark.parametrize("transposed", [False, True])
def test_float32_weight_row_bits_do_not_depend_on_the_batch(transposed: bool) -> None:
    """Float32 weights (F32 tensors, types dequantized at load), in both layouts ``graph.Linear`` keeps."""
    rng = np.random.default_rng(10)
    w = rng.standard_normal((N_OUT, N_IN)).astype(np.float32)
    wt = np.ascontiguousarray(w.T)
    fn = (lambda x: ops.linear_t(x, wt)) if transposed else (lambda x: ops.linear(x, w))
    row = rng.standard_normal(N_IN).astype(np.float32)
    _check_rows(fn, row, rng, f"float32 weight (transposed={transposed})")
    x = rng.standard_normal((9, N_IN)).astype(np.float32)  # and the right product
    np.testing.assert_allclose(fn(x), x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", ["causal", "window", "softcap", "groups"])
def test_attention_row_bits_do_not_depend_on_the_batch(case: str) -> None:
    """A query row at position p over the keys 0..p gives the same bits alone (a decode step) and as one
    row of a verify batch / prompt chunk of up to 256 rows (the keys past it cached, masked)."""
    rng = np.random.default_rng(11)
    n_head, n_head_kv, hd = (6, 2, 64) if case != "groups" else (8, 1, 32)
    n_kv = 300
    k = rng.standard_normal((n_kv, n_head_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_head_kv, hd)).astype(np.float32)
    kw = dict(scale=hd ** -0.5, causal=True, sliding_window=32 if case == "window" else None,
              soft_cap=20.0 if case == "softcap" else None)
    p = 40  # the row's position
    row = rng.standard_normal((n_head, hd)).astype(np.float32)
    alone = ops.attention(row[None], k[:p + 1], v[:p + 1], q_pos=np.array([p]), k_pos=np.arange(p + 1), **kw)[0]
    for m in [1, 2, 5, 9, 16, 17, 33, 64, 256]:
        start = p - int(rng.integers(m))  # the row somewhere in a batch of m rows at positions start..
        if start < 0:
            continue
        q = rng.standard_normal((m, n_head, hd)).astype(np.float32)
        q[p - start] = row
        n = start + m
        got = ops.attention(q, k[:n], v[:n], q_pos=np.arange(start, n), k_pos=np.arange(n), **kw)[p - start]
        assert np.array_equal(got.view(np.uint32), alone.view(np.uint32)), f"attention ({case}): batch of {m}"


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "silu", "gelu", "gelu_erf", "softmax", "sigmoid"])
def test_row_ops_do_not_depend_on_the_batch(op: str) -> None:
    rng = np.random.default_rng(12)
    wt = rng.standard_normal(N_IN).astype(np.float32)
    fn = {"rms_norm": lambda x: ops.rms_norm(x, wt, 1e-6), "layer_norm": lambda x: ops.layer_norm(x, wt, wt),
          "silu": ops.silu, "gelu": ops.gelu, "gelu_erf": ops.gelu_erf, "softmax": ops.softmax,
          "sigmoid": ops.sigmoid}[op]
    _check_rows(fn, rng.standard_normal(N_IN).astype(np.float32) * 3, rng, op)


def test_ssm_scan_rows_are_one_token_steps() -> None:
    """A recurrent layer's verify batch (ssm_scan over k + 1 rows) gives the bits of k + 1 one-token steps."""
    from plinth.ops.ssm import ssm_scan, ssm_step

    rng = np.random.default_rng(13)
    t, h, p, g, n = 9, 4, 8, 2, 16
    x = rng.standard_normal((t, h, p)).astype(np.float32)
    dt = rng.uniform(0.01, 0.5, (t, h)).astype(np.float32)
    A = -rng.uniform(0.5, 2.0, h).astype(np.float32)
    B = rng.standard_normal((t, g, n)).astype(np.float32)
    C = rng.standard_normal((t, g, n)).astype(np.float32)
    D = rng.standard_normal(h).astype(np.float32)
    s0 = rng.standard_normal((h, p, n)).astype(np.float32)
    scan = ssm_scan(x, dt, A, B, C, D, state=s0)
    state = s0
    for i in range(t):
        one = ssm_step(x[i:i + 1], dt[i:i + 1], A, B[i:i + 1], C[i:i + 1], D, state=state)
        assert np.array_equal(scan.y[i], one.y[0]), f"row {i}"
        state = one.state
    assert np.array_equal(scan.state, state)


@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 1, 256), (6, 2, 32)])  # SmolLM2, Gemma-3, the plain loop
def test_verify_row_attention_over_every_key_count(shape) -> None:
    """Every row i of a verify batch of 1 + k rows from position p sees the keys 0..p + i as its decode step
    does, for every p < 80 and k in 1, 2, 3, 8, 16: neither the keys of the later rows (masked for it) nor the
    rows it shares a task with (several rows of a sequence go through the kernel together, each with its own
    key count) may change where the vector kernel's key blocks end for it."""
    n_head, n_head_kv, hd = shape
    rng = np.random.default_rng(14)
    for n in range(1, 80):
        for k in (1, 2, 3, 8, 16):
            q = rng.standard_normal((1 + k, n_head, hd)).astype(np.float32)
            keys = rng.standard_normal((n + k, n_head_kv, hd)).astype(np.float32)
            vals = rng.standard_normal((n + k, n_head_kv, hd)).astype(np.float32)
            batch = ops.attention(q, keys, vals, q_pos=np.arange(n - 1, n + k), k_pos=np.arange(n + k),
                                  scale=hd ** -0.5)
            for i in range(1 + k) if n % 4 == 1 or k == 16 else (0,):
                alone = ops.attention(q[i:i + 1], keys[:n + i], vals[:n + i], q_pos=np.array([n - 1 + i]),
                                      k_pos=np.arange(n + i), scale=hd ** -0.5)
                assert np.array_equal(batch[i].view(np.uint32), alone[0].view(np.uint32)), \
                    f"{shape}: p={n - 1}, k={k}, row {i}"

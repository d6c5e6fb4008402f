"""The fused host block (plinth.graph.DenseBlocks, plinth.ops.fused.dense_block) gives the general
path's bits: the same logits, bit for bit, with the fast path on and off, over a prompt, decode steps, a
verify batch and its rollback (stale rows left in the cache buffers), several sequences in one step
(a server's), a pipeline stage and typed caches; and it really ran. A graph it does not fit (the int8
kernels off) takes the general path."""

from __future__ import annotations

import numpy as np
import pytest

import plinth
import plinth.quant as quant
from plinth.batch import Batch
from plinth.testing.synthetic import write_quantized_llama

pytestmark = pytest.mark.skipif(quant.compiled_i8() is None, reason="no int8 kernels here")

SHAPE = dict(n_vocab=300, n_embd=256, n_layer=4, n_head=4, n_head_kv=2, n_ff=512, n_ctx=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return plinth.load_model(str(write_quantized_llama(tmp_path_factory.mktemp("fused") / "q.gguf", **SHAPE)))


@pytest.fixture
def calls(monkeypatch):
    """The numba types of the arguments of every call of the compiled block (how many times it ran)."""
    from numba import typeof

    import plinth.ops.fused as fused

    seen = []
    real = fused.dense_block

    def recording(*a):
        seen.append(tuple(typeof(v) for v in a))
        return real(*a)

    monkeypatch.setattr(fused, "dense_block", recording)
    return seen


def _multi(tokens_by_seq: dict[int, list[int]], starts: dict[int, int]) -> Batch:
    """One step holding several sequences' rows (a server step), every row's logits asked for."""
    toks, pos, seqs = [], [], []
    for seq, toks_s in tokens_by_seq.items():
        toks += toks_s
        pos += list(range(starts[seq], starts[seq] + len(toks_s)))
        seqs += [seq] * len(toks_s)
    n = len(toks)
    return Batch(tokens=np.array(toks, np.int64), positions=np.array(pos, np.int64),
                 seq_ids=np.array(seqs, np.int64), output=np.ones(n, bool))


def _script(model, vocab: int) -> list[np.ndarray]:
    """The logits of a run touching every way rows reach a layer."""
    rng = np.random.default_rng(3)
    ctx = model.new_context()
    out = [ctx.decode(rng.integers(1, vocab, 23).tolist(), output="all").logits]
    tok = 5
    for _ in range(6):  # decode steps
        lg = ctx.decode([tok]).logits
        out.append(lg)
        tok = int(np.argmax(lg[-1]))
    n = ctx.cache.next_position(0)
    out.append(ctx.decode([tok, 7, 11, 13, 17], output="all").logits)  # a verify batch (a causal bias)
    ctx.cache.seq_rm(0, n + 2)  # its last three rows rejected: stale rows stay in the buffers
    out.append(ctx.decode([19, 23], output="all").logits)
    out.append(ctx.decode(rng.integers(1, vocab, 9).tolist(), seq=1, output="all").logits)  # a second sequence
    out.append(ctx.decode(rng.integers(1, vocab, 4).tolist(), seq=2, output="all").logits)
    for _ in range(3):  # server steps: rows of three sequences in one forward
        starts = {s: ctx.cache.next_position(s) for s in (0, 1, 2)}
        out.append(ctx.forward(_multi({0: [3], 1: [29, 31], 2: [37]}, starts)).logits)
    return [np.array(model.backend.to_numpy(o), copy=True) for o in out]


def _both(model, vocab: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    g = model.graph
    fast = g.fused
    assert fast is not None, "the llama graph has the fused block"
    try:
        on = _script(model, vocab)
        g.fused = None
        off = _script(model, vocab)
    finally:
        g.fused = fast
    return on, off


def _same(on: list[np.ndarray], off: list[np.ndarray]) -> None:
    assert len(on) == len(off)
    for i, (a, b) in enumerate(zip(on, off)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"forward {i}: the fused block's logits differ"


def test_fused_block_gives_the_general_paths_bits(tiny, calls):
    on, off = _both(tiny, SHAPE["n_vocab"])
    assert len(calls) >= 10 * SHAPE["n_layer"], f"the fused block ran {len(calls)} times"
    _same(on, off)


def test_fused_block_in_a_pipeline_stage(tiny, calls):
    """Two stages (layers 0-1, 2-3) give one forward's bits, fused or not."""
    ids = [1, 9, 40, 77, 120, 5]
    whole = np.array(tiny.new_context().decode(ids, output="all").logits)
    ctx = tiny.new_context()
    batch = Batch.from_tokens(ids, output="all")
    x = ctx.forward_stage(batch, None, 0, 2)
    out = ctx.forward_stage(batch, x, 2, SHAPE["n_layer"])
    assert np.array_equal(np.asarray(out.logits), whole)
    assert len(calls) > 0


def test_general_path_where_the_block_does_not_fit(tiny, calls, monkeypatch):
    """The int8 kernels off: no fused call, and the run still completes (f32 activations)."""
    monkeypatch.setitem(quant._state, "i8", False)
    ctx = tiny.new_context()
    assert np.isfinite(ctx.decode([1, 2, 3]).logits).all()
    assert np.isfinite(ctx.decode([4]).logits).all()
    assert len(calls) == 0


@pytest.mark.parametrize("ctk,ctv", [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "f16"), ("f32", "q5_1"),
                                     ("bf16", "q4_1")])
def test_typed_cache_gives_the_general_paths_bits(tiny, calls, ctk, ctv):
    """A typed cache (f16 / bf16 rows; q8_0 ... blocks, the Hadamard rotation on their K and V at head size 64,
    float32 on one side only) inside the fused call: the general path's bits, and the call ran."""
    from plinth.kvtypes import CacheTypes

    assert SHAPE["n_embd"] // SHAPE["n_head"] % 64 == 0, "the rotation applies at this head size"
    types = tiny.cache_types
    try:
        tiny.cache_types = CacheTypes(k=ctk, v=ctv)
        on, off = _both(tiny, SHAPE["n_vocab"])
    finally:
        tiny.cache_types = types
    assert len(calls) >= 10 * SHAPE["n_layer"], f"the fused block ran {len(calls)} times"
    _same(on, off)


def test_contexts_of_two_cache_types_on_one_model(tiny, calls):
    """One model, a float32 context and a q8_0 one stepped in turn: each keeps its own storage in the call
    (the call's storage arguments are per cache type, not per model)."""
    rng = np.random.default_rng(5)
    prompt = rng.integers(1, SHAPE["n_vocab"], 12).tolist()
    out = {}
    for fused in (True, False):
        g, fast = tiny.graph, tiny.graph.fused
        g.fused = fast if fused else None
        try:
            ctxs = [tiny.new_context(), tiny.new_context(cache_type_k="q8_0", cache_type_v="q8_0")]
            got = [[c.decode(prompt).logits] for c in ctxs]
            for step in range(4):
                for c, acc in zip(ctxs, got):
                    acc.append(c.decode([3 + step]).logits)
        finally:
            g.fused = fast
        out[fused] = [np.concatenate([np.asarray(a) for a in acc]) for acc in got]
    assert len(calls) >= 8 * SHAPE["n_layer"]
    for on, off in zip(out[True], out[False]):
        assert np.array_equal(on.view(np.uint32), off.view(np.uint32))
    assert not np.array_equal(out[True][0], out[True][1]), "the two cache types gave the same logits"


def _synthetic(tmp_path, arch: str, biases: bool = False, **extra) -> "plinth.Model":
    """A random ``arch`` model of SHAPE whose products are Q8_0 (the int8 kernels' type), norms near 1; ``biases``:
    with llama's optional biases on the attention output and the FFN's three products too."""
    import gguf
    from plinth_llama.llama import linear_bias_tensors

    from plinth.plugins import default_registry
    from plinth.testing.synthetic import random_tensors, synthetic_specs, tiny_metadata, write_gguf

    md = tiny_metadata(arch, **SHAPE, **extra)
    md[f"{arch}.rope.dimension_count"] = SHAPE["n_embd"] // SHAPE["n_head"]
    reg = default_registry()
    hp = reg.arch_hparams(arch, md, arch)
    specs = synthetic_specs(reg, arch, hp)
    if biases:
        specs += [s for il in range(SHAPE["n_layer"]) for s in linear_bias_tensors(hp, il)]
    q8 = {s.name: gguf.GGMLQuantizationType.Q8_0 for s in specs if len(s.shape) == 2 and s.name != "token_embd.weight"}
    path = write_gguf(tmp_path / f"{arch}.gguf", md, random_tensors(specs, seed=4, scale=0.1), q8)
    return plinth.load_model(str(path), registry=reg)


def _window_script(model, vocab: int) -> list[np.ndarray]:
    """Decode steps and a verify batch past a sliding window of 16 and past WINDOW_SKIP keys (whole runs of
    keys left out of the rows' tables), for two sequences stepped together."""
    rng = np.random.default_rng(8)
    ctx = model.new_context()
    out = [ctx.decode(rng.integers(1, vocab, 60).tolist(), output="all").logits,
           ctx.decode(rng.integers(1, vocab, 50).tolist(), seq=1, output="all").logits]
    for i in range(45):
        starts = {s: ctx.cache.next_position(s) for s in (0, 1)}
        rows = {0: [3 + i % 7], 1: [5, 9 + i % 5]} if i % 9 == 4 else {0: [3 + i % 7], 1: [11 + i % 3]}
        out.append(ctx.forward(_multi(rows, starts)).logits)
    return [np.array(model.backend.to_numpy(o), copy=True) for o in out]


@pytest.mark.parametrize("arch,form,biases", [("qwen3", (True, False, False), 0), ("gemma3", (True, True, True), 0),
                                              ("qwen2", (False, False, False), 1), ("llama", (False, False, False), 14)])
def test_other_layer_forms_give_the_general_paths_bits(tmp_path, calls, arch, form, biases):
    """Qwen3's layer (Q / K norms), Gemma-3's (Q / K norms, post-norms, GELU, sliding-window layers), Qwen2's (Q / K
    / V biases) and a llama with biases on its other three products in the fused call: the general path's bits over the run
    of the llama test and, for Gemma-3, over steps past a sliding window of 16 keys (two of four layers slide),
    where whole runs of keys are skipped, with a float32 cache and a q8_0 / f16 one."""
    import plinth.graph as graph

    extra = {"attention__sliding_window": 16, "attention__sliding_window_pattern": 2} if arch == "gemma3" else {}
    model = _synthetic(tmp_path, arch, biases=arch == "llama", **extra)
    assert model.graph.fused is not None and model.graph.fused.form == form
    model.graph.fused._layer_args(0)
    assert model.graph.fused._biases[0][0] == biases
    _same(*_both(model, SHAPE["n_vocab"]))
    assert len(calls) >= 10 * SHAPE["n_layer"], f"the fused block ran {len(calls)} times"
    if arch != "gemma3":
        return
    assert model.graph.fused.windows == [16, 0, 16, 0]
    skips = []
    real = graph._window_columns

    def watch(*a):
        got = real(*a)
        skips.append(int(got[0].max()))
        return got

    from plinth.kvtypes import CacheTypes

    g, fast, types = model.graph, model.graph.fused, model.cache_types
    for ctk, ctv in (("f32", "f32"), ("q8_0", "f16")):  # (a typed cache skips the keys by its stored rows' bytes)
        n_calls = len(calls)
        skips.clear()
        try:
            model.cache_types = CacheTypes(k=ctk, v=ctv)
            graph._window_columns = watch
            on = _window_script(model, SHAPE["n_vocab"])
            g.fused = None
            off = _window_script(model, SHAPE["n_vocab"])
        finally:
            g.fused = fast
            graph._window_columns = real
            model.cache_types = types
        assert len(calls) - n_calls >= 45 * SHAPE["n_layer"]
        assert max(skips) >= graph.WINDOW_SKIP, "no keys were skipped: the window test did not reach its case"
        _same(on, off)


def test_gelu_rows_is_the_tanh_gelu_and_ops_gelu_takes_it():
    """The host GELU (x / (1 + exp(-2 c u)), the compiled exp) against the function computed in float64: relative
    error at most 2e-6 from x = -4 up, 5e-5 in the tail, 2e-37 absolute where the result is subnormal or 0; and
    plinth.ops.gelu of a
    float32 host array gives its bits, alone and through gelu_mul_rows."""
    from plinth import ops
    from plinth.ops.compiled import gelu_mul_rows, gelu_rows

    rng = np.random.default_rng(2)
    x = np.concatenate([rng.uniform(-12, 12, 300_000), rng.standard_normal(300_000),
                        [0.0, -0.0, 1e-30, -1e-30, 40.0, -40.0, 3e38, -3e38]]).astype(np.float32)
    got = np.empty((1, x.size), np.float32)
    gelu_rows(x[None], got)
    d = x.astype(np.float64)
    t = np.sqrt(2.0 / np.pi) * (d + 0.044715 * d ** 3)
    with np.errstate(over="ignore"):  # (1 + tanh t = 2 / (1 + e^-2t): float64's tanh rounds to -1 below t ~ -19)
        ref = d / (1.0 + np.exp(-2.0 * t))
    easy = x > -3  # (where the tanh form itself is well conditioned in float64: the two forms agree)
    assert np.allclose(ref[easy], 0.5 * d[easy] * (1.0 + np.tanh(t[easy])), rtol=1e-12, atol=1e-300)
    err = np.abs(got[0] - ref)
    normal = np.abs(ref) > 1e-36  # (float32's normal range, with room for the exp's clamp at -87.3)
    rel = err[normal] / np.abs(ref[normal])
    # (the argument's float32 rounding, times |2 c u| where the result is a tail of the logistic: 1e-6 down to
    # x = -4, ~1e-5 in the far tail, 4e-5 at the edge of float32's normal range; float32's tanh form, numpy's, is 3e-5 off at x = -3 and all wrong below -4)
    assert rel[x[normal] >= -4].max() <= 2e-6 and rel.max() <= 5e-5
    assert err[~normal].max() <= 2e-37
    assert np.array_equal(ops.gelu(x).view(np.uint32), got[0].view(np.uint32))
    gu = rng.standard_normal((5, 64)).astype(np.float32)
    out = np.empty((5, 32), np.float32)
    gelu_mul_rows(gu, 32, out)
    h = ops.gelu(gu[:, :32])
    h *= gu[:, 32:]
    assert np.array_equal(out.view(np.uint32), h.view(np.uint32))


@pytest.mark.real
@pytest.mark.network
def test_fused_block_real_model(calls):
    """SmolLM2-135M (Q4_1 / Q8_0 in its file) and Gemma-3-270M (Q4_K_M: Q / K norms, post-norms, GELU, sliding
    layers): the same bits with and without the fused block."""
    for name in ("smollm2-135m-instruct", "gemma-3-270m"):
        model = plinth.load_model(name)
        n = len(calls)
        on, off = _both(model, model.n_vocab)
        assert len(calls) > n, name
        _same(on, off)


def test_compiled_exp_within_2_ulp():
    """The float32 exp of every host silu: within 2 ulp of float64's over the normal float32 range; inf, 0 and
    NaN at the ends."""
    from numba import njit

    from plinth.ops.compiled import exp_f32

    @njit
    def exps(a, out):
        for i in range(a.size):
            out[i] = exp_f32(a[i])

    rng = np.random.default_rng(11)
    x = np.concatenate([rng.uniform(-87.3, 88.7, 400_000), rng.uniform(-4, 4, 400_000),
                        [0.0, -0.0, 1e-30, -1e-30, 88.72, -87.33]]).astype(np.float32)
    got = np.empty_like(x)
    exps(x, got)
    ref = np.exp(x.astype(np.float64))
    ulp = np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert (np.abs(got - ref) / ulp).max() <= 2.0
    ends = np.array([88.8, 1000, np.inf, -87.4, -1000, -np.inf, np.nan], np.float32)
    out = np.empty_like(ends)
    exps(ends, out)
    assert np.array_equal(out[:6], [np.inf, np.inf, np.inf, 0, 0, 0]) and np.isnan(out[6])


def test_silu_is_one_definition():
    """ops.silu (contiguous or a strided view, any batch) and the fused block's silu(gate) * up give the same
    bits; silu is within 3e-7 (relative) of float64's."""
    from plinth import ops
    from plinth.ops.compiled import silu_mul_rows

    rng = np.random.default_rng(12)
    gu = (rng.standard_normal((7, 64)) * rng.choice([0.1, 3.0, 40.0], (7, 1))).astype(np.float32)
    want = ops.silu(gu[:, :32])
    want *= gu[:, 32:]
    got = np.empty((7, 32), np.float32)
    silu_mul_rows(gu, 32, got)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    alone = ops.silu(gu[3:4, :32].copy())
    assert np.array_equal(alone[0].view(np.uint32), ops.silu(gu[:, :32])[3].view(np.uint32))
    x64 = gu.astype(np.float64)
    ref = x64 / (1 + np.exp(-x64))
    assert (np.abs(ops.silu(gu) - ref) / np.maximum(np.abs(ref), 1e-30)).max() < 3e-7


def test_warm_up_compiles_what_a_model_passes(tiny, calls):
    """plinth.ops.warm_up (an image build's) compiles the fused block for the argument types a model's layers
    pass it: the types of its warm-up call are those of a model's calls."""
    from plinth.ops import fused

    fused.warm_up()
    ctx = tiny.new_context()
    ctx.decode([1, 2, 3])
    ctx.decode([4])
    assert len(calls) > 1 and set(calls) == {calls[0]}, "the warm-up and a model call the block with other types"

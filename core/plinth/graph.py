"""The public graph API: everything an architecture plugin builds its forward from.

An architecture plugin needs three things from the core, all here:

* the data: :class:`Batch` (rows in), :class:`ForwardOutput` (logits / embeddings /
  feature taps out), the :class:`Cache` and its per-layer cache kinds (:class:`KV`,
  :class:`Latent`, :class:`IndexerKeys`, :class:`SharedKV`, :class:`CompressedKV`,
  :class:`Recurrent`);
* the plumbing every graph repeats: ``with cache.forward(batch):`` (:meth:`Cache.forward`: one
  forward's transaction on the cache, committed at the end or rolled back if it raises),
  :func:`run_layers` (the layer loop with feature taps), :func:`seq_groups` (rows per sequence),
  :func:`embed_rows` (token / embedding / mixed rows), :class:`Linear` (weights stacked on
  the output axis, multiplied through :func:`plinth.ops.linear`), :class:`LMHead` (tied or
  untied, logits only for rows that ask), :func:`pool`, :func:`attend` (per-sequence
  attention over a :class:`KV` cache) and :class:`Rope` (per-layer RoPE tables);
* two base classes: :class:`BaseGraph` (a forward that embeds, runs ``layer(il, x, step)``
  for every layer and applies the head) and :class:`Architecture` (the three steps the
  engine calls — hparams, tensors, build — from one class).

A graph satisfies the :class:`Graph` protocol; hparams satisfy :class:`HParams` (the
fields the core reads). Model code uses :mod:`plinth.ops` for the maths. What else a plugin
needs of the core is re-exported here (the tensor checks, :class:`QuantWeight` with the GGUF
types it keeps and their block sizes, :class:`NumpyBackend`, ``DENSE_RANGES``), so plugins import
no private module.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping, Protocol, Sequence, runtime_checkable

import attrs
import numpy as np

from . import ops, quant
from .cache import (
    KV,
    Cache,
    CacheKind,
    CacheSnapshot,
    CompressedKV,
    IndexerKeys,
    Latent,
    Layout,
    Recurrent,
    Rows,
    SharedKV,
    run_layers,
)
from .batch import Batch, ForwardOutput, pool
from .backend import NumpyBackend
from .hparams import DENSE_RANGES, HParamsError, KeyReader, PerLayer
from .quant import KEPT_TYPES, QuantWeight, block_values
from .tensors import KeyUse, TensorCheckError, TensorSpec, check_tensors, scale_name, unused_tensors

__all__ = [
    "Architecture",
    "BaseGraph",
    "Batch",
    "Cache",
    "CacheKind",
    "CacheSnapshot",
    "CompressedKV",
    "DENSE_RANGES",
    "ForwardOutput",
    "Graph",
    "HParams",
    "HParamsError",
    "IndexerKeys",
    "KEPT_TYPES",
    "KV",
    "KeyReader",
    "LMHead",
    "Latent",
    "Layout",
    "Linear",
    "NumpyBackend",
    "PerLayer",
    "QuantWeight",
    "Recurrent",
    "Rope",
    "Rows",
    "SharedKV",
    "Step",
    "TargetView",
    "TensorCheckError",
    "TensorSpec",
    "attend",
    "block_values",
    "check_tensors",
    "embed_rows",
    "pool",
    "run_layers",
    "scale_name",
    "seq_groups",
    "unused_tensors",
]


# ============================================================================ protocols


@runtime_checkable
class HParams(Protocol):
    """The hparams fields the core reads (any attrs ``@frozen`` class with these).

    n_layer: number of blocks (feature taps are 0..n_layer). n_vocab: rows of the LM head
    (-1 until the loader fills it from ``token_embd.weight``). n_embd: width of the residual
    (drafters check it). n_ctx_train: the context the model was trained for (the default
    context size).
    """

    n_layer: int
    n_vocab: int
    n_embd: int
    n_ctx_train: int


@runtime_checkable
class Graph(Protocol):
    """What ``Architecture.build`` returns: the forward the engine runs.

    ``cache_layout()``: per layer, fresh :class:`CacheKind` instances (the layer's memory).
    ``forward(batch, cache, *, taps=(), pooling="none", embeddings=False)``: run ``batch``
    against ``cache`` (writing its rows inside one ``with cache.forward(batch):``); logits ``[n_out, n_vocab]`` for
    the rows with ``batch.output``, or pooled embeddings when ``pooling`` != "none"; the
    residual entering each layer in ``taps``.
    """

    def cache_layout(self) -> Layout: ...

    def forward(self, batch: Batch, cache: Cache, *, taps: Sequence[int] = (), pooling: str = "none",
                embeddings: bool = False) -> ForwardOutput: ...


# ============================================================================ rows per sequence


def seq_groups(seq_ids: np.ndarray) -> list[tuple[int, Any]]:
    """The batch's rows per sequence, in order of sequence id: (seq, selector).

    The selector is a slice when the sequence's rows are contiguous (the common case),
    else an index array.
    """
    n = len(seq_ids)
    if n and seq_ids[0] == seq_ids[-1] and (n < 3 or (seq_ids == seq_ids[0]).all()):
        return [(int(seq_ids[0]), slice(0, n))]
    groups = []
    for seq in np.unique(seq_ids):
        rows = np.nonzero(seq_ids == seq)[0]
        contiguous = rows[-1] - rows[0] + 1 == len(rows)
        groups.append((int(seq), slice(int(rows[0]), int(rows[-1]) + 1) if contiguous else rows))
    return groups


@attrs.define
class Step:
    """What one forward computes once and every layer shares.

    batch, cache: the forward's. groups: :func:`seq_groups` of the batch. memo: values
    layers share (attention biases, RoPE tables), filled on first use through :meth:`once`.
    """

    batch: Batch
    cache: Cache
    groups: list[tuple[int, Any]]
    memo: dict[Any, Any] = attrs.field(factory=dict)

    def once(self, key: Any, make: Callable[[], Any]) -> Any:
        """``memo[key]``, computed by ``make()`` the first time."""
        if key in self.memo:
            return self.memo[key]
        value = self.memo[key] = make()  # None is a value too (no attention bias needed)
        return value

    def require_in_order(self, source: str, what: str, start: Callable[[int], int | None] | None = None,
                         hint: str = "") -> None:
        """Refuse a batch whose sequences skip or reorder positions, for a model whose ``what``
        (a recurrent state, a compressed stream) reads every token once in order.

        Each sequence's rows must have consecutive increasing positions; ``start(seq)``, when given
        and not None, is the position the sequence must continue at (``hint`` ends that message).
        """
        from .errors import UserError

        for seq, sel in self.groups:
            pos = self.batch.positions[sel]
            if len(pos) > 1 and not np.all(np.diff(pos) == 1):
                raise UserError(f"{source}: sequence {seq}'s rows must have consecutive increasing positions in a "
                                f"batch (got {pos.tolist()}); {what} cannot skip or reorder tokens")
            at = start(seq) if start is not None else None
            if at is not None and int(pos[0]) != at:
                raise UserError(f"{source}: sequence {seq} continues at position {int(pos[0])}, but its {what} "
                                f"stands at position {at}{hint}")


# ============================================================================ embedding and linears


def expert_tensors(prefix: str, n_expert: int, n_ff: int, n_embd: int, *, required: bool = True) -> list[TensorSpec]:
    """A mixture-of-experts FFN's tensors as llama.cpp names them: the router ``ffn_gate_inp`` [n_expert,
    n_embd] and the stacked experts ``ffn_{gate,up}_exps`` [n_expert, n_ff, n_embd], ``ffn_down_exps``
    [n_expert, n_embd, n_ff] (``prefix``: ``blk.N.``)."""
    return [TensorSpec(prefix + "ffn_gate_inp.weight", (n_expert, n_embd), required=required),
            TensorSpec(prefix + "ffn_gate_exps.weight", (n_expert, n_ff, n_embd), required=required),
            TensorSpec(prefix + "ffn_up_exps.weight", (n_expert, n_ff, n_embd), required=required),
            TensorSpec(prefix + "ffn_down_exps.weight", (n_expert, n_embd, n_ff), required=required)]


def embed_rows(table: Any, batch: Batch, xp: Any, scale: float = 1.0) -> Any:
    """Input rows [n_rows, n_embd]: ``table[token]``, or the batch's own embedding where ``is_embd``.

    table: [n_vocab, n_embd]. ``scale`` multiplies every row (Gemma's sqrt(n_embd)).
    """
    x = table[xp.asarray(batch.tokens)]
    if batch.is_embd is not None and batch.is_embd.any():
        x = xp.where(xp.asarray(batch.is_embd)[:, None], xp.asarray(batch.embeddings, dtype=xp.float32), x)
    if scale != 1.0:
        x = x * np.float32(scale)
    return x


def _offsets(parts: list[Any]) -> list[int]:
    out, o = [], 0
    for p in parts:
        out.append(o)
        o += p.shape[0]
    return out


@attrs.frozen
class Linear:
    """``x -> x @ W.T (+ bias)``, W kept in the layout the matrix product runs fastest.

    OpenBLAS streams a matrix-vector product through a row-major [n_in, n_out] matrix faster
    than through [n_out, n_in] when the output is at least as wide as the input (QKV,
    gate/up, the attention output), and slower for narrow outputs (FFN down); see
    benchmarks/README.md. ``transposed`` says which layout ``w`` has. Build one with
    :meth:`stack`.
    """

    w: Any  # [n_out, n_in], or [n_in, n_out] when transposed
    transposed: bool
    bias: Any = None
    _weight: Any = attrs.field(default=None, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_weight", self.w.T if self.transposed else self.w)

    def __call__(self, x: Any) -> Any:
        """x: [n, n_in] -> [n, n_out]."""
        if type(x) is np.ndarray and isinstance(self.w, quant.WEIGHT_TYPES):
            y = quant.rows_product(self.w, x)  # (a decode row's product with the least Python: the same bits)
            if y is not None:
                if self.bias is not None:
                    y += self.bias
                return y
        return ops.linear_t(x, self.w, self.bias) if self.transposed else ops.linear(x, self.w, self.bias)

    @property
    def weight(self) -> Any:
        """The matrix in GGUF layout [n_out, n_in] (a view; the same object every time)."""
        return self._weight

    @classmethod
    def stack(cls, weights: Mapping[str, Any], names: Sequence[str], xp: Any, bias: Sequence[str] = ()) -> "Linear":
        """The named [n_out, n_in] weights stacked on the output axis as one matrix (Q|K|V, gate|up).

        ``bias``: names of the matching bias vectors (all or none). When ``weights`` is a dict, its
        entries for ``names`` become views of the stacked matrix, so memory is not doubled.
        """
        b = xp.concatenate([xp.asarray(weights[n], dtype=xp.float32) for n in bias]) if bias else None
        stacked = quant.stack([weights[n] for n in names])  # quantized weights stay quantized
        if stacked is not None:
            parts = [weights[n] for n in names]
            views = [stacked[o:o + p.shape[0]] for o, p in zip(_offsets(parts), parts)]
            lin = cls(stacked, transposed=False, bias=b)
        else:
            lin, views = cls._stack_f32([xp.asarray(weights[n], dtype=xp.float32) for n in names], xp, b)
        if isinstance(weights, dict):
            for n, v in zip(names, views):
                weights[n] = v
        return lin

    @classmethod
    def _stack_f32(cls, parts: list[Any], xp: Any, b: Any) -> tuple["Linear", list[Any]]:
        """float32 parts stacked in the layout their products run fastest, and a view of each part.

        On the host with the compiled kernels a decode row's product goes through the batch-invariant
        kernel, which reads the GGUF layout [n_out, n_in] 7-13x faster than the transposed one (one
        row, one thread: 1.8 vs 13.4 ms at 32000 x 512); without them (a device, or no numba) BLAS's
        matrix-vector product is faster transposed when the output is at least as wide as the input.
        """
        n_in, n_out = parts[0].shape[1], sum(p.shape[0] for p in parts)
        if n_out < n_in or (xp.__name__ == "numpy" and quant.compiled() is not None):
            w = parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=0)
            w = xp.ascontiguousarray(w)
            views = [w[o:o + p.shape[0]] for o, p in zip(_offsets(parts), parts)]
            lin = cls(w, transposed=False, bias=b)
        else:
            w_t = xp.empty((n_in, n_out), dtype=xp.float32)
            for o, p in zip(_offsets(parts), parts):
                for r in range(0, p.shape[0], 256):  # in blocks: a whole-matrix transpose thrashes the cache
                    r1 = min(r + 256, p.shape[0])
                    w_t[:, o + r:o + r1] = p[r:r1].T
            views = [w_t[:, o:o + p.shape[0]].T for o, p in zip(_offsets(parts), parts)]
            lin = cls(w_t, transposed=True, bias=b)
        return lin, views


@attrs.frozen
class LMHead:
    """The output projection: ``output.weight``, or ``token_embd.weight`` when the file ties them.

    ``softcap`` > 0 applies ``tanh(logits / c) * c`` (Gemma). :attr:`weight` is the matrix in
    GGUF layout [n_vocab, n_embd], what a drafter sharing the head multiplies by. A quantized head
    is marked ``precise``: after its int8 products, each row's logits near the maximum are
    recomputed from f32 activations (:meth:`plinth.quant.QuantWeight._refine`), so the argmax is
    the one f32 activations give (SmolLM2's 512 peer-corpus positions: 96.5% -> 98.2% the argmax
    of the all-f32-activation head).
    """

    linear: Linear
    tied: bool
    softcap: float = 0.0

    @classmethod
    def from_weights(cls, weights: Mapping[str, Any], xp: Any, softcap: float = 0.0) -> "LMHead":
        tied = "output.weight" not in weights
        name = "token_embd.weight" if tied else "output.weight"
        if hasattr(weights[name], "precise"):  # a quantized head: the top logits of its int8 products redone in f32
            weights[name].precise = True
        return cls(Linear.stack(weights, [name], xp), tied, softcap)

    @property
    def weight(self) -> Any:
        return self.linear.weight

    def __call__(self, h: Any) -> Any:
        """h: [n, n_embd] (after the final norm) -> logits [n, n_vocab]."""
        logits = self.linear(h)
        if self.softcap:
            c = np.float32(self.softcap)
            logits = ops.array_module(logits).tanh(logits / c) * c
        return logits


# ============================================================================ attention and RoPE


def attend(il: int, q: Any, k: Any, v: Any, step: Step, *, scale: float, window: int = 0,
           soft_cap: float | None = None) -> Any:
    """Causal self-attention of layer ``il`` over its :class:`KV` cache, per sequence.

    q: [n_rows, n_head, hd_k]; k: [n_rows, n_head_kv, hd_k]; v: [n_rows, n_head_kv, hd_v]
    (this forward's rows, appended to the cache here; a layer whose layout has a
    :class:`SharedKV` reads its source's rows instead and ignores k, v). ``window`` > 0 limits each query to
    that many most recent positions. Returns [n_rows, n_head, hd_v].
    """
    xp = ops.array_module(q)
    kv = step.cache.kv(il)
    shared = kv.layer != il  # the K/V of an earlier layer (SharedKV)
    positions = step.batch.positions
    groups = []  # per sequence: its rows, its K/V so far and its bias
    host = xp is np
    if host and step.once(("attn_rows", il if shared else -1), lambda: _rows_path(kv, shared, step)):
        return _attend_rows(q, k, v, kv, shared, step, scale, window, soft_cap)
    for seq, sel in step.groups:
        pos = positions[sel]
        # a layer sharing an earlier layer's K/V reads them (k, v unused); others append theirs
        kc, vc, kpos = kv.get(seq) if shared else kv.update(seq, pos, k[sel], v[sel])
        bias = step.once(("attn_bias", seq, window, len(kpos)),
                         lambda: ops.attention_bias(pos, kpos, causal=True, sliding_window=window or None,
                                                    xp=xp))
        groups.append((sel, kc, vc, bias, kv.addresses(seq) if host and len(kpos) and not kv.typed else None))
    if all(isinstance(g[0], slice) for g in groups):
        # (a step that mixes prompt chunks with few-row groups: those still go through one compiled call)
        return ops.attention_groups(q, [(sel.start, sel.stop, kc, vc, bias, at) for sel, kc, vc, bias, at in groups],
                                    scale=scale, soft_cap=soft_cap)
    out = xp.empty(q.shape[:2] + (v.shape[2],), dtype=xp.float32)
    for sel, kc, vc, bias, _ in groups:
        out[sel] = ops.attention(q[sel], kc, vc, scale=scale, causal=False, bias=bias, soft_cap=soft_cap)
    return out


def _rows_path(kv: Any, shared: bool, step: Step) -> bool:
    """Whether :func:`attend` takes :func:`_attend_rows`: the compiled host kernels, every sequence's
    rows a slice of at most ``KERNEL_MAX_Q`` (decode, verify and server steps), and (a shared layer)
    rows cached for each."""
    from .ops._xp import compiled_ops
    from .ops.attention import KERNEL_MAX_Q

    if compiled_ops() is None:
        return False
    for seq, sel in step.groups:
        if not (isinstance(sel, slice) and 0 < sel.stop - sel.start <= KERNEL_MAX_Q):
            return False
        if shared and not kv.n_rows(seq):
            return False
    return True


def _attend_rows(q: Any, k: Any, v: Any, kv: Any, shared: bool, step: Step, scale: float, window: int,
                 soft_cap: float | None) -> Any:
    """:func:`attend` for few rows a sequence on the host: room is made in each sequence's cache
    buffers, one compiled call writes every sequence's rows there, and the attention kernel reads them
    in place (one table row a sequence, no views, no per-group checks: a server step's 16 sequences
    cost about a third of the Python of the general path)."""
    if kv.roles and not kv.cache.types.plain:  # a typed cache (plinth.kvtypes): a kernel that reads its blocks
        from .ops.attend_q import attend_rows_typed

        return attend_rows_typed(q, k, v, kv, shared, step, scale, window, soft_cap, _key_columns)
    groups = step.groups
    if not shared:
        table = kv.reserve_rows(groups, (k.shape[1:], v.shape[1:]))
        pos = step.once("positions_i64", lambda: np.asarray(step.batch.positions, dtype=np.int64))
        ops._xp.compiled_ops().scatter_rows(k, v, pos, table)
        table[:, 2] += table[:, 1] - table[:, 0]  # (the key counts, this forward's rows included)
    else:
        table = kv.rows_table(groups)
    _key_columns(step, kv, table, window)
    kb, vb = kv.buffers(groups[0][0])[:2]
    if kb.shape[2] != q.shape[2]:
        raise ValueError(f"attention: the cached keys have head size {kb.shape[2]}, the queries {q.shape[2]}")
    return ops.attention_rows(q, table, kb.shape[1], vb.shape[2], scale, soft_cap)


#: a sliding-window layer's rows skip the keys before their window in whole runs of this many keys (a
#: multiple of the attention kernels' key blocks: the keys they still see fall in the blocks they fell in)
WINDOW_SKIP = 64


def _key_columns(step: Step, kv: Any, table: np.ndarray, window: int) -> None:
    """Columns 2..5 of an attention table (key count, K and V addresses, bias address) for ``step``'s
    groups: the bias addresses (one list a step for all the layers with these key counts); for a
    sliding-window layer the keys before the earliest row's window are left out, in whole runs of
    :data:`WINDOW_SKIP` (every key skipped is hidden from every row of the group: whole blocks of
    -inf change no bit of the kernels' sums), so such a layer reads about its window of keys, not
    the whole cache."""
    if not window:
        table[:, 5] = step.once(_bias_column_key(table[:, 2], window),
                                lambda: _bias_column(step, kv, table[:, 2], window))
        return
    lo, col = step.once(("attn_window_cols", window, table[:, 2].tobytes()),
                        lambda: _window_columns(step, kv, table[:, 2].copy(), window))
    kb, vb = kv.buffers(step.groups[0][0])[:2]
    table[:, 2] -= lo
    table[:, 3] += lo * kb.strides[0]
    table[:, 4] += lo * vb.strides[0]
    table[:, 5] = col


def _window_columns(step: Step, kv: Any, n_kv: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group: the keys skipped before the window (a multiple of WINDOW_SKIP) and the address of the
    bias against the keys left."""
    positions = step.batch.positions
    lo = np.zeros(len(step.groups), dtype=np.int64)
    col = np.zeros(len(step.groups), dtype=np.int64)
    for i, (seq, sel) in enumerate(step.groups):
        n = int(n_kv[i])
        kpos = kv.positions(seq)[:n]
        first = int(np.min(positions[sel])) - window + 1  # the earliest key the group's rows may see
        skip = int(np.searchsorted(kpos, first)) if n and (np.diff(kpos) > 0).all() else 0
        skip = min(skip, n - 1) // WINDOW_SKIP * WINDOW_SKIP if n else 0
        lo[i] = skip
        bias = ops.attention_bias(positions[sel], kpos[skip:], causal=True, sliding_window=window, xp=np)
        if bias is not None:
            col[i] = _bias_address(step, bias, ("window", seq, window, n), sel.stop - sel.start, n - skip)
    return lo, col


def _bias_column_key(n_kv: np.ndarray, window: int) -> tuple:
    """The step memo's key of :func:`_bias_column` for these key counts (int64) and window: layers with
    the same key counts share one column (:func:`_key_columns`, :class:`DenseBlocks`)."""
    return "attn_bias_col", window, n_kv.tobytes()


def _bias_column(step: Step, kv: Any, n_kv: np.ndarray, window: int) -> np.ndarray:
    """Per group of ``step``, the data address of its attention bias against its ``n_kv`` keys (0: none)."""
    positions = step.batch.positions
    col = np.zeros(len(step.groups), dtype=np.int64)
    for i, (seq, sel) in enumerate(step.groups):
        n = int(n_kv[i])
        bias = step.once(("attn_bias", seq, window, n),
                         lambda: ops.attention_bias(positions[sel], kv.positions(seq), causal=True,
                                                    sliding_window=window or None, xp=np))
        if bias is not None:  # (kept alive by the step's memo)
            col[i] = step.once(("attn_bias_at", seq, window, n),
                               lambda: _bias_address(step, bias, (seq, window, n), sel.stop - sel.start, n))
    return col


def _bias_address(step: Step, bias: Any, key: tuple, n_rows: int, n_kv: int) -> int:
    """The data address of ``bias`` as a C-order float32 ``[n_rows, n_kv]`` array (kept in the step's memo)."""
    from .ops.attention import host_bias

    b = host_bias(bias, n_rows, n_kv)
    step.memo[("attn_bias_kept",) + key] = b
    return int(b.ctypes.data)


#: the call's stand-in for a norm weight or bias a layer does not have (read-only, as a mapped file's weights)
_ABSENT = np.ones(1, dtype=np.float32)
_ABSENT.flags.writeable = False


def _frozen_f32(w: Any) -> np.ndarray:
    """``w`` as a read-only C-order float32 host array (the argument type of the call's other norm weights:
    one compiled form for every model)."""
    a = np.ascontiguousarray(w, dtype=np.float32)
    if a.flags.writeable:
        a = a.copy()
        a.flags.writeable = False
    return a


class DenseBlocks:
    """The host fast path of a llama-style block: the whole layer in one compiled call
    (:func:`plinth.ops.fused.dense_block`) instead of a dozen calls with Python between them.

    ``graph`` holds per layer ``norms`` (attention and FFN norm weights), ``heads`` (query heads, kv
    heads, head size), the :class:`Linear` s ``qkv``, ``attn_out``, ``gate_up``, ``down``, and ``rope``
    (a :class:`Rope`), ``attn_scale``, ``hp.norm_eps`` and ``hp.n_ff``; its layer is ``x1 = x +
    attention(rms_norm(x))`` with plain RoPE on Q and K and a causal attention without a window or
    soft-cap, then ``x1 + down(silu(gate) * up)`` of ``rms_norm(x1)``. Other forms of that layer, as the graph
    declares them (``form``): ``qk_norm`` (Q and K normed per head before RoPE, Qwen3's), ``post_norms`` (the
    attention's and the FFN's outputs normed before their residual adds, Gemma-3's), ``act`` "gelu" (GELU's
    tanh form for SiLU) and ``windows`` (per layer a sliding window, 0: none); the graph's
    ``fused_norms(il)`` gives the weights of the extra norms (Q, K, post-attention, post-FFN; None where
    the form has none). :meth:`block` returns None wherever the general path would not run
    the very kernels the call runs (a device, kernels off, a scaled weight, a shared cache, a
    typed cache of head sizes its vector kernel does not take, more rows than the kernels take...): the
    caller then takes that path, which gives the same bits where both apply. A typed cache
    (:mod:`plinth.kvtypes`) runs inside the call as :func:`plinth.ops.attend_q.attend_rows_typed` runs it."""

    def __init__(self, graph: Any, *, qk_norm: bool = False, post_norms: bool = False, act: str = "silu",
                 windows: Sequence[int] | None = None) -> None:
        if act not in ("silu", "gelu"):
            raise ValueError(f"DenseBlocks: act {act!r} is not one the call takes (silu, gelu)")
        self.graph = graph
        self.form = (bool(qk_norm), bool(post_norms), act == "gelu")
        self.windows = list(windows) if windows is not None else None
        self._weights: dict[int, Any] = {}  # per layer: the four products' kernel arguments, or False
        self._norms: dict[int, tuple] = {}  # per layer: the extra norms' weights as the call takes them
        self._zeros: dict[int, np.ndarray] = {}
        self._biases: dict[int, tuple] = {}  # per layer: the products' bias mask and biases as the call takes them
        self._stored: dict[tuple, Any] = {}  # per head size and K / V codecs: _stored_args', or False

    def _layer_args(self, il: int) -> Any:
        """Layer ``il``'s four products' kernel arguments (remembered), or False where a product is not a
        plain int8-kernel one (a scale, a transposed float matrix, a part of another type; a bias is added in
        the call). Asked with the int8 kernels on (:meth:`block` checks first), so False is for good."""
        g = self.graph
        lins = (g.qkv[il], g.attn_out[il], g.gate_up[il], g.down[il])
        got = [(lin.bias is None or (type(lin.bias) is np.ndarray and lin.bias.shape == (lin.w.shape[0],)))
               and not lin.transposed and isinstance(lin.w, quant.WEIGHT_TYPES) and not lin.w.scaled
               and not lin.w.precise and quant._int8_args(lin.w, getattr(lin.w, "parts", [lin.w])) for lin in lins]
        args = self._weights[il] = all(got) and tuple(a for one in got for a in one)
        if args:
            qk_norm, post_norms, _ = self.form
            weights = self.graph.fused_norms(il) if qk_norm or post_norms else (None,) * 4
            self._norms[il] = tuple(_ABSENT if w is None else _frozen_f32(w) for w in weights)
            mask = sum(1 << p for p, lin in enumerate(lins) if lin.bias is not None)
            self._biases[il] = (mask, *(_ABSENT if lin.bias is None else _frozen_f32(lin.bias) for lin in lins))
        return args

    def block(self, il: int, x: Any, step: Step) -> Any:
        """Layer ``il``'s output for the rows ``x`` [m, n_embd], or None (the caller takes the general path)."""
        if quant.compiled_i8() is None or type(x) is not np.ndarray or x.dtype != np.float32 \
                or x.ndim != 2 or not x.flags.c_contiguous or not 0 < x.shape[0] <= quant.KERNEL_MAX_ROWS:
            return None
        args = self._weights.get(il)
        if args is None:
            args = self._layer_args(il)
        if not args:
            return None
        kv = step.cache.kv(il)
        if kv.layer != il:
            return None
        n_head, n_head_kv, hd = self.graph.heads[il]
        shapes = ((n_head_kv, hd), (n_head_kv, hd))
        codecs = kv.stored_codecs(shapes) if kv.roles else (None, None)
        typed = self._stored.get((hd, codecs))  # (contexts of one model may store their caches differently)
        if typed is None:
            typed = self._stored[(hd, codecs)] = self._stored_args(hd, codecs)
        if not typed:
            return None
        typed_task, stored = typed
        g = self.graph
        table = g.rope.tables[il]
        per_step = step.memo.get((DenseBlocks, id(table)))
        if per_step is None:
            per_step = step.memo[(DenseBlocks, id(table))] = self._per_step(kv, step, table, x.shape[0])
        if not per_step:
            return None
        cos, sin, pos = per_step
        if quant.blas._state["current"] != 1:
            quant.blas.use(1)
        rows = kv.reserve_rows(step.groups, shapes)
        n_kv = rows[:, 2] + (rows[:, 1] - rows[:, 0])
        window = self.windows[il] if self.windows is not None else 0
        # (once a step for the layers of these key counts: the bias reads the new rows' positions, which the
        # call writes later; the keys a sliding window skips and their bias as graph._key_columns has them)
        key = _bias_column_key(n_kv, 0) if not window else ("attn_window_cols", window, n_kv.tobytes())
        got = step.memo.get(key)
        if got is None:
            for (seq, sel), n0 in zip(step.groups, rows[:, 2]):
                kv.positions(seq)[n0:] = step.batch.positions[sel]
            got = step.once(key, lambda: _bias_column(step, kv, n_kv, 0) if not window
                            else _window_columns(step, kv, n_kv.copy(), window))
        lo, col = (self._no_skip(len(n_kv)), got) if not window else got
        attn_norm, ffn_norm = g.norms[il]
        eps, neox, task, vector, scale, threads = self._consts
        qn, kn, pa, pf = self._norms[il]
        qk_norm, post_norms, gelu = self.form
        return self._kernel(x, attn_norm, ffn_norm, eps, *args, n_head, n_head_kv, hd, g.hp.n_ff[il], cos, sin, neox,
                            pos, rows, col, typed_task or task, vector, scale, threads, *stored, qk_norm, qn, kn,
                            post_norms, pa, pf, gelu, lo, *self._biases[il])

    def _no_skip(self, n: int) -> np.ndarray:
        """int64 zeros [n]: no key skipped (remembered per size)."""
        got = self._zeros.get(n)
        if got is None:
            got = self._zeros[n] = np.zeros(n, dtype=np.int64)
        return got

    def _stored_args(self, hd: int, codecs: tuple[Any, Any]) -> Any:
        """A cache's storage as the call takes it, for head size ``hd`` and the K / V :class:`plinth.kvtypes.Codec`
        s (None: float32): (the typed attention task's address, 0 for a float32 cache; the call's K code, V code,
        K / V Hadamard sizes and their ``1 / sqrt(n)``, K / V bytes a stored row), or False where the call cannot
        take it (a typed cache whose head size the typed vector kernel does not take: the general path's plain
        loops)."""
        from .kvtypes import CACHE_TYPES, rotation_scale

        if all(c is None for c in codecs):
            return 0, (0, 0, 0, 0, 1.0, 1.0, hd * 4, hd * 4)
        from .ops import attend_q, compiled

        if not compiled.vector_suits(hd, hd, None):
            return False
        kt, vt = (CACHE_TYPES["f32"] if c is None else c.type for c in codecs)
        kr, vr = (0 if c is None else c.rot for c in codecs)
        scales = (float(rotation_scale(n)) if n else 1.0 for n in (kr, vr))
        return attend_q.task_address(), (kt.code, vt.code, kr, vr, *scales, kt.row_bytes(hd), vt.row_bytes(hd))

    def _per_step(self, kv: Any, step: Step, table: Any, m: int) -> Any:
        """(cos, sin, positions) of ``step``'s rows for layers with RoPE ``table``, or False where the
        general path would not take the kernels of the call (the rows of a sequence past the compiled
        attention's, a RoPE table of another form). Also settles the constants of the call."""
        g = self.graph
        if not _rows_path(kv, False, step):
            return False
        cos, sin = step.once(("rope", id(table)), lambda: table(step.batch.positions))
        hd = g.heads[0][2]
        if not (type(cos) is np.ndarray and cos.dtype == np.float32 and sin.dtype == np.float32
                and cos.shape[0] == m and 2 * cos.shape[1] <= hd and g.rope.mode in ("normal", "neox")
                and all(h[2] == hd for h in g.heads)):
            return False
        from .ops import compiled, fused
        from .ops.attention import _threads

        vector = compiled.vector_suits(hd, hd, None)  # (attention_groups' choice)
        self._consts = (float(g.hp.norm_eps), g.rope.mode == "neox", compiled.task_address(vector), vector,
                        float(g.attn_scale), _threads())
        self._kernel = fused.dense_block
        return cos, sin, step.once("positions_i64", lambda: np.asarray(step.batch.positions, dtype=np.int64))


class Rope:
    """Rotary position embedding tables for every layer; layers with equal settings share one.

    ``base`` and ``scaled`` are per layer (Gemma-3's local layers use another base and no
    scaling); ``scaling`` / ``factor`` / ``n_ctx_orig`` are the ``rope.scaling.*`` keys, and
    ``beta_fast`` / ``beta_slow`` / ``ext_factor`` / ``attn_factor`` YaRN's
    (``rope.scaling.yarn_*``, ``rope.scaling.attn_factor``; see :func:`plinth.ops.rope_freqs`).
    ``freq_factors`` [n_rot // 2] divides each rotary frequency on every layer (Llama 3.1+'s
    ``rope_freqs.weight``, as llama.cpp's ``ggml_rope_ext`` applies it; None: none).
    :meth:`__call__` rotates Q and K heads (side by side in one array) at the batch positions.
    """

    def __init__(self, n_rot: int, base: Sequence[float], xp: Any, *, mode: str = "normal", scaling: str = "none",
                 factor: float = 1.0, n_ctx_orig: int = 0, scaled: Sequence[bool] | None = None,
                 freq_factors: Any = None, beta_fast: float = 32.0, beta_slow: float = 1.0,
                 ext_factor: float | None = None, attn_factor: float = 1.0) -> None:
        self.mode = mode
        by_key: dict[tuple[float, str], Any] = {}
        self.tables = []
        for il, b in enumerate(base):
            s = scaling if scaled is None or scaled[il] else "none"
            if (b, s) not in by_key:
                by_key[(b, s)] = ops.RopeCache(ops.rope_freqs(
                    n_rot, base=b, scaling=s, factor=factor, n_ctx_orig=n_ctx_orig, beta_fast=beta_fast,
                    beta_slow=beta_slow, ext_factor=ext_factor if s != "none" else None, attn_factor=attn_factor,
                    freq_factors=freq_factors, xp=xp))
            self.tables.append(by_key[(b, s)])

    def __call__(self, il: int, x: Any, step: Step) -> Any:
        """x: [n_rows, n_heads, head_dim] -> rotated at ``step.batch.positions``."""
        table = self.tables[il]
        cos_sin = step.once(("rope", id(table)), lambda: table(step.batch.positions))
        return ops.apply_rope(x, mode=self.mode, cos_sin=cos_sin)


# ============================================================================ base classes


class TargetView:
    """What a drafter may use of its target model (a declared interface, no reach into weights).

    embed(ids): token embeddings [n, n_embd] as the target's first layer sees them (before any
    input scaling). head(h): logits [n, n_vocab] of rows ``h`` [n, n_embd] taken after the final
    norm. head_weight / embed_table: those matrices in GGUF layout [n_vocab, n_embd].
    final_norm(x): the target's output norm. n_embd, n_vocab, n_layer: sizes; feature taps are
    asked for with ``DrafterRequirements.taps`` and arrive in ``ForwardOutput.features``.
    draft_heads / draft_head(name): draft heads shipped in the target's file (MTP layers...).
    """

    def __init__(self, graph: Any, hparams: Any) -> None:
        self._graph = graph
        self.n_embd = int(hparams.n_embd)
        self.n_vocab = int(hparams.n_vocab)
        self.n_layer = int(hparams.n_layer)

    @property
    def embed_table(self) -> Any:
        return self._graph.embed_table

    @property
    def head_weight(self) -> Any:
        return self._graph.head.weight

    def embed(self, ids: Any) -> Any:
        xp = ops.array_module(self.embed_table)
        return self.embed_table[xp.asarray(ids)]

    def head(self, h: Any) -> Any:
        return self._graph.head(h)

    def final_norm(self, x: Any) -> Any:
        return self._graph.final_norm(x)

    @property
    def draft_heads(self) -> list[str]:
        """Names of the draft heads shipped in the target's file (MTP layers, a DSpark head...)."""
        heads = getattr(self._graph, "draft_heads", None)
        return sorted(heads()) if heads is not None else []

    def draft_head(self, name: str) -> Any:
        """The draft head ``name`` the target's architecture declares (its graph's ``draft_heads()``)."""
        heads = getattr(self._graph, "draft_heads", None)
        found = heads() if heads is not None else {}
        if name not in found:
            from .errors import UserError

            raise UserError(f"the target ({type(self._graph).__name__}) ships no draft head {name!r}; "
                            f"it declares {sorted(found) or 'none'}")
        return found[name]


class BaseGraph:
    """A forward built from one method per layer.

    Subclasses set :attr:`cache_layout` (default: a :class:`KV` per layer) and implement
    ``layer(il, x, step) -> x`` (x: [n_rows, n_embd]); override :meth:`embed`,
    :meth:`final_norm` or :attr:`head` when the architecture differs (Gemma scales its
    embeddings; OLMo has no final RMSNorm weight...). :meth:`forward` does the rest: input
    rows and the layer loop with taps inside one cache transaction (:meth:`Cache.forward`),
    then the final norm and the LM head for the output rows only (or pooling).

    Attributes: hp, w (weights by GGUF name), backend, xp, head (:class:`LMHead`),
    embed_table ([n_vocab, n_embd]).
    """

    #: the GGUF name of the final norm's weight, read by the default :meth:`final_norm`
    output_norm: ClassVar[str] = "output_norm.weight"

    def __init__(self, hp: Any, weights: Mapping[str, Any], backend: Any, *, softcap: float = 0.0) -> None:
        self.hp = hp
        self.w = weights
        self.backend = backend
        self.xp = backend.xp
        self.head = LMHead.from_weights(weights, self.xp, softcap=softcap)
        self.embed_table = weights["token_embd.weight"]  # after the head: a view of a tied head

    # -------------------------------------------------------------- what subclasses define

    def cache_layout(self) -> Layout:
        """Per layer, the cache kinds it keeps (fresh instances). Default: one :class:`KV` each."""
        return [(KV(),) for _ in range(self.hp.n_layer)]

    def layer(self, il: int, x: Any, step: Step) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define layer(il, x, step)")

    def embed(self, batch: Batch) -> Any:
        """Input rows [n_rows, n_embd]."""
        return embed_rows(self.embed_table, batch, self.xp)

    def final_norm(self, x: Any) -> Any:
        """x: [n, n_embd] -> normed, before the LM head."""
        return ops.rms_norm(x, self.w[self.output_norm], self.hp.norm_eps)

    def step(self, batch: Batch, cache: Cache) -> Step:
        """The per-forward shared state (override to check the batch or add to it)."""
        return Step(batch=batch, cache=cache, groups=seq_groups(batch.seq_ids))

    # -------------------------------------------------------------- the forward

    def target_view(self) -> TargetView:
        """The interface drafters use (see :class:`TargetView`)."""
        return TargetView(self, self.hp)

    def draft_heads(self) -> dict[str, Any]:
        """Draft heads shipped inside this model's file, by name (default: none).

        An architecture whose files carry MTP layers or another draft head reads their tensors
        (declared in its ``tensors``) and returns here one object per head, with the forward its
        drafter drives (the architecture documents it); the plugin's manifest lists a drafter that
        takes it from ``target.target_view().draft_head(name)``, so the file is loaded once.
        """
        return {}

    def forward(self, batch: Batch, cache: Cache, *, taps: Sequence[int] = (), pooling: str = "none",
                embeddings: bool = False) -> ForwardOutput:
        """Run ``batch``; logits for rows with ``batch.output`` (none when ``pooling`` != "none")."""
        return self.forward_stage(batch, cache, None, 0, self.hp.n_layer, taps=taps, pooling=pooling,
                                  embeddings=embeddings)

    def forward_stage(self, batch: Batch, cache: Cache, x: Any, start: int, stop: int, *,
                      taps: Sequence[int] = (), pooling: str = "none", embeddings: bool = False) -> Any:
        """Layers ``start..stop-1`` of :meth:`forward`: one stage of a model split by layers.

        The first stage (``start == 0``) takes ``x = None`` and embeds the batch; a later stage
        takes the residual rows [n_rows, n_embd] the stage before returned. A stage that does not
        end the model returns its residual; the last (``stop == n_layer``) returns the
        :class:`ForwardOutput` of :meth:`forward` (features hold the taps inside this stage).
        Each stage keeps its layers' cache in its own ``cache``; ``forward`` is the one-stage case.
        """
        n_layer = self.hp.n_layer
        if not 0 <= start < stop <= n_layer:
            raise ValueError(f"a stage runs layers start..stop-1 with 0 <= start < stop <= {n_layer}; "
                             f"got {start}..{stop}")
        if (x is None) != (start == 0):
            raise ValueError("the first stage embeds the batch (x=None); a later stage needs the residual rows")
        with cache.forward(batch):
            step = self.step(batch, cache)
            if x is None:
                x = self.embed(batch)
            x, features = run_layers(x, stop, lambda il, h: self.layer(il, h, step), cache, taps, start=start)
        if stop < n_layer:
            return x
        rows = np.nonzero(batch.output)[0]
        if pooling != "none":
            pooled, seqs = pool(self.final_norm(x), batch, pooling, self.xp)
            return ForwardOutput(rows=rows, embeddings=pooled, embedding_seqs=seqs, features=features)
        h = self.final_norm(x[rows])
        return ForwardOutput(rows=rows, logits=self.head(h), embeddings=h if embeddings else None,
                             features=features)


class Architecture:
    """One architecture: the three steps the engine calls, from one class.

    Set ``name`` (the GGUF ``general.architecture``) and ``graph`` (a :class:`BaseGraph`
    subclass, or any callable ``(hparams, weights, backend) -> Graph``), and implement
    ``hparams(r: KeyReader) -> hparams`` and ``tensors(hp) -> [TensorSpec]``. The base
    turns those into ``load_hparams`` / ``tensor_specs`` / ``build``. ``drafters``: names of
    draft heads shipped inside this architecture's files (MTP layers...), each exported as a
    drafter by :meth:`make_drafter`.
    """

    name: ClassVar[str] = ""
    graph: ClassVar[Any] = None
    #: extra declared key ranges for this architecture's KeyReader (e.g. ``plinth.hparams.DENSE_RANGES``)
    ranges: ClassVar[Mapping[str, Any] | None] = None

    def hparams(self, r: KeyReader) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define hparams(r)")

    def tensors(self, hp: Any) -> list[TensorSpec]:
        raise NotImplementedError(f"{type(self).__name__} must define tensors(hp)")

    # -------------------------------------------------------------- the engine's three steps

    def load_hparams(self, metadata: Mapping[str, Any], source: str) -> Any:
        return self.hparams(KeyReader(metadata, source, self.name, ranges=self.ranges))

    def tensor_specs(self, hparams: Any) -> list[TensorSpec]:
        return self.tensors(hparams)

    def build(self, hparams: Any, weights: Mapping[str, Any], backend: Any) -> Any:
        return self.graph(hparams, weights, backend)

    # -------------------------------------------------------------- checking a file

    def check(self, metadata: Mapping[str, Any], tensors: Mapping[str, Any], source: str) -> Any:
        """Check a file's contents against this architecture's own reading of it; returns the hparams.

        ``metadata``: the GGUF keys; ``tensors``: name -> array (anything with ``.shape``; integer
        arrays count as I32) or name -> (numpy shape, GGML type name). Raises a one-line
        :class:`~plinth.errors.UserError` for a missing or malformed key, a missing tensor or one of
        the wrong shape or type (:func:`check_tensors`), and for a tensor no spec declares or an
        ``{name}.*`` key the hparams step never read: what loading the file would refuse. A
        converter calls it on what it is about to write.
        """
        from .errors import UserError

        keys = KeyUse(metadata)
        hp = self.load_hparams(keys, source)
        specs = self.tensor_specs(hp)
        present = {n: _shape_and_type(t) for n, t in tensors.items()}
        check_tensors(specs, present, source)
        extra = unused_tensors(specs, present) + keys.unread(self.name + ".")
        if extra:
            raise UserError(f"{source}: tensor(s) or key(s) {extra} are not read by the {self.name} architecture")
        return hp


def _shape_and_type(t: Any) -> tuple[tuple[int, ...], str]:
    """(numpy shape, GGML type name) of an array, or the pair itself."""
    if isinstance(t, tuple):
        return tuple(t[0]), str(t[1])
    kind = getattr(getattr(t, "dtype", None), "kind", "f")
    return tuple(t.shape), "I32" if kind in "iu" else "F32"

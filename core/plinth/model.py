"""Loading a GGUF model through its architecture plugin, and the stable Python facade.

``plinth.load_model(path_or_name)``: GGUF reader -> ``general.architecture`` selects the
plugin -> hparams -> tensor specs checked against the file -> weights on the backend ->
graph. :class:`Model` then offers ``logits(token_ids)`` and incremental use through
:meth:`Model.new_context` (a :class:`Context`: a cache and the forward options).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Sequence

import attrs
import numpy as np

from .cache import Cache
from .batch import Batch, ForwardOutput
from .errors import UserError
from .quant import QuantWeight
from .tensors import KeyUse, TensorSpec, check_tensors, check_unused, scale_name, unused_tensors
from .validation import check_model_file, check_tensor_types, check_vocab


@attrs.define
class LoadStats:
    open_s: float = 0.0
    weights_s: float = 0.0
    build_s: float = 0.0
    n_params: int = 0
    #: tensors and ``{arch}.*`` keys of the file that the architecture does not read (only with
    #: ``allow_unused``; otherwise such a file is refused)
    unused: list[str] = attrs.field(factory=list)
    unused_keys: list[str] = attrs.field(factory=list)


class Context:
    """One inference context: a KV cache and the forward options (taps, pooling).

    ``cache_types``: the storage types of its K/V rows (:class:`plinth.kvtypes.CacheTypes`; default the
    model's, from ``load_model(cache_type_k=..., cache_type_v=...)``)."""

    def __init__(self, model: "Model", *, taps: Iterable[int] = (), pooling: str = "none",
                 cache_types: Any = None) -> None:
        n_layer = model.hparams.n_layer
        self.taps = tuple(sorted(set(int(t) for t in taps)))
        extra = set(getattr(model.graph, "extra_taps", ()))  # taps a graph defines beyond its layers
        for t in self.taps:
            if not 0 <= t <= n_layer and t not in extra:
                raise ValueError(f"feature tap {t} out of range: layers are 0..{n_layer} (n_layer = {n_layer})")
        self.model = model
        self.pooling = pooling
        if not callable(getattr(model.graph, "cache_layout", None)):
            raise UserError(f"{model.path.name}: the {model.arch} graph (plugin {model.plugin}) declares no "
                            "cache_layout(); a graph says per layer what it keeps (plinth.graph.Graph)")
        types = cache_types if cache_types is not None else getattr(model, "cache_types", None)
        self.cache = Cache(n_layer, model.backend.xp, model.graph.cache_layout(), types=types, max_rows=model.n_ctx)

    def forward(self, batch: Batch) -> ForwardOutput:
        return self._run(batch, lambda: self.model.graph.forward(batch, self.cache, taps=self.taps,
                                                                 pooling=self.pooling))

    def forward_stage(self, batch: Batch, x: Any, start: int, stop: int) -> Any:
        """Layers ``start..stop-1`` only (:meth:`plinth.graph.BaseGraph.forward_stage`): one stage of a
        model split by layers, with the residual rows ``x`` of the stage before (None on the first)."""
        return self._run(batch, lambda: self.model.graph.forward_stage(batch, self.cache, x, start, stop,
                                                                       taps=self.taps, pooling=self.pooling))

    def _run(self, batch: Batch, forward: Any) -> Any:
        """``forward()`` once the batch is checked against the context limit."""
        for seq in np.unique(batch.seq_ids):
            n = int(self.cache.n_cached(int(seq)) + np.count_nonzero(batch.seq_ids == seq))
            if n > self.model.n_ctx:
                raise UserError(
                    f"context limit exceeded: sequence {int(seq)} would hold {n} tokens, "
                    f"the context holds {self.model.n_ctx} (raise it with n_ctx=...)"
                )
        return forward()  # (the graph opens the forward's cache transaction: Cache.forward)

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps state that cannot be cut (rollback needs snapshot + replay)."""
        return any(k.rollback == "snapshot" for k in self.cache.kinds())

    def rollback_plan(self, seq: int, start: int, end: int) -> str:
        """How to undo rows ``start..end-1`` of ``seq`` about to be run: "cut" or "snapshot" (asks the cache)."""
        return self.cache.cut_plan(seq, start, end)

    def decode(self, tokens: Sequence[int], seq: int = 0, output: str = "last") -> ForwardOutput:
        """Append ``tokens`` to sequence ``seq`` after what it already holds."""
        start = self.cache.next_position(seq)
        return self.forward(Batch.from_tokens(tokens, start=start, seq=seq, output=output))


class ModelFile:
    """What a model knows from its file: ``n_vocab`` and the tokenizer built from the GGUF metadata
    (on first use). Needs ``hparams``, ``metadata``, ``path`` and ``_tokenizer`` (None at first)."""

    hparams: Any
    metadata: dict[str, Any]
    path: Path
    _tokenizer: Any

    @property
    def n_vocab(self) -> int:
        return int(self.hparams.n_vocab)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from .tokenizer import Tokenizer

            tok = Tokenizer.from_metadata(self.metadata, source=str(self.path))
            check_vocab(tok, self.n_vocab, str(self.path))
            self._tokenizer = tok
        return self._tokenizer


class Model(ModelFile):
    """A loaded model: hparams, weights on a backend, the architecture's graph."""

    def __init__(self, path: Path, arch: str, plugin: str, hparams: Any, specs: Sequence[TensorSpec],
                 weights: dict[str, Any], graph: Any, backend: Any, metadata: dict[str, Any],
                 tensor_types: dict[str, str], stats: LoadStats, n_ctx: int | None = None) -> None:
        self.path = path
        self.arch = arch
        self.plugin = plugin
        self.hparams = hparams
        self.specs = list(specs)
        self.weights = weights
        self.graph = graph
        self.backend = backend
        self.metadata = metadata
        self.tensor_types = tensor_types
        self.stats = stats
        self.n_ctx = int(n_ctx or hparams.n_ctx_train or 4096)
        self._tokenizer: Any = None
        from .kvtypes import CacheTypes

        #: the K/V cache storage types of its contexts (``load_model(cache_type_k=..., cache_type_v=...)``)
        self.cache_types = CacheTypes()

    def target_view(self) -> Any:
        """What a drafter may use of this model: :class:`plinth.graph.TargetView` (embedding, head, sizes)."""
        make = getattr(self.graph, "target_view", None)
        if make is None:
            raise UserError(f"{self.path.name}: the {self.arch} graph (plugin {self.plugin}) declares no target_view(); "
                            "drafters that share the embedding or LM head cannot use it (derive it from "
                            "plinth.graph.BaseGraph or define target_view())")
        return make()

    def new_context(self, *, taps: Iterable[int] = (), pooling: str = "none", cache_type_k: str | None = None,
                    cache_type_v: str | None = None) -> Context:
        """A fresh context; ``cache_type_k`` / ``cache_type_v`` override the model's cache types for it."""
        types = None
        if cache_type_k is not None or cache_type_v is not None:
            types = attrs.evolve(self.cache_types, k=cache_type_k or self.cache_types.k,
                                 v=cache_type_v or self.cache_types.v)
        return Context(self, taps=taps, pooling=pooling, cache_types=types)

    def prepare(self) -> float:
        """One forward of one token in a throwaway context, so that a first request does not pay the
        one-time work: the int8 kernels repack each quantized weight on its first product
        (:mod:`plinth.quant`), and numba loads the compiled kernels. Seconds taken. A graph that
        cannot run a lone token (one that needs other inputs) is left to its first request."""
        t = time.perf_counter()
        try:
            self.new_context().forward(Batch.from_tokens([0], output="last"))
        except Exception as e:  # the first real forward reports whatever this one hit
            _log.debug("prepare: a one-token forward of %s failed (%s); weights repack on first use", self.path.name, e)
        return time.perf_counter() - t

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [n_tokens, n_vocab]: the logits at every position of one fresh sequence."""
        ctx = self.new_context()
        out = ctx.forward(Batch.from_tokens(list(token_ids), output="all"))
        return np.asarray(self.backend.to_numpy(out.logits), dtype=np.float32)


#: the hparams fields the core reads (the plinth.graph.HParams protocol)
HPARAMS_FIELDS = ("n_layer", "n_vocab", "n_embd", "n_ctx_train")

_log = logging.getLogger("plinth.model")

CHUNK_ELEMENTS = 1 << 21  # rows dequantized per task: small enough that temporaries stay in cache


def _dequantized(gf: Any, name: str, info: Any, pool: Any = None) -> np.ndarray:
    """A tensor as float32: a zero-copy view for F32, else dequantized in row chunks.

    With ``pool`` (a ``concurrent.futures`` executor) the chunks run in parallel; numpy
    releases the GIL inside the dequantizers' array passes.
    """
    from .gguf import quants

    raw = gf.raw(name)
    if info.type_name == "F32":
        return raw  # a zero-copy view of the mapped file
    n_rows = raw.shape[0] if raw.ndim == 2 else 1
    row_len = info.n_elements // n_rows
    step = max(1, CHUNK_ELEMENTS // row_len)
    if n_rows <= step or raw.ndim != 2:
        return quants.dequantize(raw, info.ggml_type, info.shape)
    out = np.empty(info.shape, dtype=np.float32)
    rows = out.reshape(n_rows, row_len)

    def chunk(r0: int) -> None:
        r1 = min(r0 + step, n_rows)
        rows[r0:r1] = quants.dequantize(raw[r0:r1], info.ggml_type, (r1 - r0, row_len))

    starts = range(0, n_rows, step)
    if pool is None:
        for r0 in starts:
            chunk(r0)
    else:
        for f in [pool.submit(chunk, r0) for r0 in starts]:
            f.result()
    return out


def _keeps_quantized(backend: Any) -> bool:
    """Whether weights stay in their GGUF blocks: the numpy backend, unless PLINTH_DEQUANTIZE=1."""
    return getattr(backend, "name", "") == "numpy" and os.environ.get("PLINTH_DEQUANTIZE", "0") != "1"


def _quantizable(info: Any) -> bool:
    """A 2-D tensor of a type the kernels read, with whole blocks in every row."""
    from .quant import KEPT_TYPES, block_values

    return (info.type_name in KEPT_TYPES and len(info.shape) == 2
            and info.shape[1] % block_values(info.type_name) == 0)


def allow_unused_default() -> bool:
    """``PLINTH_ALLOW_UNUSED=1`` (the ``--allow-unused`` option sets it): load files whose tensors or keys
    the architecture does not read."""
    text = os.environ.get("PLINTH_ALLOW_UNUSED", "0")
    if text not in ("0", "1"):
        raise UserError(f"PLINTH_ALLOW_UNUSED={text!r}: 1 (load files with tensors or keys nothing reads) or 0")
    return text == "1"


def load_model(path_or_name: str | os.PathLike[str], backend: str = "numpy", *, registry: Any = None,
               n_ctx: int | None = None, progress: bool = False, tokenizer: bool = False,
               allow_unused: bool | None = None, cache_type_k: str = "f32", cache_type_v: str = "f32") -> Model:
    """Load a GGUF file (or a known model name, fetched on first use) with its architecture plugin.

    Every problem with the file is a :class:`~plinth.errors.UserError` naming it, raised before
    the weights load. With ``tokenizer=True`` the tokenizer is built (and checked against the
    vocabulary size) before the weights too, so a file without one fails at once.

    A file holding tensors or ``{arch}.*`` keys that the architecture does not read is refused
    (:class:`~plinth.tensors.UnusedError`): a rope table or a bias left out computes fluent, wrong
    text. ``allow_unused=True`` (default: ``PLINTH_ALLOW_UNUSED``) loads it anyway and lists them in
    ``model.stats.unused`` / ``unused_keys``. Integer tensors (I8..I64) load as integer arrays
    where the architecture's spec allows their type.

    ``cache_type_k`` / ``cache_type_v``: how its contexts store K/V rows (``-ctk`` / ``-ctv``: f32, f16,
    bf16, q8_0, q4_0, q4_1, q5_0, q5_1; :mod:`plinth.kvtypes`); checked before anything loads.
    """
    from .kvtypes import CacheTypes

    cache_types = CacheTypes(k=cache_type_k, v=cache_type_v)
    if allow_unused is None:
        allow_unused = allow_unused_default()
    from . import hub
    from .gguf import open_gguf
    from .plugins import default_registry

    registry = registry or default_registry()
    path = hub.resolve_model(str(path_or_name), progress=progress)
    stats = LoadStats()
    t0 = time.perf_counter()
    gf = open_gguf(path)
    metadata = dict(gf.metadata)
    arch = check_model_file(metadata, len(gf.tensors), str(path))
    plugin = registry.owner("architectures", arch, source=str(path))
    tok = None
    if tokenizer:
        from .tokenizer import Tokenizer

        tok = Tokenizer.from_metadata(metadata, source=str(path))
    key_use = KeyUse(metadata)
    hparams = registry.arch_hparams(arch, key_use, str(path))
    missing = [f for f in HPARAMS_FIELDS if not hasattr(hparams, f)]
    if missing:
        raise UserError(f"{path}: the {arch} hparams (plugin {plugin}) lack {', '.join(missing)}; an architecture's "
                        "hparams must have the fields of plinth.graph.HParams")
    if hparams.n_vocab == -1 and "token_embd.weight" in gf.tensors:
        hparams = attrs.evolve(hparams, n_vocab=gf.tensors["token_embd.weight"].shape[0])
    if tok is not None:
        check_vocab(tok, int(getattr(hparams, "n_vocab", -1) or -1), str(path))
    specs = registry.arch_tensors(arch, hparams)
    present = {name: (tuple(info.shape), info.type_name) for name, info in gf.tensors.items()}
    found = check_tensors(specs, present, str(path))
    integer = {spec.name for spec in found if _integer(gf.tensors[spec.name], spec)}
    check_tensor_types([n for spec in found for n in (spec.name, scale_name(spec.name)) if n not in integer],
                       gf.tensors, str(path))
    stats.unused = unused_tensors(specs, gf.tensors)
    stats.unused_keys = key_use.unread(arch + ".")
    if not allow_unused:
        check_unused(stats.unused, stats.unused_keys, str(path), arch, plugin)
    stats.open_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    be = registry.make_backend(backend)
    weights: dict[str, Any] = {}
    iterator: Iterable[TensorSpec] = found
    if progress:
        iterator = _progress(found, f"loading {path.name}")
    keep = _keeps_quantized(be)
    noted: set[str] = set()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for spec in iterator:
            info = gf.tensors[spec.name]
            if spec.name in integer:  # an index table (DeepSeek V4's token-to-expert map): kept as integers
                weights[spec.name] = be.asarray(np.array(gf.raw(spec.name)))
                continue
            scaled = spec.scale and scale_name(spec.name) in gf.tensors
            scale = None
            if keep and scaled and _quantizable(info):  # one value or one a row: kept beside the blocks
                sname = scale_name(spec.name)
                scale = np.asarray(_dequantized(gf, sname, gf.tensors[sname], pool), dtype=np.float32).reshape(-1)
                if scale.size not in (1, int(info.shape[0])):
                    scale = None  # (another layout: multiplied into a float32 copy below)
            if keep and _quantizable(info) and (not scaled or scale is not None):
                weights[spec.name] = QuantWeight(gf.raw(spec.name), info.ggml_type, tuple(info.shape), scale)
                stats.n_params += int(info.n_elements)
                continue
            if keep and info.type_name not in ("F32", "F16", "BF16") and info.type_name not in noted:
                noted.add(info.type_name)
                _log.info("%s: %s tensors have no quantized kernel; dequantized to float32 at load",
                          path.name, info.type_name)
            arr = _dequantized(gf, spec.name, info, pool)
            if scaled:
                arr = arr * _dequantized(gf, scale_name(spec.name), gf.tensors[scale_name(spec.name)], pool)
            weights[spec.name] = be.asarray(np.ascontiguousarray(arr, dtype=np.float32))
            stats.n_params += int(arr.size)
    stats.weights_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    graph = registry.arch_build(arch, hparams, weights, be)
    stats.build_s = time.perf_counter() - t0
    types = {name: info.type_name for name, info in gf.tensors.items()}
    model = Model(path, arch, plugin, hparams, specs, weights, graph, be, metadata, types, stats, n_ctx=n_ctx)
    model._tokenizer = tok
    model.cache_types = cache_types
    return model


_INTEGER_TYPES = ("I8", "I16", "I32", "I64")


def _integer(info: Any, spec: TensorSpec) -> bool:
    """An integer tensor whose spec names its type among the allowed ones (loaded as integers)."""
    return info.type_name in _INTEGER_TYPES and spec.dtypes is not None and info.type_name in spec.dtypes


def _progress(items: Sequence[Any], desc: str) -> Iterable[Any]:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return items
    return tqdm(items, desc=desc, unit="tensor", leave=False)

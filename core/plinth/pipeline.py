"""A model split by layers over Ray actors: pipeline stages for models larger than one node.

Each stage is a Ray actor that loads the model file and runs only its slice of layers
(:meth:`plinth.graph.BaseGraph.forward_stage`); the KV cache of those layers lives with
it. A forward is a chain of actor calls: stage 0 embeds the batch and runs its layers,
hands its residual rows to stage 1 through Ray's object store, and so on; the last stage
applies the final norm and the LM head. The driver never sees the activations, only the
logits. Weights kept in their GGUF blocks (the default for quantized files) are pages of
the memory-mapped file, so a stage only brings into memory the layers it runs.

:class:`PipelineModel` / :class:`PipelineContext` stand in for :class:`plinth.model.Model`
/ :class:`plinth.model.Context`: plain and speculative generation (ngram and draft-model
drafters: the verify batch goes through the same pipeline), rollback by cut or by
snapshot + replay, and ``plinth bench`` run on them unchanged. Drafters that read the
target's hidden states (feature taps) need a single-process model.

Command line: ``plinth generate -m MODEL --ray-stages 2 [--ray-address ADDR] PROMPT``.
Needs the ``ray`` extra: ``pip install 'plinth[ray]'``.
"""

from __future__ import annotations

import itertools
import os
import types
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .batch import Batch, ForwardOutput
from .errors import UserError, missing_extra
from .model import ModelFile

#: snapshots a stage keeps (the engine takes one per speculative step and restores at most that one)
MAX_SNAPSHOTS = 8


#: environment variables carried to every Ray worker (stages, Serve replicas): plugin selection, kernels, threads
CARRIED_ENV = ("PLINTH_PLUGINS", "PLINTH_DISABLE_PLUGINS", "PLINTH_PREFER", "PLINTH_STRICT_PLUGINS", "PLINTH_THREADS",
               "PLINTH_ALLOW_UNUSED",
               "PLINTH_KERNELS", "PLINTH_INT8", "PLINTH_KERNEL_ROWS", "PLINTH_DEQUANTIZE", "PLINTH_MALLOC",
               "PLINTH_CACHE_DIR", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "NUMBA_CACHE_DIR",
               "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def carried_env() -> dict[str, str]:
    """The PLINTH_* (and thread) settings of this process, for every Ray worker's runtime environment."""
    return {k: os.environ[k] for k in CARRIED_ENV if k in os.environ}


def split_layers(n_layer: int, n_stages: int, split: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Layer ranges [start, stop) per stage: even (earlier stages take the remainder), or at the
    given first layers of stages 1.. (``split``, increasing)."""
    if n_stages < 1:
        raise UserError(f"a pipeline needs at least 1 stage, not {n_stages}")
    if n_stages > n_layer:
        raise UserError(f"{n_stages} pipeline stages for a model of {n_layer} layers: at most one stage per layer")
    if split:
        bounds = [0, *[int(s) for s in split], n_layer]
        if len(bounds) != n_stages + 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise UserError(f"--ray-split {','.join(map(str, split))}: give {n_stages - 1} increasing first "
                            f"layers of stages 2..{n_stages}, each in 1..{n_layer - 1}")
    else:
        base, extra = divmod(n_layer, n_stages)
        sizes = [base + (i < extra) for i in range(n_stages)]
        bounds = [0, *itertools.accumulate(sizes)]
    return list(zip(bounds[:-1], bounds[1:]))


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise missing_extra("a pipeline over Ray actors", "ray", exc) from None
    return ray


def _get(refs: Any) -> Any:
    """``ray.get``, with a plinth error raised in a stage re-raised as itself (one line, no Ray traceback)."""
    ray = _ray()
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, (UserError, ValueError)):
            raise cause from None
        raise
    except ray.exceptions.RayActorError as exc:
        raise UserError(f"a pipeline stage died ({type(exc).__name__}): {str(exc).splitlines()[0]}") from None


class Stage:
    """One pipeline stage (a Ray actor): the model file loaded, layers ``start..stop-1`` run here."""

    def __init__(self, model: str, start: int, stop: int, *, n_ctx: int | None, backend: str,
                 plugins: dict[str, Any], threads: int | None) -> None:
        from .model import load_model
        from .plugins import discover

        self.rss0 = _rss()  # the worker before the model: the stage's own share is rss - rss0
        if threads is not None:
            from . import quant

            quant.set_threads(threads)
        registry = discover(**plugins)
        self.model = load_model(model, backend=backend, registry=registry, n_ctx=n_ctx, progress=False,
                                tokenizer=False)
        graph = self.model.graph
        if not callable(getattr(graph, "forward_stage", None)):
            raise UserError(f"{self.model.path.name}: the {self.model.arch} graph (plugin {self.model.plugin}) has "
                            "no forward_stage(); a pipeline splits only graphs built on plinth.graph.BaseGraph")
        self.start, self.stop = start, stop
        self.last = stop == self.model.hparams.n_layer
        self.ctx = self.model.new_context()
        self.snaps: OrderedDict[int, Any] = OrderedDict()

    def info(self, metadata: bool = False) -> dict[str, Any]:
        m = self.model
        hp = m.hparams
        out = {"arch": m.arch, "plugin": m.plugin, "path": str(m.path), "n_ctx": m.n_ctx,
               "n_layer": int(hp.n_layer), "n_vocab": int(hp.n_vocab), "n_embd": int(hp.n_embd),
               "n_ctx_train": int(getattr(hp, "n_ctx_train", 0) or 0), "recurrent": bool(self.ctx.recurrent),
               "node": os.uname().nodename, "pid": os.getpid(), "rss": _rss(), "rss0": self.rss0,
               "weights_rss": mapped_rss(m.path)}
        if metadata:
            out["metadata"] = m.metadata
        return out

    def forward(self, batch: Batch, x: Any) -> Any:
        """This stage's layers on ``batch`` (``x``: the stage before's residual; None on stage 0)."""
        out = self.ctx.forward_stage(batch, x, self.start, self.stop)
        to_numpy = self.model.backend.to_numpy
        if self.last:
            return np.asarray(out.rows), np.asarray(to_numpy(out.logits), dtype=np.float32)
        return np.asarray(to_numpy(out))

    def hop(self, x: Any) -> Any:
        """Nothing but the call: what one stage-to-stage hop costs."""
        return x

    def cache(self, name: str, *args: Any) -> Any:
        return getattr(self.ctx.cache, name)(*args)

    def snapshot(self, seq: int, key: int) -> None:
        self.snaps[key] = self.ctx.cache.snapshot(seq)
        while len(self.snaps) > MAX_SNAPSHOTS:
            self.snaps.popitem(last=False)

    def restore(self, key: int) -> None:
        if key not in self.snaps:
            raise UserError(f"pipeline stage {self.start}..{self.stop - 1}: snapshot {key} is gone "
                            f"(a stage keeps the last {MAX_SNAPSHOTS})")
        self.ctx.cache.restore(self.snaps.pop(key))

    def reset(self) -> None:
        self.ctx = self.model.new_context()
        self.snaps.clear()


def mapped_rss(path: str | os.PathLike[str]) -> int:
    """Resident bytes of this process's mappings of ``path`` (the model file's pages in memory)."""
    import re

    header = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")
    target, total, inside = str(Path(path).resolve()), 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if header.match(line):  # "start-end perms offset dev inode [path]"
                    parts = line.split(None, 5)
                    inside = len(parts) == 6 and parts[5].strip() == target
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def _rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _Snap:
    """A snapshot of every stage's cache for one sequence (each stage keeps its part)."""

    def __init__(self, key: int, seq: int) -> None:
        self.key, self.seq = key, seq


class PipelineCache:
    """The cache calls the engine makes, sent to every stage (each holds its layers' part)."""

    def __init__(self, stages: list[Any]) -> None:
        self._stages = stages
        self._keys = itertools.count()

    def _all(self, name: str, *args: Any) -> list[Any]:
        return _get([s.cache.remote(name, *args) for s in self._stages])

    def _first(self, name: str, *args: Any) -> Any:
        return _get(self._stages[0].cache.remote(name, *args))

    def next_position(self, seq: int) -> int:
        return int(self._first("next_position", seq))

    def n_cached(self, seq: int) -> int:
        return int(self._first("n_cached", seq))

    def seqs(self) -> list[int]:
        return list(self._first("seqs"))

    def can_cut(self, seq: int, p: int) -> bool:
        return all(self._all("can_cut", seq, p))

    def cut_plan(self, seq: int, start: int, end: int) -> str:
        return "snapshot" if "snapshot" in self._all("cut_plan", seq, start, end) else "cut"

    def seq_rm(self, seq: int, p0: int = 0, p1: int | None = None) -> None:
        self._all("seq_rm", seq, p0, p1)

    def seq_cp(self, src: int, dst: int) -> None:
        self._all("seq_cp", src, dst)

    def clear(self, seq: int | None = None) -> None:
        self._all("clear", seq)

    def rollback_pending(self) -> None:
        self._all("rollback_pending")

    def snapshot(self, seq: int) -> _Snap:
        key = next(self._keys)
        _get([s.snapshot.remote(seq, key) for s in self._stages])
        return _Snap(key, seq)

    def restore(self, snap: _Snap) -> None:
        _get([s.restore.remote(snap.key) for s in self._stages])

    def nbytes_by_kind(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for part in self._all("nbytes_by_kind"):
            for k, v in part.items():
                total[k] = total.get(k, 0) + v
        return total

    def nbytes(self) -> int:
        return int(sum(self._all("nbytes")))


class PipelineContext:
    """:class:`plinth.model.Context` over the stages: a forward is a chain of stage calls."""

    def __init__(self, model: "PipelineModel") -> None:
        self.model = model
        self.taps: tuple[int, ...] = ()
        self.pooling = "none"
        self.cache = PipelineCache(model.stages)

    def forward(self, batch: Batch) -> ForwardOutput:
        ref = None
        for stage in self.model.stages:  # each call gets the previous stage's output as an object ref:
            ref = stage.forward.remote(batch, ref)  # Ray hands it from stage to stage, not via the driver
        rows, logits = _get(ref)
        return ForwardOutput(rows=rows, logits=logits)

    @property
    def recurrent(self) -> bool:
        return self.model.recurrent

    def rollback_plan(self, seq: int, start: int, end: int) -> str:
        return "snapshot" if self.model.recurrent else self.cache.cut_plan(seq, start, end)

    def decode(self, tokens: Sequence[int], seq: int = 0, output: str = "last") -> ForwardOutput:
        start = self.cache.next_position(seq)
        return self.forward(Batch.from_tokens(tokens, start=start, seq=seq, output=output))


class _HostBackend:
    name = "numpy"
    xp = np

    @staticmethod
    def to_numpy(array: Any) -> Any:
        return np.asarray(array)


class PipelineModel(ModelFile):
    """:class:`plinth.model.Model` whose layers run on Ray actors (see :func:`load_pipeline`)."""

    def __init__(self, stages: list[Any], ranges: list[tuple[int, int]], infos: list[dict[str, Any]],
                 metadata: dict[str, Any]) -> None:
        self.stages = stages
        self.ranges = ranges
        self.infos = infos
        first = infos[0]
        self.path = Path(first["path"])
        self.arch = first["arch"]
        self.plugin = first["plugin"]
        self.hparams = types.SimpleNamespace(n_layer=first["n_layer"], n_vocab=first["n_vocab"],
                                             n_embd=first["n_embd"], n_ctx_train=first["n_ctx_train"])
        self.n_ctx = int(first["n_ctx"])
        self.recurrent = any(i["recurrent"] for i in infos)
        self.metadata = metadata
        self.backend = _HostBackend()
        self._tokenizer: Any = None
        self._context: PipelineContext | None = None

    def describe(self) -> str:
        parts = [f"layers {a}-{b - 1} on {i['node']} (pid {i['pid']})" for (a, b), i in zip(self.ranges, self.infos)]
        return f"{self.path.name} ({self.arch}) in {len(self.stages)} stages: " + "; ".join(parts)

    def target_view(self) -> Any:
        raise UserError(f"{self.path.name} runs as a pipeline over Ray actors; drafters that share the target's "
                        "embedding, LM head or hidden states need it in one process (use ngram or draft)")

    def new_context(self, *, taps: Iterable[int] = (), pooling: str = "none") -> PipelineContext:
        """A fresh context (the stages' caches are cleared: a pipeline holds one context at a time)."""
        if tuple(taps) or pooling != "none":
            raise UserError("a pipeline model gives logits only: feature taps and pooled embeddings need the model "
                            "in one process")
        if self._context is not None:
            _get([s.reset.remote() for s in self.stages])
        self._context = PipelineContext(self)
        return self._context

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [n_tokens, n_vocab]: the logits at every position of one fresh sequence."""
        out = self.new_context().forward(Batch.from_tokens(list(token_ids), output="all"))
        return np.asarray(out.logits, dtype=np.float32)

    def hop_latency(self, n: int = 50) -> float:
        """Seconds for one stage-to-stage hop of one residual row (median over ``n`` chains)."""
        import time

        x = np.zeros((1, self.hparams.n_embd), dtype=np.float32)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            ref = x
            for s in self.stages:
                ref = s.hop.remote(ref)
            _get(ref)
            times.append((time.perf_counter() - t0) / len(self.stages))
        return float(np.median(times))

    def stage_rss(self) -> list[tuple[int, int, int]]:
        """Per stage: resident bytes; of which added since before the load (model, kernels, cache); of which
        pages of the model file."""
        return [(int(i["rss"]), int(i["rss"]) - int(i["rss0"]), int(i["weights_rss"]))
                for i in _get([s.info.remote() for s in self.stages])]

    def close(self) -> None:
        ray = _ray()
        for s in self.stages:
            ray.kill(s)
        self.stages = []


def load_pipeline(model: str, stages: int = 2, *, address: str | None = None, split: Sequence[int] | None = None,
                  n_ctx: int | None = None, backend: str = "numpy", plugins: dict[str, Any] | None = None,
                  threads: int | None = None, cpus: float = 1.0) -> PipelineModel:
    """Load ``model`` split by layers over ``stages`` Ray actors on the cluster at ``address``
    (None: the one this process is connected to, else a new local one). Raises UserError for a
    model that cannot be split."""
    ray = _ray()
    from .gguf.reader import GGUFFile
    from .hub import resolve_model

    path = resolve_model(model)
    with GGUFFile(path) as gf:  # the layer count, before any actor starts
        arch = gf.metadata.get("general.architecture")
        n_layer = gf.metadata.get(f"{arch}.block_count")
    if not isinstance(n_layer, int):
        raise UserError(f"{Path(path).name}: no {arch}.block_count: cannot split it by layers")
    ranges = split_layers(n_layer, stages, split)
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level="warning",
                 runtime_env={"env_vars": carried_env()})
    free = ray.available_resources().get("CPU", 0.0)
    if free < stages * cpus:
        raise UserError(f"the Ray cluster has {free:g} CPUs free; {stages} stages of {cpus:g} CPUs need "
                        f"{stages * cpus:g} (add nodes, or lower --ray-cpus)")
    actor = ray.remote(Stage).options(num_cpus=cpus, max_concurrency=1)
    handles = [actor.remote(str(path), a, b, n_ctx=n_ctx, backend=backend, plugins=dict(plugins or {}),
                            threads=threads) for a, b in ranges]
    infos = _get([h.info.remote(metadata=i == 0) for i, h in enumerate(handles)])
    metadata = infos[0].pop("metadata")
    return PipelineModel(handles, ranges, infos, metadata)

"""An in-process stand-in for ``--ray-stages``: a :class:`plinth.pipeline.PipelineModel` whose stages
run in this process, for tests that a split model decodes as one process does (no Ray needed).

    def test_stages(monkeypatch):
        pm = in_process_pipeline(monkeypatch, path, 2, plugins="llama")
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Sequence


class InProcessHandle:
    """What the pipeline uses of a Ray actor handle, ``handle.method.remote(*args)``, run here at once."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._obj, name)
        return types.SimpleNamespace(remote=lambda *a, **k: fn(*a, **k))


def in_process_pipeline(monkeypatch: Any, path: str | Path, stages: int | Sequence[tuple[int, int]], *,
                        plugins: str, n_layer: int | None = None, split: Any = None, n_ctx: int = 256,
                        backend: str = "numpy") -> Any:
    """A PipelineModel over ``path`` cut into ``stages`` (a count, split by
    :func:`plinth.pipeline.split_layers` over ``n_layer`` layers with ``split``; or the layer ranges
    themselves), each stage loading only the plugin ``plugins``. ``monkeypatch`` (pytest's) makes the
    pipeline's ``ray.get`` hand plain values through for the test's duration."""
    from .. import pipeline

    monkeypatch.setattr(pipeline, "_get", lambda refs: refs)
    if isinstance(stages, int):
        if n_layer is None:
            raise ValueError("in_process_pipeline: a stage count needs n_layer")
        ranges = pipeline.split_layers(n_layer, stages, split)
    else:
        ranges = [tuple(r) for r in stages]
    handles = [InProcessHandle(pipeline.Stage(str(path), a, b, n_ctx=n_ctx, backend=backend,
                                              plugins={"plugins": plugins}, threads=None)) for a, b in ranges]
    infos = [h.info.remote(metadata=i == 0) for i, h in enumerate(handles)]
    return pipeline.PipelineModel(handles, ranges, infos, infos[0].pop("metadata"))

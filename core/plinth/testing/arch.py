"""``check_architecture``: the contract every architecture plugin passes, on a tiny synthetic GGUF."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np


def check_architecture(registry: Any, arch: str, metadata: Mapping[str, Any], folder: str | Path, *,
                       seed: int = 0, scale: float = 0.2, prompts: Sequence[Sequence[int]] | None = None,
                       max_tokens: int = 16, atol: float = 1e-4, backend: str = "numpy") -> Any:
    """Write a random ``arch`` model from ``metadata`` into ``folder`` and check, through the public API:

    * ``plinth.load_model`` loads it; the hparams have the :class:`plinth.graph.HParams` fields and
      the graph is a :class:`plinth.graph.Graph` whose ``cache_layout()`` has one entry per layer;
    * prefill then one-token decode equals one full forward; two sequences in one batch equal
      separate runs; logits only for the rows that ask;
    * cache rollback: rows run and then undone the way the cache says (cut, or snapshot + replay)
      leave the cache equal, kind by kind, to a cache that never ran them;
    * ``Generator`` decodes greedily, and speculative decoding with the n-gram drafter and with a
      random drafter (rejections at every position) gives the same tokens, its cache equal to
      plain decoding's.

    ``metadata`` must give a 257-token vocabulary (``tiny_metadata(arch, n_vocab=257)``): the byte
    tokenizer of :func:`plinth.testing.byte_vocab` is added. ``backend``: "numpy", or "strict" (the
    strict device stand-in: host arrays refused in device ops, and a decode forward may read
    nothing back from the device). Returns the loaded model.
    """
    from ..graph import Batch, Graph, HParams
    from ..model import load_model
    from ..speculative.ngram import NgramDrafter
    from . import check_prefill_then_decode, new_cache
    from .drafters import RandomDrafter, assert_caches_equal, check_drafter_contract
    from .synthetic import byte_vocab, write_synthetic_gguf

    n_vocab = metadata.get(f"{arch}.vocab_size")
    if n_vocab is not None and n_vocab != 257:
        raise ValueError(f"check_architecture writes the 257-token byte vocabulary, but the metadata says "
                         f"{arch}.vocab_size = {n_vocab}: give tiny_metadata({arch!r}, n_vocab=257)")
    md = {**dict(metadata), **byte_vocab()}
    path = write_synthetic_gguf(Path(folder) / f"{arch}.gguf", arch, md, registry, seed=seed, scale=scale)
    model = load_model(path, registry=registry, backend=backend)
    be = model.backend
    hp, graph = model.hparams, model.graph
    assert isinstance(hp, HParams), f"{arch}: hparams lack a field of plinth.graph.HParams (n_layer, n_vocab, ...)"
    assert isinstance(graph, Graph), f"{arch}: the graph lacks cache_layout() or forward()"
    assert len(graph.cache_layout()) == hp.n_layer, f"{arch}: cache_layout() must have one entry per layer"
    assert hp.n_vocab == 257, f"{arch}: n_vocab {hp.n_vocab}, expected the 257-token byte vocabulary"
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, 12).tolist()

    # forward contracts
    check_prefill_then_decode(graph, hp.n_layer, tokens, 5, atol=atol, backend=be)
    a, b = tokens[:9], rng.integers(0, 256, 6).tolist()
    la = be.to_numpy(graph.forward(Batch.from_tokens(a, output="all"), new_cache(graph, hp.n_layer)).logits)
    lb = be.to_numpy(graph.forward(Batch.from_tokens(b, output="all"), new_cache(graph, hp.n_layer)).logits)
    both = Batch.concat([Batch.from_tokens(a, seq=0, output="all"), Batch.from_tokens(b, seq=1, output="all")])
    lab = be.to_numpy(graph.forward(both, new_cache(graph, hp.n_layer)).logits)
    np.testing.assert_allclose(lab, np.concatenate([la, lb]), atol=atol, rtol=0)
    mask = [i % 3 == 0 for i in range(len(tokens))]
    part = graph.forward(Batch.from_tokens(tokens, output=mask), new_cache(graph, hp.n_layer))
    assert tuple(part.logits.shape) == (sum(mask), hp.n_vocab) and list(part.rows) == [0, 3, 6, 9]

    # rollback: run 8 tokens, then 4 more that are undone as the cache says
    ctx, ref = model.new_context(), model.new_context()
    ctx.decode(tokens[:8])
    ref.decode(tokens[:8])
    plan = ctx.rollback_plan(0, 8, 12)
    snap = ctx.cache.snapshot(0) if plan == "snapshot" else None
    ctx.forward(Batch.from_tokens(tokens[8:12], start=8, output="all"))
    if snap is not None:
        ctx.cache.restore(snap)
        ctx.forward(Batch.from_tokens(tokens[8:9], start=8, output="none"))
    else:
        ctx.cache.seq_rm(0, 9)
    ref.decode(tokens[8:9])
    assert_caches_equal(ctx.cache, ref.cache, atol=atol, rtol=atol)
    np.testing.assert_allclose(be.to_numpy(ctx.decode(tokens[9:10]).logits),
                               be.to_numpy(ref.decode(tokens[9:10]).logits), atol=atol, rtol=0)

    # generation, plain and speculative
    prompts = prompts or [tokens[:6] * 2, rng.integers(0, 256, 5).tolist()]
    check_drafter_contract(model, lambda: NgramDrafter(n_draft=4), prompts, max_tokens=max_tokens, atol=atol,
                           rtol=atol)
    check_drafter_contract(model, lambda: RandomDrafter(hp.n_vocab, length=3, seed=seed), prompts,
                           max_tokens=max_tokens, atol=atol, rtol=atol)
    return model

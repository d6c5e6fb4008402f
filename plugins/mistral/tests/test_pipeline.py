"""Mistral Large 4 split by layers (plinth.pipeline, what ``--ray-stages`` runs): the stages' chain
equals one forward, a pipeline of in-process stages decodes and generates as one process, and a
split the model's state cannot cross (a "shared" indexer layer first in a stage, a layer reading a
latent of an earlier stage) is refused by name before any compute."""

from __future__ import annotations

import numpy as np
import pytest

from plinth.graph import Batch
from plinth.testing.pipeline import in_process_pipeline


def tokens(n, seed=0, vocab=256):
    return np.random.default_rng(seed).permutation(vocab)[:n].tolist()


def test_split_points_follow_the_layer_pattern(mistral_models):
    # dense_topk: every layer full, no sharing; issue: layer 1/3 shared, layer 2 reads layer 0's latent
    assert mistral_models("dense_topk").graph.split_points() == [1, 2, 3]
    assert mistral_models("issue").graph.split_points() == []
    assert mistral_models("deep").graph.split_points() == []


@pytest.mark.parametrize("bounds", [[0, 4], [0, 2, 4], [0, 1, 3, 4], [0, 1, 2, 3, 4]])
def test_stage_chain_equals_forward(mistral_models, bounds):
    model = mistral_models("dense_topk")
    g = model.graph
    ids = tokens(30, 9)
    want = model.new_context().forward(Batch.from_tokens(ids, output="all")).logits
    caches = [model.new_context().cache for _ in bounds[1:]]  # each stage its own cache, as on separate actors
    x = None
    for cache, a, b in zip(caches, bounds, bounds[1:]):
        x = g.forward_stage(Batch.from_tokens(ids, output="all"), cache, x, a, b)
    np.testing.assert_array_equal(x.logits, want)
    # a decode step through the same stage caches
    x = None
    for cache, a, b in zip(caches, bounds, bounds[1:]):
        x = g.forward_stage(Batch.from_tokens([7], start=30), cache, x, a, b)
    one = model.new_context()
    one.forward(Batch.from_tokens(ids, output="all"))
    np.testing.assert_array_equal(x.logits, one.forward(Batch.from_tokens([7], start=30)).logits)


@pytest.mark.parametrize("case,start,why", [("issue", 1, "layers none"), ("issue", 2, "cannot start at layer 2"),
                                            ("deep", 3, "cannot start at layer 3")])
def test_a_split_across_shared_state_is_refused(mistral_models, case, start, why):
    model = mistral_models(case)
    x = np.zeros((3, model.hparams.n_embd), np.float32)
    with pytest.raises(ValueError, match=why):
        model.graph.forward_stage(Batch.from_tokens([1, 2, 3]), model.new_context().cache, x, start,
                                  model.hparams.n_layer)
    cache = model.new_context().cache
    with pytest.raises(ValueError, match=why.replace("layers none", "layer")):  # the stage before the cut refuses too
        model.graph.forward_stage(Batch.from_tokens([1, 2, 3]), cache, None, 0, start)
    assert cache.n_cached(0) == 0  # before computing anything


def test_pipeline_of_stages_equals_one_process(mistral_models, with_byte_vocab, tmp_path, monkeypatch):
    from plinth.generate import Generator
    from plinth.model import load_model

    path = with_byte_vocab(mistral_models("dense_topk").path, tmp_path / "dense_topk-vocab.gguf")
    pm = in_process_pipeline(monkeypatch, path, 2, n_layer=4, plugins="mistral")
    single = load_model(path)
    ids = tokens(20, 3)
    np.testing.assert_array_equal(pm.logits(ids), single.logits(ids))
    assert Generator(pm).generate(ids, max_tokens=16) == Generator(single).generate(ids, max_tokens=16)

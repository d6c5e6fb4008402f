"""The public graph API: exports, protocols, the drafter's view of a target, draft heads."""

from __future__ import annotations

import numpy as np
import pytest

import plinth
import plinth.graph as graph
from plinth.errors import UserError
from plinth.testing import byte_vocab, make_registry, tiny_metadata, write_synthetic_gguf


def test_public_names_resolve():
    for name in graph.__all__:
        assert getattr(graph, name) is not None
    for name in plinth.__all__:
        assert getattr(plinth, name) is not None
    assert issubclass(plinth.TensorCheckError, plinth.UserError) and issubclass(plinth.HParamsError, UserError)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from plinth_llama.plugin import plugin

    reg = make_registry(plugin)
    md = tiny_metadata("qwen3", n_vocab=257) | byte_vocab()
    path = write_synthetic_gguf(tmp_path_factory.mktemp("g") / "q.gguf", "qwen3", md, reg)
    return plinth.load_model(path, registry=reg)


def test_model_satisfies_the_protocols(model):
    assert isinstance(model.hparams, graph.HParams) and isinstance(model.graph, graph.Graph)
    assert all(isinstance(kinds[0], graph.KV) for kinds in model.graph.cache_layout())


def test_target_view_embedding_and_head_are_the_models(model):
    view = model.target_view()
    assert (view.n_embd, view.n_vocab, view.n_layer) == (64, 257, 2)
    ids = [3, 1, 250]
    np.testing.assert_array_equal(view.embed(ids), view.embed_table[ids])
    ctx = model.new_context(taps=(2,))
    out = ctx.forward(graph.Batch.from_tokens(ids, output="all"))
    h = view.final_norm(out.features[2])
    np.testing.assert_allclose(view.head(h), out.logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose(h @ view.head_weight.T, out.logits, atol=1e-4, rtol=0)
    assert view.head_weight is model.target_view().head_weight  # one object, shareable


def test_draft_heads_are_declared_by_the_graph(model):
    view = model.target_view()
    assert view.draft_heads == []
    with pytest.raises(UserError, match="ships no draft head 'mtp'; it declares none"):
        view.draft_head("mtp")

    class WithHead(type(model.graph)):
        def draft_heads(self):
            return {"mtp": "the head"}

    g = WithHead.__new__(WithHead)
    g.__dict__.update(model.graph.__dict__)
    view = graph.TargetView(g, model.hparams)
    assert view.draft_heads == ["mtp"] and view.draft_head("mtp") == "the head"

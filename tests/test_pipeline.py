"""A model split by layers (plinth.pipeline) without a Ray cluster: the stages run in this process
behind a stand-in for Ray's actor handles, so the split, the cache calls sent to every stage and
the engine's use of the pipeline are checked on every CI run. tests/test_ray.py runs the same
stages as real Ray actors on a two-node cluster (opt-in: make test-ray)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import plinth
from plinth import pipeline
from plinth.errors import UserError
from plinth.graph import Batch
from plinth.testing import byte_vocab, make_registry, tiny_metadata, write_synthetic_gguf


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from plinth_llama.plugin import plugin

    reg = make_registry(plugin)
    md = tiny_metadata("qwen3", n_vocab=257, n_layer=5) | byte_vocab()
    return write_synthetic_gguf(tmp_path_factory.mktemp("p") / "q.gguf", "qwen3", md, reg)


@pytest.fixture(scope="module")
def single(model_path):
    return plinth.load_model(model_path)


@pytest.fixture()
def in_process(monkeypatch, model_path):
    """A PipelineModel over stages in this process (``_get`` of a plain value is the value)."""
    from plinth.testing.pipeline import in_process_pipeline

    def make(stages: int, split=None):
        return in_process_pipeline(monkeypatch, model_path, stages, n_layer=5, split=split, plugins="llama")

    return make


def test_split_layers():
    assert pipeline.split_layers(30, 2) == [(0, 15), (15, 30)]
    assert pipeline.split_layers(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert pipeline.split_layers(5, 1) == [(0, 5)]
    assert pipeline.split_layers(30, 3, [4, 20]) == [(0, 4), (4, 20), (20, 30)]
    with pytest.raises(UserError, match="3 pipeline stages for a model of 2 layers"):
        pipeline.split_layers(2, 3)
    with pytest.raises(UserError, match="--ray-split 20,4: give 2 increasing first layers"):
        pipeline.split_layers(30, 3, [20, 4])
    with pytest.raises(UserError, match="each in 1..29"):
        pipeline.split_layers(30, 2, [30])


def test_forward_stage_chain_equals_forward(single):
    g = single.graph
    ids = [5, 77, 3, 200, 9, 41]
    want = single.new_context().forward(Batch.from_tokens(ids, output="all")).logits
    for bounds in ([0, 5], [0, 2, 5], [0, 1, 3, 4, 5]):
        x = None
        for a, b in zip(bounds, bounds[1:]):
            cache = single.new_context().cache  # each stage its own cache, as on separate actors
            batch = Batch.from_tokens(ids, output="all")
            x = g.forward_stage(batch, cache, x, a, b)
        np.testing.assert_array_equal(x.logits, want)
    cache = single.new_context().cache
    with pytest.raises(ValueError, match="0 <= start < stop <= 5; got 3..3"):
        g.forward_stage(Batch.from_tokens(ids), cache, None, 3, 3)
    with pytest.raises(ValueError, match="a later stage needs the residual rows"):
        g.forward_stage(Batch.from_tokens(ids), cache, None, 2, 5)


@pytest.mark.parametrize("stages,split", [(2, None), (3, [1, 4])])
def test_pipeline_logits_and_steps_equal_one_process(in_process, single, stages, split):
    pm = in_process(stages, split)
    assert pm.n_vocab == 257 and pm.hparams.n_layer == 5 and pm.arch == "qwen3"
    ids = [1, 2, 3, 250, 17, 99, 4]
    np.testing.assert_allclose(pm.logits(ids), single.logits(ids), atol=1e-6, rtol=0)
    ctx, one = pm.new_context(), single.new_context()
    np.testing.assert_allclose(ctx.decode(ids).logits, one.decode(ids).logits, atol=1e-6, rtol=0)
    for t in (8, 120):
        np.testing.assert_allclose(ctx.decode([t]).logits, one.decode([t]).logits, atol=1e-6, rtol=0)
    assert ctx.cache.next_position(0) == 9 and ctx.cache.n_cached(0) == 9
    # every stage cut; the next step equals the one-process model's after the same cut
    assert ctx.cache.can_cut(0, 7) and ctx.rollback_plan(0, 7, 9) == "cut"
    ctx.cache.seq_rm(0, 7)
    one.cache.seq_rm(0, 7)
    np.testing.assert_allclose(ctx.decode([33]).logits, one.decode([33]).logits, atol=1e-6, rtol=0)
    # snapshot + restore reach every stage
    snap, snap1 = ctx.cache.snapshot(0), one.cache.snapshot(0)
    ctx.decode([5, 6])
    one.decode([5, 6])
    ctx.cache.restore(snap)
    one.cache.restore(snap1)
    np.testing.assert_allclose(ctx.decode([7]).logits, one.decode([7]).logits, atol=1e-6, rtol=0)
    assert ctx.cache.nbytes() == one.cache.nbytes()  # each layer's cache is held once, by its stage


@pytest.mark.parametrize("spec", [None, "ngram", "draft"])
def test_pipeline_generation_is_identical(in_process, single, model_path, spec):
    from plinth.generate import Generator
    from plinth.plugins import discover

    pm = in_process(2)
    prompt = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11]
    want = Generator(single).generate(prompt, max_tokens=24)
    if spec is None:
        got = Generator(pm).generate(prompt, max_tokens=24)
    else:
        from plinth.speculative.engine import SpecConfig, SpeculativeGenerator

        registry = discover(plugins="llama")
        options = {"draft": str(model_path), "n_max": 4, "n_min": 0, "p_min": 0.0, "backend": "numpy",
                   "ngram_max": 3, "ngram_min": 1, "progress": False, "temperature": 0.0}
        g = SpeculativeGenerator(pm, [registry.make_drafter(spec, pm, options)], config=SpecConfig(n_max=4),
                                 registry=registry)
        got = g.generate(prompt, max_tokens=24)
        assert g.stats.n_drafted > 0
    assert got == want


def test_pipeline_refuses_what_needs_one_process(in_process):
    pm = in_process(2)
    with pytest.raises(UserError, match="feature taps and pooled embeddings need the model in one process"):
        pm.new_context(taps=(2,))
    with pytest.raises(UserError, match="drafters that share the target's embedding"):
        pm.target_view()


def test_missing_ray_extra_is_one_line(monkeypatch, model_path):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(UserError, match=r"needs the 'ray' extra \(ray is missing\): pip install 'plinth\[ray\]'"):
        pipeline.load_pipeline(str(model_path), 2)
    from plinth.serve import ray as serve_ray

    with pytest.raises(UserError, match=r"needs the 'ray' extra"):
        serve_ray.deployment({}, replicas=1)


@pytest.mark.parametrize("argv,message", [
    (["generate", "--ray-split", "2", "x"], "--ray-split needs --ray-stages N"),
    (["generate", "--ray-address", "auto", "x"], "--ray-address needs --ray-stages N"),
    (["generate", "--ray-stages", "3", "--ray-split", "2", "x"], "--ray-split gives 1 first layer(s); 3 stages need 2"),
    (["generate", "--ray-stages", "2", "--ray-split", "0", "x"], "layer numbers start at 1"),
    (["generate", "--ray-stages", "0", "x"], "--ray-stages"),
    (["bench", "--ray-cpus", "0", "--ray-stages", "2"], "--ray-cpus"),
    (["generate", "--ray-stages", "2", "--image", "x.png", "x"], "--image with --ray-stages"),
    (["serve", "--ray-address", "auto"], "--ray-address needs --ray REPLICAS"),
    (["serve", "--ray", "2", "--ray-max-replicas", "1"], "--ray-max-replicas 1 is smaller than --ray 2"),
])
def test_ray_options_are_checked_when_parsed(capsys, argv, message):
    from plinth.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err

"""Greedy output with the DSpark drafter equals plain greedy decoding (the drafter contract), in both block
layouts, with and without a reduced vocabulary and a confidence head; pruning never changes greedy output."""

from __future__ import annotations

import numpy as np
import pytest

PROMPTS = [[3, 17, 42, 8, 23], [60, 2, 2, 2, 9, 31, 77, 4, 50, 12, 1]]
#: qwen3, llama and, with plinth-gemma installed, gemma4 (the conftest's targets)
TARGETS = ("qwen3", "llama") + (("gemma4",) if __import__("importlib.util").util.find_spec("plinth_gemma") else ())
VARIANTS = {
    "anchor-first": dict(),
    "bonus-anchor": dict(sample_from_anchor=False),
    "reduced-vocab": dict(draft_vocab=64),
    "no-conf-head": dict(conf=False, has_confidence_head=False),
    "conf-without-markov": dict(conf_with_markov=False, w2_scale=2.5),
    # Nemotron-3.5-style per-head attention sinks and a per-layer sliding window in the draft backbone
    "sinks-swa": dict(sliding_window=3, swa_pattern=[True, False],
                      extra_tensors={f"blk.{i}.attn_sinks.weight": np.full(4, 0.5 - i, dtype=np.float32)
                                     for i in range(2)}),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_drafter_contract_on_tiny_targets(targets, dspark_file, target, variant):
    from plinth.testing.drafters import check_drafter_contract
    from plinth_dspark.drafter import make_dspark

    path = str(dspark_file(block_size=6, **VARIANTS[variant]))
    model = targets[target]
    stats = check_drafter_contract(model, lambda: make_dspark(model, {"draft": path}), PROMPTS, max_tokens=20,
                                   n_max=6)
    assert all(s.n_drafts > 0 for s in stats)


@pytest.mark.parametrize("p_min", [0.2, 0.5, 0.8])
def test_pruning_never_changes_greedy_output(targets, dspark_file, p_min):
    from plinth.generate import Generator
    from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
    from plinth_dspark.drafter import make_dspark

    model = targets["qwen3"]
    path = str(dspark_file(block_size=7))
    plain = Generator(model).generate(PROMPTS[1], 24)
    dr = make_dspark(model, {"draft": path, "p_min": p_min})
    gen = SpeculativeGenerator(model, [dr], config=SpecConfig(n_max=7, p_min=p_min, verifier="greedy"))
    assert gen.generate(PROMPTS[1], 24) == plain
    assert dr.stats["pruned"] > 0  # the threshold did cut drafts


def test_rejection_sampling_keeps_the_target_distribution(targets, dspark_file):
    """Second generated token: its exact marginal under plain sampling vs draws with --spec dspark (chi-square,
    Wilson-Hilferty threshold at p ~ 0.0005)."""
    import numpy as np

    from plinth.sampling import Sampler, SamplerConfig
    from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
    from plinth.testing.sampling import assert_counts_fit, second_token_marginal
    from plinth_dspark.drafter import make_dspark

    model = targets["qwen3"]
    cfg = SamplerConfig(temperature=1.0, top_k=4)
    prompt = PROMPTS[0]
    s = Sampler(cfg)
    marginal = second_token_marginal(model, s, prompt)
    dr = make_dspark(model, {"draft": str(dspark_file(block_size=4))})
    gen = SpeculativeGenerator(model, [dr], config=SpecConfig(n_max=3, seed=11),
                               sampler=Sampler(SamplerConfig(temperature=1.0, top_k=4, seed=12)))
    counts = np.zeros(model.n_vocab)
    drafted = 0
    for _ in range(400):
        out = gen.generate(prompt, 3)
        counts[out[1]] += 1
        drafted += gen.stats.n_drafted
    assert_counts_fit(counts, marginal)
    assert drafted > 0


def test_lossless_on_a_hybrid_nemotron_h_target(tmp_path):
    """A Mamba-2 / attention / MoE hybrid: rejected drafts are undone by snapshot + replay of the target's
    recurrent state; greedy output and the target cache stay identical to plain decoding."""
    from pathlib import Path

    import plinth_nemotron
    from plinth.model import load_model
    from plinth.testing import load_module, make_registry
    from plinth.testing.drafters import check_drafter_contract
    from plinth_dspark.drafter import make_dspark
    from plinth_dspark.testkit import write_tiny_dspark
    from plinth_nemotron.plugin import plugin

    tiny = load_module(Path(plinth_nemotron.__file__).parents[1] / "tests" / "tiny.py")
    reg = make_registry(plugin)
    md = tiny.metadata("M*EM-E", vocab=True, n_embd=48, top_k=[0, 0, 2, 0, 0, 3], n_ff_exp=[0, 0, 16, 0, 0, 24])
    model = load_model(tiny.write(tmp_path / "hybrid.gguf", reg, md, seed=11), registry=reg)
    assert model.new_context().recurrent
    path = str(write_tiny_dspark(tmp_path / "d.gguf", n_vocab=257, mask_token=255, n_embd=48, n_head=4, n_head_kv=2,
                                 taps=(2, 6), block_size=6))
    for opts in ({}, {"p_min": 0.4}):
        stats = check_drafter_contract(model, lambda: make_dspark(model, {"draft": path, **opts}), PROMPTS,
                                       max_tokens=20, n_max=6)
        assert all(s.n_drafts > 0 for s in stats)


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("anchor_first", [True, False])
def test_lossless_on_smollm2(tmp_path, anchor_first):
    import plinth
    from plinth.generate import Generator
    from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
    from plinth_dspark.drafter import make_dspark
    from plinth_dspark.testkit import write_tiny_dspark

    try:
        model = plinth.load_model("smollm2-135m-instruct")
    except Exception as exc:  # pragma: no cover - offline machine without the cached file
        pytest.skip(f"SmolLM2 not available: {exc}")
    hp = model.hparams
    path = write_tiny_dspark(tmp_path / "dspark.gguf", n_embd=hp.n_embd, n_vocab=model.n_vocab, n_layer=2, n_head=9,
                             n_head_kv=3, n_ff=768, taps=(2, 10, 20, 30), block_size=8, mask_token=0, scale=0.05,
                             rank=32, draft_vocab=4096, sample_from_anchor=anchor_first)
    prompt = model.tokenizer.encode("The capital of France is")
    plain = Generator(model).generate(prompt, 24)
    for p_min in (0.0, 0.5):
        gen = SpeculativeGenerator(model, [make_dspark(model, {"draft": str(path), "p_min": p_min})],
                                   config=SpecConfig(n_max=8, p_min=p_min, verifier="greedy"))
        assert gen.generate(prompt, 24) == plain
        assert gen.stats.n_drafts > 0


def test_cli_generate_with_spec_dspark_and_stats(targets, dspark_file, capsys):
    from plinth.cli import main

    model = str(targets["qwen3"].path)
    draft = str(dspark_file(block_size=6))
    base = ["--plugins", "llama,dflash,dspark", "generate", "hello", "-m", model, "-n", "16", "--temp", "0"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--spec", "dspark", "--draft", draft, "--spec-n-max", "6", "--spec-p-min", "0.3",
                        "--stats"]) == 0
    out = capsys.readouterr()
    assert out.out == plain
    assert "per position [" in out.err
    assert "dspark: pruned positions" in out.err and "mean conf accepted" in out.err and "mean conf rejected" in out.err

"""Greedy output with DFlash / DFlash2 / LiLiCorr drafters equals plain greedy decoding (the drafter contract)."""

from __future__ import annotations

import numpy as np
import pytest

from plinth.testing import CONTRACT_BACKENDS

VARIANTS = ("dflash", "dflash2", "lilicorr")
#: qwen3, llama and, with plinth-gemma installed, gemma4 (the conftest's targets)
TARGETS = ("qwen3", "llama") + (("gemma4",) if __import__("importlib.util").util.find_spec("plinth_gemma") else ())
PROMPTS = [[3, 17, 42, 8, 23], [60, 2, 2, 2, 9, 31, 77, 4, 50, 12, 1]]


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_drafter_contract_on_tiny_targets(targets_on, draft_file, target, variant, backend):
    from plinth.testing.drafters import check_drafter_contract
    from plinth_dflash.drafter import make_dflash

    path = str(draft_file(variant, taps=(1, 2, 3), block_size=6))
    model = targets_on(backend)[target]
    stats = check_drafter_contract(model, lambda: make_dflash(model, {"draft": path}), PROMPTS, max_tokens=20,
                                   n_max=5)
    assert all(s.n_drafts > 0 for s in stats)


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_lossless_with_p_min_n_min_and_swa(targets_on, draft_file, variant, backend):
    from plinth.generate import Generator
    from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
    from plinth_dflash.drafter import make_dflash

    model = targets_on(backend)["qwen3"]
    path = str(draft_file(variant, taps=(3,), sliding_window=3, swa_pattern=[True, False], causal=variant == "lilicorr"))
    plain = Generator(model).generate(PROMPTS[1], 24)
    for cfg in (SpecConfig(n_max=7, p_min=0.3, verifier="greedy"), SpecConfig(n_max=7, n_min=3, verifier="greedy")):
        dr = make_dflash(model, {"draft": path, "p_min": cfg.p_min, "n_min": cfg.n_min})
        gen = SpeculativeGenerator(model, [dr], config=cfg)
        assert gen.generate(PROMPTS[1], 24) == plain


def test_accept_paths_with_a_perfect_draft(targets, draft_file):
    """Long accepts: a draft whose every token the target takes (its head forced to the target's greedy choice)
    keeps the caches right through full acceptances."""
    from plinth.generate import Generator
    from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
    from plinth_dflash.drafter import make_dflash

    model = targets["qwen3"]
    prompt = PROMPTS[0]
    plain = Generator(model).generate(prompt, 30)
    dr = make_dflash(model, {"draft": str(draft_file("dflash", taps=(1, 3)))})
    seq_tokens = prompt + plain
    real_draft = dr.draft

    def oracle_draft(seq, n_max, *, history, pos):
        d = real_draft(seq, n_max, history=history, pos=pos)  # runs the block (cache hygiene is exercised)
        g = len(history) - len(prompt)
        from plinth.speculative.base import Draft

        return Draft(tokens=tuple(plain[g:g + len(d)]), confidences=d.confidences)

    dr.draft = oracle_draft
    gen = SpeculativeGenerator(model, [dr], config=SpecConfig(n_max=7, verifier="greedy"))
    assert gen.generate(prompt, 30) == plain
    assert gen.stats.acceptance_rate > 0.9
    assert dr.cache.positions(0).size == 0 or dr.cache.positions(0).max() < len(seq_tokens)


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_lossless_on_smollm2(tmp_path, variant):
    import plinth
    from plinth.generate import Generator
    from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
    from plinth_dflash.drafter import make_dflash
    from plinth_dflash.testkit import write_tiny_draft

    try:
        model = plinth.load_model("smollm2-135m-instruct")
    except Exception as exc:  # pragma: no cover - offline machine without the cached file
        pytest.skip(f"SmolLM2 not available: {exc}")
    hp = model.hparams
    path = write_tiny_draft(tmp_path / f"{variant}.gguf", variant, n_embd=hp.n_embd, n_vocab=model.n_vocab, n_layer=2,
                            n_head=9, n_head_kv=3, n_ff=768, taps=(2, 10, 20, 30), block_size=8, mask_token=0,
                            conv_group=16, selector_top_k=8, scale=0.05)
    prompt = model.tokenizer.encode("The capital of France is")
    plain = Generator(model).generate(prompt, 24)
    gen = SpeculativeGenerator(model, [make_dflash(model, {"draft": str(path)})],
                               config=SpecConfig(n_max=7, verifier="greedy"))
    assert gen.generate(prompt, 24) == plain
    assert gen.stats.n_drafts > 0


def test_cli_generate_with_spec_dflash(targets, draft_file, capsys):
    from plinth.cli import main

    model = str(targets["qwen3"].path)
    draft = str(draft_file("dflash2", taps=(1, 3)))
    base = ["--plugins", "llama,dflash", "generate", "hello", "-m", model, "-n", "12", "--temp", "0"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--spec", "dflash", "--draft", draft, "--spec-n-max", "5"]) == 0
    assert capsys.readouterr().out == plain

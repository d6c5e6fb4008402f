"""Speculative decoding on hybrid Nemotron-H targets is lossless.

The Mamba-2 states cannot be cropped, so a partly rejected verify batch is undone by the
engine's snapshot / restore of the recurrent state plus a replay of the kept rows. Greedy
output with the ``ngram`` drafter, the oracle drafter and an oracle that errs at a moving
position (so every accept length occurs) is byte-identical to plain greedy decoding, and the
target's cache (KV rows, conv and SSM states) afterwards equals plain decoding's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.generate import Generator
from plinth.speculative.base import BaseDrafter, Draft
from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
from plinth.speculative.ngram import NgramDrafter
from plinth.testing.drafters import OracleDrafter, RandomDrafter, check_drafter_contract
from plinth.testing import CONTRACT_BACKENDS, load_module


tiny = load_module(Path(__file__).parent / "tiny.py")
N_MAX = 5
MAX_TOKENS = 28


class Recorded(BaseDrafter):
    """Wraps a drafter and records (drafted, accepted) per verify step."""

    def __init__(self, inner):
        self.inner = inner
        self.name = f"recorded-{inner.name}"
        self.steps: list[tuple[int, int]] = []
        self._k = 0

    def requirements(self):
        return self.inner.requirements()

    def begin(self, seq, prompt_ids):
        self.inner.begin(seq, prompt_ids)

    def process(self, target_output):
        self.inner.process(target_output)

    def draft(self, seq, n_max, *, history, pos):
        d = self.inner.draft(seq, n_max, history=history, pos=pos)
        self._k = len(d) if d is not None else 0
        return d

    def accept(self, seq, n_accepted):
        if self._k:
            self.steps.append((self._k, n_accepted))
        self.inner.accept(seq, n_accepted)


class FaultyOracle(OracleDrafter):
    """The target's own continuation with one token wrong, at a position that moves every step."""

    name = "faulty-oracle"

    def __init__(self, model, **kw):
        super().__init__(model, **kw)
        self.step = 0

    def draft(self, seq, n_max, *, history, pos):
        d = super().draft(seq, n_max, history=history, pos=pos)
        toks = list(d.tokens)
        if toks:
            j = self.step % (len(toks) + 1)  # j == len: no error this step (a full accept)
            if j < len(toks):
                toks[j] = (toks[j] + 1) % self.model.n_vocab
        self.step += 1
        return Draft(tokens=tuple(toks))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from plinth.model import load_model
    from plinth.testing import make_registry
    from plinth_nemotron.plugin import plugin

    reg = make_registry(plugin)
    md = tiny.metadata("M*EM-E", vocab=True, n_embd=48, top_k=[0, 0, 2, 0, 0, 3], n_ff_exp=[0, 0, 16, 0, 0, 24],
                       latent=[0, 0, 0, 0, 0, 16])
    path = tiny.write(tmp_path_factory.mktemp("spec") / "hybrid.gguf", reg, md, seed=11)
    model = load_model(path, registry=reg)
    assert model.new_context().recurrent and set(model.hparams.pattern) == set("M*E-")
    return model


@pytest.fixture(scope="module")
def targets_on(target):
    """``targets_on(backend)``: the hybrid target on "numpy", or the same file on the strict device stand-in."""
    from plinth.model import load_model
    from plinth.testing import make_registry
    from plinth_nemotron.plugin import plugin

    strict = []

    def get(backend):
        if backend == "numpy":
            return target
        if not strict:
            strict.append(load_model(target.path, backend="strict", registry=make_registry(plugin)))
        return strict[0]

    return get


def prompts():
    rng = np.random.default_rng(7)
    motif = rng.integers(0, 256, 5).tolist()
    return [motif * 4 + [motif[0]], rng.integers(0, 256, 11).tolist()]


def run_contract(target, factory):
    made = []

    def make():
        made.append(Recorded(factory()))
        return made[-1]

    stats = check_drafter_contract(target, make, prompts(), max_tokens=MAX_TOKENS, n_max=N_MAX)
    steps = [s for d in made for s in d.steps]
    return stats, steps


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
def test_ngram_drafter_is_lossless_with_partial_acceptances(targets_on, backend):
    target = targets_on(backend)
    stats, steps = run_contract(target, lambda: NgramDrafter(n_match_max=3, n_match_min=1, n_draft=N_MAX))
    assert sum(s.n_drafts for s in stats) > 0
    assert any(0 < a < k for k, a in steps), f"no partial acceptance exercised: {steps}"


def test_oracle_drafter_is_lossless_and_fully_accepted(target):
    stats, steps = run_contract(target, lambda: OracleDrafter(target, horizon=MAX_TOKENS + 8, n_draft=N_MAX))
    assert steps and all(a == k for k, a in steps)
    assert all(s.n_steps < MAX_TOKENS for s in stats)  # several tokens per target forward


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
def test_faulty_oracle_exercises_every_accept_length(targets_on, backend):
    target = targets_on(backend)
    stats, steps = run_contract(target, lambda: FaultyOracle(target, horizon=MAX_TOKENS + 8, n_draft=N_MAX))
    lengths = {a for k, a in steps if k == N_MAX}
    assert {0, 1, 2, 3, 4, N_MAX} <= lengths, steps  # every partial acceptance, and full ones
    assert any(0 < a < k for k, a in steps)


def test_random_drafter_rejections_are_lossless(target):
    stats, steps = run_contract(target, lambda: RandomDrafter(target.n_vocab, length=3, seed=1))
    assert steps and sum(a for _, a in steps) < sum(k for k, _ in steps)


def test_output_bytes_identical_with_and_without_speculation(target):
    prompt = prompts()[0]
    plain = Generator(target).generate(prompt, MAX_TOKENS)
    tok = target.tokenizer
    for drafter in (NgramDrafter(n_draft=N_MAX), FaultyOracle(target, horizon=MAX_TOKENS + 8, n_draft=N_MAX)):
        gen = SpeculativeGenerator(target, [drafter], config=SpecConfig(n_max=N_MAX, verifier="greedy"))
        spec = gen.generate(prompt, MAX_TOKENS)
        assert tok.decode_bytes(spec) == tok.decode_bytes(plain)
        assert gen.stats.rollback_s >= 0.0

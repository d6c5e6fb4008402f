"""Speculative decoding: verification rules, the engine, built-in drafters, rollback, metrics, CLI."""

from __future__ import annotations

import math

import numpy as np
import pytest

import plinth
from plinth.graph import KV, Batch, Cache, Recurrent
from plinth.errors import UserError
from plinth.generate import Generator
from plinth.sampling import Sampler, SamplerConfig
from plinth.speculative.base import BaseDrafter, Draft, DrafterRequirements, VocabInfo
from plinth.speculative.draft_model import DraftModelDrafter
from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
from plinth.speculative.ngram import NgramDrafter, lookup
from plinth.speculative.verify import GreedyVerifier, RejectionVerifier, VerifyResult
from plinth.testing import CONTRACT_BACKENDS, byte_vocab, tiny_metadata, write_synthetic_gguf
from plinth.testing.drafters import OracleDrafter, RandomDrafter, assert_caches_equal, check_drafter_contract
from plinth.testing.recurrent import recurrent_plugin, write_toy_recurrent

PROMPTS = [list(b"abcabcabc hello hello"), list(b"the cat sat on the mat; the cat"), list(b"0123 0123 01")]


@pytest.fixture(scope="module")
def registry():
    from plinth.testing import make_registry
    from plinth_llama.plugin import plugin

    return make_registry(plugin, recurrent_plugin())


@pytest.fixture(scope="module")
def tiny(registry, tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "tiny-llama.gguf"
    md = tiny_metadata("llama", n_vocab=257) | byte_vocab()
    return plinth.load_model(write_synthetic_gguf(path, "llama", md, registry, seed=4), registry=registry)


@pytest.fixture(scope="module")
def tiny_qwen3(registry, tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "tiny-qwen3.gguf"
    md = tiny_metadata("qwen3", n_vocab=257, n_layer=3) | byte_vocab()
    return plinth.load_model(write_synthetic_gguf(path, "qwen3", md, registry, seed=7), registry=registry)


@pytest.fixture(scope="module")
def recurrent(registry, tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "toy-recurrent.gguf"
    return plinth.load_model(write_toy_recurrent(path, seed=3), registry=registry)


@pytest.fixture(scope="module")
def on_backend(registry):
    """``on_backend(model, backend)``: the same file loaded on ``backend`` ("numpy": the model itself)."""
    loaded = {}

    def get(model, backend):
        if backend == "numpy":
            return model
        key = (str(model.path), backend)
        if key not in loaded:
            loaded[key] = plinth.load_model(model.path, backend=backend, registry=registry)
        return loaded[key]

    return get


def chi2_threshold(df: int, z: float = 3.29) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 3.29 is about p = 0.0005."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    keep = probs * n >= 5  # pool the rare cells
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep] * n, probs[~keep].sum() * n)
    ok = exp > 0
    return float(((obs[ok] - exp[ok]) ** 2 / exp[ok]).sum()), int(ok.sum() - 1)


# ---------------------------------------------------------------------------- verification rules


def test_greedy_rule_accepts_the_matching_prefix_and_corrects():
    v = GreedyVerifier.verify_argmax
    assert v([4, 5, 6], [4, 5, 9, 1]) == VerifyResult(2, 9)
    assert v([4, 5], [4, 5, 7]) == VerifyResult(2, 7)  # all accepted: the bonus token
    assert v([], [3]) == VerifyResult(0, 3)
    p = np.eye(6)[[4, 2, 1]]
    r = GreedyVerifier().verify([4, 3], None, p, None)
    assert (r.n_accepted, r.next_token) == (1, 2)


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_rule_emits_tokens_distributed_as_the_target(with_q):
    rng = np.random.default_rng(0)
    p = np.array([[0.4, 0.3, 0.2, 0.1, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1, 0.3, 0.3]])
    q = np.array([[0.1, 0.1, 0.5, 0.1, 0.1, 0.1]])
    counts = np.zeros(6)
    accepted = 0
    n = 20000
    v = RejectionVerifier()
    for _ in range(n):
        d = int(rng.choice(6, p=q[0])) if with_q else int(rng.choice(6, p=[0.25, 0.25, 0.25, 0.25, 0, 0]))
        r = v.verify([d], q if with_q else None, p, rng)
        first = d if r.n_accepted == 1 else r.next_token
        counts[first] += 1
        accepted += r.n_accepted
    stat, df = chi2(counts, p[0])
    assert stat < chi2_threshold(df), (counts / n, p[0])
    # acceptance probability is sum_x min(p, q)
    expect = np.minimum(p[0], q[0]).sum() if with_q else (p[0][:4] * 0.25).sum()
    assert abs(accepted / n - expect) < 0.02


def test_rejection_rule_never_accepts_a_token_the_target_excludes():
    rng = np.random.default_rng(1)
    p = np.array([[0.0, 1.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    for _ in range(200):
        r = RejectionVerifier().verify([0], None, p, rng)
        assert (r.n_accepted, r.next_token) == (0, 1)


# ---------------------------------------------------------------------------- ngram lookup


def test_ngram_lookup_prefers_long_and_recent_matches():
    h = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert lookup(h, 3, n_match_max=2) == [7, 8, 5]  # "2 3" most recently followed by 7 8 5
    assert lookup(h, 3, n_match_max=2, search="first") == [9, 1, 2]
    assert lookup([1, 2, 3, 4], 4) == []  # nothing repeats
    assert lookup([5, 5], 4) == [5]
    assert lookup([4], 4) == []


def test_ngram_drafter_limits_and_requirements():
    d = NgramDrafter(n_match_max=2, n_draft=3)
    assert d.requirements().max_draft == 3
    assert d.draft(0, 2, history=[1, 2, 3, 1, 2], pos=4).tokens == (3, 1)
    with pytest.raises(ValueError):
        NgramDrafter(n_match_max=1, n_match_min=2)


# ---------------------------------------------------------------------------- engine: lossless greedy


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
@pytest.mark.parametrize("verifier", ["greedy", "rejection"])
@pytest.mark.parametrize("model_name", ["tiny", "tiny_qwen3", "recurrent"])
@pytest.mark.parametrize("drafter", ["ngram", "oracle", "random"])
def test_greedy_output_is_identical_with_every_drafter(request, on_backend, model_name, drafter, verifier, backend):
    model = on_backend(request.getfixturevalue(model_name), backend)
    make = {
        "ngram": lambda: NgramDrafter(),
        "oracle": lambda: OracleDrafter(model, taps=(0, model.hparams.n_layer)),
        "random": lambda: RandomDrafter(model.n_vocab, length=3, seed=5),
    }[drafter]
    stats = check_drafter_contract(model, make, PROMPTS, max_tokens=24, n_max=4, verifier=verifier)
    total = sum(s.n_drafted for s in stats)
    accepted = sum(s.n_accepted for s in stats)
    if drafter == "oracle":
        assert total > 0 and accepted == total  # the target's own continuation is always kept
    if drafter == "random":
        assert total > 0 and accepted / total < 0.2
        assert any(0 < s.n_accepted or s.histogram.get(0) for s in stats)  # rejections happened


@pytest.mark.parametrize("backend", CONTRACT_BACKENDS)
def test_partial_acceptances_roll_back_recurrent_state(on_backend, recurrent, backend):
    """A drafter right for the first two tokens, wrong after: every step is a partial accept."""
    recurrent = on_backend(recurrent, backend)
    plain = Generator(recurrent).generate(PROMPTS[0], 20)

    class HalfRight(OracleDrafter):
        def draft(self, seq, n_max, *, history, pos):
            good = super().draft(seq, n_max, history=history, pos=pos).tokens
            return Draft(tokens=good[:2] + tuple((t + 1) % 256 for t in good[2:]))

    gen = SpeculativeGenerator(recurrent, [HalfRight(recurrent)], config=SpecConfig(n_max=5))
    assert gen.generate(PROMPTS[0], 20) == plain
    st = gen.stats
    assert st.n_drafts > 0 and set(st.histogram) == {2}  # always exactly two accepted
    ref = recurrent.new_context()
    ref.decode(PROMPTS[0])
    for t in plain[:-1]:
        ref.decode([t])
    assert_caches_equal(gen.context.cache, ref.cache)


def test_draft_model_drafter_is_lossless_and_agrees_with_itself(tiny, registry, tmp_path):
    # the same weights as the drafter: every draft is accepted
    st = check_drafter_contract(tiny, lambda: DraftModelDrafter(tiny, n_draft=4), PROMPTS[:2], max_tokens=20)
    assert all(s.n_accepted == s.n_drafted > 0 for s in st)
    # another model with the same vocabulary: lossless, partial acceptance
    md = tiny_metadata("llama", n_vocab=257, n_embd=32, n_head=2, n_head_kv=1) | byte_vocab()
    small = plinth.load_model(write_synthetic_gguf(tmp_path / "small.gguf", "llama", md, registry, seed=9),
                              registry=registry)
    check_drafter_contract(tiny, lambda: DraftModelDrafter(small, n_draft=4), PROMPTS, max_tokens=20)


# ---------------------------------------------------------------------------- engine: sampling


def test_rejection_sampled_output_has_the_plain_sampling_distribution(tiny):
    """Second generated token: its exact marginal under plain sampling vs speculative draws (chi-square)."""
    cfg = SamplerConfig(temperature=1.0, top_k=4)
    prompt = list(b"ab")
    s = Sampler(cfg)
    ctx = tiny.new_context()
    p1 = s.probs(ctx.decode(prompt).logits[-1], prompt)
    marginal = np.zeros(tiny.n_vocab)
    for t1 in np.nonzero(p1)[0]:
        c = tiny.new_context()
        c.decode(prompt)
        marginal += p1[t1] * s.probs(c.decode([int(t1)]).logits[-1], prompt + [int(t1)])
    draft_cfg = SamplerConfig(temperature=1.6, top_k=6)  # a different q: accepts and rejections
    drafter = DraftModelDrafter(tiny, draft_cfg, n_draft=2)
    gen = SpeculativeGenerator(tiny, [drafter], config=SpecConfig(n_max=2, seed=11),
                               sampler=Sampler(SamplerConfig(temperature=1.0, top_k=4, seed=12)))
    counts = np.zeros(tiny.n_vocab)
    n = 500
    drafted = accepted = 0
    for _ in range(n):
        out = gen.generate(prompt, 3)
        counts[out[1]] += 1
        drafted += gen.stats.n_drafted
        accepted += gen.stats.n_accepted
    stat, df = chi2(counts, marginal)
    assert stat < chi2_threshold(df), stat
    assert 0 < accepted < drafted  # both branches of the rule ran


def test_same_distribution_drafts_are_always_accepted(tiny):
    cfg = SamplerConfig(temperature=0.9, top_k=5, seed=3)
    gen = SpeculativeGenerator(tiny, [DraftModelDrafter(tiny, attrs_evolve(cfg, seed=4), n_draft=4)],
                               config=SpecConfig(n_max=4, seed=5), sampler=cfg)
    gen.generate(PROMPTS[1], 20)
    assert gen.stats.n_drafted > 0 and gen.stats.n_accepted == gen.stats.n_drafted


def attrs_evolve(cfg, **kw):
    import attrs

    return attrs.evolve(cfg, **kw)


def test_greedy_rule_with_temperature_is_refused(tiny):
    with pytest.raises(UserError, match="rejection"):
        SpeculativeGenerator(tiny, [NgramDrafter()], config=SpecConfig(verifier="greedy"),
                             sampler=SamplerConfig(temperature=0.7))


# ---------------------------------------------------------------------------- controls and metrics


class Scripted(BaseDrafter):
    """Proposes a fixed draft with given confidences."""

    def __init__(self, name, tokens, conf=None, max_draft=None):
        self.name, self.tokens, self.conf, self.max_draft = name, tuple(tokens), conf, max_draft
        self.calls = []

    def requirements(self):
        return DrafterRequirements(max_draft=self.max_draft)

    def draft(self, seq, n_max, *, history, pos):
        self.calls.append(n_max)
        return Draft(tokens=self.tokens[:n_max], confidences=None if self.conf is None else self.conf[:n_max])


def test_n_max_p_min_n_min_and_drafter_order(tiny):
    d = Scripted("s", [1, 2, 3, 4, 5, 6], conf=np.array([0.9, 0.8, 0.3, 0.9, 0.9, 0.9]), max_draft=5)
    gen = SpeculativeGenerator(tiny, [d], config=SpecConfig(n_max=8, p_min=0.5))
    gen.generate(PROMPTS[0], 30)
    assert d.calls and max(d.calls) == 5  # clamped to the drafter's limit
    assert set(gen.stats.by_drafter) == {"s"}
    assert len(gen.stats.accepted_per_pos) == 2  # every draft cut at the first confidence below 0.5
    # n_min drops the 2-token drafts entirely; the next drafter in order takes the step
    d2 = Scripted("t", [7, 7, 7])
    gen = SpeculativeGenerator(tiny, [d, d2], config=SpecConfig(n_max=8, p_min=0.5, n_min=3))
    plain = Generator(tiny).generate(PROMPTS[0], 10)
    assert gen.generate(PROMPTS[0], 10) == plain
    assert set(gen.stats.by_drafter) == {"t"} and len(gen.stats.accepted_per_pos) == 3


def test_metrics_definitions(tiny):
    gen = SpeculativeGenerator(tiny, [OracleDrafter(tiny)], config=SpecConfig(n_max=3))
    out = gen.generate(PROMPTS[2], 13)
    st = gen.stats
    assert len(out) == st.n_generated == 13
    assert st.acceptance_rate == 1.0 and st.tau == 4.0  # 1 + 3 accepted per draft
    assert st.per_position == [1.0, 1.0, 1.0]
    d = st.as_dict()
    assert d["tau"] == 4.0 and d["histogram"] == {3: st.n_drafts}
    assert "tau 4.00" in st.summary() and st.decode_s >= st.verify_s > 0


def test_synthetic_acceptance_mode(tiny):
    for rate, check in ((0.0, lambda s: s.n_accepted == 0), (1.0, lambda s: s.n_accepted == s.n_drafted)):
        gen = SpeculativeGenerator(tiny, [RandomDrafter(tiny.n_vocab, length=4)],
                                   config=SpecConfig(n_max=4, synthetic_accept=rate))
        gen.generate(PROMPTS[0], 21)
        assert gen.stats.synthetic and gen.stats.n_drafts > 0 and check(gen.stats)
        assert "SYNTHETIC" in gen.stats.summary()
    gen = SpeculativeGenerator(tiny, [RandomDrafter(tiny.n_vocab, length=8)],
                               config=SpecConfig(n_max=8, synthetic_accept=0.7, seed=1))
    gen.generate(PROMPTS[0], 400)
    assert abs(gen.stats.per_position[0] - 0.7) < 0.1


def test_budget_is_never_exceeded(tiny):
    for n in (1, 2, 5, 9):
        gen = SpeculativeGenerator(tiny, [OracleDrafter(tiny)], config=SpecConfig(n_max=4))
        assert len(gen.generate(PROMPTS[0], n)) == n


# ---------------------------------------------------------------------------- compatibility checks


class Needs(BaseDrafter):
    name = "needs"

    def __init__(self, **req):
        self.req = DrafterRequirements(**req)

    def requirements(self):
        return self.req

    def draft(self, seq, n_max, *, history, pos):
        return Draft()


def test_incompatible_drafters_are_refused_with_the_mismatch(tiny):
    n_layer = tiny.hparams.n_layer
    with pytest.raises(UserError, match=rf"taps \[{n_layer + 1}\].*0\.\.{n_layer}"):
        SpeculativeGenerator(tiny, [Needs(taps=(1, n_layer + 1))])
    with pytest.raises(UserError, match="hidden size 576.*n_embd = 64"):
        SpeculativeGenerator(tiny, [Needs(n_embd=576, shares_head=True)])
    with pytest.raises(UserError, match="vocabulary of 300 tokens"):
        SpeculativeGenerator(tiny, [Needs(vocab=VocabInfo(n_vocab=300))])
    with pytest.raises(UserError, match="eos_id 3"):
        SpeculativeGenerator(tiny, [Needs(vocab=VocabInfo(n_vocab=257, eos_id=3))])
    toks = list(VocabInfo.of_model(tiny).tokens)
    toks[65] = "X"
    with pytest.raises(UserError, match="token 65"):
        SpeculativeGenerator(tiny, [Needs(vocab=VocabInfo(n_vocab=257, tokens=tuple(toks)))])


def test_taps_reach_the_drafter(tiny):
    d = OracleDrafter(tiny, taps=(1, tiny.hparams.n_layer))
    SpeculativeGenerator(tiny, [d], config=SpecConfig(n_max=2)).generate(PROMPTS[0], 8)
    assert d.seen_phases[0] == "prefill" and "verify" in d.seen_phases
    assert len(d.accepted) == d.seen_phases.count("verify")


# ---------------------------------------------------------------------------- cache snapshot / restore


def test_snapshot_restore_and_state_rules():
    c = Cache(2, np, [(KV(),), (Recurrent(),)])
    k = np.ones((3, 1, 2), np.float32)
    with c.forward(Batch.from_tokens([0, 0, 0])):
        c.kv(0).update(0, np.arange(3), k, k)
        c.state(1).set(0, np.zeros(4, np.float32))
    snap = c.snapshot(0)
    with c.forward(Batch.from_tokens([0, 0], start=3)):
        c.kv(0).update(0, np.arange(3, 5), k[:2] * 2, k[:2] * 2)
        c.state(1).set(0, np.ones(4, np.float32))
    assert c.n_cached(0) == 5 and c.state(1).get(0).sum() == 4
    with pytest.raises(ValueError, match="recurrent state"):
        c.seq_rm(0, 3)
    c.restore(snap)
    assert c.n_cached(0) == 3 and c.state(1).get(0).sum() == 0 and c.next_position(0) == 3
    c.seq_cp(0, 1)
    assert c.state(1).holds(1) and c.n_cached(1) == 3
    c.seq_rm(1)  # removing everything is allowed
    assert c.n_cached(1) == 0 and not c.holds_state(1) and c.next_position(1) == 0
    with pytest.raises(ZeroDivisionError):  # pending state is dropped by a failed forward
        with c.forward(Batch.from_tokens([0], start=3)):
            c.state(1).set(0, np.full(4, 7, np.float32))
            1 / 0
    assert c.state(1).get(0).sum() == 0 and c.next_position(0) == 3


# ---------------------------------------------------------------------------- registry and CLI


def test_builtin_drafters_and_verifiers_are_registered(tiny):
    from plinth.plugins import discover

    reg = discover(entry_points=[])
    assert {"ngram", "draft"} <= set(reg.names("drafters"))
    assert {"greedy", "rejection"} <= set(reg.names("verifiers"))
    assert reg.make_verifier("rejection").name == "rejection"
    d = reg.make_drafter("ngram", tiny, {"n_max": 5, "ngram_max": 4})
    assert d.n_match_max == 4 and d.requirements().max_draft == 5
    with pytest.raises(UserError, match="--draft"):
        reg.make_drafter("draft", tiny, {})


def test_cli_generate_with_spec_prints_the_same_text_and_metrics(tmp_path, registry, capsys):
    from plinth.cli import main

    md = tiny_metadata("llama", n_vocab=257) | byte_vocab()
    path = write_synthetic_gguf(tmp_path / "cli.gguf", "llama", md, registry, seed=4)
    assert main(["generate", "-m", str(path), "abcabc abcabc", "-n", "24"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", "-m", str(path), "abcabc abcabc", "-n", "24", "--spec", "ngram,draft",
                 "--draft", str(path), "--spec-n-max", "3", "--stats"]) == 0
    out = capsys.readouterr()
    assert out.out == plain
    assert "tau" in out.err and "drafted tokens accepted" in out.err
    with pytest.raises(SystemExit) as exc:  # refused at parse time, before the model loads
        main(["generate", "-m", str(path), "x", "--spec", "nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "drafter 'nope'" in err and "draft, " in err and "ngram" in err


@pytest.mark.parametrize("model_name", ["tiny", "recurrent"])
def test_rows_after_an_accepted_end_of_generation_token_are_dropped(request, model_name):
    model = request.getfixturevalue(model_name)
    eog = 256
    d = Scripted("eog", [65, eog, 66, 67])
    gen = SpeculativeGenerator(model, [d], config=SpecConfig(n_max=4, synthetic_accept=1.0))
    out = gen.generate(PROMPTS[0], 20)
    assert gen.stats.stop_reason == "end of generation token"
    assert out[-1] == 65 and eog not in out
    assert gen.context.cache.next_position(0) == len(PROMPTS[0]) + len(out)
    ref = model.new_context()
    ref.decode(PROMPTS[0] + out)
    assert_caches_equal(gen.context.cache, ref.cache)

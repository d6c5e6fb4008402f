"""plinth.sampling: exact distributions (checked by chi-square), greedy, penalty, seeding."""

from __future__ import annotations

import math

import numpy as np
import pytest

from plinth.sampling import Sampler, SamplerConfig, apply_repetition_penalty

LOGITS = np.array([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.4, -1.0, -1.3, -2.0, 0.7, 1.1], dtype=np.float32)


# ---------------------------------------------------------------- independent reference


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Straight from the definitions, with plain Python loops over a sorted list."""
    x = [float(v) for v in logits]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    kept = order[:top_k] if top_k > 0 else order
    if top_p < 1.0:
        z = sum(math.exp(x[i]) for i in kept)
        acc, out = 0.0, []
        for i in kept:
            out.append(i)
            acc += math.exp(x[i]) / z
            if acc >= top_p:
                break
        kept = out
    if min_p > 0.0:
        z = sum(math.exp(x[i]) for i in kept)
        pmax = math.exp(x[kept[0]]) / z
        kept = [i for i in kept if math.exp(x[i]) / z >= min_p * pmax]
    z = sum(math.exp(x[i] / temperature) for i in kept)
    p = [0.0] * len(x)
    for i in kept:
        p[i] = math.exp(x[i] / temperature) / z
    return np.array(p)


def chi2_critical(df: int, alpha: float = 0.001) -> float:
    try:
        from scipy.stats import chi2

        return float(chi2.ppf(1 - alpha, df))
    except ImportError:  # Wilson-Hilferty; z for upper 0.001 tail
        z = 3.090232306167813
        return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.8),
    dict(top_k=4),
    dict(top_p=0.8),
    dict(min_p=0.3),
    dict(temperature=0.8, top_k=8, top_p=0.9, min_p=0.1),
    dict(temperature=1.3, top_k=6, min_p=0.2),
    dict(temperature=1.3, top_k=1),  # one token survives: every draw must be the argmax
    dict(min_p=0.95),  # the same through min-p
]


@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_probs_match_reference(kw):
    s = Sampler(SamplerConfig(seed=0, **kw))
    p = s.probs(LOGITS)
    ref = reference_probs(LOGITS, **kw)
    np.testing.assert_allclose(p, ref, rtol=1e-9, atol=1e-12)
    assert p.dtype == np.float64 and abs(p.sum() - 1) < 1e-12


@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_chi_square(kw):
    n = 20000
    s = Sampler(SamplerConfig(seed=1234, **kw))
    counts = np.zeros(len(LOGITS), dtype=np.int64)
    for _ in range(n):
        r = s.sample(LOGITS)
        counts[r.token] += 1
    expected = reference_probs(LOGITS, **kw) * n
    kept = expected > 0
    assert counts[~kept].sum() == 0, "drew a token the filters removed"
    df = int(kept.sum()) - 1
    if df == 0:  # a single survivor: nothing for a chi-square to test, but every draw must be that token
        assert np.nonzero(kept)[0].tolist() == [int(np.argmax(LOGITS))]
        assert counts[int(np.argmax(LOGITS))] == n
    else:
        stat = float((((counts[kept] - expected[kept]) ** 2) / expected[kept]).sum())
        assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df}"


def test_wilson_hilferty_close_to_scipy():
    scipy = pytest.importorskip("scipy.stats")
    for df in (3, 7, 11, 50):
        z = 3.090232306167813
        wh = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
        assert abs(wh - scipy.chi2.ppf(0.999, df)) / scipy.chi2.ppf(0.999, df) < 0.02


def test_greedy_is_argmax_one_hot():
    rng = np.random.default_rng(0)
    s = Sampler(SamplerConfig(temperature=0, top_k=3, top_p=0.5))
    for _ in range(20):
        x = rng.normal(size=1000).astype(np.float32)
        r = s.sample(x)
        assert r.token == int(np.argmax(x))
        assert r.probs[r.token] == 1.0 and r.probs.sum() == 1.0


def test_reproducible_with_seed():
    cfg = SamplerConfig(seed=42, temperature=1.2, top_k=10)
    a = [Sampler(cfg).sample(LOGITS).token for _ in range(1)]
    s1, s2 = Sampler(cfg), Sampler(cfg)
    t1 = [s1.sample(LOGITS).token for _ in range(200)]
    t2 = [s2.sample(LOGITS).token for _ in range(200)]
    assert t1 == t2 and a[0] == t1[0]
    s3 = Sampler(SamplerConfig(seed=43, temperature=1.2, top_k=10))
    assert [s3.sample(LOGITS).token for _ in range(200)] != t1


def test_repetition_penalty():
    x = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    y = apply_repetition_penalty(x, [0, 1, 1], penalty=2.0, last_n=64)
    np.testing.assert_allclose(y, [1.0, -2.0, 0.5, 3.0])
    assert x[0] == 2.0  # input untouched
    # only the last n tokens count
    y = apply_repetition_penalty(x, [0, 1, 3], penalty=2.0, last_n=1)
    np.testing.assert_allclose(y, [2.0, -1.0, 0.5, 1.5])
    # greedy flips away from a penalised token
    s = Sampler(SamplerConfig(temperature=0, repetition_penalty=4.0))
    assert s.sample(x).token == 3
    assert s.sample(x, history=[3]).token == 0
    # sampling: penalised token loses mass
    s = Sampler(SamplerConfig(repetition_penalty=1.5))
    assert s.probs(LOGITS, history=[0])[0] < Sampler(SamplerConfig()).probs(LOGITS)[0]
    assert apply_repetition_penalty(x, None, 2.0, 64) is x


def test_probs_sum_to_one_large_vocab():
    rng = np.random.default_rng(1)
    x = (rng.normal(size=262144) * 4).astype(np.float32)
    for kw in SETTINGS:
        p = Sampler(SamplerConfig(**kw)).probs(x, history=rng.integers(0, 262144, 100))
        assert p.shape == (262144,) and abs(p.sum() - 1) < 1e-9 and (p >= 0).all()


def test_invalid_config():
    with pytest.raises(ValueError):
        SamplerConfig(top_p=1.5)
    with pytest.raises(ValueError):
        SamplerConfig(temperature=-1)
    with pytest.raises(ValueError):
        SamplerConfig(repetition_penalty=0)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.999])
def test_top_p_partial_sort_matches_full_sort(top_p):
    rng = np.random.default_rng(7)
    x = (rng.normal(size=50000) * 2).astype(np.float32)
    p = Sampler(SamplerConfig(top_p=top_p)).probs(x)
    x64 = x.astype(np.float64)
    order = np.argsort(-x64, kind="stable")
    e = np.exp(x64[order] - x64.max())
    cum = np.cumsum(e) / e.sum()
    cut = int(np.searchsorted(cum, top_p)) + 1
    ref = np.zeros_like(x64)
    ref[order[:cut]] = e[:cut] / e[:cut].sum()
    np.testing.assert_allclose(p, ref, rtol=1e-9, atol=1e-15)


def test_sample_consistent_with_probs():
    x = np.random.default_rng(3).normal(size=5000).astype(np.float32)
    cfg = SamplerConfig(seed=5, temperature=0.9, top_k=50, top_p=0.9, min_p=0.02)
    s = Sampler(cfg)
    for _ in range(50):
        r = s.sample(x)
        np.testing.assert_array_equal(r.probs, Sampler(cfg).probs(x))
        assert r.probs[r.token] > 0


@pytest.mark.parametrize("cfg", [dict(temperature=0.0), dict(temperature=0.8, seed=3),
                                 dict(temperature=1.2, top_k=5, seed=4),
                                 dict(temperature=0.7, top_p=0.9, min_p=0.05, seed=5),
                                 dict(temperature=0.0, repetition_penalty=1.3)])
def test_token_is_the_sampled_token_with_the_same_draws(cfg):
    """``Sampler.token`` (what decode loops call) picks what ``sample(...).token`` picks from the same
    seeded generator, step after step, without building the whole distribution."""
    rng = np.random.default_rng(0)
    a, b = Sampler(SamplerConfig(**cfg)), Sampler(SamplerConfig(**cfg))
    history = [1, 2, 3]
    for _ in range(50):
        logits = rng.standard_normal(300).astype(np.float32) * 3
        t = a.token(logits, history)
        assert t == b.sample(logits, history).token
        history.append(t)


@pytest.mark.parametrize("cfg", [dict(temperature=0.7), dict(temperature=0.3), dict(temperature=1.0, logit_bias={5: 3.0}),
                                 dict(temperature=0.8, frequency_penalty=0.5, presence_penalty=0.3),
                                 dict(temperature=0.9, repetition_penalty=1.1), dict(temperature=1.3, top_p=0.9),
                                 dict(temperature=0.7, top_k=40), dict(temperature=0.7, min_p=0.05)])
def test_compiled_draw_passes_pick_numpys_tokens(cfg, monkeypatch):
    """The compiled passes of a temperature draw (plinth.sampling_kernels: the float64 conversion, division,
    subtraction and sequential sum outside numpy's exp and pairwise sum) pick the very tokens numpy's passes
    pick from the same seeds, over a SmolLM2-sized vocabulary with tied logits, under bias, penalties and
    grammar masks (wide and narrow), and from float64 logits."""
    import plinth.sampling as sampling

    pytest.importorskip("numba")
    kernels = pytest.importorskip("plinth.sampling_kernels")
    n = 49152

    def run(jit: bool) -> list[int]:
        monkeypatch.setitem(sampling._JIT, "mod", kernels if jit else False)
        rng = np.random.default_rng(7)
        s = Sampler(SamplerConfig(seed=11, **cfg), n_prompt=3)
        history, out = [1, 2, 3], []
        for step in range(24):
            x = (rng.standard_normal(n) * (0.5, 3.0, 10.0)[step % 3]).astype(np.float32)
            x[:200] = np.round(x[:200])  # ties
            t = s.token(x, history)
            history.append(t)
            out += [t, s.sample(x, history).token, s.token(x.astype(np.float64), history)]
            out += [s.token(x, history, rng.random(n) < p) for p in (0.5, 0.1)]
        return out

    assert run(True) == run(False)
    p = np.random.default_rng(3).random(n)
    got = np.empty_like(p)
    kernels.cumsum(p / p.sum(), got)
    np.testing.assert_array_equal(got, np.cumsum(p / p.sum()))
    kernels.normalised_cumsum(p, p.sum(), got)
    np.testing.assert_array_equal(got, np.cumsum(p / p.sum()))

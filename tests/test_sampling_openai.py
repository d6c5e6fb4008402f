"""OpenAI's sampling parameters in plinth.sampling: logit_bias, frequency_penalty, presence_penalty.

Checked against a hand computation of OpenAI's definitions: ``mu[j] - c[j] * frequency - (c[j] > 0) *
presence + bias[j]``, with ``c[j]`` counting token j among the tokens sampled so far (not the prompt).
"""

from __future__ import annotations

import numpy as np
import pytest
from plinth.sampling import Sampler, SamplerConfig, apply_logit_bias, apply_penalties

RNG = np.random.default_rng(7)
LOGITS = RNG.standard_normal(50).astype(np.float32)


def hand(logits, generated, freq, pres, bias=None):
    x = logits.astype(np.float64).copy()
    for j in range(x.shape[0]):
        c = list(generated).count(j)
        x[j] -= c * freq + (c > 0) * pres
    for j, b in (bias or {}).items():
        x[j] += b
    return x


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("freq,pres", [(0.5, 0.0), (0.0, 1.2), (1.5, -0.7), (-2.0, 2.0)])
def test_penalties_are_openais_over_the_sampled_tokens_only(freq, pres):
    prompt = [3, 3, 3, 9]
    sampled = [4, 4, 7, 4, 11]
    s = Sampler(SamplerConfig(temperature=1.0, frequency_penalty=freq, presence_penalty=pres),
                n_prompt=len(prompt))
    p = s.probs(LOGITS, prompt + sampled)
    np.testing.assert_allclose(p, softmax(hand(LOGITS, sampled, freq, pres)), rtol=1e-6)
    # the prompt's tokens are not penalised
    assert p[3] == pytest.approx(softmax(hand(LOGITS, sampled, freq, pres))[3], rel=1e-6)
    g = Sampler(SamplerConfig(temperature=0, frequency_penalty=freq, presence_penalty=pres), n_prompt=len(prompt))
    assert g.token(LOGITS, prompt + sampled) == int(np.argmax(hand(LOGITS, sampled, freq, pres)))


def test_penalties_need_the_prompt_length():
    s = Sampler(SamplerConfig(frequency_penalty=0.5))
    with pytest.raises(ValueError, match="n_prompt"):
        s.token(LOGITS, [1, 2])
    s.n_prompt = 2
    s.token(LOGITS, [1, 2])


def test_logit_bias_bans_and_forces():
    top = int(np.argmax(LOGITS))
    g = Sampler(SamplerConfig(temperature=0, logit_bias={str(top): -100}))  # JSON keys arrive as strings
    assert g.token(LOGITS) == int(np.argsort(LOGITS)[-2])
    low = int(np.argmin(LOGITS))
    assert Sampler(SamplerConfig(temperature=0, logit_bias={low: 100})).token(LOGITS) == low
    s = Sampler(SamplerConfig(temperature=0.7, logit_bias={5: 2.5, 8: -1.0}))
    np.testing.assert_allclose(s.probs(LOGITS), softmax(hand(LOGITS, [], 0, 0, {5: 2.5, 8: -1.0}) / 0.7), rtol=1e-6)
    assert s.config.logit_bias == ((5, 2.5), (8, -1.0))
    assert apply_logit_bias(LOGITS, ()) is LOGITS and apply_penalties(LOGITS, [], 1.0, 1.0) is LOGITS


def test_bias_and_penalties_then_the_truncation_filters():
    """Bias and penalties come before top-k / top-p: the filters see the changed logits."""
    cfg = SamplerConfig(temperature=1.0, top_k=3, logit_bias={int(np.argmin(LOGITS)): 50.0},
                        frequency_penalty=2.0)
    sampled = [int(np.argmax(LOGITS))] * 3
    p = Sampler(cfg, n_prompt=0).probs(LOGITS, sampled)
    x = hand(LOGITS, sampled, 2.0, 0.0, {int(np.argmin(LOGITS)): 50.0})
    keep = np.argsort(x)[-3:]
    want = np.zeros_like(x)
    want[keep] = softmax(x[keep])
    np.testing.assert_allclose(p, want, rtol=1e-6, atol=1e-12)


def test_refusals():
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplerConfig(frequency_penalty=2.5)
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplerConfig(presence_penalty=-3)
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplerConfig(logit_bias={1: 101})
    with pytest.raises(ValueError, match="token ids"):
        SamplerConfig(logit_bias={"x": 1})
    with pytest.raises(ValueError, match="token ids"):
        SamplerConfig(logit_bias={-1: 1})
    with pytest.raises(ValueError, match="past the vocabulary"):
        Sampler(SamplerConfig(logit_bias={50: 1})).token(LOGITS)


def test_plain_logits_flag():
    assert SamplerConfig().plain_logits
    for kw in ({"logit_bias": {1: 1}}, {"frequency_penalty": 0.1}, {"presence_penalty": 0.1},
               {"repetition_penalty": 1.1}):
        assert not SamplerConfig(**kw).plain_logits

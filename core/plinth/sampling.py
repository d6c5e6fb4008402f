"""Token samplers: the full filtered distribution, and a draw from it.

Speculative verification needs the *distribution* a sampler would draw from,
not just a token, so :meth:`Sampler.probs` returns the whole normalised
``[n_vocab]`` vector (zeros outside the kept set; a one-hot for greedy), and
:meth:`Sampler.sample` draws from that same vector.

Filter order (the same as llama.cpp's default chain, which puts temperature
after the truncation samplers)::

    repetition penalty -> top-k -> top-p -> min-p -> temperature -> softmax

* repetition penalty (CTRL / llama.cpp style): for every distinct token among
  the last ``repeat_last_n`` of ``history``, a positive logit is divided by the
  penalty and a negative one multiplied by it.
* top-k keeps the ``k`` largest logits (ties at the boundary are broken
  arbitrarily, as ``argpartition`` does).
* top-p keeps the smallest prefix of the candidates, sorted by probability,
  whose mass reaches ``p`` (the token that crosses ``p`` is kept). The
  probabilities are those of the penalised logits at temperature 1.
* min-p keeps candidates whose probability is at least ``min_p`` times the
  largest probability (again at temperature 1).
* temperature divides the surviving logits before the final softmax, done in
  float64 for stability. ``temperature == 0`` means greedy: a one-hot at the
  argmax of the penalised logits.

Because top-p and min-p see temperature-1 probabilities, changing the
temperature only reshapes the mass among the tokens already kept.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import numpy as np

__all__ = ["SamplerConfig", "SampleResult", "Sampler", "apply_repetition_penalty"]


def _nonneg(_inst, attr, value):
    if value < 0:
        raise ValueError(f"{attr.name} must be >= 0, got {value}")


def _unit(_inst, attr, value):
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attr.name} must be in [0, 1], got {value}")


def _positive(_inst, attr, value):
    if value <= 0:
        raise ValueError(f"{attr.name} must be > 0, got {value}")


@attrs.frozen
class SamplerConfig:
    """Sampling settings; every filter has a value that turns it off (the defaults)."""

    temperature: float = attrs.field(default=1.0, converter=float, validator=_nonneg)  # 0 = greedy
    top_k: int = attrs.field(default=0, converter=int, validator=_nonneg)  # 0 = off
    top_p: float = attrs.field(default=1.0, converter=float, validator=_unit)  # 1.0 = off
    min_p: float = attrs.field(default=0.0, converter=float, validator=_unit)  # 0 = off
    repetition_penalty: float = attrs.field(default=1.0, converter=float, validator=_positive)  # 1 = off
    repeat_last_n: int = attrs.field(default=64, converter=int, validator=_nonneg)  # 0 = no penalty
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@attrs.frozen
class SampleResult:
    """A drawn token and the distribution it was drawn from."""

    token: int
    probs: np.ndarray = attrs.field(eq=False, repr=False)


def apply_repetition_penalty(
    logits: np.ndarray, history: Sequence[int] | np.ndarray | None, penalty: float, last_n: int
) -> np.ndarray:
    """A copy of ``logits`` with the CTRL-style penalty applied to recent tokens.

    Returns ``logits`` itself (no copy) when the penalty is off or there is no history.
    """
    if penalty == 1.0 or history is None or last_n == 0:
        return logits
    hist = np.asarray(history, dtype=np.int64).ravel()
    if hist.size == 0:
        return logits
    ids = np.unique(hist[-last_n:])
    ids = ids[(ids >= 0) & (ids < logits.shape[0])]
    out = logits.copy()
    vals = out[ids]
    out[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


class Sampler:
    """Draws tokens according to a :class:`SamplerConfig`, reproducibly from its seed."""

    def __init__(self, config: SamplerConfig | None = None, **kwargs):
        if config is None:
            config = SamplerConfig(**kwargs)
        elif kwargs:
            config = attrs.evolve(config, **kwargs)
        self.config = config
        self.rng = np.random.default_rng(config.seed)

    def reseed(self, seed: int | None) -> None:
        self.rng = np.random.default_rng(seed)

    # ------------------------------------------------------------------ core

    def _candidates(self, logits: np.ndarray, history) -> tuple[np.ndarray, np.ndarray] | int:
        """Kept token ids and their (penalised, temperature-1) logits; an int for greedy."""
        cfg = self.config
        x = np.asarray(logits)
        if x.ndim != 1:
            raise ValueError(f"logits must be 1-D [n_vocab], got shape {x.shape}")
        x = apply_repetition_penalty(x, history, cfg.repetition_penalty, cfg.repeat_last_n)
        if cfg.greedy:
            return int(np.argmax(x))
        n = x.shape[0]
        if 0 < cfg.top_k < n:
            ids = np.argpartition(x, n - cfg.top_k)[n - cfg.top_k:]
        else:
            ids = None
        vals = x if ids is None else x[ids]
        vals = vals.astype(np.float64)
        if cfg.top_p < 1.0 or cfg.min_p > 0.0:
            if ids is None:
                ids = np.arange(n)
            m = vals.max()
            if cfg.min_p > 0.0:
                # p_i / p_max >= min_p  <=>  x_i - x_max >= log(min_p)
                keep = vals - m >= np.log(cfg.min_p) if cfg.top_p >= 1.0 else None
            if cfg.top_p < 1.0:
                vals, ids = _top_p(vals, ids, m, cfg.top_p)
                if cfg.min_p > 0.0:
                    keep = vals - m >= np.log(cfg.min_p)
            if cfg.min_p > 0.0:
                vals, ids = vals[keep], ids[keep]
        return ids, vals

    def _kept(self, logits: np.ndarray, history: Sequence[int] | np.ndarray | None) -> Any:
        """The candidates after all filters and their tempered probabilities: (ids or None for all,
        p), or the token id alone where the choice is certain (greedy)."""
        c = self._candidates(logits, history)
        if isinstance(c, int):
            return c
        ids, vals = c
        return ids, _softmax(vals / self.config.temperature)

    def probs(self, logits: np.ndarray, history: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """The full normalised float64 distribution over the vocabulary after all filters."""
        n = np.asarray(logits).shape[-1]
        k = self._kept(logits, history)
        out = np.zeros(n, dtype=np.float64)
        if isinstance(k, int):
            out[k] = 1.0
            return out
        ids, p = k
        if ids is None:
            return p
        out[ids] = p
        return out

    def sample(self, logits: np.ndarray, history: Sequence[int] | np.ndarray | None = None) -> SampleResult:
        """Draw one token; also return the distribution it came from."""
        n = np.asarray(logits).shape[-1]
        k = self._kept(logits, history)
        out = np.zeros(n, dtype=np.float64)
        if isinstance(k, int):
            out[k] = 1.0
            return SampleResult(k, out)
        ids, p = k
        j = self.draw(p)  # draw among the kept candidates only
        if ids is None:
            return SampleResult(j, p)
        out[ids] = p
        return SampleResult(int(ids[j]), out)

    def token(self, logits: np.ndarray, history: Sequence[int] | np.ndarray | None = None) -> int:
        """``sample(logits, history).token`` (the same draw from the generator) without building the
        distribution over the whole vocabulary: what a decode loop needs."""
        k = self._kept(logits, history)
        if isinstance(k, int):
            return k
        ids, p = k
        j = self.draw(p)
        return j if ids is None else int(ids[j])

    def draw(self, p: np.ndarray) -> int:
        """Draw an index from a normalised distribution with this sampler's generator."""
        cum = np.cumsum(p)
        u = self.rng.random() * cum[-1]
        return int(min(np.searchsorted(cum, u, side="right"), p.shape[0] - 1))

    def __call__(self, logits, history=None) -> int:
        return self.token(logits, history)


def _top_p(vals: np.ndarray, ids: np.ndarray, m: float, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Smallest highest-probability prefix with mass >= top_p, sorted descending.

    Only the largest candidates are sorted: take the top ``k`` with argpartition,
    and double ``k`` until they already hold ``top_p`` of the mass.
    """
    e_all = np.exp(vals - m)
    total = e_all.sum()
    n = vals.shape[0]
    k = min(n, 256)
    while True:
        if k < n:
            sel = np.argpartition(-vals, k - 1)[:k]
        else:
            sel = np.arange(n)
        if k >= n or e_all[sel].sum() >= top_p * total:
            break
        k = min(n, 4 * k)
    order = sel[np.argsort(-vals[sel], kind="stable")]
    cum = np.cumsum(e_all[order])
    cut = min(int(np.searchsorted(cum, top_p * total, side="left")) + 1, order.shape[0])
    order = order[:cut]
    return vals[order], ids[order]


def _softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()

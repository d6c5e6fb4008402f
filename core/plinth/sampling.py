"""Token samplers: the full filtered distribution, and a draw from it.

Speculative verification needs the *distribution* a sampler would draw from,
not just a token, so :meth:`Sampler.probs` returns the whole normalised
``[n_vocab]`` vector (zeros outside the kept set; a one-hot for greedy), and
:meth:`Sampler.sample` draws from that same vector.

Filter order (the same as llama.cpp's default chain, which puts temperature
after the truncation samplers)::

    logit bias -> grammar mask -> repetition penalty -> frequency / presence penalties
    -> top-k -> top-p -> min-p -> temperature -> softmax

* logit bias (OpenAI's ``logit_bias``): a constant added to chosen tokens' logits
  (-100 bans a token in practice, +100 all but forces it).
* grammar mask: a token the request's grammar forbids gets ``-inf`` (a
  :class:`plinth.grammar.ConstraintState` or a bool mask passed as ``constraint``);
  greedy decoding checks the unmasked argmax first and builds the whole mask only
  when the grammar refuses it (the same token either way). Where fewer than a
  quarter of the tokens are allowed, the filters run over the allowed ones alone
  (the same distribution, at a fraction of the cost).
* frequency / presence penalties (OpenAI's definitions): with ``c[j]`` the number
  of times token ``j`` was sampled so far in this generation (the prompt does not
  count: ``history[n_prompt:]``), ``logit[j] -= c[j] * frequency_penalty +
  (c[j] > 0) * presence_penalty``.
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

__all__ = ["SamplerConfig", "SampleResult", "Sampler", "apply_repetition_penalty", "apply_penalties",
           "apply_logit_bias"]


def _nonneg(_inst, attr, value):
    if value < 0:
        raise ValueError(f"{attr.name} must be >= 0, got {value}")


def _unit(_inst, attr, value):
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attr.name} must be in [0, 1], got {value}")


def _positive(_inst, attr, value):
    if value <= 0:
        raise ValueError(f"{attr.name} must be > 0, got {value}")


def _penalty(_inst, attr, value):
    if not -2.0 <= value <= 2.0:  # OpenAI's range
        raise ValueError(f"{attr.name} must be in [-2, 2], got {value}")


def _bias_items(value: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted ``(token id, bias)`` pairs, from a mapping or pairs (JSON keys may be strings)."""
    if value is None:
        return ()
    items = value.items() if hasattr(value, "items") else value
    out: dict[int, float] = {}
    for k, v in items:
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
        if isinstance(k, float) or tid < 0:
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
        b = float(v)
        if not -100.0 <= b <= 100.0:  # OpenAI's range
            raise ValueError(f"logit_bias values must be in [-100, 100], got {v!r} for token {tid}")
        out[tid] = b
    return tuple(sorted(out.items()))


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
    frequency_penalty: float = attrs.field(default=0.0, converter=float, validator=_penalty)  # 0 = off
    presence_penalty: float = attrs.field(default=0.0, converter=float, validator=_penalty)  # 0 = off
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_bias_items)  # () = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_logits(self) -> bool:
        """No transform before the truncation filters: greedy is the raw logits' argmax."""
        return (self.repetition_penalty == 1.0 and self.frequency_penalty == 0.0 and self.presence_penalty == 0.0
                and not self.logit_bias)


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


def apply_logit_bias(logits: np.ndarray, bias: Sequence[tuple[int, float]]) -> np.ndarray:
    """A copy of ``logits`` with ``bias`` ((token id, value) pairs) added; ``logits`` itself when empty."""
    if not bias:
        return logits
    ids = np.fromiter((t for t, _ in bias), dtype=np.int64, count=len(bias))
    if ids.max() >= logits.shape[0]:
        raise ValueError(f"logit_bias names token {int(ids.max())}, past the vocabulary of {logits.shape[0]}")
    out = logits.copy()
    out[ids] += np.fromiter((b for _, b in bias), dtype=np.float64, count=len(bias)).astype(out.dtype)
    return out


def apply_penalties(logits: np.ndarray, generated: Sequence[int] | np.ndarray | None, frequency: float,
                    presence: float) -> np.ndarray:
    """OpenAI's frequency / presence penalties over the tokens ``generated`` so far (a copy; ``logits``
    itself when both are 0 or nothing was generated)."""
    if (frequency == 0.0 and presence == 0.0) or generated is None or len(generated) == 0:
        return logits
    ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
    keep = (ids >= 0) & (ids < logits.shape[0])
    ids, counts = ids[keep], counts[keep]
    out = logits.copy()
    out[ids] -= (counts * frequency + presence).astype(out.dtype)
    return out


class Sampler:
    """Draws tokens according to a :class:`SamplerConfig`, reproducibly from its seed.

    ``n_prompt``: how many leading tokens of the ``history`` passed to each call are the prompt; the
    frequency and presence penalties count only the tokens after them (the ones sampled). It must be
    set (here or as the attribute, before each generation) when either penalty is on.
    """

    def __init__(self, config: SamplerConfig | None = None, *, n_prompt: int | None = None, **kwargs):
        if config is None:
            config = SamplerConfig(**kwargs)
        elif kwargs:
            config = attrs.evolve(config, **kwargs)
        self.config = config
        self.n_prompt = n_prompt
        self.rng = np.random.default_rng(config.seed)

    def reseed(self, seed: int | None) -> None:
        self.rng = np.random.default_rng(seed)

    # ------------------------------------------------------------------ core

    def _logits(self, logits: np.ndarray, history) -> np.ndarray:
        """The logits after bias and penalties (no copy when none applies)."""
        cfg = self.config
        x = np.asarray(logits)
        if x.ndim != 1:
            raise ValueError(f"logits must be 1-D [n_vocab], got shape {x.shape}")
        x = apply_logit_bias(x, cfg.logit_bias)
        x = apply_repetition_penalty(x, history, cfg.repetition_penalty, cfg.repeat_last_n)
        if cfg.frequency_penalty != 0.0 or cfg.presence_penalty != 0.0:
            if self.n_prompt is None:
                raise ValueError("frequency / presence penalties need the prompt's length (Sampler.n_prompt) to "
                                 "tell sampled tokens from the prompt")
            gen = None if history is None else np.asarray(history, dtype=np.int64).ravel()[self.n_prompt:]
            x = apply_penalties(x, gen, cfg.frequency_penalty, cfg.presence_penalty)
        return x

    def _masked(self, logits: np.ndarray, history, constraint: Any = None) -> tuple[np.ndarray | None, np.ndarray] | int:
        """The penalised logits under the grammar's mask: (the allowed ids where the logits are of a subset of
        the vocabulary, else None; the logits), or the token id alone where greedy's choice is already certain."""
        cfg = self.config
        x = self._logits(logits, history)
        base = None  # the allowed ids, where the candidates are a subset of the vocabulary
        if constraint is not None:
            if cfg.greedy and not isinstance(constraint, np.ndarray):
                t = int(np.argmax(x))  # the unmasked choice stands when the grammar allows it
                if constraint.allows(t):
                    return t
            m = _mask_of(x, constraint)
            if 4 * int(np.count_nonzero(m)) < m.shape[0]:  # few allowed: work on them alone
                base = np.flatnonzero(m)
                x = x[base]
            else:
                x = np.where(m, x, -np.inf).astype(x.dtype, copy=False)
        return base, x

    def _candidates(self, logits: np.ndarray, history, constraint: Any = None) -> tuple[np.ndarray, np.ndarray] | int:
        """Kept token ids and their (penalised, temperature-1) logits; an int for greedy."""
        cfg = self.config
        r = self._masked(logits, history, constraint)
        if isinstance(r, int):
            return r
        base, x = r
        if cfg.greedy:
            j = int(np.argmax(x))  # (the first of equal maxima, over the subset as over the whole)
            return j if base is None else int(base[j])
        ids, vals = self._filtered(x)
        if base is not None:
            ids = base if ids is None else base[ids]
        return ids, vals

    def _filtered(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """top-k, top-p and min-p over the logits ``x``: the kept indices (None: all) and their float64 logits."""
        cfg = self.config
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

    def _kept(self, logits: np.ndarray, history: Sequence[int] | np.ndarray | None, constraint: Any = None) -> Any:
        """The candidates after all filters and their tempered probabilities: (ids or None for all,
        p), or the token id alone where the choice is certain (greedy)."""
        c = self._candidates(logits, history, constraint)
        if isinstance(c, int):
            return c
        ids, vals = c
        return ids, _softmax(vals / self.config.temperature)

    def probs(self, logits: np.ndarray, history: Sequence[int] | np.ndarray | None = None,
              constraint: Any = None) -> np.ndarray:
        """The full normalised float64 distribution over the vocabulary after all filters (and the mask
        of ``constraint``: a :class:`plinth.grammar.ConstraintState` or a bool array of allowed tokens)."""
        n = np.asarray(logits).shape[-1]
        k = self._kept(logits, history, constraint)
        out = np.zeros(n, dtype=np.float64)
        if isinstance(k, int):
            out[k] = 1.0
            return out
        ids, p = k
        if ids is None:
            return p
        out[ids] = p
        return out

    def sample(self, logits: np.ndarray, history: Sequence[int] | np.ndarray | None = None,
               constraint: Any = None) -> SampleResult:
        """Draw one token; also return the distribution it came from."""
        n = np.asarray(logits).shape[-1]
        k = self._kept(logits, history, constraint)
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

    def token(self, logits: np.ndarray, history: Sequence[int] | np.ndarray | None = None,
              constraint: Any = None) -> int:
        """``sample(logits, history, constraint).token`` (the same draw from the generator) without building
        the distribution over the whole vocabulary: what a decode loop needs. The constraint's state is not
        advanced here: the caller advances it over the tokens it keeps."""
        cfg = self.config
        jit = _kernels()
        if jit is not None and not cfg.greedy and cfg.top_k == 0 and cfg.top_p >= 1.0 and cfg.min_p == 0.0:
            # the whole (allowed) vocabulary at a temperature: the same draw through compiled passes
            base, x = self._masked(logits, history, constraint)  # (a pair: not greedy)
            if x.dtype in (np.float32, np.float64) and x.shape[0] > 0:
                j = self._draw_tempered(jit, x)
                return j if base is None else int(base[j])
        k = self._kept(logits, history, constraint)
        if isinstance(k, int):
            return k
        ids, p = k
        j = self.draw(p)
        return j if ids is None else int(ids[j])

    def draw(self, p: np.ndarray) -> int:
        """Draw an index from a normalised distribution with this sampler's generator."""
        jit = _kernels()
        if jit is not None and p.dtype == np.float64 and p.ndim == 1 and p.shape[0] > 0:
            cum = np.empty_like(p)
            jit.cumsum(p, cum)  # (numpy's cumsum, bit for bit, ~3x faster)
        else:
            cum = np.cumsum(p)
        return self._search(cum)

    def _search(self, cum: np.ndarray) -> int:
        u = self.rng.random() * cum[-1]
        return int(min(np.searchsorted(cum, u, side="right"), cum.shape[0] - 1))

    def _draw_tempered(self, jit: Any, x: np.ndarray) -> int:
        """``draw(_softmax(x.astype(float64) / T))`` without the intermediate arrays: the same arithmetic in
        the same order (:mod:`plinth.sampling_kernels`), so the same index."""
        t = self.config.temperature
        m = np.float64(x.max()) / t  # (division by t > 0 keeps the order: the largest of x / t)
        z = np.empty(x.shape[0], dtype=np.float64)
        jit.tempered(x, t, m, z)
        np.exp(z, out=z)
        jit.normalised_cumsum(z, z.sum(), z)
        return self._search(z)

    def __call__(self, logits, history=None, constraint=None) -> int:
        return self.token(logits, history, constraint)


_JIT: dict[str, Any] = {"mod": None}


def _kernels() -> Any:
    """:mod:`plinth.sampling_kernels`, or None (numba missing, or ``PLINTH_KERNELS=0``): numpy's passes."""
    if _JIT["mod"] is None:
        import os

        _JIT["mod"] = False
        if os.environ.get("PLINTH_KERNELS", "1") != "0":
            try:
                from . import sampling_kernels
            except ImportError:
                pass
            else:
                _JIT["mod"] = sampling_kernels
    return _JIT["mod"] or None


def _mask_of(x: np.ndarray, constraint: Any) -> np.ndarray:
    """The bool mask of allowed tokens of a constraint (a state with ``mask()`` or a bool array), checked."""
    m = constraint if isinstance(constraint, np.ndarray) else constraint.mask()
    if m.shape[0] != x.shape[0]:
        raise ValueError(f"the grammar mask covers {m.shape[0]} tokens, the logits {x.shape[0]}")
    if not m.any():
        raise ValueError("the grammar allows no token here")
    return m


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

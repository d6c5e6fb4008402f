"""Tests against an independent reference (Hugging Face transformers as the oracle).

Two sides, used by the bundled plugins' ``tests/golden/make_golden.py`` scripts and their
``test_reference.py`` files:

* the reference side (needs torch and transformers, imported on call): :func:`load_reference`
  (a checkpoint folder in float32 with eager attention, every tensor loaded), :class:`HFReference`
  (its all-position logits), :func:`greedy_full` (greedy tokens by full recompute) and
  :func:`reference_record` (one golden record: per prompt, its logits and greedy continuation);
* plinth's side (numpy only): :func:`assert_logits_close`, :func:`assert_greedy_matches`,
  :func:`assert_record_reproduces` (a live record against the stored one) and
  :func:`assert_converted_matches` (a folder transformers saved itself, through plinth's
  converter, against the reference's logits).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

#: what ``from_pretrained(..., output_loading_info=True)`` reports that a reference must not have
_LOAD_PROBLEMS = ("missing_keys", "unexpected_keys", "mismatched_keys")


# --------------------------------------------------------------------------- reference side (torch)

def load_reference(model_class: Any, folder: str | Path) -> Any:
    """``model_class.from_pretrained(folder)`` in float32 with eager attention, in eval mode. A folder
    of which transformers did not load every tensor (missing, unexpected or mismatched) is refused:
    its default initialisation would stand in for weights plinth reads."""
    import torch

    model, info = model_class.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                              output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in _LOAD_PROBLEMS}
    if bad:
        raise RuntimeError(f"{folder}: transformers did not load every tensor: {bad}")
    return model.eval()


class HFReference:
    """A transformers causal LM loaded by :func:`load_reference`; :meth:`logits` of a whole prompt."""

    def __init__(self, model_class: Any, folder: str | Path) -> None:
        self.model = load_reference(model_class, folder)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """All-position logits [n, n_vocab] (float32, no cache)."""
        import torch

        with torch.no_grad():
            return self.model(torch.tensor([list(ids)]), use_cache=False).logits[0].float().numpy()


def greedy_full(ref: Any, prompt: Sequence[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt``, each from ``ref.logits`` of the whole sequence so far."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(ref.logits(ids)[-1])))
    return ids[len(prompt):]


def reference_record(info: dict[str, Any], prompts: Iterable[Sequence[int]], make_ref: Callable[[], Any],
                     n_greedy: int, *, rows: Callable[[int], np.ndarray] | None = None,
                     with_greedy: bool = True) -> dict[str, Any]:
    """A golden record: ``info`` as JSON and, per prompt i, ``prompt_i`` (int32), ``logits_i`` (float32)
    and ``greedy_i`` (``n_greedy`` tokens, int32; left out without ``with_greedy``). ``make_ref()``
    builds the reference (anything with ``logits(ids)``) after ``torch.manual_seed(0)``. With ``rows``,
    only the logit rows ``rows(len(prompt))`` are kept, and stored as ``rows_i`` (int32)."""
    import torch

    torch.manual_seed(0)
    ref = make_ref()
    rec: dict[str, Any] = {"info": json.dumps(info)}
    for i, prompt in enumerate(prompts):
        rec[f"prompt_{i}"] = np.asarray(prompt, dtype=np.int32)
        logits = ref.logits(prompt)
        if rows is not None:
            kept = rows(len(prompt))
            rec[f"rows_{i}"] = kept.astype(np.int32)
            logits = logits[kept]
        rec[f"logits_{i}"] = logits.astype(np.float32)
        if with_greedy:
            rec[f"greedy_{i}"] = np.asarray(greedy_full(ref, prompt, n_greedy), dtype=np.int32)
    return rec


# --------------------------------------------------------------------------- plinth's side (numpy)

def assert_logits_close(got: Any, want: np.ndarray, atol: float, what: str, oracle: str = "transformers") -> None:
    """``got`` has ``want``'s shape and differs from it by at most ``atol`` anywhere."""
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: logits of shape {got.shape}, the reference's {want.shape}"
    diff = float(np.max(np.abs(got - want)))
    assert diff <= atol, f"{what}: max |plinth - {oracle}| = {diff:.3g}"


def assert_greedy_matches(graph: Any, n_layer: int, prompt: list[int], want: list[int], what: str) -> None:
    """plinth's greedy continuation of ``prompt`` through the cache (one prefill, then one token at a
    time) is ``want``; the message names the first step that differs."""
    from . import greedy_through_cache

    got = greedy_through_cache(graph, n_layer, prompt, len(want))
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert got == want, f"{what}: greedy tokens differ from step {first}"


def assert_record_reproduces(rec: dict[str, Any], runs: Sequence[tuple[Any, ...]], atol: float = 1e-5) -> None:
    """A record computed now (:func:`reference_record`) has the stored runs' prompts and logits (within
    ``atol``). ``runs`` as the golden loaders give them: the prompt first, the logits second to last."""
    for i, run in enumerate(runs):
        prompt, logits = run[0], run[-2]
        assert rec[f"prompt_{i}"].tolist() == prompt
        np.testing.assert_allclose(rec[f"logits_{i}"], logits, atol=atol, rtol=0)


def assert_converted_matches(saved: str | Path, ref: Any, prompts: Iterable[list[int]], registry: Any,
                             out: str | Path, atol: float, what: str = "") -> Any:
    """The checkpoint folder ``saved`` (e.g. written by transformers' own ``save_pretrained``) through
    plinth's converter into ``out``, loaded with ``registry``: its logits of each prompt are ``ref``'s
    within ``atol``. Returns the loaded model."""
    from .golden import convert_and_load

    model = convert_and_load(saved, out, registry)
    for prompt in prompts:
        diff = float(np.abs(model.logits(prompt) - ref.logits(prompt)).max())
        assert diff <= atol, f"{what + ', ' if what else ''}prompt of {len(prompt)}: {diff:.3g}"
    return model

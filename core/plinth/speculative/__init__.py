"""Speculative decoding: the drafter contract, verification rules, the engine, built-in drafters.

Import what you need from the submodules; nothing heavy happens at import time:

* :mod:`plinth.speculative.base` — :class:`DrafterRequirements`, :class:`Draft`,
  :class:`TargetOutput`, :class:`BaseDrafter`, :func:`check_compatible`;
* :mod:`plinth.speculative.verify` — the ``greedy`` and ``rejection`` verifiers;
* :mod:`plinth.speculative.engine` — :class:`SpecConfig`, :class:`SpecStats`,
  :class:`SpeculativeGenerator`;
* :mod:`plinth.speculative.ngram` and :mod:`plinth.speculative.draft_model` — the
  ``ngram`` and ``draft`` drafters.
"""

from .base import BaseDrafter, Draft, DrafterRequirements, TargetOutput, VocabInfo, check_compatible

__all__ = ["BaseDrafter", "Draft", "DrafterRequirements", "TargetOutput", "VocabInfo", "check_compatible"]

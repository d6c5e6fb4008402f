"""``plinth serve``: an OpenAI-compatible HTTP server with continuous batching.

:mod:`.scheduler` batches every running request into shared forwards (with per-request sampling and
speculative decoding, the step shared with the solo loop in :mod:`plinth.speculative.step`); its
parts are :mod:`.request` (a request and its events), :mod:`.prompt_cache` and :mod:`.emission`
(tokens to text). :mod:`.protocol` checks the OpenAI request fields (every one honoured or refused),
:mod:`.structured` the constrained-decoding ones; :mod:`.embeddings` pools hidden states;
:mod:`.app` is the Starlette app (routes as methods of ``Handlers``) with SSE streaming,
``/metrics`` (:mod:`.metrics`) and the chat page (``static/chat.html``, ``static/markdown.js``);
:mod:`.build` builds a server from ``plinth serve`` options, and :mod:`.ray` runs replicas on Ray
Serve. Needs the ``serve`` extra: ``pip install 'plinth[serve]'``.
"""

from .request import Event, QueueFull, Request
from .scheduler import Scheduler

__all__ = ["Event", "QueueFull", "Request", "Scheduler"]

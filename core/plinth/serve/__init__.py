"""``plinth serve``: an OpenAI-compatible HTTP server with continuous batching.

:mod:`.scheduler` batches every running request into shared forwards (with
per-request sampling and speculative decoding); :mod:`.protocol` checks the
OpenAI request fields; :mod:`.app` is the Starlette app with SSE streaming,
``/metrics`` (:mod:`.metrics`) and the chat page (``static/chat.html``).
Needs the ``serve`` extra: ``pip install 'plinth[serve]'``.
"""

from .scheduler import Event, QueueFull, Request, Scheduler

__all__ = ["Event", "QueueFull", "Request", "Scheduler"]

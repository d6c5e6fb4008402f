"""pytest plugin registered by the ``plinth`` distribution (entry point group ``pytest11``).

Kept light: importing it loads no plinth plugin.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest


@pytest.fixture
def plinth_registry() -> Callable[..., Any]:
    """Factory for isolated registries: ``reg = plinth_registry(plugin_a, "llama")``.

    Only the built-in plugin and the named plugins are loaded; environment
    variables such as ``PLINTH_PLUGINS`` are ignored. See
    :func:`plinth.testing.make_registry` for what each argument may be.
    """
    from . import make_registry

    return make_registry

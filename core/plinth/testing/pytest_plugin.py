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


@pytest.fixture(scope="session")
def llama_cpp_converter() -> Callable[..., Any]:
    """``convert(hf_dir, out_path, outtype="f32", args=())``: llama.cpp's own ``convert_hf_to_gguf.py``
    (:mod:`plinth.testing.interop`). Skips the test when torch, transformers or the llama.cpp sources
    (the llama-cpp-python sdist, fetched once) are missing."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from .interop import convert_with_llama_cpp, llama_cpp_sources

    src = llama_cpp_sources()
    if src is None:
        pytest.skip("llama.cpp's converter: the llama-cpp-python sdist could not be fetched")

    def convert(hf_dir: Any, out: Any, outtype: str = "f32", args: Any = ()) -> Any:
        return convert_with_llama_cpp(hf_dir, out, src=src, outtype=outtype, args=args)

    return convert

"""The plinth plugin contract: every hook a plugin may implement.

A plugin is any object (usually a module, or a :class:`plinth.ManifestPlugin`)
whose functions are marked with :data:`hookimpl` and named like the specs below.
The plugin manager is a pluggy ``PluginManager`` under the project name
``"plinth"``; :mod:`plinth.plugins` discovers plugins through the entry-point
group ``plinth.plugins`` and wraps the hook relay in a typed facade
(:class:`plinth.PluginRegistry`), so core code never calls ``pm.hook`` untyped.

Calling convention
------------------
* Hooks marked **firstresult** stop at the first implementation that returns
  something other than ``None``. Implementations return ``None`` for names they do
  not own (an architecture, drafter, backend... of another plugin).
* The registry routes a named request (``arch="llama"``) only to the plugin whose
  manifest declares that name, so two plugins never race for it; a conflict
  (two plugins declaring the same name) must be resolved by the operator with
  ``prefer=`` / ``PLINTH_PREFER``.
* Nothing heavy happens at discovery: only :func:`plinth_register` is called then,
  and it must not import numpy or model code. Every other hook is called when
  the feature is used, and may import what it needs at that point.

Shapes are written ``[rows, cols]`` in numpy order; "metadata" is the mapping of
GGUF keys to Python values (strings, ints, floats, bools, lists, numpy arrays).

Versioning
----------
The contract is versioned by :data:`plinth.PLUGIN_API_VERSION` (``major.minor``).
Each plugin's manifest states the version it was built against. A different
major is refused at discovery with a message naming the plugin and both versions;
a newer minor than the core's is accepted with a warning (the plugin may use hooks
this core does not call).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import pluggy

if TYPE_CHECKING:  # pragma: no cover - typing only
    import argparse

    from .interfaces import Architecture, Backend, Converter, Drafter, Verifier
    from .manifest import Manifest

PROJECT = "plinth"

hookspec = pluggy.HookspecMarker(PROJECT)
"""Marker for hook specifications (used only in this module)."""

hookimpl = pluggy.HookimplMarker(PROJECT)
"""Marker plugins use on their hook implementations: ``@plinth.hookimpl``."""


# --------------------------------------------------------------------------- registration


@hookspec
def plinth_register() -> Manifest:
    """Declare what the plugin provides. Called once per plugin at discovery.

    Called: by :func:`plinth.discover` right after the plugin's entry point is
    loaded, before any other hook. Must be cheap: no numpy, no model code.

    Returns: a :class:`plinth.Manifest` with the plugin's name, the plugin API
    version it was built for, and the names it provides (architectures, drafters,
    verifiers, backends, converters), each mapped to an import path
    ``"package.module:attribute"`` that is imported only when used.

    Not firstresult: the registry calls it per plugin and keeps every manifest.
    """


# --------------------------------------------------------------------------- architectures


@hookspec(firstresult=True)
def plinth_get_architecture(name: str) -> Architecture | None:
    """Return the architecture object for the GGUF ``general.architecture`` ``name``.

    Called: when a model file is opened, with the file's architecture string
    (``"llama"``, ``"qwen3"``, ``"gemma3"``, ``"nemotron_h"``...). Routed only to
    the plugin whose manifest lists ``name`` under ``architectures``.

    Returns: an object implementing :class:`plinth.interfaces.Architecture`
    (usually a :class:`plinth.graph.Architecture` subclass), whose three steps the
    engine then calls in order, as llama.cpp's ``load_arch_hparams`` /
    ``load_arch_tensors`` / ``build_arch_graph``:

    1. ``load_hparams(metadata, source)``: GGUF metadata to a frozen hparams object
       with at least the fields of :class:`plinth.graph.HParams` (``n_layer``,
       ``n_vocab``, ``n_embd``, ``n_ctx_train``); a missing required key raises an
       error naming the key and ``source``.
    2. ``tensor_specs(hparams)``: every tensor it reads, as
       :class:`plinth.tensors.TensorSpec`; the loader checks the whole file against it.
    3. ``build(hparams, weights, backend)``: a :class:`plinth.graph.Graph`, i.e.
       ``cache_layout()`` (per layer, the cache kinds it keeps) and
       ``forward(batch: plinth.graph.Batch, cache: plinth.graph.Cache, *, taps=(),
       pooling="none", embeddings=False) -> plinth.graph.ForwardOutput`` (logits only
       for rows that ask, pooled embeddings, feature taps). ``weights`` maps tensor
       names to backend arrays for every declared tensor present in the file. On
       the numpy backend 2-D tensors of the quantized types plinth has kernels for
       arrive as :class:`plinth.quant.QuantWeight` ``[n_out, n_in]``: pass them to
       ``ops.linear``, stack them with ``plinth.quant.stack`` (or
       ``plinth.graph.Linear.stack``), gather rows with ``w[ids]``;
       ``numpy.asarray(w)`` dequantizes the whole tensor.

    ``None`` when the plugin does not own ``name``. firstresult.
    """


# --------------------------------------------------------------------------- speculative decoding


@hookspec(firstresult=True)
def plinth_make_drafter(name: str, target: Any, options: Mapping[str, Any]) -> Drafter | None:
    """Create the speculative-decoding drafter ``name`` for ``target``.

    Called: when generation starts with ``--draft NAME`` (or ``drafter=NAME``).

    Args:
        target: the target :class:`plinth.Model` (hparams, vocabulary, backend). A
            drafter uses the target's embedding, LM head and sizes only through
            ``target.target_view()`` (:class:`plinth.graph.TargetView`) and gets
            feature taps by declaring them in ``requirements()``; it does not read
            ``target.weights`` or the graph's attributes.
        options: drafter options from the CLI / API (``n_max``, ``n_min``,
            ``p_min``, a draft-model path, ...).

    Returns: an object implementing :class:`plinth.interfaces.Drafter`
    (``begin`` / ``process`` / ``draft`` / ``accept``), or ``None`` if the plugin
    does not own ``name``. firstresult.
    """


@hookspec(firstresult=True)
def plinth_make_verifier(name: str, options: Mapping[str, Any]) -> Verifier | None:
    """Create the verification strategy ``name`` (``"greedy"``, ``"rejection"``, ...).

    Called: once per speculative generation.

    Returns: an object implementing :class:`plinth.interfaces.Verifier`, which
    takes the drafted tokens, their draft probabilities ``q: [n_draft, n_vocab]``
    (or ``None``) and the target's probabilities ``p: [n_draft + 1, n_vocab]``,
    and returns the accepted prefix plus the next token. ``None`` if the plugin
    does not own ``name``. firstresult.
    """


@hookspec
def plinth_describe_draft(arch: str, metadata: Mapping[str, Any], tensors: Mapping[str, tuple[tuple[int, ...], str]],
                          source: str) -> list[str] | None:
    """Describe a draft-model file (for ``plinth info``) without loading it. Optional (API 2.1).

    Called: by ``plinth info`` on a file whose ``general.architecture`` no plugin serves
    as an architecture (a drafter's own format, e.g. ``"dflash"``), routed only to the
    plugins whose manifest lists ``arch`` under ``draft_formats``. Several plugins may
    list one format (a drafter and a plugin extending its files); each is called in turn.

    Args:
        metadata: the file's GGUF metadata.
        tensors: tensor name -> (numpy-order shape, GGML type name), for every tensor
            in the file; detect the draft's kind by which tensors are present.
        source: the file path, to start error messages.

    Returns: lines of text (``"name  value"``, no indentation; the first names the
    drafter kind), or ``None`` when the file is not this plugin's (another plugin
    declaring the same format recognises it). Exactly one plugin must answer. A file
    that is the plugin's but that it cannot use raises a
    :class:`plinth.errors.UserError` naming the key or tensor. Not firstresult.
    """


# --------------------------------------------------------------------------- backends and converters


@hookspec(firstresult=True)
def plinth_make_backend(name: str, options: Mapping[str, Any]) -> Backend | None:
    """Create the compute backend ``name`` (``"numpy"``, ``"cupy"``, ...).

    Called: once per model load. A backend that cannot run here (no device)
    raises an error saying why instead of returning ``None``.

    Returns: an object implementing :class:`plinth.interfaces.Backend` (name,
    array module ``xp``, ``asarray``, ``to_numpy``), or ``None``.
    firstresult.
    """


@hookspec(firstresult=True)
def plinth_get_converter(hf_arch: str) -> Converter | None:
    """Return the HF-to-GGUF converter for the transformers class name ``hf_arch``.

    Called: by ``plinth convert`` with ``config.json``'s ``architectures[0]``
    (``"Qwen3ForCausalLM"``, ``"DFlashDraftModel"``, ...).

    Returns: an object implementing :class:`plinth.interfaces.Converter`
    (``convert(model_dir, out_path, options)``), or ``None``. firstresult.
    """


# --------------------------------------------------------------------------- command line


@hookspec
def plinth_add_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add subcommands to the ``plinth`` CLI.

    Called: once when the CLI starts, for every loaded plugin. Each
    implementation calls ``subparsers.add_parser(...)`` and sets
    ``func=callable(args) -> int`` with ``set_defaults``. Keep imports inside the
    command function so ``plinth --help`` stays fast. Not firstresult.
    """

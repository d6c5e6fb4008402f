"""What a plugin declares at discovery, and a ready-made plugin built from it.

Most plugins need no hand-written hook implementations: they describe what they
provide in a :class:`Manifest` (names mapped to lazy import paths) and expose a
:class:`ManifestPlugin` as their entry point::

    # plinth_foo/plugin.py  (entry point: foo = "plinth_foo.plugin:plugin")
    from plinth.manifest import Manifest, ManifestPlugin

    plugin = ManifestPlugin(Manifest(
        name="foo",
        api_version="2.0",
        architectures={"foo": "plinth_foo.arch:FooArchitecture"},
    ))

The import paths are resolved only when the feature is used, so discovery costs
one small module import per plugin.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

import attrs

from .hookspecs import hookimpl

#: The kinds of things a plugin can provide, as Manifest field names.
FEATURES = ("architectures", "drafters", "verifiers", "backends", "converters")


def _frozen_dict(value: Mapping[str, str] | None) -> dict[str, str]:
    return dict(value or {})


@attrs.frozen
class Manifest:
    """A plugin's declaration.

    Attributes:
        name: the plugin's name (shown by ``plinth plugins``).
        api_version: the plinth plugin API (``"major.minor"``) it was built for.
        architectures: GGUF architecture name -> ``"module:attr"`` of an
            :class:`plinth.interfaces.Architecture` (an instance, or a class
            instantiated without arguments).
        drafters: drafter name -> ``"module:attr"`` of a factory
            ``(target, options) -> Drafter``.
        verifiers: verifier name -> ``"module:attr"`` of a factory ``(options) -> Verifier``.
        backends: backend name -> ``"module:attr"`` of a factory ``(options) -> Backend``.
        converters: HF architecture class name -> ``"module:attr"`` of a Converter.
        draft_formats: (API 2.1, optional) GGUF ``general.architecture`` of a *draft* file
            (one no architecture serves, e.g. ``"dflash"``) -> ``"module:attr"`` of
            ``describe(metadata, tensors, source) -> list[str] | None``, which ``plinth info``
            calls (see :func:`plinth.hookspecs.plinth_describe_draft`). Unlike the kinds
            above, several plugins may declare the same format: each recognises its own
            files (by their tensors) and returns ``None`` for the others.
        description: one line for listings.
    """

    name: str
    api_version: str
    architectures: dict[str, str] = attrs.field(factory=dict, converter=_frozen_dict)
    drafters: dict[str, str] = attrs.field(factory=dict, converter=_frozen_dict)
    verifiers: dict[str, str] = attrs.field(factory=dict, converter=_frozen_dict)
    backends: dict[str, str] = attrs.field(factory=dict, converter=_frozen_dict)
    converters: dict[str, str] = attrs.field(factory=dict, converter=_frozen_dict)
    description: str = ""
    draft_formats: dict[str, str] = attrs.field(factory=dict, converter=_frozen_dict)

    def provides(self) -> dict[str, list[str]]:
        """Kind -> sorted names, leaving out empty kinds (``draft_formats`` last, when declared)."""
        out = {}
        for feature in (*FEATURES, "draft_formats"):
            names = sorted(getattr(self, feature))
            if names:
                out[feature] = names
        return out


def import_object(path: str) -> Any:
    """Import ``"package.module:attr.sub"`` and return the attribute."""
    module_name, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


class ManifestPlugin:
    """A plugin object whose hooks serve the import paths of a :class:`Manifest`."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._cache: dict[tuple[str, str], Any] = {}

    def __repr__(self) -> str:
        return f"ManifestPlugin({self.manifest.name!r})"

    def _resolve(self, feature: str, name: str) -> Any | None:
        path = getattr(self.manifest, feature).get(name)
        if path is None:
            return None
        key = (feature, name)
        if key not in self._cache:
            self._cache[key] = import_object(path)
        return self._cache[key]

    def _architecture(self, name: str) -> Any | None:
        obj = self._resolve("architectures", name)
        if isinstance(obj, type):
            obj = obj()
            self._cache[("architectures", name)] = obj
        return obj

    @hookimpl
    def plinth_register(self) -> Manifest:
        return self.manifest

    @hookimpl
    def plinth_get_architecture(self, name: str) -> Any | None:
        return self._architecture(name)

    @hookimpl
    def plinth_make_drafter(self, name: str, target: Any, options: Mapping[str, Any]) -> Any | None:
        factory = self._resolve("drafters", name)
        return None if factory is None else factory(target, options)

    @hookimpl
    def plinth_make_verifier(self, name: str, options: Mapping[str, Any]) -> Any | None:
        factory = self._resolve("verifiers", name)
        return None if factory is None else factory(options)

    @hookimpl
    def plinth_make_backend(self, name: str, options: Mapping[str, Any]) -> Any | None:
        factory = self._resolve("backends", name)
        return None if factory is None else factory(options)

    @hookimpl
    def plinth_describe_draft(self, arch: str, metadata: Mapping[str, Any],
                              tensors: Mapping[str, tuple[tuple[int, ...], str]], source: str) -> list[str] | None:
        describe = self._resolve("draft_formats", arch)
        return None if describe is None else describe(metadata, tensors, source)

    @hookimpl
    def plinth_get_converter(self, hf_arch: str) -> Any | None:
        obj = self._resolve("converters", hf_arch)
        if isinstance(obj, type):
            obj = obj()
        return obj

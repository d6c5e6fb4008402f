"""Plugin discovery, selection and the typed facade over the hook relay.

Plugins are found through the entry-point group ``plinth.plugins``. Each entry
point is loaded in its own ``try``: one that fails to import or register is
recorded (entry-point name, distribution, version, the exception, a one-line
hint) and skipped, unless strict mode is on (``PLINTH_STRICT_PLUGINS=1`` or
``strict=True``), which makes it fatal.

Selection, by entry-point name:

* ``PLINTH_PLUGINS`` / ``plugins=``: unset (``None``) loads all; an empty string
  (or empty list) loads none; ``"a,b"`` loads only those. Unknown names are reported.
* ``PLINTH_DISABLE_PLUGINS`` / ``disable=``: never load these.
* ``PLINTH_PREFER`` / ``prefer=``: plugin names that win a conflict (two plugins
  declaring the same architecture, drafter, ... name). An unresolved conflict is
  an error naming both plugins when that name is used, and fatal in strict mode.

The built-in plugin ``plinth`` (numpy backend, core drafters and verifiers) is
always loaded; it is not an entry point and cannot be disabled.
"""

from __future__ import annotations

import os
import traceback
import warnings
from importlib import metadata as importlib_metadata
from typing import Any, Iterable, Mapping, Sequence

import attrs
import pluggy

from . import hookspecs
from ._version import PLUGIN_API_VERSION, __version__
from .manifest import KINDS, Manifest

ENTRY_POINT_GROUP = "plinth.plugins"
BUILTIN_NAME = "plinth"


class PluginError(RuntimeError):
    """A plugin could not be loaded, or a requested feature has no plugin."""


class PluginConflictError(PluginError):
    """Two plugins declare the same name and none is preferred."""


class PluginAPIVersionWarning(UserWarning):
    """A plugin was built for a newer minor version of the plugin API."""


@attrs.define
class PluginRecord:
    """One discovered plugin and how its loading went.

    ``status`` is ``"loaded"``, ``"failed"``, ``"refused"`` (API major mismatch),
    ``"disabled"`` (blocked by selection) or ``"builtin"``.
    """

    name: str
    distribution: str | None
    version: str | None
    value: str
    status: str
    manifest: Manifest | None = None
    error: str | None = None
    hint: str | None = None
    warning: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.value,
            "api_version": self.manifest.api_version if self.manifest else None,
            "provides": self.manifest.provides() if self.manifest else {},
            "status": self.status,
            "error": self.error,
            "hint": self.hint,
            "warning": self.warning,
        }


def _split_names(value: str | Iterable[str] | None) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [n.strip() for n in value.split(",") if n.strip()]
    return [n.strip() for n in value if n.strip()]


def _parse_version(text: str) -> tuple[int, int]:
    major, _, minor = str(text).partition(".")
    return int(major), int(minor or 0)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _distribution_of(ep: importlib_metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def _hint_for(exc: BaseException, dist: str | None) -> str:
    if isinstance(exc, ModuleNotFoundError):
        missing = exc.name or "a module"
        return f"install the missing module '{missing}' or reinstall {dist or 'the plugin'} with its dependencies"
    if isinstance(exc, ImportError):
        return f"reinstall {dist or 'the plugin'}; it does not match the installed packages"
    return f"report this to the author of {dist or 'the plugin'}, or disable it with PLINTH_DISABLE_PLUGINS"


def check_api_version(plugin: str, declared: str, core: str = PLUGIN_API_VERSION) -> str | None:
    """Refuse a major mismatch; return a warning text for a newer minor, else ``None``."""
    try:
        p_major, p_minor = _parse_version(declared)
    except ValueError as exc:
        raise PluginError(f"plugin '{plugin}' declares an unreadable plugin API version {declared!r}") from exc
    c_major, c_minor = _parse_version(core)
    if p_major != c_major:
        what = ""
        if p_major < 2 <= c_major:
            what = (" (API 2.0 replaced the plinth_arch_* hooks by the architecture object's own steps, "
                    "graphs declare cache_layout() and drafters use target.target_view(); see "
                    "docs/writing-a-plugin.md)")
        raise PluginError(
            f"plugin '{plugin}' was built for plinth plugin API {declared}, but this plinth "
            f"({__version__}) speaks {core}; install a version of the plugin built for API {c_major}.x{what}"
        )
    if p_minor > c_minor:
        return (
            f"plugin '{plugin}' was built for plinth plugin API {declared}, newer than this plinth's {core}; "
            "upgrade plinth to use all of its features"
        )
    return None


class PluginRegistry:
    """The typed facade over the plugin manager.

    Core code asks the registry (``registry.architecture("llama")``,
    ``registry.make_drafter("ngram", target, {})``...) instead of calling
    ``pm.hook`` directly: each request is routed to the one plugin that declares
    the name, and a missing or conflicting name raises a :class:`PluginError`
    that says what is installed.
    """

    def __init__(self, prefer: Sequence[str] = ()) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: list[PluginRecord] = []
        self.unknown_selected: list[str] = []
        self.prefer = list(prefer)
        self._owners: dict[tuple[str, str], list[str]] = {}

    # ------------------------------------------------------------------ registration

    def add(self, plugin: Any, name: str, *, distribution: str | None = None, version: str | None = None,
            value: str = "", status: str = "loaded", strict: bool = False) -> PluginRecord:
        """Register ``plugin`` (an object with hookimpls) under ``name`` and read its manifest."""
        record = PluginRecord(name, distribution, version, value, status)
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # pluggy validation: bad hook signature, duplicate name
            record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"
            record.hint = "the plugin's hook implementations do not match plinth's hookspecs"
            self.records.append(record)
            if strict:
                raise PluginError(f"plugin '{name}' could not be registered: {exc}") from exc
            return record
        try:
            impl = getattr(plugin, "plinth_register", None)
            manifest = impl() if impl is not None else None
            if manifest is None:
                raise PluginError(f"plugin '{name}' does not implement plinth_register()")
            if not isinstance(manifest, Manifest):
                raise PluginError(f"plugin '{name}': plinth_register() returned {type(manifest).__name__}, not a Manifest")
            record.manifest = manifest
            record.warning = check_api_version(name, manifest.api_version)
        except Exception as exc:
            self.pm.unregister(plugin)
            refused = isinstance(exc, PluginError) and "plugin API" in str(exc)
            record.status = "refused" if refused else "failed"
            record.error = str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__}: {exc}"
            record.hint = record.hint or ("" if refused else _hint_for(exc, distribution))
            self.records.append(record)
            if strict:
                raise PluginError(record.error) from exc
            return record
        if record.warning:
            warnings.warn(record.warning, PluginAPIVersionWarning, stacklevel=2)
        for kind in KINDS:
            for item in getattr(manifest, kind):
                self._owners.setdefault((kind, item), []).append(name)
        self.records.append(record)
        return record

    def record(self, name: str) -> PluginRecord:
        for rec in self.records:
            if rec.name == name:
                return rec
        raise KeyError(name)

    @property
    def loaded(self) -> list[PluginRecord]:
        return [r for r in self.records if r.status in ("loaded", "builtin")]

    @property
    def failed(self) -> list[PluginRecord]:
        return [r for r in self.records if r.status in ("failed", "refused")]

    # ------------------------------------------------------------------ routing

    def conflicts(self) -> dict[tuple[str, str], list[str]]:
        """(kind, name) -> plugins declaring it, where more than one does and none is preferred."""
        out = {}
        for key, owners in self._owners.items():
            if len(owners) > 1 and not any(p in owners for p in self.prefer):
                out[key] = list(owners)
        return out

    def names(self, kind: str) -> list[str]:
        """All names of one kind (``"architectures"``, ``"drafters"``...) that loaded plugins provide."""
        return sorted(n for (k, n) in self._owners if k == kind)

    def owner(self, kind: str, name: str) -> str:
        """The plugin that serves ``name`` of ``kind``; raises if none or ambiguous."""
        owners = self._owners.get((kind, name), [])
        if not owners:
            available = ", ".join(self.names(kind)) or "none"
            singular = kind[:-1]
            raise PluginError(
                f"no loaded plugin provides the {singular} '{name}' (available: {available}); "
                f"`plinth plugins` lists what is installed and why a plugin did not load"
            )
        if len(owners) == 1:
            return owners[0]
        for preferred in self.prefer:
            if preferred in owners:
                return preferred
        raise PluginConflictError(
            f"the {kind[:-1]} '{name}' is provided by more than one plugin: {' and '.join(owners)}; "
            f"choose one with PLINTH_PREFER={owners[0]} (or --prefer / prefer=), or disable the other"
        )

    def _call(self, kind: str, key: str, hook: str, **kwargs: Any) -> Any:
        owner = self.owner(kind, key)
        others = [p for p in self.pm.get_plugins() if self.pm.get_name(p) != owner]
        caller = self.pm.subset_hook_caller(hook, remove_plugins=others)
        result = caller(**kwargs)
        if result is None:
            raise PluginError(f"plugin '{owner}' declares the {kind[:-1]} '{key}' but its {hook} hook returned nothing")
        return result

    # ------------------------------------------------------------------ typed facade

    def architecture(self, name: str) -> Any:
        """The :class:`~plinth.interfaces.Architecture` for a GGUF architecture string."""
        return self._call("architectures", name, "plinth_get_architecture", name=name)

    # the three architecture steps, called on the object plinth_get_architecture returned
    def arch_hparams(self, arch: str, metadata: Mapping[str, Any], source: str) -> Any:
        return self.architecture(arch).load_hparams(metadata, source)

    def arch_tensors(self, arch: str, hparams: Any) -> Sequence[Any]:
        result: Sequence[Any] = self.architecture(arch).tensor_specs(hparams)
        return result

    def arch_build(self, arch: str, hparams: Any, weights: Mapping[str, Any], backend: Any) -> Any:
        return self.architecture(arch).build(hparams, weights, backend)

    def make_drafter(self, name: str, target: Any, options: Mapping[str, Any] | None = None) -> Any:
        return self._call("drafters", name, "plinth_make_drafter", name=name, target=target, options=dict(options or {}))

    def make_verifier(self, name: str, options: Mapping[str, Any] | None = None) -> Any:
        return self._call("verifiers", name, "plinth_make_verifier", name=name, options=dict(options or {}))

    def make_backend(self, name: str, options: Mapping[str, Any] | None = None) -> Any:
        return self._call("backends", name, "plinth_make_backend", name=name, options=dict(options or {}))

    def converter(self, hf_arch: str) -> Any:
        return self._call("converters", hf_arch, "plinth_get_converter", hf_arch=hf_arch)

    def add_commands(self, subparsers: Any) -> None:
        self.pm.hook.plinth_add_commands(subparsers=subparsers)


def _builtin_plugin() -> Any:
    from . import builtin

    return builtin.plugin


def discover(
    plugins: str | Iterable[str] | None = None,
    disable: str | Iterable[str] | None = None,
    *,
    strict: bool | None = None,
    prefer: str | Iterable[str] | None = None,
    entry_points: Iterable[importlib_metadata.EntryPoint] | None = None,
    builtin: bool = True,
) -> PluginRegistry:
    """Discover, select and load plugins; return the registry.

    Args:
        plugins: entry-point names to load (``None``: read ``PLINTH_PLUGINS``;
            unset there too means all; ``""`` or ``[]`` means none).
        disable: names never to load (added to ``PLINTH_DISABLE_PLUGINS``).
        strict: make a failing plugin or a conflict fatal (default: ``PLINTH_STRICT_PLUGINS``).
        prefer: plugin names that win name conflicts (added to ``PLINTH_PREFER``).
        entry_points: use these instead of the installed ones (tests).
        builtin: register the built-in ``plinth`` plugin.
    """
    if plugins is None and "PLINTH_PLUGINS" in os.environ:
        plugins = os.environ["PLINTH_PLUGINS"]
    allow = _split_names(plugins)
    blocked = set(_split_names(disable) or []) | set(_split_names(os.environ.get("PLINTH_DISABLE_PLUGINS")) or [])
    preferred = (_split_names(prefer) or []) + (_split_names(os.environ.get("PLINTH_PREFER")) or [])
    if strict is None:
        strict = _env_flag("PLINTH_STRICT_PLUGINS")

    registry = PluginRegistry(prefer=preferred)
    if builtin:
        registry.add(_builtin_plugin(), BUILTIN_NAME, distribution="plinth", version=__version__,
                     value="plinth.builtin:plugin", status="builtin", strict=True)

    if entry_points is None:
        entry_points = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
    seen: set[str] = set()
    for ep in sorted(entry_points, key=lambda e: e.name):
        if ep.name in seen:  # the same distribution visible twice on sys.path
            continue
        seen.add(ep.name)
        dist, version = _distribution_of(ep)
        if (allow is not None and ep.name not in allow) or ep.name in blocked:
            registry.records.append(PluginRecord(ep.name, dist, version, ep.value, "disabled"))
            continue
        try:
            obj = ep.load()
        except BaseException as exc:  # noqa: BLE001 - a plugin must never take plinth down
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            rec = PluginRecord(ep.name, dist, version, ep.value, "failed", error=detail, hint=_hint_for(exc, dist))
            registry.records.append(rec)
            if strict:
                raise PluginError(f"plugin '{ep.name}' ({dist or '?'} {version or ''}) failed to load: {detail}") from exc
            continue
        registry.add(obj, ep.name, distribution=dist, version=version, value=ep.value, strict=strict)

    if allow is not None:
        registry.unknown_selected = sorted(set(allow) - seen)
        if registry.unknown_selected and strict:
            raise PluginError(f"PLINTH_PLUGINS names unknown plugins: {', '.join(registry.unknown_selected)}")
    if strict and registry.conflicts():
        (kind, name), owners = next(iter(registry.conflicts().items()))
        registry.owner(kind, name)  # raises PluginConflictError naming both
    return registry


_default: PluginRegistry | None = None


def default_registry() -> PluginRegistry:
    """A process-wide registry from the environment's settings (discovered once)."""
    global _default
    if _default is None:
        _default = discover()
    return _default

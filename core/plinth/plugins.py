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
from .errors import UserError
from .manifest import FEATURES, Manifest, import_object

ENTRY_POINT_GROUP = "plinth.plugins"
BUILTIN_NAME = "plinth"


class PluginError(RuntimeError):
    """A plugin could not be loaded, or a requested feature has no plugin."""


class PluginConflictError(PluginError):
    """Two plugins declare the same name and none is preferred."""


class PluginHookError(PluginError, UserError):
    """A plugin's hook raised: the message names the plugin, its distribution and version, and the hook."""


class UnknownNameError(PluginError, UserError):
    """A file asks for an architecture (or other name) that no loaded plugin provides."""


_HOOK_ERRORS: dict[type, type] = {}


def _hook_error(message: str, exc: Exception) -> PluginHookError:
    """A PluginHookError that is also an instance of ``exc``'s type where Python allows it.

    So a caller (or a plugin author's test) catching ``KeyError`` from a hook still catches it.
    """
    base = type(exc)
    try:
        cls = _HOOK_ERRORS.get(base)
        if cls is None:
            cls = type(f"PluginHookError_{base.__name__}", (PluginHookError, base),
                       {"__str__": lambda self: str(self.args[0]) if self.args else ""})
            _HOOK_ERRORS[base] = cls
        return cls(message)  # type: ignore[no-any-return]
    except TypeError:  # an incompatible layout or constructor (OSError, UnicodeError...)
        return PluginHookError(message)


class PluginWarning(UserWarning):
    """A plugin was skipped or renamed (one line, naming it); the rest of plinth works."""


class PluginAPIVersionWarning(PluginWarning):
    """A plugin was built for a newer minor version of the plugin API."""


def _label(name: str, dist: str | None, version: str | None) -> str:
    """``'name' (distribution version)`` for messages."""
    where = " ".join(x for x in (dist, version) if x)
    return f"'{name}' ({where})" if where else f"'{name}'"


def _one_line(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return " ".join(text.split())


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
        self.strict = False
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
            _warn(record.warning, PluginAPIVersionWarning)
        for feature in FEATURES:
            for item in getattr(manifest, feature):
                self._owners.setdefault((feature, item), []).append(name)
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
        """(feature, name) -> plugins declaring it, where more than one does and none is preferred.

        A drafter name declared by several plugins that each provide architectures of their own
        (a draft head shipped in target files, such as ``mtp``) is no conflict: it is routed by
        the target's architecture (see :meth:`drafter_owner`).
        """
        out = {}
        for key, owners in self._owners.items():
            if len(owners) > 1 and not any(p in owners for p in self.prefer):
                if key[0] == "drafters" and self._arch_scoped(owners):
                    continue
                out[key] = list(owners)
        return out

    def _arch_scoped(self, owners: Sequence[str]) -> bool:
        """Every owner provides architectures, and no architecture twice."""
        archs = [set(n for (k, n), o in self._owners.items() if k == "architectures" and p in o) for p in owners]
        return all(archs) and sum(len(a) for a in archs) == len(set().union(*archs))

    def drafter_owner(self, name: str, arch: str | None) -> str:
        """The plugin serving drafter ``name`` for a target of architecture ``arch``.

        When several plugins declare ``name`` (and none is preferred), the one that also provides
        ``arch`` serves it: each ships the drafter for its own architectures' draft heads.
        """
        owners = self._owners.get(("drafters", name), [])
        if len(owners) > 1 and not any(p in owners for p in self.prefer) and self._arch_scoped(owners):
            mine = [p for p in owners if p in self._owners.get(("architectures", str(arch)), [])]
            if len(mine) == 1:
                return mine[0]
            raise PluginError(f"the drafter '{name}' is provided by {' and '.join(owners)}, each for its own "
                              f"architectures; none of them provides the target's architecture '{arch}'")
        return self.owner("drafters", name)

    def names(self, feature: str) -> list[str]:
        """All names of one feature (``"architectures"``, ``"drafters"``...) that loaded plugins provide."""
        return sorted(n for (k, n) in self._owners if k == feature)

    def owner(self, feature: str, name: str, source: str | None = None) -> str:
        """The plugin that serves ``name`` of ``feature``; raises if none or ambiguous.

        ``source`` (the file that asked for ``name``) starts the message; the error is then
        also a :class:`~plinth.errors.UserError`.
        """
        owners = self._owners.get((feature, name), [])
        if not owners:
            available = ", ".join(self.names(feature)) or "none"
            singular = feature[:-1]
            text = (f"no loaded plugin provides the {singular} '{name}' (available: {available}); "
                    f"`plinth plugins` lists what is installed and why a plugin did not load")
            if source is not None:
                raise UnknownNameError(f"{source}: {text}")
            raise PluginError(text)
        if len(owners) == 1:
            return owners[0]
        for preferred in self.prefer:
            if preferred in owners:
                return preferred
        raise PluginConflictError(
            f"the {feature[:-1]} '{name}' is provided by more than one plugin: {' and '.join(owners)}; "
            f"choose one with PLINTH_PREFER={owners[0]} (or --prefer / prefer=), or disable the other"
        )

    def describe(self, name: str) -> str:
        """``'name' (distribution version)`` for messages."""
        try:
            rec = self.record(name)
        except KeyError:
            return f"'{name}'"
        return _label(name, rec.distribution, rec.version)

    def _guarded(self, feature: str, key: str, step: str, fn: Any, source: str | None = None,
                 owner: str | None = None) -> Any:
        """``fn()``; an exception from plugin code is re-raised naming the plugin, its version and ``step``."""
        try:
            return fn()
        except (UserError, PluginError):
            raise
        except Exception as exc:  # a plugin's bug or a value it did not expect: name the plugin
            where = f"{source}: " if source else ""
            raise _hook_error(f"{where}plugin {self.describe(owner or self.owner(feature, key))} failed in {step} for the "
                              f"{feature[:-1]} '{key}': {_one_line(exc)}", exc) from exc

    def _call(self, feature: str, key: str, hook: str, *, where: str | None = None, owner: str | None = None,
              **kwargs: Any) -> Any:
        """Call ``hook`` on the one plugin that declares ``key``; ``where`` (a file) starts any error."""
        owner = owner or self.owner(feature, key)
        others = [p for p in self.pm.get_plugins() if self.pm.get_name(p) != owner]
        caller = self.pm.subset_hook_caller(hook, remove_plugins=others)
        result = self._guarded(feature, key, hook, lambda: caller(**kwargs), where, owner)
        if result is None:
            raise PluginError(f"plugin '{owner}' declares the {feature[:-1]} '{key}' but its {hook} hook returned nothing")
        return result

    # ------------------------------------------------------------------ typed facade

    def architecture(self, name: str, source: str | None = None) -> Any:
        """The :class:`~plinth.interfaces.Architecture` for a GGUF architecture string (of file ``source``)."""
        return self._call("architectures", name, "plinth_get_architecture", where=source, name=name)

    # the three architecture steps, called on the object plinth_get_architecture returned
    def arch_hparams(self, arch: str, metadata: Mapping[str, Any], source: str) -> Any:
        """The plugin's hparams for ``arch``, checked by :func:`plinth.validation.check_hparams`."""
        from .validation import check_hparams

        hp = self._guarded("architectures", arch, "load_hparams",
                           lambda: self.architecture(arch, source).load_hparams(metadata, source), source)
        return check_hparams(hp, source, arch)

    def arch_tensors(self, arch: str, hparams: Any) -> Sequence[Any]:
        result: Sequence[Any] = self._guarded("architectures", arch, "tensor_specs",
                                              lambda: self.architecture(arch).tensor_specs(hparams))
        return result

    def arch_build(self, arch: str, hparams: Any, weights: Mapping[str, Any], backend: Any) -> Any:
        return self._guarded("architectures", arch, "build",
                             lambda: self.architecture(arch).build(hparams, weights, backend))

    def make_drafter(self, name: str, target: Any, options: Mapping[str, Any] | None = None) -> Any:
        owner = self.drafter_owner(name, getattr(target, "arch", None))
        return self._call("drafters", name, "plinth_make_drafter", owner=owner, name=name, target=target,
                          options=dict(options or {}))

    def make_verifier(self, name: str, options: Mapping[str, Any] | None = None) -> Any:
        return self._call("verifiers", name, "plinth_make_verifier", name=name, options=dict(options or {}))

    def make_backend(self, name: str, options: Mapping[str, Any] | None = None) -> Any:
        return self._call("backends", name, "plinth_make_backend", name=name, options=dict(options or {}))

    def converter(self, hf_arch: str) -> Any:
        return self._call("converters", hf_arch, "plinth_get_converter", hf_arch=hf_arch)

    def draft_formats(self, arch: str) -> list[str]:
        """The loaded plugins that declare ``arch`` under ``draft_formats`` (manifest API 2.1), in load order."""
        return [rec.name for rec in self.loaded if rec.manifest is not None and arch in rec.manifest.draft_formats]

    def describe_draft(self, arch: str, metadata: Mapping[str, Any],
                       tensors: Mapping[str, tuple[tuple[int, ...], str]], source: str) -> tuple[str, list[str]]:
        """``(plugin, lines)``: the one plugin declaring the draft format ``arch`` that recognises the file.

        Every declaring plugin is asked in turn (see :func:`plinth.hookspecs.plinth_describe_draft`);
        none or several answering is an error naming them and the file.
        """
        declared = self.draft_formats(arch)
        if not declared:
            raise UnknownNameError(f"{source}: no loaded plugin provides the architecture or draft format '{arch}' "
                                   f"(architectures: {', '.join(self.names('architectures')) or 'none'}); "
                                   "`plinth plugins` lists what is installed and why a plugin did not load")
        answers: list[tuple[str, list[str]]] = []
        for name in declared:
            others = [p for p in self.pm.get_plugins() if self.pm.get_name(p) != name]
            caller = self.pm.subset_hook_caller("plinth_describe_draft", remove_plugins=others)
            try:
                results = caller(arch=arch, metadata=metadata, tensors=tensors, source=source)
            except (UserError, PluginError):
                raise
            except Exception as exc:  # a plugin's bug: name it
                raise _hook_error(f"{source}: plugin {self.describe(name)} failed in plinth_describe_draft for the "
                                  f"draft format '{arch}': {_one_line(exc)}", exc) from exc
            answers += [(name, [str(line) for line in lines]) for lines in results if lines is not None]
        if not answers:
            raise UnknownNameError(f"{source}: a '{arch}' draft that none of the plugins declaring that format "
                                   f"({', '.join(declared)}) recognises; a plugin for its kind may be missing "
                                   "(`plinth plugins` lists what is installed)")
        if len(answers) > 1:
            raise PluginConflictError(f"{source}: the '{arch}' draft is claimed by more than one plugin: "
                                      f"{' and '.join(n for n, _ in answers)}; disable one with PLINTH_DISABLE_PLUGINS")
        return answers[0]

    def add_commands(self, subparsers: Any, strict: bool = False) -> None:
        """Each plugin's ``plinth_add_commands``, one at a time: a failing one is recorded and skipped."""
        for impl in self.pm.hook.plinth_add_commands.get_hookimpls():
            try:
                impl.function(subparsers=subparsers)
            except Exception as exc:
                msg = (f"plugin {self.describe(impl.plugin_name)} failed in plinth_add_commands: {_one_line(exc)}; "
                       "its commands are skipped")
                if strict:
                    raise PluginError(msg) from exc
                try:
                    rec = self.record(impl.plugin_name)
                    rec.error = msg
                    rec.hint = _hint_for(exc, rec.distribution)
                except KeyError:
                    pass
                _warn(msg)

    def check_manifests(self) -> list[tuple[str, str, str, str]]:
        """Import every path of every loaded manifest; ``(plugin, feature, name, error)`` for each that fails."""
        problems = []
        for rec in self.loaded:
            if rec.manifest is None:
                continue
            for feature in (*FEATURES, "draft_formats"):
                for item, path in sorted(getattr(rec.manifest, feature).items()):
                    try:
                        import_object(path)
                    except BaseException as exc:  # noqa: BLE001 - SystemExit at import is a plugin bug too
                        if isinstance(exc, KeyboardInterrupt):
                            raise
                        problems.append((rec.name, feature[:-1], item, f"'{path}': {_one_line(exc)}"))
        return problems


def _warn(message: str, category: type[Warning] = PluginWarning) -> None:
    warnings.warn(message, category, stacklevel=3)


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
    registry.strict = bool(strict)
    if builtin:
        registry.add(_builtin_plugin(), BUILTIN_NAME, distribution="plinth", version=__version__,
                     value="plinth.builtin:plugin", status="builtin", strict=True)

    if entry_points is None:
        entry_points = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
    seen: set[str] = set()
    unique: dict[tuple[str, str | None, str], importlib_metadata.EntryPoint] = {}
    for ep in entry_points:  # the same distribution visible twice on sys.path counts once
        unique.setdefault((ep.name, _distribution_of(ep)[0], ep.value), ep)
    by_name: dict[str, list[importlib_metadata.EntryPoint]] = {}
    for key in sorted(unique, key=lambda k: (k[0], str(k[1]), k[2])):
        by_name.setdefault(key[0], []).append(unique[key])
    for ep_name, group in sorted(by_name.items()):
        if len(group) > 1:
            # two distributions claim one entry-point name: neither silently replaces the other,
            # each is loaded under "name@distribution" and any name they both provide is a conflict
            labels = [_label(f"{ep.name}@{_distribution_of(ep)[0] or ep.value}", *_distribution_of(ep))
                      for ep in group]
            msg = (f"the plugin entry-point name '{ep_name}' is registered by {len(group)} distributions; "
                   f"they are loaded as {' and '.join(labels)} (uninstall one, or pick one with "
                   "--disable-plugins / --prefer)")
            if strict:
                raise PluginConflictError(msg)
            _warn(msg)
    for ep in [ep for _, group in sorted(by_name.items()) for ep in group]:
        dist, version = _distribution_of(ep)
        name = ep.name if len(by_name[ep.name]) == 1 else f"{ep.name}@{dist or ep.value}"
        seen.add(ep.name)
        if (allow is not None and ep.name not in allow and name not in allow) or ep.name in blocked \
                or name in blocked:
            registry.records.append(PluginRecord(name, dist, version, ep.value, "disabled"))
            continue
        try:
            obj = ep.load()
        except BaseException as exc:  # noqa: BLE001 - a plugin must never take plinth down
            if isinstance(exc, KeyboardInterrupt):
                raise
            if isinstance(exc, SystemExit):
                detail = f"the plugin module called sys.exit({exc.code!r}) while being imported"
            else:
                detail = _one_line(exc)
            rec = PluginRecord(name, dist, version, ep.value, "failed", error=detail, hint=_hint_for(exc, dist))
            registry.records.append(rec)
            msg = f"plugin {_label(name, dist, version)} failed to load: {detail}"
            if strict:
                raise PluginError(msg) from (None if isinstance(exc, SystemExit) else exc)
            _warn(f"{msg}; skipped (`plinth plugins` shows it)")
            continue
        rec = registry.add(obj, name, distribution=dist, version=version, value=ep.value, strict=strict)
        if rec.status in ("failed", "refused"):
            _warn(f"plugin {_label(name, dist, version)} {rec.status}: {rec.error}; skipped")

    if allow is not None:
        registry.unknown_selected = sorted(set(allow) - seen)
        if registry.unknown_selected:
            msg = (f"unknown plugin(s) selected: {', '.join(registry.unknown_selected)} (installed: "
                   f"{', '.join(sorted(seen)) or 'none'}; `plinth plugins` lists them)")
            if strict:
                raise PluginError(msg)
            _warn(msg)
    if strict and registry.conflicts():
        (feature, name), owners = next(iter(registry.conflicts().items()))
        registry.owner(feature, name)  # raises PluginConflictError naming both
    return registry


_default: PluginRegistry | None = None


def default_registry() -> PluginRegistry:
    """A process-wide registry from the environment's settings (discovered once)."""
    global _default
    if _default is None:
        _default = discover()
    return _default

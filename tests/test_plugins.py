"""Discovery, selection, version checks and routing of the plugin registry (in process)."""

from __future__ import annotations

import sys
import textwrap
from importlib.metadata import EntryPoint

import pytest

import plinth
from plinth.manifest import Manifest, ManifestPlugin
from plinth.plugins import PluginConflictError, PluginError, check_api_version, discover


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A folder on sys.path where tests write small plugin modules."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("tp_")]:
        del sys.modules[name]


def write_plugin(folder, module, name, api="2.0", archs=("a",), drafters=(), body=""):
    archs_src = ", ".join(f"{a!r}: '{module}:Arch'" for a in archs)
    drafters_src = ", ".join(f"{d!r}: '{module}:Drafter'" for d in drafters)
    (folder / f"{module}.py").write_text(textwrap.dedent(f"""
        from plinth.manifest import Manifest, ManifestPlugin
        {body}
        class Arch:
            name = {archs[0] if archs else ''!r}
            def load_hparams(self, metadata, source):
                return ("hp", {module!r}, dict(metadata))
            def tensor_specs(self, hparams):
                return []
            def build(self, hparams, weights, backend):
                return ("graph", {module!r})
        class Drafter:
            def __init__(self, target, options):
                self.options = options
        plugin = ManifestPlugin(Manifest(name={name!r}, api_version={api!r},
                                architectures={{{archs_src}}}, drafters={{{drafters_src}}}))
    """))
    return EntryPoint(name=name, value=f"{module}:plugin", group="plinth.plugins")


def test_import_plinth_is_light():
    import subprocess

    code = "import sys, plinth, plinth.plugins, plinth.cli; print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_discovery_and_routing(plugin_dir):
    eps = [write_plugin(plugin_dir, "tp_one", "one", archs=("alpha",), drafters=("d1",)),
           write_plugin(plugin_dir, "tp_two", "two", archs=("beta",))]
    reg = discover(entry_points=eps, plugins=None, disable=())
    assert [r.status for r in reg.records] == ["builtin", "loaded", "loaded"]
    assert reg.names("architectures") == ["alpha", "beta"]
    assert reg.arch_hparams("beta", {"k": 1}, "f.gguf") == ("hp", "tp_two", {"k": 1})
    assert reg.arch_build("alpha", None, {}, None) == ("graph", "tp_one")
    assert reg.make_drafter("d1", target=None, options={"n_max": 4}).options == {"n_max": 4}
    with pytest.raises(PluginError, match="no loaded plugin provides the architecture 'gamma'.*alpha, beta"):
        reg.architecture("gamma")


def test_selection_allow_list_disable_and_unknown(plugin_dir, monkeypatch):
    eps = [write_plugin(plugin_dir, "tp_one", "one"), write_plugin(plugin_dir, "tp_two", "two", archs=("b",))]
    reg = discover(entry_points=eps, plugins="two,nosuch", disable=())
    assert {r.name: r.status for r in reg.records} == {"plinth": "builtin", "one": "disabled", "two": "loaded"}
    assert reg.unknown_selected == ["nosuch"]
    assert "tp_one" not in sys.modules  # a plugin not selected is never imported

    reg = discover(entry_points=eps, plugins="", disable=())
    assert [r.status for r in reg.records[1:]] == ["disabled", "disabled"]

    monkeypatch.setenv("PLINTH_DISABLE_PLUGINS", "one")
    reg = discover(entry_points=eps, plugins=None)
    assert reg.record("one").status == "disabled" and reg.record("two").status == "loaded"

    monkeypatch.setenv("PLINTH_PLUGINS", "one")
    monkeypatch.delenv("PLINTH_DISABLE_PLUGINS")
    reg = discover(entry_points=eps)
    assert reg.record("one").status == "loaded" and reg.record("two").status == "disabled"


def test_broken_plugin_is_recorded_and_skipped(plugin_dir, monkeypatch):
    (plugin_dir / "tp_broken.py").write_text("import tp_module_that_does_not_exist\n")
    eps = [EntryPoint(name="broken", value="tp_broken:plugin", group="plinth.plugins"),
           write_plugin(plugin_dir, "tp_ok", "ok")]
    reg = discover(entry_points=eps, plugins=None, disable=())
    rec = reg.record("broken")
    assert rec.status == "failed"
    assert "tp_module_that_does_not_exist" in rec.error
    assert "install the missing module" in rec.hint
    assert reg.record("ok").status == "loaded"
    with pytest.raises(PluginError, match="plugin 'broken'.*failed to load"):
        discover(entry_points=eps, plugins=None, disable=(), strict=True)
    monkeypatch.setenv("PLINTH_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError):
        discover(entry_points=eps, plugins=None, disable=())


def test_api_version_major_refused_minor_warns(plugin_dir):
    eps = [write_plugin(plugin_dir, "tp_old", "old", api="1.0"),
           write_plugin(plugin_dir, "tp_new", "new", api="2.7", archs=("n",))]
    with pytest.warns(UserWarning, match="plugin 'new'.*2.7.*newer"):
        reg = discover(entry_points=eps, plugins=None, disable=())
    old = reg.record("old")
    assert old.status == "refused"
    assert "plugin 'old'" in old.error and "1.0" in old.error and plinth.PLUGIN_API_VERSION in old.error
    assert "docs/writing-a-plugin.md" in old.error  # a 1.x plugin is told what changed
    assert reg.names("architectures") == ["n"]  # the refused plugin provides nothing
    assert reg.record("new").status == "loaded"


def test_check_api_version_messages():
    assert check_api_version("p", "1.0", core="1.0") is None
    assert check_api_version("p", "1.0", core="1.3") is None
    with pytest.raises(PluginError, match="plugin 'p' was built for plinth plugin API 2.0.*speaks 1.3"):
        check_api_version("p", "2.0", core="1.3")
    with pytest.raises(PluginError, match=r"plugin 'p' was built for plinth plugin API 1.0.*speaks 2.0; install a "
                                          r"version of the plugin built for API 2.x \(API 2.0 replaced the plinth_arch_"):
        check_api_version("p", "1.0", core="2.0")
    with pytest.raises(PluginError, match="unreadable"):
        check_api_version("p", "x.y")


def test_conflicts_name_both_unless_preferred(plugin_dir, monkeypatch):
    eps = [write_plugin(plugin_dir, "tp_a", "pa", archs=("same",)),
           write_plugin(plugin_dir, "tp_b", "pb", archs=("same",))]
    reg = discover(entry_points=eps, plugins=None, disable=())
    assert reg.conflicts() == {("architectures", "same"): ["pa", "pb"]}
    with pytest.raises(PluginConflictError, match="'same' is provided by more than one plugin: pa and pb"):
        reg.arch_hparams("same", {}, "f")
    with pytest.raises(PluginConflictError):
        discover(entry_points=eps, plugins=None, disable=(), strict=True)
    reg = discover(entry_points=eps, plugins=None, disable=(), prefer="pb")
    assert reg.conflicts() == {}
    assert reg.arch_hparams("same", {}, "f")[1] == "tp_b"
    monkeypatch.setenv("PLINTH_PREFER", "pa")
    assert discover(entry_points=eps, plugins=None, disable=()).arch_hparams("same", {}, "f")[1] == "tp_a"


def test_plugin_with_bad_hook_signature_is_reported():
    from plinth.hookspecs import hookimpl

    class Bad:
        @hookimpl
        def plinth_get_architecture(self, name, extra_argument):
            return None

    reg = discover(entry_points=[], plugins=None, disable=())
    rec = reg.add(Bad(), "bad")
    assert rec.status == "failed" and "extra_argument" in rec.error


def test_register_must_return_manifest():
    class NoManifest:
        pass

    reg = discover(entry_points=[], plugins=None, disable=())
    rec = reg.add(NoManifest(), "nomanifest")
    assert rec.status == "failed" and "plinth_register" in rec.error


def test_test_kit_registry_is_isolated(plinth_registry, monkeypatch):
    monkeypatch.setenv("PLINTH_PLUGINS", "")  # ignored by the test kit
    plugin = ManifestPlugin(Manifest(name="intest", api_version="2.0", backends={"fake": "builtins:dict"}))
    reg = plinth_registry(plugin)
    assert [r.name for r in reg.records] == ["plinth", "plinth-testing", "intest"]
    assert reg.make_backend("fake", {"x": 1}) == {"x": 1}
    assert reg.make_backend("numpy").name == "numpy"
    assert reg.make_backend("strict").name == "strict"  # the test kit's device stand-in


def test_manifest_provides_and_builtin():
    reg = discover(entry_points=[], plugins=None, disable=())
    assert reg.record("plinth").manifest.provides() == {"backends": ["cupy", "numpy"],
                                                        "drafters": ["draft", "ngram", "ngram-cache"],
                                                        "verifiers": ["greedy", "rejection"]}


def test_draft_formats_route_describe_to_the_plugin_that_recognises_the_file(plugin_dir):
    """API 2.1 ``draft_formats``: every declaring plugin is asked, exactly one must answer; 2.0 plugins still load."""
    describers = """
        def mine(metadata, tensors, source):
            return ["drafter  mine", f"n {len(tensors)}"] if "mine.weight" in tensors else None
        def theirs(metadata, tensors, source):
            return ["drafter  theirs"] if "theirs.weight" in tensors else None
        def greedy(metadata, tensors, source):
            return ["drafter  greedy"]
    """
    (plugin_dir / "tp_desc.py").write_text(textwrap.dedent(describers))
    plugins = [ManifestPlugin(Manifest(name=n, api_version="2.1", draft_formats={"dr": f"tp_desc:{n}"}))
               for n in ("mine", "theirs")]
    eps = [write_plugin(plugin_dir, "tp_old", "old", api="2.0", archs=("alpha",))]
    reg = discover(entry_points=eps, plugins=None, disable=())
    for p in plugins:
        reg.add(p, p.manifest.name)
    assert reg.record("old").status == "loaded" and reg.record("old").warning is None
    assert reg.draft_formats("dr") == ["mine", "theirs"]
    shapes = {"mine.weight": ((2, 3), "F32")}
    assert reg.describe_draft("dr", {}, shapes, "f.gguf") == ("mine", ["drafter  mine", "n 1"])
    assert reg.describe_draft("dr", {}, {"theirs.weight": ((1,), "F32")}, "f.gguf")[0] == "theirs"
    with pytest.raises(PluginError, match=r"f.gguf: a 'dr' draft that none of the plugins .*\(mine, theirs\)"):
        reg.describe_draft("dr", {}, {}, "f.gguf")
    with pytest.raises(PluginError, match="f.gguf: no loaded plugin provides the architecture or draft format 'zz'"):
        reg.describe_draft("zz", {}, {}, "f.gguf")
    greedy = ManifestPlugin(Manifest(name="greedy", api_version="2.1", draft_formats={"dr": "tp_desc:greedy"}))
    reg.add(greedy, "greedy")
    with pytest.raises(PluginConflictError, match="claimed by more than one plugin: mine and greedy"):
        reg.describe_draft("dr", {}, shapes, "f.gguf")
    assert reg.check_manifests() == []


def test_draft_head_drafter_declared_by_several_architecture_plugins_is_routed_by_target(plugin_dir):
    """Two plugins each ship an ``mtp`` drafter for their own architectures' draft heads: no conflict;
    the target's architecture picks the plugin. A drafter-only clash stays a conflict."""
    import types

    eps = [write_plugin(plugin_dir, "tp_ha", "ha", archs=("arch_a",), drafters=("mtp",)),
           write_plugin(plugin_dir, "tp_hb", "hb", archs=("arch_b",), drafters=("mtp",))]
    reg = discover(entry_points=eps, plugins=None, disable=(), strict=True)
    assert reg.conflicts() == {}
    for arch, module in (("arch_a", "tp_ha"), ("arch_b", "tp_hb")):
        drafter = reg.make_drafter("mtp", types.SimpleNamespace(arch=arch), {"n_max": 2})
        assert type(drafter).__module__ == module
    with pytest.raises(PluginError, match="'mtp' is provided by ha and hb, each for its own architectures; none "
                                          "of them provides the target's architecture 'other'"):
        reg.make_drafter("mtp", types.SimpleNamespace(arch="other"), {})
    eps = [write_plugin(plugin_dir, "tp_da", "da", archs=(), drafters=("same_d",)),
           write_plugin(plugin_dir, "tp_db", "db", archs=(), drafters=("same_d",))]
    assert ("drafters", "same_d") in discover(entry_points=eps, plugins=None, disable=()).conflicts()

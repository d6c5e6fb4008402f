"""Broken third-party plugins, installed beside the bundled ones: each is named, the rest keeps working.

Each fake is a hand-written installed distribution (a module and a dist-info with
one ``plinth.plugins`` entry point) in its own folder on PYTHONPATH; the CLI runs
in a subprocess as a user would. With any of them installed, ``plinth --help``
works, ``plinth plugins`` lists the bundled plugins and names the broken one
with its error, and warnings are one line each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import plinth

ROOT = Path(__file__).resolve().parents[1]
API = plinth.PLUGIN_API_VERSION
NEWER = f"{API.split('.')[0]}.{int(API.split('.')[1]) + 9}"

MANIFEST = "from plinth.manifest import Manifest, ManifestPlugin\n"

FAKES = {
    # name: (distribution, entry-point name, module source, what `plinth plugins` must say about it)
    "commands": ("plinth-badcommands", "badcommands", MANIFEST + """
        from plinth.hookspecs import hookimpl
        class Plugin(ManifestPlugin):
            @hookimpl
            def plinth_add_commands(self, subparsers):
                raise RuntimeError("no commands today")
        plugin = Plugin(Manifest(name="badcommands", api_version="{API}"))
    """, "failed in plinth_add_commands: RuntimeError: no commands today"),
    "exit": ("plinth-exits", "exits", "import sys\nsys.exit(3)\n", "called sys.exit(3) while being imported"),
    "hook": ("plinth-badhook", "badhook", MANIFEST + """
        class Boom:
            def load_hparams(self, metadata, source):
                raise ZeroDivisionError("boom in hparams")
            def tensor_specs(self, hparams):
                return []
            def build(self, hparams, weights, backend):
                return None
        plugin = ManifestPlugin(Manifest(name="badhook", api_version="{API}",
                                         architectures={"boomarch": "plinth_fake_hook:Boom"}))
    """, None),
    "path": ("plinth-badpath", "badpath", MANIFEST + """
        plugin = ManifestPlugin(Manifest(name="badpath", api_version="{API}",
                                         architectures={"ghost": "plinth_no_such_module:Ghost"}))
    """, None),
    "squat": ("aaa-squatter", "llama", MANIFEST + """
        plugin = ManifestPlugin(Manifest(name="squatter", api_version="{API}",
                                         drafters={"squat": "plinth_fake_squat:make"}))
        def make(target, options):
            raise RuntimeError("unused")
    """, None),
    "newer": ("plinth-newer", "newer", MANIFEST + """
        plugin = ManifestPlugin(Manifest(name="newer", api_version="{NEWER}"))
    """, None),
}


def install_fake(site: Path, key: str) -> None:
    dist, ep_name, source, _ = FAKES[key]
    module = f"plinth_fake_{key}"
    site.mkdir(parents=True, exist_ok=True)
    head = MANIFEST if source.startswith(MANIFEST) else ""
    body = textwrap.dedent(source[len(head):]).replace("{API}", API).replace("{NEWER}", NEWER)
    (site / f"{module}.py").write_text(head + body)
    info = site / f"{dist.replace('-', '_')}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[plinth.plugins]\n{ep_name} = {module}:plugin\n")


def run_cli(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLINTH_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT / "core"), env.get("PYTHONPATH", "")])
    env["OPENBLAS_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "plinth", *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fakes")
    out = {}
    for key in FAKES:
        install_fake(root / key, key)
        out[key] = root / key
    for key in FAKES:
        install_fake(root / "all", key)
    out["all"] = root / "all"
    return out


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("plinth: warning: ")]


@pytest.mark.parametrize("key", [*FAKES, "all"])
def test_help_and_listing_work_with_the_broken_plugin_installed(sites, key):
    help_ = run_cli(sites[key], "--help")
    assert help_.returncode == 0, help_.stderr
    assert "generate" in help_.stdout and "Traceback" not in help_.stderr
    proc = run_cli(sites[key], "plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    rows = {row["name"]: row for row in json.loads(proc.stdout)["plugins"]}
    bundled = {n for n in rows if n.startswith(("llama", "dflash", "nemotron"))}
    assert {"dflash", "nemotron"} <= bundled
    assert any(rows[n]["status"] == "loaded" and "llama" in rows[n]["provides"].get("architectures", [])
               for n in bundled)
    # every stderr line is a one-line warning, never a source path or a traceback
    assert all(line.startswith("plinth: warning: ") for line in proc.stderr.splitlines()), proc.stderr


@pytest.mark.parametrize("key", ["commands", "exit"])
def test_a_failing_plugin_is_named_with_its_error(sites, key):
    dist, ep_name, _, said = FAKES[key]
    proc = run_cli(sites[key], "plugins", "--json")
    row = {r["name"]: r for r in json.loads(proc.stdout)["plugins"]}[ep_name]
    assert said in row["error"]
    warned = _warnings(proc.stderr)
    assert len(warned) == 1 and f"'{ep_name}' ({dist} 0.0.1)" in warned[0] and said in warned[0], proc.stderr
    assert run_cli(sites[key], "plugins").returncode == 0
    strict = run_cli(sites[key], "--strict-plugins", "plugins")
    assert strict.returncode == 2 and said in strict.stderr and "Traceback" not in strict.stderr


def test_an_exception_inside_a_hook_names_plugin_distribution_version_and_hook(sites, tmp_path):
    from plinth.testing import write_gguf

    path = write_gguf(tmp_path / "boom.gguf", {"general.architecture": "boomarch"},
                      {"w": np.zeros((1, 32), np.float32)})
    proc = run_cli(sites["hook"], "info", "-m", str(path))
    assert proc.returncode == 1
    assert proc.stderr == (f"plinth: error: {path}: plugin 'badhook' (plinth-badhook 0.0.1) failed in "
                           "load_hparams for the architecture 'boomarch': ZeroDivisionError: boom in "
                           "hparams\n"), proc.stderr


def test_plugins_check_imports_every_manifest_path(sites):
    plain = run_cli(sites["path"], "plugins")
    assert plain.returncode == 0
    proc = run_cli(sites["path"], "plugins", "--check")
    assert proc.returncode == 1
    assert ("check failed: architecture 'ghost': 'plinth_no_such_module:Ghost': ModuleNotFoundError: "
            "No module named 'plinth_no_such_module'") in proc.stdout
    assert "check: 1 manifest import path(s) failed" in proc.stdout
    rows = {r["name"]: r for r in json.loads(run_cli(sites["path"], "plugins", "--json", "--check").stdout)["plugins"]}
    assert rows["badpath"]["status"] == "broken" and rows["llama"]["status"] == "loaded"


def test_using_a_broken_manifest_path_names_the_plugin(sites, tmp_path):
    from plinth.testing import write_gguf

    path = write_gguf(tmp_path / "ghost.gguf", {"general.architecture": "ghost"}, {"w": np.zeros((1, 32), np.float32)})
    proc = run_cli(sites["path"], "info", "-m", str(path))
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"plinth: error: {path}: plugin 'badpath' (plinth-badpath 0.0.1) failed in "
                                  "plinth_get_architecture"), proc.stderr
    assert "No module named 'plinth_no_such_module'" in proc.stderr


def test_an_entry_point_named_llama_from_another_distribution_replaces_nothing(sites, tmp_path):
    from plinth.plugins import discover
    from plinth.testing import byte_vocab, tiny_metadata, write_synthetic_gguf

    proc = run_cli(sites["squat"], "plugins", "--json")
    rows = {r["name"]: r for r in json.loads(proc.stdout)["plugins"]}
    assert rows["llama@aaa-squatter"]["provides"] == {"drafters": ["squat"]}
    assert rows["llama@plinth-llama"]["provides"]["architectures"] == ["gemma3", "llama", "qwen2", "qwen3"]
    warned = _warnings(proc.stderr)
    assert len(warned) == 1 and "'llama' is registered by 2 distributions" in warned[0]
    assert "aaa-squatter 0.0.1" in warned[0] and "plinth-llama" in warned[0]
    model = write_synthetic_gguf(tmp_path / "tiny.gguf", "llama", tiny_metadata("llama", n_vocab=257) | byte_vocab(),
                                 discover(plugins="llama"))
    gen = run_cli(sites["squat"], "generate", "-m", str(model), "-n", "2", "hi")
    assert gen.returncode == 0, gen.stderr
    strict = run_cli(sites["squat"], "--strict-plugins", "plugins")
    assert strict.returncode == 2 and "registered by 2 distributions" in strict.stderr


def test_newer_minor_api_warning_is_one_line(sites):
    proc = run_cli(sites["newer"], "plugins")
    assert proc.returncode == 0
    assert proc.stderr == (f"plinth: warning: plugin 'newer' was built for plinth plugin API {NEWER}, newer than "
                           f"this plinth's {API}; upgrade plinth to use all of its features\n"), proc.stderr

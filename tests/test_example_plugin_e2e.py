"""End to end: the example third-party plugin installed by pip, seen through the `plinth` CLI.

The example (examples/plinth-example) is installed with pip into a temporary
folder (a real wheel build with its dist-info and entry point), and the CLI runs
in a subprocess with that folder on PYTHONPATH. Beside it, dist-infos written by
hand provide a plugin that fails to import and one built for another plugin API.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import plinth

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plinth-example"


def fake_distribution(site: Path, dist: str, ep_name: str, module: str, source: str) -> None:
    """A minimal installed distribution: a module plus a dist-info with one plinth entry point."""
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[plinth.plugins]\n{ep_name} = {module}:plugin\n")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(EXAMPLE)],
        check=True, capture_output=True, text=True,
    )
    assert list(site.glob("plinth_example-*.dist-info"))
    fake_distribution(site, "plinth-broken", "broken", "plinth_broken_plugin",
                      "import a_module_nobody_installed\n")
    fake_distribution(site, "plinth-future", "future", "plinth_future_plugin", f"""
        from plinth.manifest import Manifest, ManifestPlugin
        plugin = ManifestPlugin(Manifest(name="future", api_version="{int(plinth.PLUGIN_API_VERSION.split('.')[0]) + 1}.0",
                                         architectures={{"future-arch": "x:y"}}))
    """)
    return site


def run_cli(site: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PLINTH_")}
    environ["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT / "core"), environ.get("PYTHONPATH", "")])
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "plinth", *args], capture_output=True, text=True, env=environ)


def listing(site: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, dict]:
    out = run_cli(site, "plugins", "--json", *args, env=env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    return {row["name"]: row for row in data["plugins"]} | {"_unknown": data["unknown_selected"]}


def test_example_discovered_with_what_it_provides(site):
    rows = listing(site)
    ex = rows["example"]
    assert ex["status"] == "loaded"
    assert ex["distribution"] == "plinth-example" and ex["version"] == "0.1.0"
    assert ex["api_version"] == "2.0"
    assert ex["provides"] == {"architectures": ["minidense"], "converters": ["MiniDenseForCausalLM"],
                              "drafters": ["toy-repeat"]}


def test_broken_plugin_reported_without_taking_cli_down(site):
    rows = listing(site)
    broken = rows["broken"]
    assert broken["status"] == "failed"
    assert broken["distribution"] == "plinth-broken" and broken["version"] == "0.0.1"
    assert "a_module_nobody_installed" in broken["error"]
    assert broken["hint"]
    assert rows["example"]["status"] == "loaded"
    table = run_cli(site, "plugins")
    assert table.returncode == 0
    assert "broken" in table.stdout and "error:" in table.stdout and "hint:" in table.stdout


def test_api_major_mismatch_refused(site):
    future = listing(site)["future"]
    assert future["status"] == "refused"
    assert "plugin 'future'" in future["error"] and plinth.PLUGIN_API_VERSION in future["error"]
    assert future["provides"]  # the manifest is shown, but nothing from it is served


def test_selection_by_env_and_flags(site):
    rows = listing(site, env={"PLINTH_PLUGINS": "example,nonexistent"})
    assert rows["example"]["status"] == "loaded"
    assert rows["broken"]["status"] == "disabled" and rows["future"]["status"] == "disabled"
    assert rows["_unknown"] == ["nonexistent"]
    rows = listing(site, "--disable-plugins", "example")
    assert rows["example"]["status"] == "disabled"
    rows = listing(site, env={"PLINTH_PLUGINS": ""})
    assert all(r["status"] in ("disabled", "builtin") for k, r in rows.items() if k != "_unknown")
    rows = listing(site, "--plugins", "example")
    assert rows["example"]["status"] == "loaded" and rows["broken"]["status"] == "disabled"
    # global options may also come before the subcommand
    out = run_cli(site, "--plugins", "example", "plugins", "--json")
    assert json.loads(out.stdout)["plugins"][1]["status"] in ("loaded", "disabled")


def test_strict_mode_is_fatal(site):
    out = run_cli(site, "plugins", env={"PLINTH_STRICT_PLUGINS": "1"})
    assert out.returncode == 2
    assert "broken" in out.stderr and "a_module_nobody_installed" in out.stderr
    out = run_cli(site, "--strict-plugins", "--plugins", "example", "plugins")
    assert out.returncode == 0, out.stderr


def guide_commands() -> list[str]:
    """The commands of the guide's "Try it" section, in order, as written."""
    text = (ROOT / "docs" / "writing-a-plugin.md").read_text()
    section = text.split("## 8. Try it", 1)[1].split("\n## ", 1)[0]
    block = section.split("```console", 1)[1].split("```", 1)[0]
    return [line[2:].strip() for line in block.splitlines() if line.startswith("$ ")]


def test_the_guide_followed_verbatim(tmp_path):
    """Every command of docs/writing-a-plugin.md "Try it", run as written from a checkout.

    ``pip install`` goes to a private folder (put on PYTHONPATH) instead of the environment;
    everything else runs as the guide says, from a working folder holding the repository's examples.
    """
    commands = guide_commands()
    assert [c.split()[:2] for c in commands][:4] == [["pip", "install"], ["plinth", "plugins"],
                                                     ["python", "-m"], ["plinth", "convert"]]
    site = tmp_path / "site"
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PLINTH_")}
    environ["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT / "core")])
    outputs = {}
    for command in commands:
        argv = shlex.split(command)
        if argv[:2] == ["pip", "install"]:
            argv = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), *argv[2:]]
        elif argv[0] == "plinth":
            argv = [sys.executable, "-m", "plinth", *argv[1:]]
        elif argv[0] == "python":
            argv = [sys.executable, *argv[1:]]
        t0 = time.perf_counter()
        out = subprocess.run(argv, capture_output=True, text=True, env=environ, cwd=str(work), timeout=300)
        assert out.returncode == 0, f"$ {command}\n{out.stdout}\n{out.stderr}"
        assert time.perf_counter() - t0 < 300
        outputs[command] = out
    listing = outputs["plinth plugins"].stdout
    assert "example" in listing and "minidense" in listing and "MiniDenseForCausalLM" in listing
    info = outputs["plinth info -m tiny.gguf --cache"].stdout
    assert "architecture: minidense (plugin 'example')" in info and "2 x kv (layers)" in info
    texts = [o.stdout for c, o in outputs.items() if c.startswith("plinth generate")]
    assert len(texts) == 3 and texts[0].strip() and texts[0] == texts[1] == texts[2]  # greedy: drafters change nothing
    stats = next(o.stderr for c, o in outputs.items() if "--stats" in c)
    assert "speculative:" in stats and "[cache: kv " in stats
    assert " passed" in outputs["python -m pytest -q examples/plinth-example/tests"].stdout


def test_version_and_help():
    environ = dict(os.environ, PYTHONPATH=str(ROOT / "core"))
    out = subprocess.run([sys.executable, "-m", "plinth", "--version"], capture_output=True, text=True, env=environ)
    assert out.stdout.strip() == f"plinth {plinth.__version__} (plugin API {plinth.PLUGIN_API_VERSION})"
    out = subprocess.run([sys.executable, "-m", "plinth", "plugins", "--help"], capture_output=True, text=True,
                         env=environ)
    assert out.returncode == 0 and "--json" in out.stdout


def test_plugins_listing_is_fast(site):
    start = time.perf_counter()
    out = run_cli(site, "plugins")
    elapsed = time.perf_counter() - start
    assert out.returncode == 0
    # generous bound for loaded CI machines; benchmarks/bench_plugins.py measures the real figure
    assert elapsed < 5.0

"""The core's modules import in layers (no cycle); the bundled and example plugins import only the public API.

Read from the sources (no code runs). Module-level imports decide import order, so a cycle among them
fails; imports inside functions are lazy, yet a cycle there still means two layers reaching into each
other, so those fail too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plinth.testing.layering import PUBLIC_MODULES, import_cycles, imports, private_imports

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core"
PLUGINS = sorted(p for p in (ROOT / "plugins").glob("*/plinth_*") if p.is_dir())
#: the example and the third-party fixtures, written from the guide
EXAMPLES = sorted(p for pattern in ("examples/*/plinth_*", "tests/fixtures/*/plinth_*")
                  for p in ROOT.glob(pattern) if p.is_dir())


@pytest.mark.parametrize("nested", [False, True], ids=["module-level", "with-function-level"])
def test_core_modules_import_without_cycles(nested):
    assert import_cycles(CORE, "plinth", nested=nested) == []


def test_bundled_plugins_import_only_public_core_modules():
    assert PLUGINS, "no bundled plugin found"
    assert EXAMPLES, "no example plugin found"
    found = [line for p in PLUGINS + EXAMPLES for line in private_imports(p)]
    assert found == [], f"plugins import non-public core modules (public: {', '.join(PUBLIC_MODULES)}):\n" + \
        "\n".join(found)


def test_the_checks_can_fail(tmp_path):
    """A two-module cycle and an import of a private module are found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    assert import_cycles(tmp_path, "pkg") == []
    assert import_cycles(tmp_path, "pkg", nested=True) == [["pkg.a", "pkg.b"]]
    plugin = tmp_path / "plinth_x"
    plugin.mkdir()
    (plugin / "m.py").write_text("from plinth.graph import Batch\nfrom plinth.tensors import check_tensors\n"
                                 "import plinth.ops\n\ndef f():\n    from plinth.cache import KV\n")
    assert [s.split(": ")[-1] for s in private_imports(plugin)] == ["plinth.tensors", "plinth.cache"]
    assert imports(plugin / "m.py", "plinth_x.m")[0] == (1, "plinth.graph.Batch")


def test_the_guide_states_the_public_modules():
    guide = (ROOT / "docs" / "writing-a-plugin.md").read_text()
    for module in PUBLIC_MODULES:
        assert f"`{module}`" in guide, f"docs/writing-a-plugin.md does not list {module}"

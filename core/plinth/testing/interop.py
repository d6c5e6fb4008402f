"""llama.cpp's own converter and gguf-py, for interop tests: files the way users get them.

The converter (``convert_hf_to_gguf.py``) and the gguf-py beside it come from the llama.cpp sources
vendored in the llama-cpp-python 0.3.36 sdist, fetched with pip on first use and unpacked into the
test-data cache (``$PLINTH_CACHE/test-data``, default ``~/.cache/plinth/test-data``);
``PLINTH_LLAMA_CPP_SRC`` may point at an unpacked ``vendor/llama.cpp`` instead. The converter needs
torch and transformers (``pip install -e '.[ref]'``)::

    src = llama_cpp_sources()                  # None when the sdist cannot be had
    gguf_path = convert_with_llama_cpp(hf_dir, tmp_path / "m.gguf", src=src)

Tests use the ``llama_cpp_converter`` fixture (:mod:`plinth.testing.pytest_plugin`), which skips
when torch, transformers or the sources are missing, and mark themselves ``interop``
(``make test-interop``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Sequence

SDIST = "llama-cpp-python==0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
#: what is unpacked from the sdist's vendor/llama.cpp: the converter, its package and gguf-py
_KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-")


def cache_dir() -> Path:
    root = os.environ.get("PLINTH_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "plinth"
    d = base / "test-data"
    d.mkdir(parents=True, exist_ok=True)
    return d


def sdist_tarball() -> Path | None:
    """The llama-cpp-python sdist in the test-data cache, downloaded by pip once; None when it cannot be had."""
    d = cache_dir()
    tar = d / SDIST_FILE
    if not tar.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", SDIST,
                        "-d", str(d)], capture_output=True, text=True)
    return tar if tar.exists() else None


def llama_cpp_sources() -> Path | None:
    """The unpacked ``vendor/llama.cpp`` folder (converter, gguf-py), fetching the sdist once; None
    when it cannot be had (no network and no cached copy)."""
    given = os.environ.get("PLINTH_LLAMA_CPP_SRC")
    if given:
        path = Path(given)
        if not (path / "convert_hf_to_gguf.py").is_file():
            raise FileNotFoundError(f"PLINTH_LLAMA_CPP_SRC={given}: no convert_hf_to_gguf.py there")
        return path
    out = cache_dir() / "llama.cpp-0.3.36"
    if (out / ".done").exists():
        return out
    tar = sdist_tarball()
    if tar is None:
        return None
    marker = "/vendor/llama.cpp/"
    with tarfile.open(tar) as tf:
        for m in tf:
            i = m.name.find(marker)
            if i < 0 or not m.isfile():
                continue
            rel = m.name[i + len(marker):]
            if not rel.startswith(_KEEP) or ".." in Path(rel).parts:
                continue
            dest = out / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            f = tf.extractfile(m)
            if f is not None:
                dest.write_bytes(f.read())
    (out / ".done").write_text("ok")
    return out


def convert_with_llama_cpp(hf_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, src: Path | None = None,
                           outtype: str = "f32", args: Sequence[str] = (), timeout: float = 300) -> Path:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` on a Hugging Face folder; the written file's path.
    Raises RuntimeError with the converter's last lines when it fails."""
    src = src or llama_cpp_sources()
    if src is None:
        raise RuntimeError("llama.cpp's converter is not available (the llama-cpp-python sdist could not be fetched)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src / "gguf-py"), str(src)] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("HF_HUB_OFFLINE", "1")
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out),
           "--outtype", outtype, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0 or not Path(out).is_file():
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"llama.cpp's converter failed on {hf_dir} (exit {r.returncode}):\n{tail}")
    return Path(out)


def llama_cpp_gguf_py(src: Path | None = None) -> object:
    """The gguf-py package vendored with that converter (newer than PyPI's gguf of the same version
    number: it knows DFlash, DeepSeek V4 and the MTP layouts), imported under its own name."""
    import importlib.util

    src = src or llama_cpp_sources()
    if src is None:
        raise RuntimeError("llama.cpp's gguf-py is not available (the llama-cpp-python sdist could not be fetched)")
    init = src / "gguf-py" / "gguf" / "__init__.py"
    name = "llama_cpp_gguf"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

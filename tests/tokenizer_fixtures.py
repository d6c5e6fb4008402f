"""Fetch and cache the GGUF vocab test vectors shipped in the llama-cpp-python sdist."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"


def cache_dir() -> Path:
    root = os.environ.get("PLINTH_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "plinth"
    d = base / "test-data"
    d.mkdir(parents=True, exist_ok=True)
    return d


def vocab_dir() -> Path | None:
    """Directory holding ggml-vocab-* files, downloading once if needed; None if unavailable."""
    d = cache_dir()
    out = d / "ggml-vocab"
    if (out / ".done").exists():
        return out
    tar = d / SDIST_FILE
    if not tar.exists():
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
             SDIST, "-d", str(d)],
            capture_output=True, text=True,
        )
        if not tar.exists():
            return None
    out.mkdir(exist_ok=True)
    with tarfile.open(tar) as tf:
        for m in tf:
            name = m.name.rsplit("/", 1)[-1]
            if "/vendor/llama.cpp/models/ggml-vocab-" in m.name and m.isfile():
                f = tf.extractfile(m)
                (out / name).write_bytes(f.read())
    (out / ".done").write_text("ok")
    return out


def metadata(path) -> dict:
    import gguf

    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}


def vectors(d: Path, name: str):
    inp = (d / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    out = (d / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    return [(s, [int(x) for x in out[i].split()]) for i, s in enumerate(inp)]

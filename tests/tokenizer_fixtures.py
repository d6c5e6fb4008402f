"""Fetch and cache the GGUF vocab test vectors shipped in the llama-cpp-python sdist."""
from __future__ import annotations

import tarfile
from pathlib import Path

from plinth.testing.interop import cache_dir, sdist_tarball as _sdist


def _extract(dirname: str, wanted) -> Path | None:
    """Files of the sdist whose member path ``wanted`` accepts, flattened into a cache folder."""
    out = cache_dir() / dirname
    if (out / ".done").exists():
        return out
    tar = _sdist()
    if tar is None:
        return None
    out.mkdir(exist_ok=True)
    with tarfile.open(tar) as tf:
        for m in tf:
            if m.isfile() and wanted(m.name):
                (out / m.name.rsplit("/", 1)[-1]).write_bytes(tf.extractfile(m).read())
    (out / ".done").write_text("ok")
    return out


def vocab_dir() -> Path | None:
    """Directory holding ggml-vocab-* files, downloading once if needed; None if unavailable."""
    return _extract("ggml-vocab", lambda name: "/vendor/llama.cpp/models/ggml-vocab-" in name)


LLAMA_SRC_FILES = ("llama-vocab.cpp", "unicode.cpp", "unicode.h", "unicode-data.cpp", "unicode-data.h")


def llama_src_dir() -> Path | None:
    """llama.cpp's vocabulary and unicode sources from the same sdist (the pre-tokenizer
    names, their regexes and the reference splitter); None if unavailable."""
    return _extract("llama-src", lambda name: any(name.endswith("/vendor/llama.cpp/src/" + f)
                                                  for f in LLAMA_SRC_FILES))


def metadata(path) -> dict:
    import gguf

    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}


def vectors(d: Path, name: str):
    inp = (d / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    out = (d / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    return [(s, [int(x) for x in out[i].split()]) for i, s in enumerate(inp)]

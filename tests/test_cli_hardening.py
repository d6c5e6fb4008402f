"""The CLI as a hostile user drives it: bad options, bad bytes, closed pipes, Ctrl-C, odd paths.

Bad options are refused at parse time (argparse's one-line usage error, exit 2)
before any model loads: ``load_model`` is replaced by a function that fails
the test if it is reached.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import plinth.model
from plinth.cli import main
from plinth.testing import load_module

pytest.importorskip("gguf")
fuzz = load_module(Path(__file__).with_name("fuzz_gguf.py"), "fuzz_gguf")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return fuzz.write_model(tmp_path_factory.mktemp("cli") / "tiny.gguf")


def run_cli(*args: str | bytes, stdin: bytes | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLINTH_")}
    env.update(OPENBLAS_NUM_THREADS="1", PLINTH_PLUGINS="llama")
    return subprocess.run([sys.executable, "-m", "plinth", *args], input=stdin, capture_output=True,
                          timeout=timeout, env=env, check=False)


def _cupy_missing() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return True
    return False


BAD_OPTIONS = [
    (["generate", "--temperature", "-1", "hi"], "--temperature: -1 is out of range: must be >= 0"),
    (["generate", "--temperature", "nan", "hi"], "--temperature: nan is not a finite number"),
    (["generate", "--temperature", "inf", "hi"], "--temperature: inf is not a finite number"),
    (["generate", "--top-p", "2", "hi"], "--top-p: 2 is out of range"),
    (["generate", "--top-p", "nan", "hi"], "--top-p: nan is not a finite number"),
    (["generate", "--top-p", "0", "hi"], "--top-p: 0 is out of range: must be > 0 and <= 1"),
    (["generate", "--top-k", "-1", "hi"], "--top-k: -1 is out of range"),
    (["generate", "--min-p", "5", "hi"], "--min-p: 5 is out of range"),
    (["generate", "--repeat-penalty", "0", "hi"], "--repeat-penalty: 0 is out of range: must be > 0"),
    (["generate", "--seed", "-1", "hi"], "--seed: -1 is out of range"),
    (["generate", "--spec-n-max", "-3", "hi"], "--spec-n-max: -3 is out of range"),
    (["generate", "--spec", "ngram", "--spec-ngram-min", "5", "--spec-ngram-max", "2", "hi"],
     "--spec-ngram-min 5 is larger than --spec-ngram-max 2"),
    (["generate", "--spec-n-min", "9", "--spec-n-max", "2", "hi"], "--spec-n-min 9 is larger than --spec-n-max 2"),
    (["generate", "--spec-synthetic", "2", "hi"], "--spec-synthetic: 2 is out of range"),
    (["generate", "--spec", "nosuch", "hi"], "--spec: no loaded plugin provides the drafter 'nosuch'"),
    (["generate", "--spec-verify", "maybe", "hi"], "--spec-verify 'maybe' is unknown"),
    (["generate", "--backend", "tpu", "hi"], "--backend 'tpu' is unknown"),
    (["generate", "-n", "-5", "hi"], "-n/--max-tokens: -5 is out of range: must be >= 1"),
    (["generate", "-n", "0", "hi"], "-n/--max-tokens: 0 is out of range"),
    (["generate", "--stop", "", "hi"], "--stop: must not be empty"),
    (["chat", "--temperature", "-1"], "--temperature: -1 is out of range"),
    (["chat", "-n", "0"], "-n/--max-tokens: 0 is out of range"),
    (["bench", "--prompt-tokens", "0"], "--prompt-tokens: 0 is out of range"),
    (["bench", "--decode-tokens", "-1"], "--decode-tokens: -1 is out of range"),
    (["bench", "--runs", "0"], "--runs: 0 is out of range"),
    (["generate", "--threads", "0", "hi"], "--threads: 0 is out of range"),
    (["bench", "--threads", "two"], "--threads: expected an integer"),
]


@pytest.mark.parametrize("argv,message", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_options_are_refused_before_any_model_loads(monkeypatch, capsys, tiny, argv, message):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(plinth.model, "load_model", no_load)
    with pytest.raises(SystemExit) as exc:
        main(["--plugins", "llama", argv[0], "-m", str(tiny), *argv[1:]])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


@pytest.mark.skipif(not _cupy_missing(), reason="cupy is installed here")
def test_backend_cupy_without_cupy_is_refused_at_parse_time(monkeypatch, capsys, tiny):
    monkeypatch.setattr(plinth.model, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(SystemExit):
        main(["--plugins", "llama", "generate", "-m", str(tiny), "--backend", "cupy", "hi"])
    assert "--backend cupy: " in capsys.readouterr().err


def test_good_options_still_generate(tiny, capsys):
    assert main(["--plugins", "llama", "generate", "-m", str(tiny), "-n", "3", "--temperature", "0.7", "--top-p",
                 "0.9", "--seed", "1", "--spec", "ngram", "hi"]) == 0


def test_file_without_tokenizer_fails_generate_at_once_before_weights(tmp_path, capsys):
    """One line naming the file and the missing key, in under a second, before any weight loads.

    The file also lacks required tensors: the tokenizer error comes first, so the tensors were never read.
    """
    from plinth.plugins import discover
    from plinth.testing import tiny_metadata, write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path / "notok.gguf", "llama", tiny_metadata("llama"), discover(plugins="llama"),
                                drop=["blk.1.ffn_up.weight"])
    t0 = time.perf_counter()
    code = main(["--plugins", "llama", "generate", "-m", str(path), "hi"])
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert code == 1
    assert elapsed < 1.0, elapsed
    assert err.count("\n") == 1 and err.startswith(f"plinth: error: {path}: missing key 'tokenizer.ggml.model'"), err


def test_info_accepts_the_model_as_an_argument(tiny):
    proc = run_cli("info", str(tiny))
    assert proc.returncode == 0, proc.stderr
    assert b"architecture: llama" in proc.stdout


@pytest.mark.parametrize("target", ["dir", "fifo", "/dev/null"])
def test_odd_paths_are_named(tmp_path, target):
    path = {"dir": str(tmp_path), "fifo": str(tmp_path / "p.gguf"), "/dev/null": "/dev/null"}[target]
    if target == "fifo":
        os.mkfifo(path)
    proc = run_cli("info", "-m", path, timeout=60)
    assert proc.returncode == 1
    err = proc.stderr.decode()
    assert err.startswith(f"plinth: error: {path}: is ") and err.count("\n") == 1, err


def test_unknown_plugin_selected_is_named(tiny):
    proc = run_cli("--plugins", "llama,nosuch", "info", str(tiny))
    assert proc.returncode == 0
    assert b"plinth: warning: unknown plugin(s) selected: nosuch" in proc.stderr
    assert proc.stderr.count(b"\n") == 1, proc.stderr


def test_non_utf8_argv_and_stdin_are_replaced_not_crashed(tiny):
    for args in (["generate", "-m", str(tiny), "-n", "2", b"caf\xe9 \xff"],
                 ["generate", "-m", str(tiny), "-n", "2", "--chat", b"caf\xe9 \xff"],
                 ["tokenize", "-m", str(tiny), b"caf\xe9 \xff"]):
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr
        assert b"Traceback" not in proc.stderr
        assert b"is not valid UTF-8" in proc.stderr
    proc = run_cli("tokenize", "-m", str(tiny), b"caf\xe9")
    # the invalid byte became U+FFFD, three bytes of the byte-level vocabulary
    assert proc.stdout.split() == [b"99", b"97", b"102", b"239", b"191", b"189"]
    proc = run_cli("chat", "-m", str(tiny), "-n", "2", stdin=b"caf\xe9 \xff\n")
    assert proc.returncode == 0, proc.stderr
    assert b"Traceback" not in proc.stderr


def test_closed_pipe_is_quiet(tiny, tmp_path):
    err = tmp_path / "err.txt"
    text = "a" * 100_000
    shell = (f"{sys.executable} -m plinth tokenize -m {tiny} {text} 2>{err} | head -c 10 >/dev/null; "
             "echo ${PIPESTATUS[0]}")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PLINTH_PLUGINS="llama")
    proc = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=120, env=env)
    assert err.read_text() == "", err.read_text()
    assert proc.stdout.strip() == "1"


#: run plinth's __main__ as `python -m plinth` does, with a marker byte on stderr just before its first
#: instruction (the import system's own work of finding it is not plinth's code)
STARTER = ("import importlib.util, os, sys; sys.argv = ['plinth', 'plugins', '--check']; "
           "spec = importlib.util.find_spec('plinth.__main__'); code = spec.loader.get_code('plinth.__main__'); "
           "os.write(2, b'@'); exec(code, {'__name__': '__main__', '__spec__': spec})")


def _numpy_mapped(pid: int) -> bool:
    try:
        return "_multiarray_umath" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


_UNDISTURBED: dict[str, bytes] = {}


def _undisturbed_output(env: dict) -> bytes:
    """What STARTER prints to stdout when no signal comes (computed once)."""
    if "out" not in _UNDISTURBED:
        proc = subprocess.run([sys.executable, "-c", STARTER], capture_output=True, env=env, timeout=120)
        _UNDISTURBED["out"] = proc.stdout
    return _UNDISTURBED["out"]


@pytest.mark.parametrize("when", ["0.02", "0.1", "0.3", "numpy"])
def test_ctrl_c_from_the_first_instruction_is_clean(when):
    """SIGINT while the CLI imports, discovers plugins or imports their modules exits 130 with one blank line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLINTH_")}
    env["OPENBLAS_NUM_THREADS"] = "1"
    proc = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stderr.read(1) == b"@"
    if when == "numpy":  # inside the plugin imports of `plugins --check`
        deadline = time.monotonic() + 30
        while not _numpy_mapped(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
    else:
        time.sleep(float(when))
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    if proc.returncode == 0:  # finished before the signal
        return
    if proc.returncode == -signal.SIGINT and out and out == _undisturbed_output(env):
        # the CLI had finished and the interpreter was shutting down, when Python has already put the
        # default SIGINT action back; nothing of plinth's ran any more
        return
    assert b"Traceback" not in err, err.decode()
    assert proc.returncode == 130 and err == b"\n", (proc.returncode, err)

"""`plinth generate` and `plinth chat` on the real models, run as a user would (a subprocess).

* Greedy generation prints exactly the text transformers' greedy generation
  decodes to, on the same dequantized weights (golden files of
  ``test_real_accuracy.py``; the text was decoded by transformers' own GGUF
  tokenizer), up to the first end-of-generation token. These runs use the
  f32-activation kernels (``PLINTH_INT8=0``), whose arithmetic is transformers';
  the int8-activation decode, which rounds activations as llama.cpp does, is held
  to llama.cpp's bar in ``test_real_accuracy.py``.
* Chat answers a question, stops at the end-of-turn token and prints no
  template markup.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from plinth.testing import load_module

GOLDEN = Path(__file__).resolve().parent / "golden"


golden = load_module(GOLDEN / "make_real_golden.py")

pytestmark = [pytest.mark.real, pytest.mark.network]

MARKUP = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>",
          "<|user|>", "<|assistant|>")


def plinth_cli(*args: str, stdin: str | None = None, timeout: float = 300, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "2"), **env_vars)
    return subprocess.run([sys.executable, "-m", "plinth", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


def _cases():
    for key in sorted(golden.MODELS):
        for i, (kind, _, _) in enumerate(golden.PROMPTS):
            yield pytest.param(key, i, id=f"{key}-{kind}")


@pytest.mark.slow
@pytest.mark.parametrize("key,index", list(_cases()))
def test_generate_greedy_prints_transformers_text(key, index):
    _, runs = golden.load(key)
    r = runs[index]
    if r["chat"] and not golden.tokenizer(key).chat_template:
        pytest.skip(f"{key}: the GGUF has no tokenizer.chat_template, so `plinth generate --chat` refuses it "
                    "(the chat prompt is still checked in-process by test_real_accuracy.py)")
    args = ["generate", "-m", golden.MODELS[key]["name"], "--temperature", "0", "-n", str(golden.N_GREEDY)]
    if r["chat"]:
        args.append("--chat")
    proc = plinth_cli(*args, "--", r["text"], PLINTH_INT8="0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == r["reference_text"] + "\n", (
        f"{key}/{r['kind']}: plinth printed {proc.stdout!r}, transformers decoded {r['reference_text']!r}")


CHAT_QUESTION = "What is the capital of France? Answer in one short sentence."


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(golden.MODELS))
def test_chat_answers_and_stops_at_end_of_turn(key):
    """`plinth chat` (stdin, one turn) answers, stops at the end-of-turn token, prints no markup."""
    if not golden.tokenizer(key).chat_template:
        pytest.skip(f"{key}: the GGUF has no tokenizer.chat_template; plinth refuses to guess one")
    proc = plinth_cli("chat", "-m", golden.MODELS[key]["name"], "--temperature", "0", "-n", "96", "--stats",
                      stdin=CHAT_QUESTION + "\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    reply = proc.stdout.strip()
    assert reply, "empty reply"
    assert "stop: end of generation token" in proc.stderr, proc.stderr[-1000:]
    for m in MARKUP:
        assert m not in proc.stdout, f"template markup {m!r} in the reply {proc.stdout!r}"
    assert "paris" in reply.lower(), reply


@pytest.mark.slow
def test_generate_chat_flag_stops_at_end_of_turn():
    """`plinth generate --chat` on the default model: same stop rule, no markup."""
    proc = plinth_cli("generate", "--chat", "--stats", "-n", "96", "--", CHAT_QUESTION)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()
    assert "stop: end of generation token" in proc.stderr, proc.stderr[-1000:]
    for m in MARKUP:
        assert m not in proc.stdout

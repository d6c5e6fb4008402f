"""Damaged model files: `plinth info` and `load_model` end in one named line, never a traceback or a silent load.

Each case is a tiny llama model with one value that parses but makes no sense,
or one structural change (misaligned, overlapping or re-typed tensor data),
built by ``tests/fuzz_gguf.py``. The expected message fragments are the "why"
of ``FILE: what: why``.
"""

from __future__ import annotations

import contextlib
import io
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from plinth.commands.models import run_info
from plinth.errors import UserError
from plinth.generate import render_chat
from plinth.gguf import GGUFFile
from plinth.model import load_model
from plinth.plugins import discover
from plinth.testing import load_module

pytest.importorskip("gguf")
fuzz = load_module(Path(__file__).with_name("fuzz_gguf.py"), "fuzz_gguf")

#: semantic case -> a fragment of the one-line error (both info and load_model must give it)
EXPECTED = {
    "head_count=0": "key 'llama.attention.head_count' = 0: must be >= 1",
    "embedding_length=0": "key 'llama.embedding_length' = 0: must be >= 1",
    "block_count=0": "key 'llama.block_count' = 0: must be >= 1",
    "block_count=-1": "key 'llama.block_count' = -1: must be >= 1",
    "block_count=10^6": "key 'llama.block_count' = 1000000: ",
    "block_count=10^8": "key 'llama.block_count' = 100000000: ",
    "head_count_kv=3": "not a multiple of 3 KV heads",
    "rope.dimension_count>head": "key 'llama.rope.dimension_count' = 64: larger than the head size 16",
    "rope.dimension_count odd": "must be even",
    "eps=NaN": "key 'llama.attention.layer_norm_rms_epsilon' = nan: expected a finite number",
    "eps=inf": "expected a finite number",
    "eps=0": "must be > 0",
    "rope base<0": "key 'llama.rope.freq_base' = -10000.0: must be > 0",
    "rope base=NaN": "key 'llama.rope.freq_base' = nan",
    "rope base=0": "must be > 0",
    "context_length=0": "key 'llama.context_length' = 0",
    "head_count as array of zeros": "key 'llama.attention.head_count[0]' = 0: must be >= 1",
    "block_count as float": "expected an integer",
    "block_count as string": "expected an integer",
    "alignment=true": "key 'general.alignment' = True",
    "alignment=3": "not a power of two",
    "alignment as array": "key 'general.alignment' = an array of 2 values",
    "architecture as array": "key 'general.architecture' = an array of 1 values",
    "architecture as int": "key 'general.architecture' = 7",
    "architecture unknown": "no loaded plugin provides the architecture 'nosucharch'",
    "arrays nested 20000 deep": "arrays nested more than 4 deep",
    "2^20 empty arrays": "more than 65536 nested arrays",
    "2^20 keys holding empty arrays": "more than 65536 are not supported",
    "2^20 string array count": "cannot fit in the file",
}
#: cases that pass `plinth info` (it reads no tokenizer) but fail load_model(tokenizer=True) or the chat rendering
TOKENIZER = {
    "tokens as number": "key 'tokenizer.ggml.tokens' = 257: expected an array of strings",
    "tokens missing": "key 'tokenizer.ggml.tokens' missing",
    "tokens shorter than vocab": "key 'tokenizer.ggml.tokens' = an array of 100 values: the model has n_vocab = 257",
    "token_type short": "key 'tokenizer.ggml.token_type' has 10 entries but 'tokenizer.ggml.tokens' has 257",
    "token_type out of range": "token 256 has type 77",
    "tokenizer model missing": "missing key 'tokenizer.ggml.model'",
    "tokenizer model unknown": "key 'tokenizer.ggml.model' = str 'wordpiece': unsupported",
    "tokenizer pre unknown": "key 'tokenizer.ggml.pre' = str 'nosuchpre'",
    "merges referencing a missing token": "key 'tokenizer.ggml.merges' entry 0 ('a b') uses 'ab'",
    "chat template broken": "key 'tokenizer.chat_template': template syntax error at line 1",
    "chat template raises": "key 'tokenizer.chat_template': the template refused the messages: no",
    "chat template as int": "key 'tokenizer.chat_template' = 5",
}
LOADS = {"alignment=64", "eos id out of range"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("damaged")
    base = fuzz.write_model(folder / "base.gguf")
    lay = fuzz.Layout(base.read_bytes())
    out = {"base": base}
    for i, (kind, write) in enumerate(fuzz.semantic_cases(base, lay)):
        path = folder / f"case{i:03d}.gguf"
        write(path)
        out[kind] = path
    return out


@pytest.fixture(scope="module")
def registry():
    return discover(plugins="llama")


def info(path: Path, registry) -> str:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        run_info(fuzz.info_namespace(path, registry))
    return out.getvalue()


def load_and_chat(path: Path, registry) -> None:
    model = load_model(path, registry=registry, tokenizer=True)
    tok = model.tokenizer
    render_chat(tok.chat_template, [{"role": "user", "content": "hi"}], tok)


def test_every_semantic_case_is_covered(files):
    assert set(files) - {"base"} == set(EXPECTED) | set(TOKENIZER) | LOADS | {
        "key_length=0", "feed_forward_length=0", "vocab_size=0", "vocab_size=10^9", "head_count_kv=0",
        "eps<0", "head_count array too short"}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_nonsense_values_are_one_named_line(files, registry, kind):
    path = files[kind]
    for action in (lambda: info(path, registry), lambda: load_and_chat(path, registry)):
        t0 = time.perf_counter()
        with pytest.raises(UserError) as exc:
            action()
        assert time.perf_counter() - t0 < 10
        text = str(exc.value)
        assert text.startswith(f"{path}: "), text
        assert "\n" not in text
        assert EXPECTED[kind] in text


@pytest.mark.parametrize("kind", ["key_length=0", "feed_forward_length=0", "vocab_size=0", "head_count_kv=0",
                                  "eps<0", "head_count array too short", "vocab_size=10^9"])
def test_more_nonsense_values_are_named(files, registry, kind):
    with pytest.raises(UserError, match=rf"^{files[kind]}: "):
        load_and_chat(files[kind], registry)


@pytest.mark.parametrize("kind", sorted(TOKENIZER))
def test_tokenizer_and_template_errors_are_named(files, registry, kind):
    path = files[kind]
    with pytest.raises(UserError) as exc:
        load_and_chat(path, registry)
    assert str(exc.value).startswith(f"{path}: "), str(exc.value)
    assert TOKENIZER[kind] in str(exc.value)


@pytest.mark.parametrize("kind", sorted(LOADS))
def test_odd_but_valid_files_load(files, registry, kind):
    with pytest.warns(UserWarning) if kind == "eos id out of range" else contextlib.nullcontext():
        load_and_chat(files[kind], registry)


@pytest.mark.parametrize("delta", [1, 2, 4, 32, -32])
def test_moved_tensor_offsets_are_refused(files, registry, tmp_path, delta):
    """Misaligned (+1, +2, +4) or overlapping (+-alignment) offsets once loaded silently as garbage."""
    data = files["base"].read_bytes()
    lay = fuzz.Layout(data)
    t = next(t for t in lay.tensors if t["name"] == "blk.0.attn_k.weight")
    path = tmp_path / "moved.gguf"
    path.write_bytes(fuzz._put(data, t["offset_at"], "<Q", t["offset"] + delta))
    with pytest.raises(UserError, match=rf"^{path}: tensor 'blk.0.attn_k.weight' data"):
        GGUFFile(path)
    with pytest.raises(UserError, match=rf"^{path}: "):
        load_model(path, registry=registry)


def test_overlapping_tensor_offsets_are_refused(files, tmp_path):
    data = files["base"].read_bytes()
    lay = fuzz.Layout(data)
    a, b = lay.tensors[3], lay.tensors[4]
    path = tmp_path / "overlap.gguf"
    path.write_bytes(fuzz._put(data, b["offset_at"], "<Q", a["offset"]))
    with pytest.raises(UserError, match="overlaps the tensor before it|unexplained bytes"):
        GGUFFile(path)


@pytest.mark.parametrize("new_type", [1, 8, 2])  # F16, Q8_0, Q4_0: smaller than the F32 data written
def test_shrunk_tensor_type_is_refused(files, tmp_path, new_type):
    data = files["base"].read_bytes()
    lay = fuzz.Layout(data)
    t = next(t for t in lay.tensors if t["name"] == "blk.0.ffn_gate.weight")
    path = tmp_path / "shrunk.gguf"
    path.write_bytes(fuzz._put(data, t["type_at"], "<I", new_type))
    with pytest.raises(UserError, match=rf"^{path}: tensor '.*' data at offset \d+ (leaves|overlaps)"):
        GGUFFile(path)


def test_last_tensor_shrunk_is_refused(files, tmp_path):
    data = files["base"].read_bytes()
    lay = fuzz.Layout(data)
    last = max(lay.tensors, key=lambda t: t["offset"])
    path = tmp_path / "shrunk_last.gguf"
    path.write_bytes(fuzz._put(data, last["type_at"], "<I", 1))  # F32 -> F16: half the bytes
    with pytest.raises(UserError, match="bytes after the last tensor's data"):
        GGUFFile(path)


def test_an_untouched_file_still_loads_and_reads_what_was_written(files, registry):
    model = load_model(files["base"], registry=registry, tokenizer=True)
    assert np.isfinite(model.logits([1, 2, 3])).all()


def test_block_count_is_bounded_by_the_tensors_present(files, registry, tmp_path):
    """A small file asking for more layers than it has tensors fails before any per-layer spec is built."""
    path = fuzz.write_model(tmp_path / "many.gguf", **{"llama.block_count": 60000})
    t0 = time.perf_counter()
    with pytest.raises(UserError, match=rf"^{path}: key 'llama.block_count' = 60000: more layers than the file "
                                        r"has tensors \(21\)$"):
        load_model(path, registry=registry)
    assert time.perf_counter() - t0 < 2


def test_a_flipped_byte_in_a_vocabulary_string_is_named(registry, tmp_path):
    """One byte of a BPE vocabulary string changed in the file: the merge that needs it names it."""
    from plinth.testing import byte_vocab
    from plinth.tokenizer.core import _BYTE_TO_CHAR

    vocab = byte_vocab()
    a, b = _BYTE_TO_CHAR[ord("q")], _BYTE_TO_CHAR[ord("z")]
    tokens = vocab["tokenizer.ggml.tokens"] + [a + b]
    path = fuzz.write_model(tmp_path / "vocab.gguf", **{
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * 256 + [3, 1],
        "tokenizer.ggml.merges": [f"{a} {b}"], "llama.vocab_size": 258})
    data = path.read_bytes()
    needle = struct.pack("<Q", 2) + (a + b).encode()
    assert data.count(needle) == 1
    path.write_bytes(data.replace(needle, struct.pack("<Q", 2) + (a + "y").encode()))
    with pytest.raises(UserError, match=rf"^{path}: key 'tokenizer.ggml.merges' entry 0 \('q z'\) uses 'qz', which "
                                        r"is not in 'tokenizer.ggml.tokens'"):
        load_model(path, registry=registry, tokenizer=True)


def test_special_files_are_named_not_opened(tmp_path):
    import os

    from plinth.hub import HubError, resolve_model

    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    for path, why in ((tmp_path, "is a directory"), (fifo, "not a regular file"), ("/dev/null", "not a regular file")):
        with pytest.raises(HubError, match=why):
            resolve_model(str(path))
        with pytest.raises(UserError, match="not a regular file"):
            GGUFFile(path)


def test_nested_and_counted_arrays_are_refused_before_allocation(tmp_path, files):
    lay = fuzz.Layout(files["base"].read_bytes())
    path = tmp_path / "huge_array.gguf"
    path.write_bytes(lay.with_extra_kv(fuzz._gguf_string("x.big") + struct.pack("<IIQ", 9, 6, 2**40)))
    with pytest.raises(UserError, match="truncated file"):
        GGUFFile(path)


def test_chat_template_compiled_once_and_errors_name_their_file():
    """render_chat compiles a template once (a server renders every request's messages with it), and a template
    shared by two files still names the file it is rendered for when it refuses or does not compile."""
    from types import SimpleNamespace

    from plinth.generate import _chat_template

    def tok(source):
        return SimpleNamespace(source=source, tokens=["<s>", "</s>"], bos_id=0, eos_id=1)

    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}{{ eos_token }}"
    _chat_template.cache_clear()
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(template, msgs, tok("a.gguf")) == "<s>[user] hi</s>"
    assert render_chat(template, msgs + [{"role": "assistant", "content": "yo"}], tok("a.gguf")) == \
        "<s>[user] hi[assistant] yo</s>"
    info = _chat_template.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    refuse = "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}ok"
    assert render_chat(refuse, msgs, tok("a.gguf")) == "ok"
    for source in ("a.gguf", "b.gguf"):
        with pytest.raises(UserError, match=rf"^{source}: key 'tokenizer.chat_template': the template refused the "
                                            r"messages: one message only$"):
            render_chat(refuse, msgs * 2, tok(source))
        with pytest.raises(UserError, match=rf"^{source}: key 'tokenizer.chat_template': template syntax error"):
            render_chat("{% for m in messages %}", msgs, tok(source))

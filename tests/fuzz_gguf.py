"""Mutation fuzzing of GGUF model files: every damaged file gets a named error or loads correctly.

A tiny llama model (byte-level vocabulary, chat template, F32 and Q8_0 tensors)
is written once; each case is a mutated copy of it:

* structural: truncation, byte flips in the header / key-values / tensor infos,
  absurd counts and string lengths, changed value types, tensor offsets moved
  (misaligned, overlapping), tensor types changed (a smaller or larger type),
  dimensions changed;
* semantic: values that parse but make no sense (0 heads, NaN epsilon, negative
  rope base, a million layers, alignment = true, the architecture as an array,
  the tokens list as a number, short token-type lists, arrays nested 20,000
  deep, 2^20 empty arrays...).

Each case runs in a worker process, as ``plinth info`` would (the ``info``
command's function) and as ``plinth.load_model(..., tokenizer=True)`` followed
by one forward and, when the file has a template, one chat rendering. Outcomes:

* ``named error``: a :class:`plinth.errors.UserError` (or plugin error) whose
  message starts with the file's path;
* ``loaded``: the load succeeded, every tensor whose name, type and shape are
  unchanged reads the original bytes, and the logits are finite;
* failures: ``traceback`` (any other exception), ``unnamed error`` (a user error
  not naming the file), ``garbage`` (loaded, but moved bytes or non-finite
  logits), ``hang`` (over 10 s), ``memory`` (over 1 GB traced allocation).

Run ``python tests/fuzz_gguf.py --cases 600`` for the long run and its table.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import select
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

HANG_S = 10.0
MEMORY_LIMIT = 1 << 30
FAILURES = ("traceback", "unnamed error", "garbage", "hang", "memory")

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


# ---------------------------------------------------------------------------- the tiny model

def base_metadata(**changes: Any) -> dict[str, Any]:
    from plinth.testing import byte_vocab, tiny_metadata

    md = tiny_metadata("llama", n_vocab=257, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96) | byte_vocab()
    md["tokenizer.chat_template"] = TEMPLATE
    md["llama.rope.freq_base"] = 10000.0
    for key, value in changes.items():
        if value is None:
            md.pop(key, None)
        else:
            md[key] = value
    return md


def write_model(path: Path, **changes: Any) -> Path:
    import gguf

    from plinth.plugins import discover
    from plinth.testing import random_tensors, write_gguf
    from plinth.testing.synthetic import synthetic_specs

    md = base_metadata()
    registry = discover(plugins="llama")
    hp = registry.arch_hparams("llama", md, str(path))
    tensors = random_tensors(synthetic_specs(registry, "llama", hp), seed=0)
    qtypes = {name: gguf.GGMLQuantizationType.Q8_0 for name in tensors
              if name.endswith(("attn_q.weight", "ffn_up.weight"))}
    md = base_metadata(**changes)
    return write_gguf(path, md, tensors, qtypes)


# ---------------------------------------------------------------------------- byte layout

class Layout:
    """Where each field of a GGUF file lies (offsets into its bytes)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 24
        self.n_tensors = struct.unpack_from("<Q", data, 8)[0]
        self.n_kv = struct.unpack_from("<Q", data, 16)[0]
        self.kvs: list[dict[str, Any]] = []
        self.counts: list[int] = []  # offsets of array counts and string lengths
        for _ in range(self.n_kv):
            start = self.pos
            key = self._string()
            type_at = self.pos
            vtype = self._u32()
            value_at = self.pos
            self._value(vtype)
            self.kvs.append(dict(key=key, start=start, type_at=type_at, value_at=value_at, end=self.pos, vtype=vtype))
        self.kv_end = self.pos
        self.tensors: list[dict[str, Any]] = []
        for _ in range(self.n_tensors):
            self.counts.append(self.pos)
            name = self._string()
            ndim_at = self.pos
            n_dims = self._u32()
            ne_at = self.pos
            self.pos += 8 * n_dims
            type_at = self.pos
            ggml_type = self._u32()
            offset_at = self.pos
            offset = struct.unpack_from("<Q", data, self.pos)[0]
            self.pos += 8
            self.tensors.append(dict(name=name, ndim_at=ndim_at, n_dims=n_dims, ne_at=ne_at, type_at=type_at,
                                     type=ggml_type, offset_at=offset_at, offset=offset))
        self.info_end = self.pos
        self.alignment = 32
        self.data_offset = (self.pos + 31) // 32 * 32

    def _u32(self) -> int:
        v = struct.unpack_from("<I", self.data, self.pos)[0]
        self.pos += 4
        return v

    def _string(self) -> str:
        self.counts.append(self.pos)
        n = struct.unpack_from("<Q", self.data, self.pos)[0]
        self.pos += 8
        s = self.data[self.pos:self.pos + n].decode("utf-8", "replace")
        self.pos += n
        return s

    def _value(self, vtype: int) -> None:
        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
        if vtype == 8:
            self._string()
        elif vtype == 9:
            itype = self._u32()
            self.counts.append(self.pos)
            count = struct.unpack_from("<Q", self.data, self.pos)[0]
            self.pos += 8
            for _ in range(count):
                if itype in sizes:
                    self.pos += sizes[itype] * count
                    break
                self._value(itype)
        else:
            self.pos += sizes[vtype]

    def kv(self, key: str) -> dict[str, Any]:
        return next(k for k in self.kvs if k["key"] == key)

    def with_extra_kv(self, raw_kv: bytes, n: int = 1) -> bytes:
        """The file with ``n`` more key-value pairs (raw bytes) after the others; the data section moves along."""
        d = self.data
        head = bytearray(d[:self.kv_end]) + raw_kv + d[self.kv_end:self.info_end]
        struct.pack_into("<Q", head, 16, self.n_kv + n)
        head += b"\0" * ((-len(head)) % self.alignment)
        return bytes(head) + d[self.data_offset:]


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


# ---------------------------------------------------------------------------- mutations

def _put(data: bytes, at: int, fmt: str, value: Any) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


def _flip(data: bytes, rng: random.Random, lo: int, hi: int, n: int) -> bytes:
    out = bytearray(data)
    for _ in range(n):
        i = rng.randrange(lo, hi)
        out[i] ^= rng.randrange(1, 256)
    return bytes(out)


def structural(data: bytes, lay: Layout, rng: random.Random) -> tuple[str, bytes]:
    """One random structural mutation of ``data``: (kind, bytes)."""
    kind = rng.choice(["truncate", "flip-header", "flip-kv", "flip-kv", "flip-tensor-info", "flip-tensor-info",
                       "count", "value-type", "offset", "offset", "tensor-type", "dims"])
    if kind == "truncate":
        cut = rng.choice([rng.randrange(0, lay.info_end), rng.randrange(lay.info_end, len(data))])
        return kind, data[:cut]
    if kind == "flip-header":
        return kind, _flip(data, rng, 0, 24, rng.randint(1, 2))
    if kind == "flip-kv":
        return kind, _flip(data, rng, 24, lay.kv_end, rng.randint(1, 3))
    if kind == "flip-tensor-info":
        return kind, _flip(data, rng, lay.kv_end, lay.info_end, rng.randint(1, 3))
    if kind == "count":
        at = rng.choice([8, 16, *lay.counts])
        value = rng.choice([0, 1, 2**20, 2**32, 2**63, 2**64 - 1, len(data), len(data) // 8])
        return kind, _put(data, at, "<Q", value)
    if kind == "value-type":
        kv = rng.choice(lay.kvs)
        return kind, _put(data, kv["type_at"], "<I", rng.randrange(0, 14))
    if kind == "offset":
        t = rng.choice(lay.tensors)
        other = rng.choice(lay.tensors)
        value = rng.choice([t["offset"] + d for d in (1, 2, 4, 8, 16, 32, -32, 64)] + [other["offset"], 0, 2**40])
        return kind, _put(data, t["offset_at"], "<Q", max(0, value))
    if kind == "tensor-type":
        t = rng.choice(lay.tensors)
        return kind, _put(data, t["type_at"], "<I", rng.choice([0, 1, 2, 3, 8, 12, 14, 24, 26, 30, 5, 99]))
    t = rng.choice([t for t in lay.tensors if t["n_dims"]])
    dim = rng.randrange(t["n_dims"])
    at = t["ne_at"] + 8 * dim
    old = struct.unpack_from("<Q", data, at)[0]
    return "dims", _put(data, at, "<Q", rng.choice([0, old * 2, max(1, old // 2), old + 1, 2**40]))


def semantic_cases(base: Path, lay: Layout) -> list[tuple[str, Callable[[Path], None]]]:
    """Files whose values parse but make no sense, by name: (kind, writer)."""
    def md(**changes: Any) -> Callable[[Path], None]:
        return lambda path: write_model(path, **changes)

    def raw(build: Callable[[], bytes]) -> Callable[[Path], None]:
        return lambda path: path.write_bytes(build())

    nan, inf = float("nan"), float("inf")
    cases: list[tuple[str, Callable[[Path], None]]] = [
        ("head_count=0", md(**{"llama.attention.head_count": 0})),
        ("embedding_length=0", md(**{"llama.embedding_length": 0})),
        ("block_count=0", md(**{"llama.block_count": 0})),
        ("block_count=-1", md(**{"llama.block_count": -1})),
        ("block_count=10^6", md(**{"llama.block_count": 10**6})),
        ("block_count=10^8", md(**{"llama.block_count": 10**8})),
        ("head_count_kv=3", md(**{"llama.attention.head_count_kv": 3})),
        ("head_count_kv=0", md(**{"llama.attention.head_count_kv": 0})),
        ("rope.dimension_count>head", md(**{"llama.rope.dimension_count": 64})),
        ("rope.dimension_count odd", md(**{"llama.rope.dimension_count": 7})),
        ("eps=NaN", md(**{"llama.attention.layer_norm_rms_epsilon": nan})),
        ("eps=inf", md(**{"llama.attention.layer_norm_rms_epsilon": inf})),
        ("eps=0", md(**{"llama.attention.layer_norm_rms_epsilon": 0.0})),
        ("eps<0", md(**{"llama.attention.layer_norm_rms_epsilon": -1e-6})),
        ("rope base<0", md(**{"llama.rope.freq_base": -10000.0})),
        ("rope base=NaN", md(**{"llama.rope.freq_base": nan})),
        ("rope base=0", md(**{"llama.rope.freq_base": 0.0})),
        ("context_length=0", md(**{"llama.context_length": 0})),
        ("key_length=0", md(**{"llama.attention.key_length": 0})),
        ("feed_forward_length=0", md(**{"llama.feed_forward_length": 0})),
        ("vocab_size=0", md(**{"llama.vocab_size": 0})),
        ("vocab_size=10^9", md(**{"llama.vocab_size": 10**9})),
        ("head_count as array of zeros", md(**{"llama.attention.head_count": [0, 0]})),
        ("head_count array too short", md(**{"llama.attention.head_count": [4]})),
        ("block_count as float", md(**{"llama.block_count": 2.0})),
        ("block_count as string", md(**{"llama.block_count": "2"})),
        ("alignment=true", md(**{"general.alignment": True})),
        ("alignment=3", md(**{"general.alignment": 3})),
        ("alignment as array", md(**{"general.alignment": [32, 32]})),
        ("alignment=64", md(**{"general.alignment": 64})),
        ("architecture as array", raw(lambda: _replace_kv(lay, "general.architecture", 9,
                                                          struct.pack("<IQ", 8, 1) + _gguf_string("llama")))),
        ("architecture as int", raw(lambda: _replace_kv(lay, "general.architecture", 4, struct.pack("<I", 7)))),
        ("architecture unknown", raw(lambda: _replace_kv(lay, "general.architecture", 8,
                                                         _gguf_string("nosucharch")))),
        ("tokens as number", md(**{"tokenizer.ggml.tokens": 257})),
        ("tokens missing", md(**{"tokenizer.ggml.tokens": None})),
        ("tokens shorter than vocab", md(**{"tokenizer.ggml.tokens": [f"t{i}" for i in range(100)],
                                            "tokenizer.ggml.token_type": [1] * 100, "tokenizer.ggml.eos_token_id": 99})),
        ("token_type short", md(**{"tokenizer.ggml.token_type": [1] * 10})),
        ("token_type out of range", md(**{"tokenizer.ggml.token_type": [1] * 256 + [77]})),
        ("tokenizer model missing", md(**{"tokenizer.ggml.model": None})),
        ("tokenizer model unknown", md(**{"tokenizer.ggml.model": "wordpiece"})),
        ("tokenizer pre unknown", md(**{"tokenizer.ggml.pre": "nosuchpre"})),
        ("merges referencing a missing token", md(**{"tokenizer.ggml.merges": ["a b"]})),
        ("eos id out of range", md(**{"tokenizer.ggml.eos_token_id": 10**6})),
        ("chat template broken", md(**{"tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }"})),
        ("chat template raises", md(**{"tokenizer.chat_template": "{{ raise_exception('no') }}"})),
        ("chat template as int", md(**{"tokenizer.chat_template": 5})),
        ("arrays nested 20000 deep", raw(lambda: lay.with_extra_kv(
            _gguf_string("x.nested") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 20000
            + struct.pack("<IQ", 4, 0)))),
        ("2^20 empty arrays", raw(lambda: lay.with_extra_kv(
            _gguf_string("x.empties") + struct.pack("<IIQ", 9, 9, 2**20) + struct.pack("<IQ", 4, 0) * 2**20))),
        ("2^20 keys holding empty arrays", raw(lambda: lay.with_extra_kv(
            b"".join(_gguf_string(f"x.k{i}") + struct.pack("<IIQ", 9, 4, 0) for i in range(2**20)), n=2**20))),
        ("2^20 string array count", raw(lambda: lay.with_extra_kv(
            _gguf_string("x.strs") + struct.pack("<IIQ", 9, 8, 2**40)))),
    ]
    return cases


def _replace_kv(lay: Layout, key: str, vtype: int, value: bytes) -> bytes:
    """The file with ``key``'s type and value bytes replaced (the data section moves along)."""
    kv = lay.kv(key)
    d = lay.data
    head = bytearray(d[:kv["type_at"]]) + struct.pack("<I", vtype) + value + d[kv["end"]:lay.info_end]
    head += b"\0" * ((-len(head)) % lay.alignment)
    return bytes(head) + d[lay.data_offset:]


def make_cases(folder: Path, n: int, seed: int = 0) -> list[tuple[str, Path]]:
    """The base model plus ``n`` mutated files in ``folder``: [(kind, path)], semantic cases first."""
    folder.mkdir(parents=True, exist_ok=True)
    base = write_model(folder / "base.gguf")
    data = base.read_bytes()
    lay = Layout(data)
    rng = random.Random(seed)
    cases: list[tuple[str, Path]] = [("unchanged", base)]
    for i, (kind, write) in enumerate(semantic_cases(base, lay)):
        if len(cases) > n:
            break
        path = folder / f"sem{i:03d}.gguf"
        write(path)
        cases.append((kind, path))
    i = 0
    while len(cases) <= n:
        kind, mutated = structural(data, lay, rng)
        path = folder / f"mut{i:04d}.gguf"
        path.write_bytes(mutated)
        cases.append((kind, path))
        i += 1
    return cases


# ---------------------------------------------------------------------------- one case (in the worker)

def _named(exc: BaseException, path: Path) -> bool:
    return str(exc).startswith(str(path))


_PARSERS: dict[int, Any] = {}


def info_namespace(path: Path, registry: Any) -> argparse.Namespace:
    """``plinth info -m PATH --tensors`` parsed by the real CLI parser, with ``registry``."""
    from plinth.cli import build_parser

    parser = _PARSERS.setdefault(id(registry), build_parser(registry))
    args = parser.parse_args(["info", "-m", str(path), "--tensors"])
    args.registry = registry
    return args


def run_case(path: Path, base: Path, registry: Any) -> dict[str, Any]:
    """Run ``info`` and ``load_model`` on one file; return its outcome."""
    import contextlib
    import io

    import numpy as np

    from plinth.commands.models import run_info
    from plinth.errors import UserError
    from plinth.generate import render_chat
    from plinth.gguf import GGUFFile
    from plinth.model import load_model
    from plinth.plugins import PluginError

    def attempt(fn: Callable[[], Any]) -> tuple[str, str]:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                fn()
            return "ok", ""
        except (UserError, PluginError) as exc:
            return ("named error" if _named(exc, path) else "unnamed error"), str(exc).splitlines()[0][:300]
        except MemoryError:
            return "memory", "MemoryError"
        except Exception as exc:  # noqa: BLE001 - this is what the fuzz looks for
            return "traceback", f"{type(exc).__name__}: {exc}"[:300]

    info_args = info_namespace(path, registry)
    info, info_msg = attempt(lambda: run_info(info_args))
    loaded: dict[str, Any] = {}

    def load() -> None:
        model = load_model(path, registry=registry, tokenizer=True)
        loaded["model"] = model
        logits = model.logits([1, 2, 3])
        loaded["finite"] = bool(np.isfinite(logits).all())
        tok = model.tokenizer
        if tok.chat_template:
            text = render_chat(tok.chat_template, [{"role": "user", "content": "hi"}], tok)
            tok.encode(text, add_special=False, parse_special=True)

    load_outcome, load_msg = attempt(load)
    outcome, message = load_outcome, load_msg
    if info in ("traceback", "unnamed error", "memory"):
        outcome, message = info, "info: " + info_msg
    elif load_outcome == "ok":
        outcome = "loaded"
        if not loaded.get("finite", False):
            outcome, message = "garbage", "non-finite logits"
        else:
            with GGUFFile(base) as ref, GGUFFile(path) as got:
                for name, t in got.tensors.items():
                    r = ref.tensors.get(name)
                    if r is not None and (r.ggml_type, r.ne) == (t.ggml_type, t.ne) and \
                            bytes(got.raw(name).reshape(-1).view(np.uint8)) != \
                            bytes(ref.raw(name).reshape(-1).view(np.uint8)):
                        outcome, message = "garbage", f"tensor '{name}' reads other bytes than were written"
                        break
    return {"outcome": outcome, "message": message, "info": info}


def worker(base: Path, paths: list[str]) -> None:
    """Read case paths from argv, write one JSON line per case (preceded by a start line)."""
    import resource
    import tracemalloc

    import numpy  # noqa: F401 - imported before measuring

    from plinth.plugins import discover

    soft = 6 << 30  # a runaway case fails here instead of exhausting a shared machine
    resource.setrlimit(resource.RLIMIT_AS, (soft, resource.getrlimit(resource.RLIMIT_AS)[1]))
    registry = discover(plugins="llama")
    tracemalloc.start()
    for p in paths:
        print(json.dumps({"start": p}), flush=True)
        tracemalloc.reset_peak()
        t0 = time.perf_counter()
        result = run_case(Path(p), base, registry)
        result["peak"] = tracemalloc.get_traced_memory()[1]
        result["seconds"] = time.perf_counter() - t0
        if result["peak"] > MEMORY_LIMIT:
            result["outcome"] = "memory"
        result["path"] = p
        print(json.dumps(result), flush=True)


# ---------------------------------------------------------------------------- the driver

def run_all(cases: list[tuple[str, Path]], base: Path, hang_s: float = HANG_S) -> list[dict[str, Any]]:
    """Run every case in worker subprocesses; a worker that goes silent for ``hang_s`` is killed (a hang)."""
    results: dict[str, dict[str, Any]] = {}
    kinds = {str(p): k for k, p in cases}
    todo = [str(p) for _, p in cases]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    while todo:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", str(base), *todo], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env)
        assert proc.stdout is not None
        current, deadline = None, time.monotonic() + 60 + hang_s  # the first case also pays the imports
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                proc.kill()
                proc.wait()
                stuck = current or todo[0]
                results[stuck] = {"path": stuck, "outcome": "hang", "message": f"no answer in {hang_s} s",
                                  "seconds": hang_s, "peak": 0}
                todo = todo[todo.index(stuck) + 1:]
                break
            line = proc.stdout.readline()
            if not line:  # the worker died (killed for memory, or crashed)
                proc.wait()
                if current is not None:
                    results[current] = {"path": current, "outcome": "traceback", "seconds": 0, "peak": 0,
                                        "message": f"worker died with code {proc.returncode}"}
                    todo = todo[todo.index(current) + 1:]
                else:
                    todo = []
                break
            msg = json.loads(line)
            if "start" in msg:
                current, deadline = msg["start"], time.monotonic() + hang_s
                continue
            results[msg["path"]] = msg
            todo = todo[todo.index(msg["path"]) + 1:]
            current = None
        if not todo:
            proc.wait()
    out = []
    for _, p in cases:
        r = results[str(p)]
        r["kind"] = kinds[str(p)]
        out.append(r)
    return out


def table(results: list[dict[str, Any]]) -> str:
    """A markdown table: mutation kind x outcome counts."""
    outcomes = ["named error", "loaded", *FAILURES]
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in results:
        kind = r["kind"] if r["path"].split("/")[-1].startswith("mut") else "semantic: " + r["kind"]
        kind = "semantic (values that parse)" if kind.startswith("semantic") else kind
        by_kind[kind][r["outcome"]] += 1
    lines = ["| mutation | files | " + " | ".join(outcomes) + " |",
             "|---|---:|" + "---:|" * len(outcomes)]
    total: collections.Counter[str] = collections.Counter()
    for kind in sorted(by_kind):
        c = by_kind[kind]
        total.update(c)
        lines.append(f"| {kind} | {sum(c.values())} | " + " | ".join(str(c[o]) for o in outcomes) + " |")
    lines.append(f"| **all** | {sum(total.values())} | " + " | ".join(str(total[o]) for o in outcomes) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--cases", type=int, default=600, help="mutated files (default 600)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="where to write the files (default: a temporary folder)")
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker[0]), args.worker[1:])
        return 0
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.dir or tmp)
        t0 = time.perf_counter()
        cases = make_cases(folder, args.cases, args.seed)
        results = run_all(cases, cases[0][1])
        print(table(results))
        slowest = max(results, key=lambda r: r.get("seconds", 0))
        heaviest = max(results, key=lambda r: r.get("peak", 0))
        print(f"\n{len(results)} files in {time.perf_counter() - t0:.0f} s; slowest case "
              f"{slowest.get('seconds', 0):.2f} s ({slowest['kind']}); largest traced allocation "
              f"{heaviest.get('peak', 0) / 2**20:.1f} MiB ({heaviest['kind']})")
        for r in results:
            if r["outcome"] == "loaded" and not r["path"].split("/")[-1].startswith("mut"):
                print(f"loaded: {r['kind']}")
        bad = [r for r in results if r["outcome"] in FAILURES]
        for r in bad:
            print(f"FAIL {r['outcome']}: {r['kind']}: {r['path']}: {r['message']}")
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

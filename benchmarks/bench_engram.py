"""Engram (deepseek41) memory and speed: a 50M-row table stays in the file; decode with Engram on vs off.

Usage: python benchmarks/bench_engram.py [--rows 50000000] [--prompt-tokens 32] [--decode-tokens 64] [--runs 2]

A random DeepSeek V4.1 model (hidden 256, 4 layers [window, CSA 4, HCA 16, window], hc 4, 8 experts
of width 256 with top-2 + a shared expert, vocab 8192) is converted from the golden maker's weight
drawer, relabelled ``deepseek41``, and written twice: without Engram, and with one Engram layer
(layer 1; trigrams, 4 heads -> 8 rows of 64 BF16 values a token) whose table has ``--rows`` rows
(50M x 64 x 2 B = 6.4 GB). The table is written as a hole (a sparse file: only the header and the
other tensors take disk blocks).

It prints: the file size and the blocks it occupies; load time; the table's resident pages
(``mincore`` over its mapped byte range) and the process RSS after loading and after decoding;
the distinct rows the decoded tokens read and the pages those rows lie on (RSS may grow by at
most those pages, 4 KiB each); the Engram block's time for one decode row; and greedy decode tok/s with Engram on and off (best of 3 x ``--runs``, the later rounds interleaved).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PAGE = mmap.PAGESIZE


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def resident_pages(address: int, length: int) -> int:
    """Pages of [address, address + length) in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = address - address % PAGE
    n = (address + length - start + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * n)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * PAGE), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec)


def next_prime(n: int) -> int:
    def prime(k: int) -> bool:
        if k < 2 or k % 2 == 0:
            return k == 2
        f = 3
        while f * f <= k:
            if k % f == 0:
                return False
            f += 2
        return True

    while not prime(n):
        n += 1
    return n


def config() -> dict:
    from plinth.testing import load_module

    v4 = load_module(ROOT / "plugins/deepseek41/tests/golden/make_golden.py")
    return dict(v4._COMMON, vocab_size=8192, hidden_size=256, num_hidden_layers=4, head_dim=64, q_lora_rank=64,
                o_lora_rank=32, moe_intermediate_size=256, index_head_dim=32, index_topk=8,
                layer_types=[v4.S, v4.C, v4.H, v4.S], compress_rates={v4.C: 4, v4.H: 16},
                mlp_layer_types=["moe"] * 4, sliding_window=64), v4


def write_sparse_gguf(path: Path, md: dict, tensors: dict, hole: tuple[str, tuple[int, int]] | None,
                      u64_keys: tuple[str, ...]) -> Path:
    """A GGUF whose tensor ``hole`` (name, shape; BF16) is declared but left as a hole in the file."""
    import gguf

    w = gguf.GGUFWriter(str(path), md["general.architecture"])
    for k, v in md.items():
        if k == "general.architecture":
            continue
        if k in u64_keys:
            w.add_key_value(k, [int(x) for x in v], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT64)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, (int, np.integer)):
            w.add_uint32(k, int(v)) if v >= 0 else w.add_int32(k, int(v))
        elif isinstance(v, (float, np.floating)):
            w.add_float32(k, float(v))
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_array(k, [x.item() if isinstance(x, np.generic) else x for x in v])

    class Hole:
        def __init__(self, nbytes: int) -> None:
            self.nbytes = nbytes

        def tofile(self, fh) -> None:
            fh.seek(self.nbytes, os.SEEK_CUR)  # no write: the file system keeps a hole

    if hole is not None:  # first, so the tensors written after it extend the file past the hole
        name, shape = hole
        nbytes = shape[0] * shape[1] * 2
        w.add_tensor_info(name, shape, np.dtype(np.uint16), nbytes, raw_dtype=gguf.GGMLQuantizationType.BF16)
        w.tensors[0][name].tensor = Hole(nbytes)
    for k, v in tensors.items():
        w.add_tensor(k, np.ascontiguousarray(v, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def build(tmp: Path, rows: int) -> tuple[Path, Path, dict]:
    from plinth.convert import convert
    from plinth.gguf import GGUFFile
    from plinth.testing import load_module

    cfg, v4 = config()
    g41 = load_module(ROOT / "plugins/deepseek41/tests/golden/make_golden41.py")
    folder = tmp / "hf"
    folder.mkdir()
    import json

    (folder / "config.json").write_text(json.dumps(cfg))
    v4.write_safetensors(folder / "model.safetensors", v4.hf_random_state(cfg, 7))
    reg = v4.registry()
    gf = GGUFFile(convert(folder, tmp / "v4.gguf", registry=reg))
    md = g41.relabel(dict(gf.metadata))
    tensors = {n: np.array(gf.raw(n)) for n in gf.tensors if not n.startswith("output_hc_")}
    off = write_sparse_gguf(tmp / "engram-off.gguf", md, tensors, None, ())
    n_head, n, dk, e, hc = 4, 3, 64, cfg["hidden_size"], cfg["hc_mult"]
    n_cols = (n - 1) * n_head
    share = rows // n_cols
    primes = [next_prime(share - 1000 * (i + 1)) for i in range(n_cols)]
    offsets = [i * share for i in range(n_cols)]
    rng = np.random.default_rng(3)
    c = dict(layer_ids=[1], n_head=n_head, max_ngram=n, key_length=dk, pad_id=0,
             multipliers=[int(x) | 1 for x in rng.integers(1, 1 << 37, n, dtype=np.uint64)], primes=primes,
             offsets=offsets, token_map=list(range(cfg["vocab_size"])))
    emd, _ = g41.engram_metadata(c)
    md_on = dict(md, **emd)
    t_on = dict(tensors)
    t_on["blk.1.engram_wkv.weight"] = (rng.standard_normal(((hc + 1) * e, n_cols * dk)) / 23).astype(np.float32)
    t_on["blk.1.engram_q.weight"] = rng.uniform(0.5, 1.5, (hc, e)).astype(np.float32)
    t_on["blk.1.engram_k.weight"] = rng.uniform(0.5, 1.5, (hc, e)).astype(np.float32)
    on = write_sparse_gguf(tmp / "engram-on.gguf", md_on, t_on, ("blk.1.engram_embd.weight", (rows, dk)),
                           tuple(k for k in emd if k.endswith(("multipliers", "primes", "offsets"))))
    return off, on, c


def decode_speed(model, prompt: list[int], n_new: int, runs: int) -> tuple[float, list[int]]:
    from plinth.testing import new_cache

    from plinth.graph import Batch

    best, out = float("inf"), []
    for _ in range(runs):  # decode only: the prefill is outside the timed part
        cache = new_cache(model.graph, model.hparams.n_layer)
        logits = model.graph.forward(Batch.from_tokens(prompt), cache).logits
        out = [int(np.argmax(logits[-1]))]
        t = time.perf_counter()
        for i in range(n_new - 1):
            logits = model.graph.forward(Batch.from_tokens([out[-1]], start=len(prompt) + i), cache).logits
            out.append(int(np.argmax(logits[-1])))
        best = min(best, time.perf_counter() - t)
    return (n_new - 1) / best, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=50_000_000)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    import plinth
    from plinth.testing import load_module

    print(f"load average: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        off_path, on_path, c = build(Path(tmp), args.rows)
        st = os.stat(on_path)
        print(f"engram file: {st.st_size / 2**30:.2f} GiB apparent, {st.st_blocks * 512 / 2**20:.1f} MiB on disk "
              f"(table: {args.rows:,} rows x 64 BF16)")
        reg = load_module(ROOT / "plugins/deepseek41/tests/golden/make_golden.py").registry()
        rss0 = rss_kib()
        t = time.perf_counter()
        on = plinth.load_model(on_path, registry=reg)
        load_s = time.perf_counter() - t
        table = on.weights["blk.1.engram_embd.weight"]
        addr, length = table.raw.__array_interface__["data"][0], table.raw.nbytes
        print(f"load: {load_s:.2f} s; table {type(table).__name__} {table.type_name} {table.shape}; "
              f"table pages resident {resident_pages(addr, length)} of {length // PAGE:,}; "
              f"RSS +{(rss_kib() - rss0) / 1024:.1f} MiB")
        rng = np.random.default_rng(0)
        ep = on.hparams.engram

        def pages_of_rows(rows: np.ndarray) -> np.ndarray:
            """Pages holding the rows' bytes (a 128-byte row straddles two pages when the table's start is
            not 128-aligned in the file: GGUF aligns tensor data to 32 bytes)."""
            return np.union1d((addr + rows * 128) // PAGE, (addr + rows * 128 + 127) // PAGE)

        from plinth_deepseek41.engram import engram_rows_for_batch, hash_rows

        def pages_of(tokens: list[int]) -> np.ndarray:
            ctx, _ = engram_rows_for_batch(np.asarray(tokens), None, [(0, slice(0, len(tokens)))], {}, ep)
            rows = np.unique(hash_rows(ctx, ep.multipliers[0], ep.primes[0], ep.offsets[0], ep.n_head))
            return pages_of_rows(rows)

        warm = rng.integers(0, 8192, 8).tolist()  # compiles the row kernels before anything is measured
        decode_speed(on, warm, 2, 1)
        prompt = rng.integers(0, 8192, args.prompt_tokens).tolist()
        rss1, pages1 = rss_kib(), resident_pages(addr, length)
        from plinth_deepseek41 import deepseek41 as ds41

        taken: list[np.ndarray] = []
        real_gather = ds41.gather_rows
        ds41.gather_rows = lambda t, rows, xp: taken.append(np.asarray(rows).ravel()) or real_gather(t, rows, xp)
        tps_on, out = decode_speed(on, prompt, args.decode_tokens, args.runs)  # (the rows read, recorded)
        ds41.gather_rows = real_gather
        rows = np.unique(np.concatenate(taken))
        pages = pages_of_rows(rows)
        toks = prompt + out[:-1]  # the last token is never run
        assert np.array_equal(pages, pages_of(toks))  # the hash here agrees
        grew = resident_pages(addr, length) - pages1
        print(f"decode: {len(prompt) + len(out) - 1} tokens read {rows.size} distinct table rows on {pages.size} pages "
              f"({pages.size * PAGE / 2**20:.1f} MiB); table pages resident +{grew}; "
              f"RSS +{(rss_kib() - rss1) / 1024:.1f} MiB")
        # the Engram block alone for one decode row (hash, 8 row reads, wkv, gate), best of 5 x 200 calls
        X = np.ones((1, on.hparams.hc, on.hparams.n_embd), np.float32)
        ctx, _ = engram_rows_for_batch(np.asarray(toks[-1:]), None, [(0, slice(0, 1))],
                                       {0: np.asarray(toks[-3:-1], np.uint64)}, ep)
        block_s = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(200):
                on.graph.engram_block(1, X, ctx)
            block_s = min(block_s, (time.perf_counter() - t) / 200)
        print(f"Engram block, one decode row: {block_s * 1e3:.3f} ms")
        off = plinth.load_model(off_path, registry=reg)
        tps_off, _ = decode_speed(off, prompt, args.decode_tokens, args.runs)
        for _ in range(args.runs):  # interleaved rounds, so both see the same machine load; best of all
            tps_on = max(tps_on, decode_speed(on, prompt, args.decode_tokens, 1)[0])
            tps_off = max(tps_off, decode_speed(off, prompt, args.decode_tokens, 1)[0])
        print(f"decode tok/s ({args.prompt_tokens}-token prompt, {args.decode_tokens} greedy tokens, best of "
              f"{3 * args.runs}, interleaved): Engram on {tps_on:.1f}, off {tps_off:.1f} ({tps_on / tps_off:.2f}x)")
        print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()

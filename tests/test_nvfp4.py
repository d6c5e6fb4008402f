"""NVFP4 weights stay in their blocks: a synthetic NVFP4 llama (tensors written here: gguf-py has no
NVFP4 quantizer) computes the logits of the same model written as float32 from gguf-py's dequantization
of the same bytes, and its resident memory stays within 1.3x of the file."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import plinth
from plinth.quant import QuantWeight
from plinth.testing import byte_vocab, random_tensors, synthetic_specs, tiny_metadata

gguf = pytest.importorskip("gguf")
NV = gguf.GGMLQuantizationType.NVFP4


def nvfp4_rows(rng, n_out: int, n_in: int) -> np.ndarray:
    """Random NVFP4 rows [n_out, n_in / 64 * 36] with unsigned E4M3 scales of 2^-7 .. 2^-5 (small weights)."""
    nb = n_in // 64
    raw = rng.integers(0, 256, (n_out, nb, 36), dtype=np.uint8)
    raw[:, :, :4] = rng.integers(0x08, 0x20, (n_out, nb, 4), dtype=np.uint8)
    return raw.reshape(n_out, nb * 36)


def write_pair(registry, folder, seed=0, **shape):
    """The same random model twice: 2-D weights as NVFP4 blocks, and as float32 (gguf-py's dequantization
    of those blocks); the embedding and the norms float32 in both."""
    md = tiny_metadata("llama", **shape) | byte_vocab()
    hp = registry.arch_hparams("llama", md, "x")
    tensors = random_tensors(synthetic_specs(registry, "llama", hp), seed=seed)
    blocks = {name: nvfp4_rows(np.random.default_rng([seed, i]), *t.shape)
              for i, (name, t) in enumerate(sorted(tensors.items()))
              if t.ndim == 2 and name != "token_embd.weight" and t.shape[1] % 64 == 0}
    paths = {"nvfp4": _write(folder / "nvfp4.gguf", md, tensors, blocks)}
    deq = {n: np.asarray(gguf.quants.dequantize(b, NV), dtype=np.float32).reshape(tensors[n].shape)
           for n, b in blocks.items()}
    paths["f32"] = _write(folder / "f32.gguf", md, tensors | deq, {})
    return paths


def _write(path, md, tensors, blocks):
    """Like plinth.testing.write_gguf, the tensors of ``blocks`` written as those NVFP4 bytes."""
    w = gguf.GGUFWriter(str(path), md["general.architecture"])
    from plinth.convert import write_gguf

    plain = {n: v for n, v in tensors.items() if n not in blocks}
    write_gguf(str(path) + ".plain", md, plain)  # the metadata as plinth writes it
    reader = gguf.GGUFReader(str(path) + ".plain")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0],
                        sub_type=field.types[-1] if len(field.types) > 1 else None)
    for name, t in tensors.items():
        if name in blocks:
            w.add_tensor(name, blocks[name], raw_dtype=NV)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def registry():
    from plinth.testing import make_registry
    from plinth_llama.plugin import plugin

    return make_registry(plugin)


def test_nvfp4_model_matches_its_dequantized_twin(registry, tmp_path):
    paths = write_pair(registry, tmp_path, n_vocab=257, n_embd=128, n_head=2, n_head_kv=1, n_ff=192, n_layer=2)
    q = plinth.load_model(paths["nvfp4"], registry=registry)
    f = plinth.load_model(paths["f32"], registry=registry)
    kept = [n for n, w in q.weights.items() if isinstance(w, QuantWeight) and w.type_name == "NVFP4"]
    assert len(kept) >= 7 * 2 - 2  # every 2-D block weight (the stacked ones are views of their parts)
    ids = list(np.random.default_rng(1).integers(1, 257, 24))
    a, b = q.logits(ids), f.logits(ids)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


RSS_SCRIPT = r"""
import json, os, sys
import numpy as np
import plinth
from plinth import ops
ops.warm_up()
def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
r0 = rss()
m = plinth.load_model(sys.argv[1], allow_unused=True)
m.logits(list(range(1, 9)))
print(json.dumps({"rss": rss() - r0}))
"""


def test_nvfp4_resident_memory_near_the_file(registry, tmp_path):
    if sys.platform != "linux":
        pytest.skip("reads /proc/self/status")
    paths = write_pair(registry, tmp_path, n_vocab=257, n_embd=1024, n_head=16, n_head_kv=4, n_ff=2048, n_layer=6)
    size = paths["nvfp4"].stat().st_size
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(paths["nvfp4"])], capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "PLINTH_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    grown = json.loads(out.stdout.strip().splitlines()[-1])["rss"]
    f32 = paths["f32"].stat().st_size
    print(f"NVFP4 file {size / 2**20:.1f} MiB, resident growth {grown / 2**20:.1f} MiB (f32 file {f32 / 2**20:.1f})")
    assert grown <= 1.3 * size


def test_nvfp4_dflash_draft_with_scales_stays_quantized(registry, tmp_path):
    """A DFlash draft with NVFP4 projections and per-tensor ``.scale`` companions (an NVFP4 draft as
    llama.cpp's converter writes them) keeps the blocks and the scales; its block's hidden states equal
    its float32 twin's (weights dequantized by gguf-py times the scale) within 1e-5."""
    pytest.importorskip("plinth_dflash")
    from plinth_dflash.drafter import make_dflash
    from plinth_dflash.testkit import random_draft_tensors, tiny_draft_metadata

    from plinth.testing import write_synthetic_gguf

    md_t = tiny_metadata("llama", n_vocab=257, n_embd=128, n_head=2, n_head_kv=1, n_ff=192, n_layer=2) | byte_vocab()
    target = plinth.load_model(write_synthetic_gguf(tmp_path / "t.gguf", "llama", md_t, registry, seed=1),
                               registry=registry)
    md = tiny_draft_metadata("dflash", n_embd=128, n_vocab=257, n_layer=1, n_head=2, n_head_kv=1, head_dim=64,
                             n_ff=128, taps=[0, 1], block_size=4, mask_token=0)
    tensors = random_draft_tensors(md, "dflash", seed=3, scale=0.05)
    names = [n for n, t in tensors.items() if t.ndim == 2 and n.startswith("blk.") and t.shape[1] % 64 == 0]
    blocks = {n: nvfp4_rows(np.random.default_rng([7, i]), *tensors[n].shape) for i, n in enumerate(names)}
    scales = {n[:-len(".weight")] + ".scale": np.array([0.5 + 0.25 * i], np.float32) for i, n in enumerate(names)}
    q_path = _write(tmp_path / "q.gguf", md, tensors | scales, blocks)
    twin = {n: np.asarray(gguf.quants.dequantize(b, NV), np.float32).reshape(tensors[n].shape)
            * scales[n[:-len(".weight")] + ".scale"][0] for n, b in blocks.items()}
    f_path = _write(tmp_path / "f.gguf", md, tensors | twin, {})
    out = {}
    for key, p in (("q", q_path), ("f", f_path)):
        d = make_dflash(target, {"draft": str(p)})
        if key == "q":
            kept = {n: w for n, w in d.graph.w.items() if isinstance(w, QuantWeight)}
            assert set(kept) == set(names) and all(w.type_name == "NVFP4" and w.scale is not None
                                                   for w in kept.values())
        g = np.random.default_rng(5).standard_normal((6, 128)).astype(np.float32)
        d.graph.inject(d.cache, 0, np.arange(6), g)
        out[key] = np.asarray(d.graph.forward_block(d.cache, 0, [3, 0, 0, 0], np.arange(6, 10)))
    assert np.abs(out["q"] - out["f"]).max() <= 1e-5 * np.abs(out["f"]).max()

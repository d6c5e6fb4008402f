"""Write the llama.cpp-converted fixtures of plinth-deepseek41 (``golden/llamacpp/<case>.gguf`` + ``.npz``).

Run by hand (needs torch, transformers and the llama-cpp-python sdist's converter)::

    python plugins/deepseek41/tests/golden/make_llamacpp.py

Environment: ``LLAMA_CPP_DIR`` (default ``/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp``).

A tiny random DeepSeek V4 within what llama.cpp's ``deepseek4`` accepts (4 hc streams, ratios 4 /
128 / 0, MXFP4 routed experts, a hash layer, YaRN on the compressed rope) is written twice from
one draw (``make_golden.hf_random_state``, every norm and bias redrawn):

* as DeepSeek's release checkpoint (``embed.weight``, ``layers.N.attn.kv_norm.weight``, FP4 e2m1
  experts packed two per byte with an E8M0 scale per 32 inputs, ``tid2eid`` int64, an ``mtp.0.*``
  block), converted by llama.cpp's own ``convert_hf_to_gguf.py --outtype f32`` into the trunk file
  ``lc_v4.gguf`` and, with ``--mtp``, its head-only MTP file ``lc_v4-mtp.gguf``;
* as transformers 5.24 saves it (float weights equal to the dequantized FP4 values), whose
  ``DeepseekV4ForCausalLM`` gives the reference logits stored in ``lc_v4.npz``.

One harness change, as in plinth-nemotron's script: the converter's pre-tokenizer lookup by hash
is answered ``gpt-2`` for the 300-token test vocabulary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from plinth.testing.hf import write_raw_safetensors

HERE = Path(__file__).resolve().parent
OUT = HERE / "llamacpp"
LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR") or os.environ.get("PLINTH_LLAMA_CPP_SRC")
                     or "/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")
PROMPT_LENGTHS = (1, 7, 140)  # 140: one complete HCA block of 128
SEED, PROMPT_SEED, MTP_SEED = 901, 911, 921
S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# transformers' spelling of the case
CONFIG: dict[str, Any] = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=304, hidden_size=32,
    num_attention_heads=4, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.5, q_lora_rank=32,
    o_groups=2, o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    n_shared_experts=1, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, sliding_window=8, index_n_heads=4,
    index_head_dim=16, index_topk=3, rms_norm_eps=1e-6, routed_scaling_factor=1.5, swiglu_limit=2.0,
    scoring_func="sqrtsoftplus", rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=1024,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None, num_nextn_predict_layers=0,
    num_hidden_layers=3, layer_types=[C, H, S], compress_rates={C: 4, H: 128},
    mlp_layer_types=["hash_moe", "moe", "moe"],
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32.0, "beta_slow": 1.0},
)
RATIO = {S: 0, C: 4, H: 128}
# llama.cpp's deepseek4 graph builds for the released head sizes only (head 512, rope 64, indexer 128, window
# 128; the tiny sizes above load there but fail an assertion when the graph is built), so the interop tests,
# which commit nothing, run the same model at those sizes
INTEROP_CONFIG = dict(CONFIG, head_dim=512, partial_rotary_factor=0.125, index_head_dim=128, sliding_window=128)
# prompts of that model without a tie at the indexer's top-k boundary (where the answer would hang on
# tie-breaking: plinth and llama.cpp break ties alike, transformers otherwise)
INTEROP_PROMPT_SEED = 917


def release_config(config: dict[str, Any] = CONFIG) -> dict[str, Any]:
    """The same model in the release config.json's spelling (what llama.cpp's converter reads)."""
    c = {k: v for k, v in config.items() if k not in ("layer_types", "compress_rates", "mlp_layer_types",
                                                       "rope_parameters", "partial_rotary_factor")}
    c.update(compress_ratios=[RATIO[t] for t in config["layer_types"]] + [0], num_hash_layers=1,
             qk_rope_head_dim=int(config["head_dim"] * config["partial_rotary_factor"]), norm_topk_prob=True,
             num_nextn_predict_layers=1, rope_scaling=dict(config["rope_parameters"], type="yarn"))
    return c


def golden_module() -> Any:
    from plinth.testing import load_module

    return load_module(HERE / "make_golden.py")


def prompts(seed: int = PROMPT_SEED) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 300, n).tolist() for n in PROMPT_LENGTHS]


# --------------------------------------------------------------------------- FP4 experts

FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def to_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [out, in] -> (packed uint8 [out, in/2] low nibble first, E8M0 uint8 [out, in/32], the values it holds)."""
    out, n_in = w.shape
    blocks = w.reshape(out, n_in // 32, 32)
    exp = np.ceil(np.log2(np.maximum(np.abs(blocks).max(-1), 1e-30) / 6.0)).astype(np.int32)
    scale = np.exp2(exp).astype(np.float32)[..., None]
    codes = np.abs((blocks / scale)[..., None] - FP4[None, None, None, :8]).argmin(-1)
    codes = np.where(blocks < 0, codes + 8, codes).reshape(out, n_in).astype(np.uint8)
    values = FP4[codes] * np.repeat(scale[..., 0], 32, axis=1)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), (exp + 127).astype(np.uint8), values


def states(config: dict[str, Any] = CONFIG) -> tuple[dict[str, np.ndarray], dict[str, tuple[str, tuple[int, ...], bytes]]]:
    """(transformers-named float state, release-named raw state with FP4 experts and the MTP block)."""
    g = golden_module()
    sd = g.hf_random_state(config, SEED)
    release: dict[str, tuple[str, tuple[int, ...], bytes]] = {}

    def put(name: str, a: np.ndarray) -> None:
        if a.dtype.kind in "iu":
            release[name] = ("I64", a.shape, np.ascontiguousarray(a, "<i8").tobytes())
        else:
            release[name] = ("F32", a.shape, np.ascontiguousarray(a, "<f4").tobytes())

    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight", "head.weight": "head.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}

    def release_name(name: str, prefix: str = "layers") -> str:
        rest = name.split(".", 3)[3]
        layer = name.split(".")[2]
        rest = "attn.kv_norm.weight" if rest == "attn.norm.weight" else rest
        return f"{prefix}.{layer}.{rest}"

    for name in list(sd):
        if name in top:
            put(top[name], sd[name])
            continue
        rel = release_name(name)
        if ".ffn.experts." in name:
            packed, exp, values = to_fp4(sd[name])
            sd[name] = values  # transformers sees exactly what the FP4 file holds
            release[rel] = ("I8", packed.shape, packed.tobytes())
            release[rel[: -len(".weight")] + ".scale"] = ("F8_E8M0", exp.shape, exp.tobytes())
        else:
            put(rel, sd[name])
    # the MTP block: an ordinary window layer drawn apart (mtp.0.*), plus its fusion, norm and hc head
    mtp_cfg = dict(config, num_hidden_layers=1, layer_types=[S], mlp_layer_types=["moe"])
    rng = np.random.default_rng(MTP_SEED)
    e, hc = config["hidden_size"], config["hc_mult"]
    for name, a in g.hf_random_state(mtp_cfg, MTP_SEED).items():
        if not name.startswith("model.layers.0."):
            continue
        rel = release_name(name, "mtp").replace("mtp.0.", "mtp.0.", 1)
        if ".ffn.experts." in name:
            packed, exp, _ = to_fp4(a)
            release[rel] = ("I8", packed.shape, packed.tobytes())
            release[rel[: -len(".weight")] + ".scale"] = ("F8_E8M0", exp.shape, exp.tobytes())
        else:
            put(rel, a)
    for n in ("enorm.weight", "hnorm.weight", "norm.weight"):
        put(f"mtp.0.{n}", (1.0 + 0.1 * rng.standard_normal(e)).astype(np.float32))
    for n in ("e_proj.weight", "h_proj.weight"):
        put(f"mtp.0.{n}", (rng.standard_normal((e, e)) / np.sqrt(e)).astype(np.float32))
    put("mtp.0.hc_head_fn", (rng.standard_normal((hc, hc * e)) / np.sqrt(hc * e)).astype(np.float32))
    put("mtp.0.hc_head_base", (0.5 * rng.standard_normal(hc)).astype(np.float32))
    put("mtp.0.hc_head_scale", rng.uniform(0.5, 1.5, 1).astype(np.float32))
    return sd, release


def write_folders(tmp: Path, config: dict[str, Any] = CONFIG) -> tuple[Path, Path]:
    """(transformers folder, release folder with the tokenizer) of ``config``'s model."""
    nem = load_tokenizer_writer()
    sd, release = states(config)
    hf = tmp / "transformers"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps(config, indent=1))
    golden_module().write_safetensors(hf / "model.safetensors", sd)
    rel = tmp / "release"
    rel.mkdir(parents=True)
    (rel / "config.json").write_text(json.dumps(release_config(config), indent=1))
    write_raw_safetensors(rel / "model.safetensors", release)
    nem.write_tokenizer(rel)
    return hf, rel


def load_tokenizer_writer() -> Any:
    """plinth-nemotron's fixture script holds the tiny tokenizer and the converter harness; reuse them."""
    from plinth.testing import load_module

    return load_module(HERE.parents[2] / "nemotron" / "tests" / "golden" / "make_llamacpp.py")


def convert_with_llama_cpp(folder: Path, out: Path, *extra: str) -> Path:
    return load_tokenizer_writer().convert_with_llama_cpp(folder, out, *extra)


def transformers_logits(folder: Path) -> list[np.ndarray]:
    import torch

    model = golden_module().reference_model(folder)
    with torch.no_grad():
        return [model(torch.tensor([p]), use_cache=False).logits[0].float().numpy() for p in prompts()]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        hf, rel = write_folders(Path(tmp))
        OUT.mkdir(exist_ok=True)
        trunk = convert_with_llama_cpp(rel, OUT / "lc_v4.gguf")
        mtp = convert_with_llama_cpp(rel, OUT / "lc_v4-mtp.gguf", "--mtp")
        rec: dict[str, Any] = {"info": json.dumps({"seed": SEED, "prompt_seed": PROMPT_SEED, "config": CONFIG})}
        for i, (p, logits) in enumerate(zip(prompts(), transformers_logits(hf))):
            rows = golden_module().stored_rows(len(p))  # all rows of short prompts, a stride + the tail of long ones
            rec[f"prompt_{i}"] = np.asarray(p, np.int32)
            rec[f"rows_{i}"] = rows.astype(np.int32)
            rec[f"logits_{i}"] = logits[rows].astype(np.float32)
        np.savez_compressed(OUT / "lc_v4.npz", **rec)
        for f in (trunk, mtp, OUT / "lc_v4.npz"):
            print(f, f.stat().st_size)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    raise SystemExit(main())

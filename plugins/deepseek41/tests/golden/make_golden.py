"""Write the golden reference files of plinth-deepseek41 (tiny random DeepSeek V4 models).

Run by hand (needs torch and transformers, ``pip install -e '.[ref]'``)::

    python plugins/deepseek41/tests/golden/make_golden.py            # all cases
    python plugins/deepseek41/tests/golden/make_golden.py flash      # one case

Each case is a transformers ``DeepseekV4Config`` (``CASES``: different layer-type patterns,
compression rates, hc_mult, hash layers, YaRN). Its weights are drawn with numpy from the
case's seed under the names transformers' ``save_pretrained`` writes (the upstream names:
``model.layers.N.attn.wq_a.weight``, ``hc_attn_fn``, ``ffn.experts.E.w1.weight``, ``head.weight``),
and saved as an HF folder (``config.json`` + ``model.safetensors``) without torch. Parameters the
reference initialises to constants are drawn at O(1) scale, or their features go untested:
attention sinks, compressor ``ape`` (position_bias), hyper-connection ``base`` (0) and ``scale``
(1), the router's score-correction bias (0) and ``tid2eid`` (every token to expert 0; here a
random permutation per token).

The reference: ``DeepseekV4ForCausalLM.from_pretrained(folder)`` (float32, eager attention;
loading must report no missing or unexpected tensor). For prompts of 1, 7, 40 and 301 tokens
(301 crosses many compressed blocks and ends in a partial one at every ratio) it gives the all-position logits
of one forward and a 32-token greedy continuation (``generate``, with its cache). ``<case>.npz``
stores those with the config and seeds; the weights are redrawn from the seed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from plinth.testing import write_safetensors

HERE = Path(__file__).resolve().parent

PROMPT_LENGTHS = (1, 7, 40, 301)
N_GREEDY = 32

_COMMON: dict[str, Any] = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=256, hidden_size=64,
    num_attention_heads=4, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.5, q_lora_rank=32,
    o_groups=2, o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    n_shared_experts=1, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, sliding_window=8, index_n_heads=16,
    index_head_dim=16, index_topk=3, rms_norm_eps=1e-6, routed_scaling_factor=1.5, swiglu_limit=2.0,
    scoring_func="sqrtsoftplus", rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=4096,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    num_nextn_predict_layers=0,
)
S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

CASES: dict[str, dict[str, Any]] = {
    # the "exercises everything" config: window, CSA 4, HCA 8, two hash layers
    "flash": dict(seed=501, prompt_seed=601, config=dict(
        _COMMON, num_hidden_layers=4, layer_types=[S, C, H, C],
        compress_rates={C: 4, H: 8}, mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"])),
    # two streams, CSA-first, YaRN on the compressed RoPE, one hash layer, a wider window
    "yarn_hc2": dict(seed=502, prompt_seed=602, config=dict(
        _COMMON, num_hidden_layers=3, hc_mult=2, layer_types=[C, S, C], sliding_window=16, index_topk=5,
        compress_rates={C: 4, H: 16}, mlp_layer_types=["hash_moe", "moe", "moe"], max_position_embeddings=1024,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                         "beta_fast": 32.0, "beta_slow": 1.0})),
    # heavily compressed only (no indexer), three streams, four output groups, no hash layer
    "hca_only": dict(seed=503, prompt_seed=603, config=dict(
        _COMMON, num_hidden_layers=3, hc_mult=3, o_groups=4, o_lora_rank=8, layer_types=[H, S, H],
        compress_rates={C: 4, H: 16}, mlp_layer_types=["moe", "moe", "moe"], hc_sinkhorn_iters=7)),
    # CSA at ratio 2, HCA at 32, every layer hash-routed, top-3 of 8 experts, top-k 4
    "csa2_hash": dict(seed=504, prompt_seed=604, config=dict(
        _COMMON, num_hidden_layers=4, layer_types=[C, H, C, H], num_experts_per_tok=3, index_topk=4,
        compress_rates={C: 2, H: 32}, mlp_layer_types=["hash_moe"] * 4)),
}


# --------------------------------------------------------------------------- HF-format weights (no torch)

def hf_random_state(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Random weights under the saved (upstream) names, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    e, v, hc = config["hidden_size"], config["vocab_size"], config["hc_mult"]
    d, nh, q = config["head_dim"], config["num_attention_heads"], config["q_lora_rank"]
    g, ro = config["o_groups"], config["o_lora_rank"]
    ne, k, ff = config["n_routed_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]
    di, nih = config["index_head_dim"], config["index_n_heads"]
    rates = config["compress_rates"]
    n_mix = (2 + hc) * hc

    def lin(n_out: int, n_in: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def o1(*shape: int, s: float = 1.0) -> np.ndarray:
        return (s * rng.standard_normal(shape)).astype(np.float32)

    sd = {"model.embed_tokens.weight": o1(v, e), "model.norm.weight": norm(e), "head.weight": lin(v, e),
          "model.hc_head.hc_fn": lin(hc, hc * e), "model.hc_head.hc_base": o1(hc, s=0.5),
          "model.hc_head.hc_scale": rng.uniform(0.5, 1.5, 1).astype(np.float32)}
    for i, (lt, mt) in enumerate(zip(config["layer_types"], config["mlp_layer_types"])):
        p = f"model.layers.{i}."
        for sub in ("attn", "ffn"):
            sd[p + f"hc_{sub}_fn"] = lin(n_mix, hc * e)
            sd[p + f"hc_{sub}_base"] = o1(n_mix, s=0.5)
            sd[p + f"hc_{sub}_scale"] = rng.uniform(0.5, 1.5, 3).astype(np.float32)
        sd[p + "attn_norm.weight"] = norm(e)
        sd[p + "ffn_norm.weight"] = norm(e)
        a = p + "attn."
        sd.update({a + "attn_sink": o1(nh), a + "wq_a.weight": lin(q, e), a + "q_norm.weight": norm(q),
                   a + "wq_b.weight": lin(nh * d, q), a + "wkv.weight": lin(d, e), a + "norm.weight": norm(d),
                   a + "wo_a.weight": lin(g * ro, nh * d // g), a + "wo_b.weight": lin(e, g * ro)})
        if lt != S:
            coff = 2 if lt == C else 1
            r = rates[lt]
            c = a + "compressor."
            sd.update({c + "wkv.weight": lin(coff * d, e), c + "wgate.weight": lin(coff * d, e),
                       c + "ape": o1(r, coff * d), c + "norm.weight": norm(d)})
        if lt == C:
            x = a + "indexer."
            sd.update({x + "wq_b.weight": lin(nih * di, q), x + "weights_proj.weight": lin(nih, e),
                       x + "compressor.wkv.weight": lin(2 * di, e), x + "compressor.wgate.weight": lin(2 * di, e),
                       x + "compressor.ape": o1(rates[C], 2 * di), x + "compressor.norm.weight": norm(di)})
        f = p + "ffn."
        sd[f + "gate.weight"] = lin(ne, e)
        if mt == "hash_moe":
            sd[f + "gate.tid2eid"] = np.stack([rng.permutation(ne)[:k] for _ in range(v)]).astype(np.int64)
        else:
            sd[f + "gate.bias"] = o1(ne, s=0.5)
        for j in range(ne):
            sd.update({f + f"experts.{j}.w1.weight": lin(ff, e), f + f"experts.{j}.w2.weight": lin(e, ff),
                       f + f"experts.{j}.w3.weight": lin(ff, e)})
        sd.update({f + "shared_experts.w1.weight": lin(ff, e), f + "shared_experts.w2.weight": lin(e, ff),
                   f + "shared_experts.w3.weight": lin(ff, e)})
    return sd


def write_hf_folder(case: str, folder: Path) -> Path:
    c = CASES[case]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(c["config"], indent=1))
    write_safetensors(folder / "model.safetensors", hf_random_state(c["config"], c["seed"]))
    return folder


def prompts(case: str) -> list[list[int]]:
    from plinth.testing.golden import random_prompts

    return random_prompts(CASES[case]["prompt_seed"], CASES[case]["config"]["vocab_size"], PROMPT_LENGTHS)


def registry() -> Any:
    from plinth.testing import make_registry
    from plinth_deepseek41.plugin import plugin

    return make_registry(plugin)


def plinth_model(case: str, tmp: Path, reg: Any = None, vocab: bool = False) -> Any:
    """Write the case's HF folder, convert it with plinth's converter, load it.

    ``vocab``: add a byte-level tokenizer of the 256 ids (no end token), which the generation
    loop needs; the converter itself writes no tokenizer."""
    import plinth
    from plinth.convert import convert

    reg = reg or registry()
    folder = write_hf_folder(case, tmp / case)
    out = convert(folder, tmp / f"{case}.gguf", registry=reg)
    if vocab:
        from plinth.gguf import GGUFFile
        from plinth.testing import byte_vocab, write_gguf

        gf = GGUFFile(out)
        md = dict(gf.metadata, **byte_vocab())
        md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"][:256]
        md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"][:256]
        del md["tokenizer.ggml.eos_token_id"]
        out = write_gguf(tmp / f"{case}-vocab.gguf", md, {n: np.asarray(gf.raw(n)) for n in gf.tensors})
    return plinth.load_model(out, registry=reg)


# --------------------------------------------------------------------------- reference (torch)

def reference_model(folder: Path) -> Any:
    """``DeepseekV4ForCausalLM.from_pretrained(folder)``: float32, eager attention, every tensor loaded."""
    from transformers import DeepseekV4ForCausalLM

    from plinth.testing.reference import load_reference

    return load_reference(DeepseekV4ForCausalLM, folder)


def stored_rows(n: int) -> np.ndarray:
    """Logit rows kept in the golden file: all for short prompts, a stride plus the tail for long ones."""
    if n <= 64:
        return np.arange(n)
    return np.unique(np.concatenate([np.arange(0, n, 5), np.arange(n - 20, n)]))


def reference(case: str, folder: Path) -> list[tuple[list[int], np.ndarray, list[int]]]:
    import torch

    model = reference_model(folder)
    out = []
    with torch.no_grad():
        for p in prompts(case):
            ids = torch.tensor([p])
            logits = model(ids, use_cache=False).logits[0].float().numpy()
            gen = model.generate(ids, max_new_tokens=N_GREEDY, do_sample=False, min_new_tokens=N_GREEDY)
            out.append((p, logits, gen[0, len(p):].tolist()))
    return out


def make(case: str, tmp: Path) -> Path:
    folder = write_hf_folder(case, tmp / case)
    runs = reference(case, folder)
    c = CASES[case]
    return save_runs(case, {"seed": c["seed"], "prompt_seed": c["prompt_seed"], "config": c["config"]}, runs)


def save_runs(case: str, info: dict[str, Any], runs: list[tuple[Any, Any, Any]]) -> Path:
    """``HERE/case.npz``: the info and, per run, the prompt, the stored logit rows and the greedy tokens."""
    rec: dict[str, Any] = {"info": json.dumps(info)}
    for i, (p, logits, greedy) in enumerate(runs):
        rec[f"prompt_{i}"] = np.asarray(p, np.int32)
        rows = stored_rows(len(p))
        rec[f"rows_{i}"] = rows.astype(np.int32)
        rec[f"logits_{i}"] = logits[rows].astype(np.float32)
        rec[f"greedy_{i}"] = np.asarray(greedy, np.int32)
    path = HERE / f"{case}.npz"
    np.savez_compressed(path, **rec)
    return path


def main(argv: list[str]) -> None:
    import tempfile

    cases = argv or sorted(CASES)
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            print(make(case, Path(tmp)))


if __name__ == "__main__":
    main(sys.argv[1:])

"""Write the golden reference files of plinth-gemma (tiny random Gemma 4 text models).

Run by hand (needs torch and transformers 5.24, ``pip install -e 'plugins/gemma[ref]'``)::

    python plugins/gemma/tests/golden/make_golden.py            # all cases
    python plugins/gemma/tests/golden/make_golden.py moe        # one case

Each case is a transformers ``Gemma4TextConfig`` (``CASES``: sliding / full mixes, per-layer
embeddings, KV sharing, ``attention_k_eq_v``, MoE, the double-wide MLP, soft-capping, tied or own
head). Its weights are drawn with numpy from the case's seed under the names transformers'
``save_pretrained`` writes; every parameter transformers initialises to 0 or 1 (norm weights,
``layer_scalar``, the router's ``scale`` and ``per_expert_scale``) is drawn too. The folder
(``config.json`` + ``model.safetensors`` + a byte-level ``tokenizer.json``) is written without
torch; plinth's converter turns it into GGUF and the tests compare plinth with the reference,
``Gemma4ForCausalLM.from_pretrained(folder)`` (float32, eager attention, no missing or unexpected
tensor).

Per prompt (1, 9 and 300 tokens) the record holds the reference logits at ``rows_i`` (every
position for the short prompts; every 10th and the last 5 for the long one, to keep the files
small) and a 32-token greedy continuation (full recompute per step). The weights are not stored.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent

PROMPT_LENGTHS = (1, 9, 300)
N_GREEDY = 32
N_VOCAB = 257  # the byte-level tokenizer of plinth.testing.write_hf_folder

_COMMON: dict[str, Any] = dict(
    architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=N_VOCAB, hidden_size=64,
    intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    sliding_window=8, max_position_embeddings=1024, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
    pad_token_id=None, bos_token_id=None, eos_token_id=256, hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=N_VOCAB, num_kv_shared_layers=0, attention_k_eq_v=False, enable_moe_block=False,
    use_double_wide_mlp=False, final_logit_softcapping=None, tie_word_embeddings=True,
)
_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24)
S, F = "sliding_attention", "full_attention"

CASES: dict[str, dict[str, Any]] = {
    # dense sliding / full mix (31B-like), final soft-capping, tied head
    "dense": dict(seed=501, prompt_seed=601, config=dict(
        _COMMON, num_hidden_layers=3, layer_types=[S, S, F], final_logit_softcapping=30.0, rope_parameters=_ROPE)),
    # two layers, proportional RoPE turning half the full head, other thetas, own output head
    "rope": dict(seed=502, prompt_seed=602, config=dict(
        _COMMON, num_hidden_layers=2, layer_types=[S, F], tie_word_embeddings=False, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 20_000.0}})),
    # per-layer embeddings, attention_k_eq_v with one global KV head, own head
    "ple": dict(seed=503, prompt_seed=603, config=dict(
        _COMMON, num_hidden_layers=4, layer_types=[S, F, S, F], hidden_size_per_layer_input=8,
        attention_k_eq_v=True, num_global_key_value_heads=1, tie_word_embeddings=False, rope_parameters=_ROPE)),
    # E2B-like: per-layer embeddings, the last two layers share K/V, double-wide MLP there, soft-capping
    "shared": dict(seed=504, prompt_seed=604, config=dict(
        _COMMON, num_hidden_layers=5, layer_types=[S, S, F, S, F], hidden_size_per_layer_input=8,
        num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=30.0, rope_parameters=_ROPE)),
    # 26B-A4B-like: MoE beside the dense MLP, attention_k_eq_v, soft-capping
    "moe": dict(seed=505, prompt_seed=605, config=dict(
        _COMMON, **_MOE, num_hidden_layers=4, layer_types=[S, S, S, F], attention_k_eq_v=True,
        num_global_key_value_heads=1, final_logit_softcapping=30.0, rope_parameters=_ROPE)),
    # everything at once: per-layer embeddings, KV sharing (3 of 6 layers), MoE, double-wide MLP, k_eq_v
    "all": dict(seed=506, prompt_seed=606, config=dict(
        _COMMON, **_MOE, num_hidden_layers=6, layer_types=[S, F, S, S, F, F], hidden_size_per_layer_input=8,
        num_kv_shared_layers=3, use_double_wide_mlp=True, attention_k_eq_v=True, num_global_key_value_heads=1,
        final_logit_softcapping=30.0, rope_parameters=_ROPE)),
}


# --------------------------------------------------------------------------- HF-format weights (no torch)

def layout(config: dict[str, Any]) -> tuple[list[bool], list[bool]]:
    """Per layer: sliding?, keeps its own K/V?"""
    n = config["num_hidden_layers"]
    swa = [t == S for t in config["layer_types"]]
    first_shared = n - config["num_kv_shared_layers"]
    return swa, [il < first_shared for il in range(n)]


def hf_random_state(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Random weights under transformers' saved Gemma 4 names, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)

    def lin(n_out: int, n_in: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    c = config
    d, v, n_layer = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    swa, owns = layout(c)
    n_pl = c["hidden_size_per_layer_input"]
    sd = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(np.float32)}
    if n_pl:
        sd["model.embed_tokens_per_layer.weight"] = rng.standard_normal((v, n_layer * n_pl)).astype(np.float32)
        sd["model.per_layer_model_projection.weight"] = lin(n_layer * n_pl, d)
        sd["model.per_layer_projection_norm.weight"] = norm(n_pl)
    for il in range(n_layer):
        p = f"model.layers.{il}."
        hd = c["head_dim"] if swa[il] else c["global_head_dim"]
        n_kv = c["num_key_value_heads"] if swa[il] or not c["attention_k_eq_v"] else c["num_global_key_value_heads"]
        ff = c["intermediate_size"] * (2 if c["use_double_wide_mlp"] and not owns[il] else 1)
        sd[p + "layer_scalar"] = rng.uniform(0.5, 1.5, 1).astype(np.float32)
        sd[p + "input_layernorm.weight"] = norm(d)
        sd[p + "self_attn.q_proj.weight"] = lin(c["num_attention_heads"] * hd, d)
        sd[p + "self_attn.q_norm.weight"] = norm(hd)
        if owns[il]:
            sd[p + "self_attn.k_proj.weight"] = lin(n_kv * hd, d)
            sd[p + "self_attn.k_norm.weight"] = norm(hd)
            if swa[il] or not c["attention_k_eq_v"]:
                sd[p + "self_attn.v_proj.weight"] = lin(n_kv * hd, d)
        sd[p + "self_attn.o_proj.weight"] = lin(d, c["num_attention_heads"] * hd)
        sd[p + "post_attention_layernorm.weight"] = norm(d)
        sd[p + "pre_feedforward_layernorm.weight"] = norm(d)
        sd[p + "mlp.gate_proj.weight"] = lin(ff, d)
        sd[p + "mlp.up_proj.weight"] = lin(ff, d)
        sd[p + "mlp.down_proj.weight"] = lin(d, ff)
        sd[p + "post_feedforward_layernorm.weight"] = norm(d)
        if n_pl:
            sd[p + "per_layer_input_gate.weight"] = lin(n_pl, d)
            sd[p + "per_layer_projection.weight"] = lin(d, n_pl)
            sd[p + "post_per_layer_input_norm.weight"] = norm(d)
        if c["enable_moe_block"]:
            e, ffe = c["num_experts"], c["moe_intermediate_size"]
            sd[p + "router.scale"] = norm(d)
            sd[p + "router.per_expert_scale"] = rng.uniform(0.5, 1.5, e).astype(np.float32)
            sd[p + "router.proj.weight"] = 4.0 * lin(e, d)
            sd[p + "experts.gate_up_proj"] = np.stack([lin(2 * ffe, d) for _ in range(e)])
            sd[p + "experts.down_proj"] = np.stack([lin(d, ffe) for _ in range(e)])
            sd[p + "post_feedforward_layernorm_1.weight"] = norm(d)
            sd[p + "post_feedforward_layernorm_2.weight"] = norm(d)
            sd[p + "pre_feedforward_layernorm_2.weight"] = norm(d)
    sd["model.norm.weight"] = norm(d)
    if not c["tie_word_embeddings"]:
        sd["lm_head.weight"] = lin(v, d)
    return sd


def write_hf_folder(case: str, folder: Path) -> Path:
    from plinth.testing import write_hf_folder as write

    c = CASES[case]
    return write(folder, c["config"], hf_random_state(c["config"], c["seed"]))


def gemma_tokenizer(n_vocab: int) -> dict[str, Any]:
    """A tiny ``tokenizer.json`` of Gemma's kind (BPE with byte fallback, "▁" for spaces): <pad> <eos> <bos>
    <unk>, the 256 byte tokens, letters and merges up to ``n_vocab`` tokens (what llama.cpp's converter
    takes as a Gemma 4 vocabulary). Written without the tokenizers library."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({f"<0x{b:02X}>": 4 + b for b in range(256)})
    for ch in "\u2581abcdefghijklmnopqrstuvwxyz":
        vocab.setdefault(ch, len(vocab))
    merges = []
    letters = "etaoinshrdlu"
    for a in "\u2581" + letters:
        for b in letters:
            if len(vocab) >= n_vocab:
                break
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append([a, b])
    if len(vocab) != n_vocab:
        raise ValueError(f"gemma_tokenizer: cannot make {n_vocab} tokens")
    special = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                "special": True} for t, i in list(vocab.items())[:4]]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
            "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
            "pre_tokenizer": None, "post_processor": None,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]},
            "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                      "vocab": vocab, "merges": merges}}


GEMMA_N_VOCAB = 300


def write_gemma_folder(case: str, folder: Path) -> tuple[Path, dict[str, Any]]:
    """The case with a 300-token Gemma-style tokenizer (``tokenizer.json`` + ``tokenizer_config.json``), as
    llama.cpp's converter needs; the weights are drawn from the case's seed for that vocabulary."""
    from plinth.testing import write_hf_folder as write

    c = CASES[case]
    cfg = dict(c["config"], vocab_size=GEMMA_N_VOCAB, vocab_size_per_layer_input=GEMMA_N_VOCAB, pad_token_id=0,
               eos_token_id=1, bos_token_id=2)
    write(folder, cfg, hf_random_state(cfg, c["seed"]), tokenizer=gemma_tokenizer(GEMMA_N_VOCAB))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<unk>", "add_bos_token": True,
        "chat_template": "{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n{{ m['content'] }}<turn|>\n"
                         "{% endfor %}"}))
    return folder, cfg


def registry() -> Any:
    from plinth.testing import make_registry
    from plinth_gemma.plugin import plugin

    return make_registry(plugin)


def plinth_model(case: str, tmp: Path, reg: Any = None) -> Any:
    """The case converted by plinth's converter and loaded through the plugin."""
    from plinth.testing.golden import convert_and_load

    return convert_and_load(write_hf_folder(case, tmp / f"{case}-hf"), tmp / f"{case}.gguf", reg or registry())


def prompts(case: str) -> list[list[int]]:
    from plinth.testing.golden import random_prompts

    return random_prompts(CASES[case]["prompt_seed"], N_VOCAB, PROMPT_LENGTHS)


def kept_rows(n: int) -> np.ndarray:
    """The positions whose logits a record keeps for a prompt of ``n`` tokens."""
    if n <= 64:
        return np.arange(n)
    return np.unique(np.concatenate([np.arange(0, n, 10), np.arange(n - 5, n)]))


# --------------------------------------------------------------------------- reference side (torch)

def hf_reference(folder: Path) -> Any:
    """``Gemma4ForCausalLM.from_pretrained(folder)``: float32, eager attention, every tensor loaded."""
    from transformers import Gemma4ForCausalLM

    from plinth.testing.reference import HFReference

    return HFReference(Gemma4ForCausalLM, folder)


def reference(case: str, tmp: Path, with_greedy: bool = True) -> dict[str, Any]:
    """The golden record of ``case`` computed now (``with_greedy=False``: logits only, much faster)."""
    from plinth.testing.reference import reference_record

    c = CASES[case]
    info = {"seed": c["seed"], "prompt_seed": c["prompt_seed"], "config": c["config"]}
    return reference_record(info, prompts(case), lambda: hf_reference(write_hf_folder(case, tmp / f"{case}-hf")),
                            N_GREEDY, rows=kept_rows, with_greedy=with_greedy)


def main(argv: list[str]) -> int:
    from plinth.testing.golden import write_golden_files

    write_golden_files(HERE, argv or sorted(CASES), reference)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

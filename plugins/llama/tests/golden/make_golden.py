"""Write the golden reference files of plinth-llama's dense architectures.

Run by hand (needs torch and transformers, ``pip install -e '.[ref]'``)::

    python plugins/llama/tests/golden/make_golden.py            # all cases
    python plugins/llama/tests/golden/make_golden.py qwen3      # one case

For each case a tiny random model is made with plinth's own test kit
(:func:`plinth.testing.tiny_metadata` and :func:`plinth.testing.random_tensors`),
its GGUF-named weights are mapped onto the matching Hugging Face model, and
that model (float32, eager attention) gives the reference: all-position logits
of five prompts and a 64-token greedy continuation of each. ``<case>.npz``
stores those outputs with the seeds and metadata that rebuild the weights; the
weights themselves are not stored. ``test_reference.py`` compares plinth
against the files without torch, and (marker ``ref``) rebuilds them live.

The GGUF -> Hugging Face weight mapping is :mod:`plinth.testing.hf_weights`, shared with
``tests/golden/make_real_golden.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from plinth.testing.hf_weights import hf_state_dict, load_hf_state, unpermute_rope_rows  # noqa: F401 (tests use it)

HERE = Path(__file__).resolve().parent

PROMPT_LENGTHS = (1, 7, 16, 33, 64)
N_GREEDY = 64

# case name -> how the tiny model is made. "tied": no output.weight (LM head = token_embd).
CASES: dict[str, dict[str, Any]] = {
    "llama": dict(arch="llama", seed=101, prompt_seed=201, tied=True, n_layer=2, extra={}),
    "qwen2": dict(arch="qwen2", seed=102, prompt_seed=202, tied=False, n_layer=2,
                  extra={"rope__freq_base": 1_000_000.0}),
    "qwen3": dict(arch="qwen3", seed=103, prompt_seed=203, tied=False, n_layer=2,
                  extra={"rope__freq_base": 1_000_000.0}),
    # 7 layers: sliding layers 0-4 and 6, global layer 5; a window of 5 is far shorter than the prompts.
    # No rope keys: plinth's defaults (global 1e6, local 1e4) must match the reference config below.
    "gemma3": dict(arch="gemma3", seed=104, prompt_seed=204, tied=True, n_layer=7,
                   extra={"attention__sliding_window": 5}),
}


# --------------------------------------------------------------------------- plinth side (no torch)

def registry():
    from plinth.testing import make_registry
    from plinth_llama.plugin import plugin

    return make_registry(plugin)


def metadata(case: str) -> dict[str, Any]:
    from plinth.testing import tiny_metadata

    c = CASES[case]
    return tiny_metadata(c["arch"], n_layer=c["n_layer"], **c["extra"])


def plinth_model(case: str, reg: Any = None) -> tuple[Any, dict[str, np.ndarray], Any]:
    """(hparams, GGUF-named weights, graph) of ``case``, weights drawn from its seed."""
    from plinth.testing import random_tensors

    c = CASES[case]
    reg = reg or registry()
    hp = reg.arch_hparams(c["arch"], metadata(case), f"golden-{case}.gguf")
    specs = reg.architecture(c["arch"]).synthetic_tensors(hp)  # the plain model, in declaration order
    if c["tied"]:
        specs = [s for s in specs if s.name != "output.weight"]
    weights = random_tensors(specs, seed=c["seed"])
    graph = reg.arch_build(c["arch"], hp, weights, reg.make_backend("numpy"))
    return hp, weights, graph


def prompts(case: str, n_vocab: int) -> list[list[int]]:
    from plinth.testing.golden import random_prompts

    return random_prompts(CASES[case]["prompt_seed"], n_vocab, PROMPT_LENGTHS)


# --------------------------------------------------------------------------- reference side (torch)

def hf_config(case: str, hp: Any) -> Any:
    import transformers

    c = CASES[case]
    common = dict(
        vocab_size=hp.n_vocab,
        hidden_size=hp.n_embd,
        intermediate_size=hp.n_ff[0],
        num_hidden_layers=hp.n_layer,
        num_attention_heads=hp.n_head[0],
        num_key_value_heads=hp.n_head_kv[0],
        head_dim=hp.head_dim,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=c["tied"],
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    theta = float(c["extra"].get("rope__freq_base", 10000.0))
    if c["arch"] == "llama":
        cfg = transformers.LlamaConfig(hidden_act="silu", attention_bias=False, mlp_bias=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": theta}, **common)
    elif c["arch"] == "qwen2":
        cfg = transformers.Qwen2Config(hidden_act="silu", use_sliding_window=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": theta}, **common)
    elif c["arch"] == "qwen3":
        cfg = transformers.Qwen3Config(hidden_act="silu", attention_bias=False, use_sliding_window=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": theta}, **common)
    elif c["arch"] == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=hp.head_dim,
            sliding_window=c["extra"]["attention__sliding_window"],
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(hp.n_layer)],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
            final_logit_softcapping=None, attn_logit_softcapping=None,
            **common,
        )
    else:
        raise ValueError(case)
    cfg._attn_implementation = "eager"
    return cfg


def hf_model(case: str, hp: Any, weights: dict[str, np.ndarray]) -> Any:
    import torch
    import transformers

    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM, "gemma3": transformers.Gemma3ForCausalLM}[CASES[case]["arch"]]
    torch.manual_seed(0)
    model = cls(hf_config(case, hp)).to(torch.float32).eval()
    sd = hf_state_dict(CASES[case]["arch"], weights, hp.n_layer, hp.n_head, hp.n_head_kv)
    return load_hf_state(model, sd, case, tied=CASES[case]["tied"])


def hf_run(model: Any, prompt: list[int], n_new: int) -> tuple[np.ndarray, list[int], float]:
    """(all-position logits [n, n_vocab], greedy continuation, smallest top-1/top-2 margin seen)."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt], dtype=torch.long)
        out = model(input_ids=ids, use_cache=True)
        logits = out.logits[0].float().numpy().copy()
        cache, step, new, margin = out.cache, out.logits[0, -1], [], np.inf
        for i in range(n_new):
            top2 = torch.topk(step, 2).values
            margin = min(margin, float(top2[0] - top2[1]))
            tok = int(torch.argmax(step))
            new.append(tok)
            if i == n_new - 1:
                break
            out = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True)
            cache, step = out.cache, out.logits[0, -1]
    return logits, new, margin


def reference(case: str) -> dict[str, Any]:
    """The golden record of ``case``, computed with the reference implementation."""
    import torch
    import transformers

    hp, weights, _ = plinth_model(case)
    model = hf_model(case, hp, weights)
    ps = prompts(case, hp.n_vocab)
    rec: dict[str, Any] = {}
    margins = []
    for i, p in enumerate(ps):
        logits, new, margin = hf_run(model, p, N_GREEDY)
        rec[f"prompt_{i}"] = np.asarray(p, dtype=np.int16)
        rec[f"logits_{i}"] = logits.astype(np.float32)
        rec[f"greedy_{i}"] = np.asarray(new, dtype=np.int16)
        margins.append(margin)
    c = CASES[case]
    rec["info"] = np.asarray(json.dumps({
        "case": case, "arch": c["arch"], "seed": c["seed"], "prompt_seed": c["prompt_seed"], "tied": c["tied"],
        "metadata": metadata(case), "n_greedy": N_GREEDY, "min_greedy_margin": float(min(margins)),
        "reference": f"transformers {transformers.__version__}, torch {torch.__version__}, float32, eager attention",
    }, sort_keys=True))
    return rec


def main(argv: list[str]) -> int:
    cases = argv or list(CASES)
    for case in cases:
        rec = reference(case)
        path = HERE / f"{case}.npz"
        np.savez_compressed(path, **rec)
        info = json.loads(str(rec["info"]))
        print(f"{case}: wrote {path.name} ({path.stat().st_size // 1024} KiB), "
              f"smallest greedy top-1/top-2 margin {info['min_greedy_margin']:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

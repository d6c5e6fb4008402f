"""Write the llama.cpp-converted fixtures of plinth-llama (tiny GGUF files + transformers logits).

Run by hand (needs torch, transformers, sentencepiece and the llama-cpp-python sdist's llama.cpp
tree, whose ``convert_hf_to_gguf.py`` writes the files)::

    python plugins/llama/tests/llamacpp/make_fixtures.py [CASE ...]
    LLAMA_CPP_DIR=/path/to/llama.cpp python plugins/llama/tests/llamacpp/make_fixtures.py

For each case a tiny random Hugging Face model (hidden 32, 2 layers, head_dim 16) is made with
transformers, every parameter redrawn (norm weights and biases too, which transformers sets to
0 or 1) and rounded to values float16 holds exactly; it is saved with ``save_pretrained`` next
to a tiny SentencePiece tokenizer, converted by llama.cpp's converter with ``--outtype f16``
(lossless for these weights), and run by transformers (float32, eager attention) on a fixed
prompt. ``<case>.gguf`` is llama.cpp's file as written; ``<case>.npz`` holds the prompt, the
reference logits [n_tokens, n_vocab] and the model's ``config.json``. ``test_llamacpp_files.py``
loads the files with plinth and compares (no torch needed).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR", "/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp"))
N_VOCAB = 128
N_PROMPT = 16
SEED = 7

COMMON = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
              tie_word_embeddings=False, vocab_size=N_VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=None)

# case -> (transformers class, config overrides, converter flags, what it shows)
CASES: dict[str, tuple[str, dict[str, Any], list[str], str]] = {
    "llama3_rope": ("LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), [],
        "Llama 3.1+ rope scaling: llama.cpp writes rope_freqs.weight, no rope.scaling.type"),
    "llama_biases": ("LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True), [],
                     "biases on Q, K, V, the attention output and the FFN; tied head"),
    "llama_fused_qkv": ("LlamaForCausalLM", dict(attention_bias=True), ["--fuse-qkv"],
                        "attn_qkv.weight and attn_qkv.bias (--fuse-qkv)"),
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16,
                                           router_jitter_noise=0.0), [], "Mixtral MoE as arch llama"),
    "qwen2_yarn": ("Qwen2ForCausalLM", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}),
        [], "qwen2 (Q/K/V biases) with YaRN"),
    "qwen3_linear_rope": ("Qwen3ForCausalLM", dict(rope_parameters={
        "rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}), [], "qwen3 with linear rope scaling"),
    "gemma3": ("Gemma3ForCausalLM", dict(sliding_window=4, layer_types=["sliding_attention"] * 2,
                                         query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh",
                                         tie_word_embeddings=True,
                                         rope_parameters={"full_attention": {"rope_type": "default",
                                                                             "rope_theta": 1000000.0},
                                                          "sliding_attention": {"rope_type": "default",
                                                                                "rope_theta": 10000.0}}),
               [], "gemma3, two sliding-window layers (window 4, shorter than the prompt)"),
    # llama.cpp's converter writes no attention.sliding_window_pattern for gemma3, so its file computes
    # layer 1 as a sliding layer; plinth's converter writes the pattern (test_convert.py)
    "gemma3_pattern": ("Gemma3ForCausalLM", dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                                 query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh",
                                                 tie_word_embeddings=True,
                                                 rope_parameters={"full_attention": {"rope_type": "linear",
                                                                                     "rope_theta": 1000000.0,
                                                                                     "factor": 4.0},
                                                                  "sliding_attention": {"rope_type": "default",
                                                                                        "rope_theta": 10000.0}}),
                       [], "gemma3, a sliding then a global layer (linear rope scaling on the global one)"),
}


def prompt() -> list[int]:
    return np.random.default_rng(SEED).integers(3, N_VOCAB, N_PROMPT).tolist()


def train_tokenizer(folder: Path) -> None:
    """A SentencePiece model of N_VOCAB pieces (the converter's SPM path), written as tokenizer.model."""
    import io

    import sentencepiece as spm

    text = Path(os.__file__).read_text().splitlines()
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=buf, vocab_size=N_VOCAB,
                                   model_type="bpe", character_coverage=0.98, bos_id=1, eos_id=2, unk_id=0,
                                   pad_id=-1, minloglevel=2)
    (folder / "tokenizer.model").write_bytes(buf.getvalue())


def hf_model(case: str, spec: tuple[str, dict[str, Any]] | None = None) -> Any:
    """The case's transformers model, every parameter redrawn and float16-exact.

    spec: (transformers class, config overrides) of a model that is not one of CASES.
    """
    import torch
    import transformers

    cls_name, over = spec if spec is not None else CASES[case][:2]
    cfg_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config").replace("Gemma3Config",
                                                                                        "Gemma3TextConfig"))
    cfg = cfg_cls(**{**COMMON, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                centre = 0.0 if case.startswith("gemma") else 1.0  # gemma norms compute (1 + w)
                v = centre + 0.1 * torch.randn(p.shape, generator=gen)
            else:
                v = 0.2 * torch.randn(p.shape, generator=gen)
            p.copy_(v.half().float())
    return model


def reference_logits(model: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy().copy()


def convert_with_llamacpp(model_dir: Path, out: Path, flags: list[str]) -> None:
    """llama.cpp's converter (``LLAMA_CPP_DIR`` when it holds one, else the sdist plinth's test kit fetches)."""
    from plinth.testing.interop import convert_with_llama_cpp

    src = LLAMA_CPP_DIR if (LLAMA_CPP_DIR / "convert_hf_to_gguf.py").is_file() else None
    convert_with_llama_cpp(model_dir, out, src=src, outtype="f16", args=flags)


def save_hf(case: str, folder: Path, spec: tuple[str, dict[str, Any]] | None = None) -> Any:
    """The case's model and tokenizer saved in ``folder``; returns the model (spec: see :func:`hf_model`)."""
    model = hf_model(case, spec)
    model.save_pretrained(folder)
    train_tokenizer(folder)
    return model


def make(case: str, out_dir: Path = HERE, convert: Any = None) -> dict[str, Any]:
    """Write ``<case>.gguf`` (llama.cpp's converter) and ``<case>.npz`` (transformers' logits) to ``out_dir``.

    convert: ``(hf_dir, out, outtype=, args=)`` running llama.cpp's converter (default: see
    :func:`convert_with_llamacpp`).
    """
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / case
        model = save_hf(case, folder)
        if convert is None:
            convert_with_llamacpp(folder, out_dir / f"{case}.gguf", CASES[case][2])
        else:
            convert(folder, out_dir / f"{case}.gguf", outtype="f16", args=CASES[case][2])
        config = (folder / "config.json").read_text()
    ids = prompt()
    logits = reference_logits(model, ids)
    info = {"case": case, "what": CASES[case][3], "converter_flags": CASES[case][2],
            "reference": f"transformers {transformers.__version__}, torch {torch.__version__}, float32, eager"}
    np.savez_compressed(out_dir / f"{case}.npz", prompt=np.asarray(ids, dtype=np.int16),
                        logits=logits.astype(np.float32), config=np.asarray(config), info=np.asarray(json.dumps(info)))
    return {"prompt": ids, "logits": logits, "config": json.loads(config)}


def main(argv: list[str]) -> int:
    for case in argv or list(CASES):
        make(case)
        size = (HERE / f"{case}.gguf").stat().st_size + (HERE / f"{case}.npz").stat().st_size
        print(f"{case}: {size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

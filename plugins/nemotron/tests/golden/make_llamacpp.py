"""Write the llama.cpp-converted fixtures of plinth-nemotron (``golden/llamacpp/<case>.gguf`` + ``.npz``).

Run by hand (needs torch, transformers and the llama-cpp-python sdist's converter)::

    python plugins/nemotron/tests/golden/make_llamacpp.py [case ...]

Environment: ``LLAMA_CPP_DIR`` or ``PLINTH_LLAMA_CPP_SRC`` (an unpacked ``vendor/llama.cpp``; default
``/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp``).

Each case is a tiny Hugging Face NemotronH folder (weights drawn with numpy by
``make_golden.hf_random_state``: every norm, bias, A_log and D redrawn, nothing left at
transformers' 0 / 1 init) plus a tiny byte-level BPE tokenizer saved with ``save_pretrained``.
llama.cpp's own ``convert_hf_to_gguf.py --outtype f32`` turns it into the committed GGUF, so the
file's keys, tensor names and layouts are llama.cpp's, not plinth's. One harness change: the
converter names a BPE pre-tokenizer by hashing a fixed text's token ids, which a 300-token
vocabulary cannot match, so :func:`convert_with_llama_cpp` answers that lookup with ``gpt-2``
(the tokenizer is not what these fixtures test; the weights and keys are written untouched).

The ``.npz`` holds transformers' all-position logits (``NemotronHForCausalLM``, float32, eager)
for the prompts, and, for a case with an MTP head, the head's logits from a direct evaluation
with transformers' own blocks (:func:`transformers_reference`).
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

HERE = Path(__file__).resolve().parent
OUT = HERE / "llamacpp"
LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR") or os.environ.get("PLINTH_LLAMA_CPP_SRC")
                     or "/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")
PROMPT_LENGTHS = (1, 7, 40)

_COMMON: dict[str, Any] = dict(
    vocab_size=304, hidden_size=32, max_position_embeddings=512, layer_norm_epsilon=1e-5,
    # llama.cpp's converter asks for d_inner % 64 == 0
    mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=16,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=48,
    tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
)

CASES: dict[str, dict[str, Any]] = {
    # Mamba-2 + attention + dense ReLU^2 MLP (nemotron_h). Converted from config.json alone (no model_type):
    # through transformers 5's NemotronHConfig, whose to_dict() always has num_experts_per_tok, llama.cpp's
    # converter takes every NemotronH for nemotron_h_moe and writes a dense model as all-Mamba (a file its own
    # loader rejects); files in the wild were made where AutoConfig fell back to config.json
    "lc_hybrid": dict(seed=701, prompt_seed=801, arch="nemotron_h", raw_config=True,
                      config=dict(_COMMON, architectures=["NemotronHForCausalLM"], hybrid_override_pattern="M*-M",
                                  num_hidden_layers=4)),
    # LatentMoE + shared expert, and an MTP head (nemotron_h_moe, llama.cpp's one-block nextn layout)
    "lc_moe_mtp": dict(seed=702, prompt_seed=802, arch="nemotron_h_moe",
                       config=dict(_COMMON, architectures=["NemotronHForCausalLM"], hybrid_override_pattern="ME*E",
                                   n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                   moe_shared_expert_intermediate_size=24, routed_scaling_factor=2.5,
                                   norm_topk_prob=True, n_group=1, topk_group=1, moe_latent_size=16,
                                   num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")),
}


def golden_module() -> Any:
    from plinth.testing import load_module

    return load_module(HERE / "make_golden.py")


def prompts(case: str) -> list[list[int]]:
    rng = np.random.default_rng(CASES[case]["prompt_seed"])
    return [rng.integers(0, 300, n).tolist() for n in PROMPT_LENGTHS]


def write_tokenizer(folder: Path) -> None:
    """A 300-token byte-level BPE (trained here on a fixed text), saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|eos|>"], show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 3,
                             "plinth runs every GGUF llama.cpp writes"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>").save_pretrained(folder)


def write_config(case: str, folder: Path, for_llama_cpp: bool = False) -> None:
    c = CASES[case]
    raw = for_llama_cpp and c.get("raw_config")
    (folder / "config.json").write_text(json.dumps(c["config"] if raw else dict(c["config"], model_type="nemotron_h"),
                                                   indent=1))


def write_hf_folder(case: str, folder: Path) -> Path:
    g = golden_module()
    c = CASES[case]
    folder.mkdir(parents=True, exist_ok=True)
    write_config(case, folder)
    g.write_safetensors(folder / "model.safetensors", g.hf_random_state(c["config"], c["seed"]))
    write_tokenizer(folder)
    return folder


_RUNNER = """
import runpy, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/gguf-py")
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"   # a 300-token vocabulary has no known hash
sys.argv = [sys.argv[1] + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_with_llama_cpp(folder: Path, out: Path, *extra: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py --outtype f32 (its own code, one lookup answered; see above)."""
    env = dict(os.environ, PYTHONPATH=str(LLAMA_CPP_DIR / "gguf-py"))
    subprocess.run([sys.executable, "-c", _RUNNER, str(LLAMA_CPP_DIR), str(folder), "--outtype", "f32",
                    "--outfile", str(out), *extra], check=True, env=env, capture_output=True)
    return out


def transformers_reference(folder: Path, case: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """transformers' all-position logits per prompt and, with an MTP head, the head's logits.

    The head (transformers builds none; it skips ``mtp.*``) is evaluated as in ``test_mtp.py``'s
    direct evaluation: transformers' own ``NemotronHBlock``s for its attention and MoE sub-blocks,
    its input fusion and final RMSNorm written in torch from the model card. Row i pairs token
    ``prompt[i + 1]`` with transformers' final-normed hidden row i.
    """
    import torch
    from transformers import NemotronHForCausalLM
    from transformers.models.nemotron_h import modeling_nemotron_h as nh

    model, info = NemotronHForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    missing = info.get("missing_keys") or []
    unexpected = [k for k in info.get("unexpected_keys") or [] if not k.startswith("mtp.")]
    if missing or unexpected or info.get("mismatched_keys"):
        raise RuntimeError(f"{folder}: transformers did not load every trunk tensor: {info}")
    model.eval()
    config = CASES[case]["config"]
    logits, mtp = [], []
    state = {k: torch.from_numpy(v) for k, v in golden_module().hf_random_state(config, CASES[case]["seed"]).items()}
    blocks = []
    if config.get("num_nextn_predict_layers"):
        for i, kind in enumerate(config["mtp_hybrid_override_pattern"]):
            fields = {k: v for k, v in config.items() if k not in ("architectures", "hybrid_override_pattern",
                                                                   "mtp_hybrid_override_pattern")}
            fields.update(layers_block_type=["full_attention" if kind == "*" else "moe"], num_nextn_predict_layers=0)
            cfg = nh.NemotronHConfig(**fields)
            cfg._attn_implementation = "eager"
            block = nh.NemotronHBlock(cfg, layer_idx=0).eval()
            p = f"mtp.layers.{i}."
            sd = {k[len(p):]: v for k, v in state.items() if k.startswith(p)}
            sd = {k: v for k, v in sd.items() if k.startswith(("mixer.", "norm."))}
            if kind == "E":
                for which in ("up", "down"):
                    sd[f"mixer.experts.{which}_proj"] = torch.stack(
                        [sd.pop(f"mixer.experts.{j}.{which}_proj.weight") for j in range(cfg.n_routed_experts)])
            bad = block.load_state_dict(sd, strict=False)
            if bad.missing_keys or bad.unexpected_keys:
                raise RuntimeError(f"MTP block {i}: {bad}")
            blocks.append(block)
    eps = config["layer_norm_epsilon"]

    def rms(x: Any, w: Any) -> Any:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    with torch.no_grad():
        for prompt in prompts(case):
            ids = torch.tensor([prompt])
            out = model(ids, use_cache=False)
            logits.append(out.logits[0].float().numpy())
            if not blocks or len(prompt) < 2:
                continue
            h = model.model(ids).last_hidden_state[:, :-1]  # NemotronHModel returns it after norm_f
            e = state["backbone.embeddings.weight"][torch.tensor(prompt[1:])][None]
            x = torch.cat([rms(e, state["mtp.layers.0.enorm.weight"]), rms(h, state["mtp.layers.0.hnorm.weight"])], -1)
            x = x @ state["mtp.layers.0.eh_proj.weight"].T
            n = x.shape[1]
            causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
            for block in blocks:
                x = block(x, attention_mask=causal if block.block_type == "full_attention" else None)
            y = rms(x, state[f"mtp.layers.{len(blocks) - 1}.final_layernorm.weight"])
            mtp.append((y @ state["lm_head.weight"].T)[0].numpy())
    return logits, mtp


def make(case: str, tmp: Path) -> None:
    folder = write_hf_folder(case, tmp / case)
    OUT.mkdir(exist_ok=True)
    write_config(case, folder, for_llama_cpp=True)
    gguf = convert_with_llama_cpp(folder, OUT / f"{case}.gguf")
    write_config(case, folder)
    rec: dict[str, Any] = {"info": json.dumps({k: CASES[case][k] for k in ("seed", "prompt_seed", "arch", "config")})}
    logits, mtp = transformers_reference(folder, case)
    for i, prompt in enumerate(prompts(case)):
        rec[f"prompt_{i}"] = np.asarray(prompt, np.int32)
        rec[f"logits_{i}"] = logits[i].astype(np.float32)
    for i, rows in enumerate(mtp):  # prompts of 2 tokens or more, in order
        rec[f"mtp_logits_{i}"] = rows.astype(np.float32)
    np.savez_compressed(OUT / f"{case}.npz", **rec)
    print(f"{case}: {gguf} ({gguf.stat().st_size} bytes), {OUT / (case + '.npz')}")


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for case in argv or sorted(CASES):
            make(case, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    raise SystemExit(main(sys.argv[1:]))

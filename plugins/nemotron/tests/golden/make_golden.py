"""Write the golden reference files of plinth-nemotron (tiny random Nemotron-H models).

Run by hand (needs torch and transformers, ``pip install -e 'plugins/nemotron[ref]'``)::

    python plugins/nemotron/tests/golden/make_golden.py            # all cases
    python plugins/nemotron/tests/golden/make_golden.py latent     # one case

Each case is a Hugging Face NemotronH config (``CASES``). Its weights are drawn with numpy
from the case's seed under the tensor names transformers' ``save_pretrained`` writes
(``backbone.*``, one tensor per expert, ``gate.e_score_correction_bias``), and saved as an HF
folder (``config.json`` + ``model.safetensors``) by :func:`write_hf_folder`, without torch.
plinth's converter turns that folder into GGUF; the tests compare plinth with the reference.

The reference:

* standard cases: ``NemotronHForCausalLM.from_pretrained(folder)`` (float32, eager attention;
  loading must report no missing or unexpected tensor);
* ``puzzle`` (``NemotronHPuzzleForCausalLM``, which transformers does not ship): a model assembled
  from transformers' own ``NemotronHBlock``s, block i built from the global config overlaid with
  ``block_configs[i]`` (vLLM's per-layer rule), plus transformers' embedding, final norm and head.

It gives all-position logits for prompts of 1, 7 and 64 tokens and a 32-token greedy
continuation of each (full recompute per step). ``<case>.npz`` stores those with the config
and seeds; the weights are not stored (they are redrawn from the seed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from plinth.testing import write_safetensors

HERE = Path(__file__).resolve().parent

PROMPT_LENGTHS = (1, 7, 64)
N_GREEDY = 32

_COMMON: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, max_position_embeddings=512, layer_norm_epsilon=1e-5,
    mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
    tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
)
_MOE: dict[str, Any] = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, norm_topk_prob=True,
                            n_group=1, topk_group=1)

CASES: dict[str, dict[str, Any]] = {
    # Mamba-2 only
    "mamba2": dict(seed=301, prompt_seed=401, arch="nemotron_h",
                   config=dict(_COMMON, architectures=["NemotronHForCausalLM"], hybrid_override_pattern="MMM")),
    # Mamba-2 + attention + dense ReLU^2 MLP
    "hybrid": dict(seed=302, prompt_seed=402, arch="nemotron_h",
                   config=dict(_COMMON, architectures=["NemotronHForCausalLM"],
                               layers_block_type=["mamba", "attention", "mamba", "mlp", "mamba", "attention"])),
    # routed experts without a latent projection; every FFN layer a uniform MoE (scalar keys)
    "moe": dict(seed=303, prompt_seed=403, arch="nemotron_h_moe",
                config=dict(_COMMON, **_MOE, architectures=["NemotronHForCausalLM"],
                            hybrid_override_pattern="ME*ME")),
    # LatentMoE (Nemotron 3 Super style) mixed with a dense MLP layer (per-layer arrays)
    "latent": dict(seed=304, prompt_seed=404, arch="nemotron_h_moe",
                   config=dict(_COMMON, **dict(_MOE, num_experts_per_tok=3, routed_scaling_factor=1.5),
                               architectures=["NemotronHForCausalLM"], moe_latent_size=24,
                               layers_block_type=["linear_attention", "full_attention", "moe", "mlp",
                                                  "linear_attention", "moe"])),
    # NVIDIA Puzzle: per-block expert widths, top-k and shared widths
    "puzzle": dict(seed=305, prompt_seed=405, arch="nemotron_h_moe",
                   config=dict(_COMMON, **_MOE, architectures=["NemotronHPuzzleForCausalLM"],
                               model_type="nemotron_h_puzzle", block_configs=[
                                   {"block_type": "mamba"},
                                   {"block_type": "moe", "num_experts_per_tok": 2, "moe_intermediate_size": 24},
                                   {"block_type": "attention", "num_key_value_heads": 1},
                                   {"block_type": "moe", "num_experts_per_tok": 4, "moe_intermediate_size": 40,
                                    "moe_shared_expert_intermediate_size": 32},
                                   {"block_type": "mamba"},
                                   {"block_type": "moe", "num_experts_per_tok": 1, "moe_intermediate_size": 16},
                               ])),
    # Bolt-style heterogeneous MoE: per-layer top-k, expert width, LatentMoE width, shared width and KV heads,
    # a dense MLP layer among the MoE layers, and an MTP head (attention + MoE with its own top-k)
    "bolt": dict(seed=306, prompt_seed=406, arch="nemotron_h_moe",
                 config=dict(_COMMON, **_MOE, architectures=["NemotronHPuzzleForCausalLM"],
                             model_type="nemotron_h_puzzle", num_nextn_predict_layers=1, block_configs=[
                                 {"block_type": "mamba"},
                                 {"block_type": "moe", "num_experts_per_tok": 3, "moe_intermediate_size": 24,
                                  "moe_latent_size": 24},
                                 {"block_type": "attention", "num_key_value_heads": 4},
                                 {"block_type": "mlp", "intermediate_size": 80},
                                 {"block_type": "moe", "num_experts_per_tok": 1, "moe_intermediate_size": 40,
                                  "moe_latent_size": 32, "moe_shared_expert_intermediate_size": 24},
                                 {"block_type": "mamba"},
                                 {"block_type": "attention", "num_key_value_heads": 1},
                                 {"block_type": "moe", "num_experts_per_tok": 5, "moe_intermediate_size": 16},
                             ], mtp_block_configs=[
                                 {"block_type": "attention"},
                                 {"block_type": "moe", "num_experts_per_tok": 2, "moe_intermediate_size": 32},
                             ])),
}


# --------------------------------------------------------------------------- HF-format weights (no torch)

def layer_kinds(config: dict[str, Any]) -> list[str]:
    from plinth_nemotron.convert import layer_configs

    return layer_configs(config, "golden")[2]


def _draw(rng: Any) -> tuple[Any, Any]:
    def lin(n_out: int, n_in: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    return lin, norm


def _block_state(sd: dict[str, np.ndarray], p: str, c: dict[str, Any], kind: str, d: int, rng: Any) -> None:
    """One block's tensors under prefix ``p`` (``backbone.layers.{i}.`` or ``mtp.layers.{i}.``)."""
    lin, norm = _draw(rng)
    sd[p + "norm.weight"] = norm(d)
    m = p + "mixer."
    if kind == "mamba":
        h, hd, g, n, k = c["mamba_num_heads"], c["mamba_head_dim"], c["n_groups"], c["ssm_state_size"], \
            c["conv_kernel"]
        di = h * hd
        conv = di + 2 * g * n
        sd[m + "in_proj.weight"] = lin(di + conv + h, d)
        sd[m + "conv1d.weight"] = (0.5 * rng.standard_normal((conv, 1, k))).astype(np.float32)
        sd[m + "conv1d.bias"] = (0.1 * rng.standard_normal(conv)).astype(np.float32)
        sd[m + "dt_bias"] = (0.5 * rng.standard_normal(h)).astype(np.float32)
        sd[m + "A_log"] = np.log(rng.uniform(1.0, 8.0, h)).astype(np.float32)
        sd[m + "D"] = rng.standard_normal(h).astype(np.float32)
        sd[m + "norm.weight"] = norm(di)
        sd[m + "out_proj.weight"] = lin(d, di)
    elif kind == "attention":
        hd = c["head_dim"]
        sd[m + "q_proj.weight"] = lin(c["num_attention_heads"] * hd, d)
        sd[m + "k_proj.weight"] = lin(c["num_key_value_heads"] * hd, d)
        sd[m + "v_proj.weight"] = lin(c["num_key_value_heads"] * hd, d)
        sd[m + "o_proj.weight"] = lin(d, c["num_attention_heads"] * hd)
    elif kind == "mlp":
        sd[m + "up_proj.weight"] = lin(c["intermediate_size"], d)
        sd[m + "down_proj.weight"] = lin(d, c["intermediate_size"])
    else:
        e, ff, sh = c["n_routed_experts"], c["moe_intermediate_size"], c["moe_shared_expert_intermediate_size"]
        lat = c.get("moe_latent_size") or d
        sd[m + "gate.weight"] = (2.0 * lin(e, d))
        sd[m + "gate.e_score_correction_bias"] = (0.1 * rng.standard_normal(e)).astype(np.float32)
        for j in range(e):
            sd[m + f"experts.{j}.up_proj.weight"] = lin(ff, lat)
            sd[m + f"experts.{j}.down_proj.weight"] = lin(lat, ff)
        sd[m + "shared_experts.up_proj.weight"] = lin(sh, d)
        sd[m + "shared_experts.down_proj.weight"] = lin(d, sh)
        if c.get("moe_latent_size"):
            sd[m + "fc1_latent_proj.weight"] = lin(lat, d)
            sd[m + "fc2_latent_proj.weight"] = lin(d, lat)


def hf_random_state(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Random weights under transformers' saved NemotronH names, scaled so activations stay O(1).

    When the config declares an MTP head, its ``mtp.layers.*`` tensors (release names) are added,
    drawn from their own generator so the trunk's weights do not depend on it.
    """
    from plinth_nemotron.convert import layer_configs, mtp_configs

    rng = np.random.default_rng(seed)
    _, per, kinds = layer_configs(config, "golden")
    d = config["hidden_size"]
    sd = {"backbone.embeddings.weight": rng.standard_normal((config["vocab_size"], d)).astype(np.float32)}
    for i, (c, kind) in enumerate(zip(per, kinds)):
        _block_state(sd, f"backbone.layers.{i}.", c, kind, d, rng)
    lin, norm = _draw(rng)
    sd["backbone.norm_f.weight"] = norm(d)
    sd["lm_head.weight"] = lin(config["vocab_size"], d)
    mtp_per, mtp_kinds = mtp_configs(config, "golden")
    if mtp_kinds:
        rng = np.random.default_rng(seed + 7)
        lin, norm = _draw(rng)
        sd["mtp.layers.0.enorm.weight"] = norm(d)
        sd["mtp.layers.0.hnorm.weight"] = norm(d)
        sd["mtp.layers.0.eh_proj.weight"] = lin(d, 2 * d)
        for i, (c, kind) in enumerate(zip(mtp_per, mtp_kinds)):
            _block_state(sd, f"mtp.layers.{i}.", c, kind, d, rng)
        sd[f"mtp.layers.{len(mtp_kinds) - 1}.final_layernorm.weight"] = norm(d)
    return sd


def write_hf_folder(case: str, folder: Path, state: dict[str, np.ndarray] | None = None) -> Path:
    c = CASES[case]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(c["config"], indent=1))
    write_safetensors(folder / "model.safetensors", state or hf_random_state(c["config"], c["seed"]))
    return folder


def registry() -> Any:
    from plinth.testing import make_registry
    from plinth_nemotron.plugin import plugin

    return make_registry(plugin)


def plinth_model(case: str, tmp: Path, reg: Any = None) -> Any:
    """The case converted by plinth's converter and loaded through the plugin."""
    from plinth.testing.golden import convert_and_load

    return convert_and_load(write_hf_folder(case, tmp / f"{case}-hf"), tmp / f"{case}.gguf", reg or registry())


def prompts(case: str) -> list[list[int]]:
    from plinth.testing.golden import random_prompts

    return random_prompts(CASES[case]["prompt_seed"], CASES[case]["config"]["vocab_size"], PROMPT_LENGTHS)


# --------------------------------------------------------------------------- reference side (torch)

def _hf_config(config: dict[str, Any]) -> Any:
    from transformers import NemotronHConfig

    fields = {k: v for k, v in config.items()
              if k not in ("architectures", "block_configs", "model_type", "mtp_block_configs")}
    cfg = NemotronHConfig(**fields)
    cfg._attn_implementation = "eager"
    return cfg


class PuzzleReference:
    """A Puzzle model from transformers' NemotronH blocks, each configured for its own layer."""

    def __init__(self, config: dict[str, Any], state: dict[str, np.ndarray]) -> None:
        import torch
        from transformers.models.nemotron_h import modeling_nemotron_h as nh
        from plinth_nemotron.convert import layer_configs

        _, per, kinds = layer_configs(config, "golden")
        types = ["linear_attention" if k == "mamba" else "full_attention" if k == "attention" else k for k in kinds]
        base = {k: v for k, v in config.items()
                if k not in ("architectures", "block_configs", "model_type", "mtp_block_configs")}
        t = {k: torch.from_numpy(v) for k, v in state.items()}
        self.embed = t["backbone.embeddings.weight"]
        self.blocks = []
        for i, kind in enumerate(kinds):
            overrides = {k: v for k, v in config["block_configs"][i].items() if k != "block_type"}
            cfg = _hf_config(dict(base, layers_block_type=types, **overrides))
            block = nh.NemotronHBlock(cfg, layer_idx=i).eval()
            p = f"backbone.layers.{i}."
            sd = {k[len(p):]: v for k, v in t.items() if k.startswith(p)}
            if kind == "moe":
                e = cfg.n_routed_experts
                for which in ("up", "down"):
                    sd[f"mixer.experts.{which}_proj"] = torch.stack(
                        [sd.pop(f"mixer.experts.{j}.{which}_proj.weight") for j in range(e)])
            missing, unexpected = block.load_state_dict(sd, strict=False)
            if missing or unexpected:
                raise RuntimeError(f"puzzle layer {i}: missing {missing}, unexpected {unexpected}")
            self.blocks.append(block)
        self.norm = nh.NemotronHRMSNorm(config["hidden_size"], eps=config["layer_norm_epsilon"])
        self.norm.weight.data = t["backbone.norm_f.weight"]
        self.head = t["lm_head.weight"]

    def logits(self, ids: list[int]) -> np.ndarray:
        import torch

        with torch.no_grad():
            x = self.embed[torch.tensor(ids)][None]
            n = len(ids)
            causal = torch.full((n, n), float("-inf")).triu(1)[None, None]  # additive mask for eager attention
            for block in self.blocks:
                x = block(x, attention_mask=causal if block.block_type == "full_attention" else None)
            return (self.norm(x) @ self.head.T)[0].float().numpy()


def hf_reference(folder: Path) -> Any:
    """``NemotronHForCausalLM.from_pretrained(folder)``: float32, eager attention, every tensor loaded."""
    from transformers import NemotronHForCausalLM

    from plinth.testing.reference import HFReference

    return HFReference(NemotronHForCausalLM, folder)


def reference_model(case: str, folder: Path) -> Any:
    c = CASES[case]
    if "block_configs" in c["config"]:
        return PuzzleReference(c["config"], hf_random_state(c["config"], c["seed"]))
    return hf_reference(folder)


def reference(case: str, tmp: Path, with_greedy: bool = True) -> dict[str, Any]:
    """The golden record of ``case`` computed now (``with_greedy=False``: logits only, much faster)."""
    from plinth.testing.reference import reference_record

    c = CASES[case]
    info = {"seed": c["seed"], "prompt_seed": c["prompt_seed"], "arch": c["arch"], "config": c["config"]}
    return reference_record(info, prompts(case), lambda: reference_model(case, write_hf_folder(case, tmp / f"{case}-hf")),
                            N_GREEDY, with_greedy=with_greedy)


def main(argv: list[str]) -> int:
    from plinth.testing.golden import write_golden_files

    write_golden_files(HERE, argv or sorted(CASES), reference)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    raise SystemExit(main(sys.argv[1:]))

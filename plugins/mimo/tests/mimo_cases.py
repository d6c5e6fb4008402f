"""Tiny random MiMo-V2-Flash models for the tests (loaded with ``plinth.testing.load_module``).

Each case is a ``MiMoV2FlashConfig`` in transformers' spelling plus the release config's own keys
(``hybrid_layer_pattern``, ``swa_num_key_value_heads``, ``swa_head_dim``, ``rope_theta`` ...) that
llama.cpp's converter reads, consistent with each other (so one folder serves transformers, plinth's
converter and llama.cpp's). Weights: transformers' model with every parameter redrawn (norm weights
around 1, sinks, router weights and the selection bias at O(1), which transformers sets to 0, 1 or
N(0, 0.02)), saved with ``save_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

S, F = "sliding_attention", "full_attention"
N_VOCAB = 300  # the 300-token byte-level BPE of the tokenizer writer below

BASE: dict[str, Any] = dict(
    architectures=["MiMoV2FlashForCausalLM"], model_type="mimo_v2_flash", vocab_size=N_VOCAB, hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=24,
    v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=1.0, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
    attention_value_scale=0.707, bos_token_id=None, eos_token_id=None, pad_token_id=None, sliding_window=7,
    # the release's spellings (llama.cpp's converter reads these)
    swa_num_key_value_heads=2, swa_head_dim=24, swa_v_head_dim=16, swa_num_attention_heads=4,
    topk_method="noaux_tc", scoring_func="sigmoid", layernorm_epsilon=1e-5,
    rope_theta=5_000_000.0, swa_rope_theta=10_000.0, partial_rotary_factor=0.334,
)


def case_config(layer_types: list[str], mlp: list[str], **over: Any) -> dict[str, Any]:
    cfg = dict(BASE, num_hidden_layers=len(layer_types), layer_types=layer_types, mlp_layer_types=mlp,
               hybrid_layer_pattern=[int(t == S) for t in layer_types])
    cfg.update(over)
    return cfg


CASES: dict[str, dict[str, Any]] = {
    # the release's pattern in small: full first, sliding, then full; layer 0 dense, the rest MoE
    "release": dict(seed=1, config=case_config([F, S, S, F], ["dense", "sparse", "sparse", "sparse"])),
    # sliding first and last, no MoE at all
    "dense": dict(seed=2, config=case_config([S, F, S], ["dense", "dense", "dense"])),
    # MoE everywhere, grouped routing, routed scaling, unnormalised weights, another window and value scale
    "moe": dict(seed=3, config=case_config([S, S, F], ["sparse", "sparse", "sparse"], n_group=2, topk_group=1,
                                           routed_scaling_factor=2.5, norm_topk_prob=False, sliding_window=4,
                                           attention_value_scale=1.3, num_experts_per_tok=3)),
}

#: the llama.cpp-written fixtures (tests/llamacpp): smaller widths, so the committed files stay small
FIXTURES: dict[str, dict[str, Any]] = {
    "lc_release": dict(seed=11, config=case_config([F, S, S, F], ["dense", "sparse", "sparse", "sparse"],
                                                   hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                                   n_routed_experts=4)),
    "lc_dense": dict(seed=12, config=case_config([S, F, S], ["dense"] * 3, hidden_size=32, intermediate_size=48,
                                                 sliding_window=4)),
}
CASES.update(FIXTURES)

PROMPT_LENGTHS = (1, 9, 300)


def prompts(seed: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, N_VOCAB, n).tolist() for n in PROMPT_LENGTHS]


def reference_model(cfg: dict[str, Any], seed: int, f16: bool = False) -> Any:
    """transformers' MiMoV2FlashForCausalLM of ``cfg`` (float32, eager), every parameter redrawn (``f16``: to
    values float16 holds exactly, so a float16 file is lossless)."""
    import torch
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config = MiMoV2FlashConfig(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = MiMoV2FlashForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks") or "gate.e_score_correction_bias" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))
        if f16:
            for t in list(model.parameters()) + [b for n, b in model.named_buffers() if "correction" in n]:
                t.copy_(t.half().float())
    return model


def write_folder(case: str, folder: Path, tokenizer: bool = True, for_llama_cpp: bool = False,
                 f16: bool = False) -> tuple[Path, Any]:
    """The case saved by transformers' ``save_pretrained`` (plus the release keys and a tokenizer); returns
    (folder, the transformers model). ``for_llama_cpp``: without transformers' per-layer-type
    ``rope_parameters``, as the release config (llama.cpp's converter reads the top-level rope keys; the
    cases' values are transformers' defaults, so both read the same model)."""
    c = CASES[case]
    model = reference_model(c["config"], c["seed"], f16=f16)
    model.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    for k, v in c["config"].items():
        saved.setdefault(k, v)  # the release spellings transformers does not keep
    if for_llama_cpp:
        saved.pop("rope_parameters")
    (folder / "config.json").write_text(json.dumps(saved, indent=1))
    if tokenizer:
        write_tokenizer(folder)
    return folder, model


def reference_logits(model: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


def write_tokenizer(folder: Path) -> None:
    """A 300-token byte-level BPE (trained here on a fixed text), saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=N_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|eos|>"], show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 3,
                             "plinth runs every GGUF llama.cpp writes"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>").save_pretrained(folder)


def registry() -> Any:
    from plinth.testing import make_registry
    from plinth_mimo.plugin import plugin

    return make_registry(plugin)


def mtp_state(cfg: dict[str, Any], seed: int, n_mtp: int = 1) -> dict[str, np.ndarray]:
    """Random MTP blocks in the release's names (``model.mtp.layers.N.*``): a sliding-window attention block
    with sinks and a dense SwiGLU, the input fusion (``eh_proj`` [E, 2E], ``enorm``, ``hnorm``) and the head
    norm (``final_layernorm``), every norm weight around 1."""
    rng = np.random.default_rng(seed)
    e, h, d_k, d_v = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"], cfg["v_head_dim"]
    kv, ff = cfg["swa_num_key_value_heads"], cfg["intermediate_size"]

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    out = {}
    for i in range(n_mtp):
        p = f"model.mtp.layers.{i}."
        out.update({p + "input_layernorm.weight": norm(e), p + "self_attn.q_proj.weight": mat(h * d_k, e),
                    p + "self_attn.k_proj.weight": mat(kv * d_k, e), p + "self_attn.v_proj.weight": mat(kv * d_v, e),
                    p + "self_attn.o_proj.weight": mat(e, h * d_v),
                    p + "self_attn.attention_sink_bias": rng.standard_normal(h).astype(np.float32),
                    p + "post_attention_layernorm.weight": norm(e), p + "mlp.gate_proj.weight": mat(ff, e),
                    p + "mlp.up_proj.weight": mat(ff, e), p + "mlp.down_proj.weight": mat(e, ff),
                    p + "eh_proj.weight": mat(e, 2 * e), p + "enorm.weight": norm(e), p + "hnorm.weight": norm(e),
                    p + "final_layernorm.weight": norm(e)})
    return out


def mtp_reference_logits(model: Any, state: dict[str, np.ndarray], ids: list[int], block: int = 0) -> np.ndarray:
    """MTP block ``block``'s logits for rows (token ids[p + 1], the trunk's pre-norm residual at p), p < n - 1:
    transformers' own MiMoV2FlashDecoderLayer (a sliding layer) for the block, the input fusion and the
    head norm written in torch from the model card (transformers builds no MTP)."""
    import torch
    from transformers import MiMoV2FlashConfig
    from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash as mm

    cfg = model.config
    one = MiMoV2FlashConfig(**{k: v for k, v in cfg.to_dict().items() if k in MiMoV2FlashConfig.__dataclass_fields__
                               and k not in ("num_hidden_layers", "layer_types", "mlp_layer_types")},
                            num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["dense"])
    one._attn_implementation = "eager"
    layer = mm.MiMoV2FlashDecoderLayer(one, 0).eval()
    p = f"model.mtp.layers.{block}."
    sd = {k[len(p):].replace("self_attn.attention_sink_bias", "self_attn.sinks"): torch.from_numpy(v)
          for k, v in state.items() if k.startswith(p)}
    fusion = {k: sd.pop(k) for k in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "final_layernorm.weight")}
    layer.load_state_dict(sd, strict=True)
    rot = mm.MiMoV2FlashRotaryEmbedding(one)
    eps = cfg.rms_norm_eps

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    captured = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, a, out: captured.setdefault("h", out))
    with torch.no_grad():
        model(torch.tensor([ids]), use_cache=False)
        hook.remove()
        h = captured["h"][0, :-1]
        e = model.model.embed_tokens(torch.tensor(ids[1:]))
        x = torch.cat([rms(e, fusion["enorm.weight"]), rms(h, fusion["hnorm.weight"])], -1) @ fusion["eh_proj.weight"].T
        n = x.shape[0]
        pos = torch.arange(n)[None]
        cos, sin = rot(x[None], pos, "sliding_attention")
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        mask = torch.where((k <= q) & (q - k < one.sliding_window), 0.0, float("-inf"))[None, None]
        x = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))[0]
        return model.lm_head(rms(x, fusion["final_layernorm.weight"])).numpy()

"""GGUF-named weights of a dense decoder mapped onto Hugging Face transformers parameters.

The transformers oracles (the golden-file makers of plinth-llama's tiny models and of the
real SmolLM2 / Gemma-3 files) load a GGUF's weights into the matching transformers model
through this one mapping. Importing it needs no torch; :func:`load_hf_state` imports it.

Mapping GGUF -> Hugging Face, per architecture (``llama``, ``qwen2``, ``qwen3``, ``gemma3``):

* linear weights are ``[n_out, n_in]`` on both sides;
* llama's GGUF ``attn_q`` / ``attn_k`` rows are ordered by llama.cpp's converter for RoPE on
  interleaved pairs, Hugging Face rotates halves: per head, GGUF row ``2 i + j`` is Hugging
  Face row ``j * head_dim / 2 + i`` (:func:`unpermute_rope_rows`);
* gemma3's GGUF norm weights (all of them, q/k norms included) hold ``1 + w`` where
  Hugging Face holds ``w``; gemma3 has four norms per block (input, post-attention,
  pre- and post-feed-forward);
* qwen2 has Q/K/V biases; qwen3 and gemma3 have per-head q/k norms;
* a missing ``output.weight`` means a tied LM head (no ``lm_head.weight`` entry).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF llama q/k rows (RoPE on interleaved pairs) -> Hugging Face rows (RoPE on halves).

    w: [n_head * head_dim, n_in]. Returns the same shape, rows reordered per head.
    """
    rows, n_in = w.shape
    hd = rows // n_head
    return w.reshape(n_head, hd // 2, 2, n_in).swapaxes(1, 2).reshape(rows, n_in)


def _per_layer(v: int | Sequence[int], n_layer: int) -> list[int]:
    return [int(v)] * n_layer if isinstance(v, (int, np.integer)) else [int(v[il]) for il in range(n_layer)]


def hf_state_dict(arch: str, w: Mapping[str, np.ndarray], n_layer: int, n_head: int | Sequence[int],
                  n_head_kv: int | Sequence[int]) -> dict[str, np.ndarray]:
    """Hugging Face parameter name -> array, from the GGUF-named weights ``w`` of a dense decoder.

    arch: one of :data:`ARCHS`; n_head, n_head_kv: an int or one per layer (``hp.n_head`` works).
    """
    if arch not in ARCHS:
        raise ValueError(f"no GGUF -> Hugging Face mapping for architecture {arch!r}; known: {', '.join(ARCHS)}")
    heads, kv_heads = _per_layer(n_head, n_layer), _per_layer(n_head_kv, n_layer)
    norm = (lambda a: a - np.float32(1.0)) if arch == "gemma3" else (lambda a: a)
    sd = {"model.embed_tokens.weight": w["token_embd.weight"], "model.norm.weight": norm(w["output_norm.weight"])}
    if "output.weight" in w:
        sd["lm_head.weight"] = w["output.weight"]
    for il in range(n_layer):
        g, h = f"blk.{il}.", f"model.layers.{il}."
        q, k = w[g + "attn_q.weight"], w[g + "attn_k.weight"]
        if arch == "llama":
            q, k = unpermute_rope_rows(q, heads[il]), unpermute_rope_rows(k, kv_heads[il])
        sd.update({
            h + "self_attn.q_proj.weight": q,
            h + "self_attn.k_proj.weight": k,
            h + "self_attn.v_proj.weight": w[g + "attn_v.weight"],
            h + "self_attn.o_proj.weight": w[g + "attn_output.weight"],
            h + "mlp.gate_proj.weight": w[g + "ffn_gate.weight"],
            h + "mlp.up_proj.weight": w[g + "ffn_up.weight"],
            h + "mlp.down_proj.weight": w[g + "ffn_down.weight"],
            h + "input_layernorm.weight": norm(w[g + "attn_norm.weight"]),
        })
        if arch == "gemma3":
            sd.update({
                h + "post_attention_layernorm.weight": norm(w[g + "post_attention_norm.weight"]),
                h + "pre_feedforward_layernorm.weight": norm(w[g + "ffn_norm.weight"]),
                h + "post_feedforward_layernorm.weight": norm(w[g + "post_ffw_norm.weight"]),
            })
        else:
            sd[h + "post_attention_layernorm.weight"] = w[g + "ffn_norm.weight"]
        if arch == "qwen2":
            for p in "qkv":
                sd[h + f"self_attn.{p}_proj.bias"] = w[g + f"attn_{p}.bias"]
        if arch in ("qwen3", "gemma3"):
            sd[h + "self_attn.q_norm.weight"] = norm(w[g + "attn_q_norm.weight"])
            sd[h + "self_attn.k_norm.weight"] = norm(w[g + "attn_k_norm.weight"])
    return sd


def load_hf_state(net: Any, sd: Mapping[str, np.ndarray], what: str, tied: bool) -> Any:
    """Copy ``sd`` into the torch module ``net`` (float32), refusing an unmapped or mis-shaped parameter.

    what: a label for error messages (the case or model name); tied: the LM head must share
    the embedding's storage. Returns ``net``.
    """
    import torch

    params = dict(net.named_parameters())  # a tied lm_head appears once, as the embedding
    if set(params) != set(sd):
        raise AssertionError(f"{what}: parameters not mapped {sorted(set(params) - set(sd))}, "
                             f"mapped to nothing {sorted(set(sd) - set(params))}")
    with torch.no_grad():
        for name, p in params.items():
            a = torch.from_numpy(np.ascontiguousarray(sd[name], dtype=np.float32))
            if tuple(a.shape) != tuple(p.shape):
                raise AssertionError(f"{what}: {name} is {tuple(p.shape)}, mapped array is {tuple(a.shape)}")
            p.copy_(a)
    if tied:
        assert net.lm_head.weight.data_ptr() == net.model.embed_tokens.weight.data_ptr()
    return net

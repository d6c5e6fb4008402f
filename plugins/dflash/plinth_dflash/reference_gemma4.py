"""A torch reference of a Gemma 4 DFlash draft built from transformers' own Gemma 4 modules.

No published package runs a Gemma 4 DFlash / DSpark backbone (speculators 0.9.0 builds every draft layer as a
Qwen3 layer, whatever its ``transformer_layer_config``; DeepSpec's Gemma4DSparkModel code is not public), so the
oracle is composed here from transformers 5.24's Gemma 4 building blocks: each draft layer is a
``Gemma4TextDecoderLayer`` (its projections, ``q_norm`` / ``k_norm`` / ``v_norm``, the four layer norms,
``Gemma4TextMLP`` and ``layer_scalar``), the RoPE tables come from ``Gemma4TextRotaryEmbedding`` per layer type,
the embeddings from ``Gemma4TextScaledWordEmbedding``, the norms from ``Gemma4RMSNorm``. What is written here is
only what DFlash adds around a layer: K and V of the context come from the fused target features
``g = hidden_norm(fc(f))`` through the layer's own ``k_proj`` / ``v_proj`` and are concatenated in front of the
block's; the mask is non-causal (causal on layers the config makes causal: z-lab's rule, sliding layers causal
unless ``is_causal`` is given) and a sliding layer sees keys with ``q_pos - k_pos < sliding_window``; the scores
use the attention module's own ``scaling``.

Needs ``torch==2.13.0`` and ``transformers==5.24.0`` (the case builders below need neither).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

#: config keys of a draft folder that are not Gemma4TextConfig fields
NOT_CONFIG = ("architectures", "model_type", "dflash_config", "is_causal", "markov_rank", "markov_head_type",
              "enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor", "draft_vocab_size",
              "target_layer_ids", "mask_token_id", "block_size")


class Gemma4DraftReference:
    """The draft of one HF folder (``config.json`` with ``model_type = "gemma4_text"`` + safetensors)."""

    def __init__(self, model_dir: str | Path) -> None:
        import torch
        from transformers import Gemma4TextConfig
        from transformers.models.gemma4 import modeling_gemma4 as g4

        from plinth.convert import SafetensorsDir

        raw = json.loads((Path(model_dir) / "config.json").read_text())
        self.raw = raw
        cfg = Gemma4TextConfig(**{k: v for k, v in raw.items() if k not in NOT_CONFIG})
        cfg._attn_implementation = "eager"
        self.cfg = cfg
        st = SafetensorsDir(model_dir)
        sd = {(n[len("model."):] if n.startswith("model.") else n): torch.from_numpy(np.array(st.get(n)))
              for n in st.names()}
        e = cfg.hidden_size
        self.layers = []
        for il in range(cfg.num_hidden_layers):
            layer = g4.Gemma4TextDecoderLayer(cfg, il).eval().to(torch.float32)
            p = f"layers.{il}."
            own = {k[len(p):]: v for k, v in sd.items() if k.startswith(p)}
            missing, unexpected = layer.load_state_dict(own, strict=False)
            if missing or unexpected:
                raise RuntimeError(f"layer {il}: missing {missing}, unexpected {unexpected}")
            self.layers.append(layer)
        self.rotary = g4.Gemma4TextRotaryEmbedding(cfg)
        self.fc = torch.nn.Linear(sd["fc.weight"].shape[1], e, bias=False)
        self.fc.weight.data = sd["fc.weight"]
        self.hidden_norm = g4.Gemma4RMSNorm(e, eps=cfg.rms_norm_eps)
        self.hidden_norm.weight.data = sd["hidden_norm.weight"]
        self.norm = g4.Gemma4RMSNorm(e, eps=cfg.rms_norm_eps)
        self.norm.weight.data = sd["norm.weight"]
        self.own_embed = sd.get("embed_tokens.weight")
        self.own_head = sd.get("lm_head.weight")
        self.g4 = g4
        causal = raw.get("is_causal", (raw.get("dflash_config") or {}).get("causal"))
        self.causal = [bool(causal) if causal is not None else t == "sliding_attention" for t in cfg.layer_types]

    def forward(self, features: np.ndarray, ctx_pos: np.ndarray, tokens: np.ndarray, pos: np.ndarray,
                embed_table: np.ndarray, head: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """features: [n_ctx, n_taps * E] target features of the context rows at ``ctx_pos``; tokens: [b] the block
        at ``pos``; embed_table / head: [V, E] (the target's, used when the draft has none of its own, the head
        tied to the own embedding when the config says so). Returns (final-normed hidden [b, E], logits [b, V])."""
        import torch

        g4, cfg = self.g4, self.cfg
        table = self.own_embed if self.own_embed is not None else torch.from_numpy(np.array(embed_table))
        if self.own_head is not None:
            head_t = self.own_head
        elif self.own_embed is not None and cfg.tie_word_embeddings:
            head_t = self.own_embed
        else:
            head_t = torch.from_numpy(np.array(head))
        emb = g4.Gemma4TextScaledWordEmbedding(table.shape[0], table.shape[1], None, embed_scale=cfg.hidden_size ** 0.5)
        emb.weight.data = table
        with torch.inference_mode():
            h = emb(torch.as_tensor(np.asarray(tokens), dtype=torch.long))[None]  # [1, b, E]
            g = self.hidden_norm(self.fc(torch.from_numpy(np.array(features, dtype=np.float32))[None]))  # [1, n, E]
            q_pos = torch.as_tensor(np.asarray(pos), dtype=torch.long)
            k_pos = torch.cat([torch.as_tensor(np.asarray(ctx_pos), dtype=torch.long), q_pos])
            for il, layer in enumerate(self.layers):
                layer_type = cfg.layer_types[il]
                cos_q, sin_q = self.rotary(h, q_pos[None], layer_type)
                cos_k, sin_k = self.rotary(h, k_pos[None], layer_type)
                residual = h
                x = layer.input_layernorm(h)
                window = cfg.sliding_window if layer_type == "sliding_attention" else None
                out = self._attention(layer.self_attn, x, g, cos_q, sin_q, cos_k, sin_k, q_pos, k_pos,
                                      self.causal[il], window)
                h = residual + layer.post_attention_layernorm(out)
                residual = h
                h = residual + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
                h = h * layer.layer_scalar
            hidden = self.norm(h)[0]
            return hidden.numpy().copy(), (hidden @ head_t.T).numpy().copy()

    def _attention(self, attn: Any, x: Any, g: Any, cos_q: Any, sin_q: Any, cos_k: Any, sin_k: Any, q_pos: Any,
                   k_pos: Any, causal: bool, window: int | None) -> Any:
        import torch

        g4 = self.g4
        hd = attn.head_dim
        b = x.shape[1]
        q = attn.q_norm(attn.q_proj(x).view(1, b, -1, hd))
        q = g4.apply_rotary_pos_emb(q, cos_q, sin_q, unsqueeze_dim=2).transpose(1, 2)  # [1, H, b, hd]
        both = torch.cat([g, x], dim=1)  # the context rows, then the block's own
        n = both.shape[1]
        k_raw = attn.k_proj(both).view(1, n, -1, hd)
        v = attn.v_proj(both).view(1, n, -1, hd) if attn.v_proj is not None else k_raw
        k = g4.apply_rotary_pos_emb(attn.k_norm(k_raw), cos_k, sin_k, unsqueeze_dim=2).transpose(1, 2)
        v = attn.v_norm(v).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) * attn.scaling  # [1, H, b, n]
        allowed = torch.ones(b, n, dtype=torch.bool)
        diff = q_pos[:, None] - k_pos[None, :]
        if causal:
            allowed &= diff >= 0
        if window is not None:
            allowed &= diff < window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # [1, H, b, hd]
        return attn.o_proj(out.transpose(1, 2).reshape(1, b, -1))


# ---------------------------------------------------------------------- the comparison cases (tests, golden)

#: (name, hf_gemma4_draft_config overrides, write_hf_gemma4_draft extras)
CASES = [
    # sliding + full, K = V on the full layer, proportional RoPE, the own embedding tied as the head
    ("swa-full-tied", dict(), dict(own_embd=True)),
    # transformers 5.24's per_layer_config, the target's embedding and head, a window the context outgrows
    ("per-layer-config-target-head", dict(per_layer_config=True, sliding_window=3,
                                          layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
     dict()),
    # llama.cpp's Gemma4DSparkModel shape: full layers only, K = V, an own head
    ("full-only-own-head", dict(layer_types=["full_attention", "full_attention"], tie_word_embeddings=False),
     dict(own_head=True)),
    # no K = V, the default RoPE over half the full head, non-causal sliding layers
    ("no-keqv-default-rope", dict(k_eq_v=False, rope_type="default", partial_rotary=0.5, is_causal=False,
                                  layer_types=["full_attention", "sliding_attention", "full_attention"]), dict()),
]
BLOCKS = (4, 8)
N_CTX, N_VERIFY, ACCEPTED = 9, 4, 1


def build_case(tmp_path, name, cfg_kw, extra):
    """The HF folder and its converted GGUF (same seeds always: the golden file regenerates)."""
    from plinth_dflash.convert import DFlashConverter
    from plinth_dflash.testkit import write_hf_gemma4_draft

    seed = 40 + [c[0] for c in CASES].index(name)
    hf = write_hf_gemma4_draft(tmp_path / f"hf-{name}", seed=seed, n_vocab=257, mask_token=255, block_size=8,
                               target_layer_ids=(0, 2), **cfg_kw, **extra)
    out = tmp_path / f"{name}.gguf"
    DFlashConverter().convert(str(hf), str(out), {})
    return hf, out


def rounds_inputs(seed, n_taps=2, e=64):
    rng = np.random.default_rng(seed)
    return {"prefill": rng.standard_normal((N_CTX, n_taps * e)).astype(np.float32),
            "verify": rng.standard_normal((N_VERIFY, n_taps * e)).astype(np.float32),
            "anchors": rng.integers(0, 255, 2)}


def plinth_rounds(target, path, block, inputs):
    """Two draft blocks: after the prompt's rows, and after a verify batch of which ACCEPTED drafts stay.
    Returns [(kept context positions, block positions, logits [block-1, V])]."""
    from plinth.speculative.base import TargetOutput
    from plinth_dflash.drafter import make_dflash

    dr = make_dflash(target, {"draft": str(path)})
    taps, e = dr.hp.target_layers, dr.hp.n_embd

    def feed(kind, rows, start):
        pos = np.arange(start, start + rows.shape[0])
        dr.process(TargetOutput(seq=0, phase=kind, tokens=np.zeros(len(pos), np.int64), positions=pos,
                                features={t: rows[:, i * e:(i + 1) * e] for i, t in enumerate(taps)}))

    out = []
    dr.begin(0, [])
    feed("prefill", inputs["prefill"], 0)
    out.append((np.arange(N_CTX), np.arange(N_CTX, N_CTX + block),
                np.asarray(dr.draft_logits(0, int(inputs["anchors"][0]), N_CTX, block - 1))))
    feed("verify", inputs["verify"], N_CTX)
    dr.accept(0, ACCEPTED)
    start = N_CTX + ACCEPTED + 1
    out.append((np.arange(start), np.arange(start, start + block),
                np.asarray(dr.draft_logits(0, int(inputs["anchors"][1]), start, block - 1))))
    return out


def reference_rounds(ref, target, block, inputs):
    view = target.target_view()
    be = target.backend
    table, head = np.asarray(be.to_numpy(view.embed_table)), np.asarray(be.to_numpy(view.head_weight))
    feats = np.concatenate([inputs["prefill"], inputs["verify"]])
    out = []
    for r, (n_ctx, start) in enumerate(((N_CTX, N_CTX), (N_CTX + ACCEPTED + 1, N_CTX + ACCEPTED + 1))):
        tokens = np.array([int(inputs["anchors"][r])] + [255] * (block - 1))
        _, logits = ref.forward(feats[:n_ctx], np.arange(n_ctx), tokens, np.arange(start, start + block), table, head)
        out.append(logits[1:])
    return out

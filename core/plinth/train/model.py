"""The draft network in torch, computing what plinth-dflash / plinth-dspark compute at inference.

The layer arithmetic follows :class:`plinth_dflash.graph.DraftGraph` (the inference graph), for many
blocks at once:

* context rows: ``g = RMSNorm_enc(fc . (s * f))`` from the target's features ``f`` (taps concatenated;
  ``s``: fixed per-channel scales, folded into ``fc`` at export);
  each layer's context K = RoPE(k_norm(Wk g)) at the target positions, V = Wv g;
* block rows ``[anchor, MASK x (B-1)]`` at positions ``a .. a+B-1``: target embedding, then per layer
  pre-RMSNorm attention (q_norm / k_norm, NeoX RoPE) over the context rows before the anchor and
  every row of the block (non-causal), residual, pre-RMSNorm SwiGLU, residual; final RMSNorm;
* the head: the draft's own ``output`` over the reduced vocabulary (``d2t``);
* DSpark heads: Markov bias ``w2 . w1[prev]`` and the confidence ``sigmoid(conf . [h ; w1[prev]] + b)``.

Weights are kept in GGUF layout (``[n_out, n_in]``, which is torch's ``Linear`` layout), so export
is a plain copy. ``tests/test_train.py`` checks the block logits against the plugin's own forward
on an exported file.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
from torch import nn
from torch.nn import functional as F


@attrs.frozen
class DraftConfig:
    n_vocab: int  # the target's vocabulary (markov_w1 rows, token ids)
    draft_vocab: int  # V_d: rows of the draft head (len(d2t))
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    taps: tuple[int, ...]  # plinth feature taps (input of layer k; k = n_layer: the residual before the norm)
    block_size: int = 8
    mask_token: int = 0
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    markov_rank: int = 64  # 0: a plain DFlash draft
    confidence: bool = True
    sample_from_anchor: bool = True  # DSpark's anchor-first block (row 0 predicts); False: DFlash's 1+N

    @property
    def dspark(self) -> bool:
        return self.markov_rank > 0


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """NeoX RoPE (first half / second half pairs). x: [n, H, d], pos: [n]."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cos(ang).to(x.dtype)[:, None, :], torch.sin(ang).to(x.dtype)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Layer(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        e, hd = c.n_embd, c.head_dim
        self.c = c
        self.attn_norm = nn.Parameter(torch.ones(e))
        self.attn_q = nn.Parameter(torch.empty(c.n_head * hd, e))
        self.attn_k = nn.Parameter(torch.empty(c.n_head_kv * hd, e))
        self.attn_v = nn.Parameter(torch.empty(c.n_head_kv * hd, e))
        self.attn_output = nn.Parameter(torch.empty(e, c.n_head * hd))
        self.attn_q_norm = nn.Parameter(torch.ones(hd))
        self.attn_k_norm = nn.Parameter(torch.ones(hd))
        self.ffn_norm = nn.Parameter(torch.ones(e))
        self.ffn_gate = nn.Parameter(torch.empty(c.n_ff, e))
        self.ffn_up = nn.Parameter(torch.empty(c.n_ff, e))
        self.ffn_down = nn.Parameter(torch.empty(e, c.n_ff))
        for p in (self.attn_q, self.attn_k, self.attn_v, self.attn_output, self.ffn_gate, self.ffn_up, self.ffn_down):
            nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[1]))
        with torch.no_grad():
            self.attn_output.mul_(0.5)
            self.ffn_down.mul_(0.5)

    def kv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.c
        n = x.shape[0]
        k = (x @ self.attn_k.T).view(n, c.n_head_kv, c.head_dim)
        v = (x @ self.attn_v.T).view(n, c.n_head_kv, c.head_dim)
        k = rope(rms_norm(k, self.attn_k_norm, c.norm_eps), pos, c.rope_base)
        return k, v

    def forward(self, h: torch.Tensor, pos: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                ctx_mask: torch.Tensor, nb: int) -> torch.Tensor:
        """h: [nb*B, E] block rows; ctx_k / ctx_v: [T, Hkv, d]; ctx_mask: [nb, T] True where a block sees the row."""
        c = self.c
        n = h.shape[0]
        b = n // nb
        u = rms_norm(h, self.attn_norm, c.norm_eps)
        q = rope(rms_norm((u @ self.attn_q.T).view(n, c.n_head, c.head_dim), self.attn_q_norm, c.norm_eps), pos,
                 c.rope_base)
        kb, vb = self.kv(u, pos)
        g = c.n_head // c.n_head_kv
        qb = q.view(nb, b, c.n_head_kv, g, c.head_dim)
        scale = 1.0 / math.sqrt(c.head_dim)
        s_ctx = torch.einsum("nbkgd,tkd->nkgbt", qb, ctx_k) * scale  # [nb, Hkv, g, B, T]
        s_ctx = s_ctx.masked_fill(~ctx_mask[:, None, None, None, :], float("-inf"))
        kbb = kb.view(nb, b, c.n_head_kv, c.head_dim)
        vbb = vb.view(nb, b, c.n_head_kv, c.head_dim)
        s_blk = torch.einsum("nbkgd,nckd->nkgbc", qb, kbb) * scale  # [nb, Hkv, g, B, B]
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)
        t = ctx_k.shape[0]
        o = torch.einsum("nkgbt,tkd->nbkgd", p[..., :t], ctx_v) + torch.einsum("nkgbc,nckd->nbkgd", p[..., t:], vbb)
        h = h + o.reshape(n, c.n_head * c.head_dim) @ self.attn_output.T
        x = rms_norm(h, self.ffn_norm, c.norm_eps)
        m = (F.silu(x @ self.ffn_gate.T) * (x @ self.ffn_up.T)) @ self.ffn_down.T
        return h + m


class DraftNet(nn.Module):
    """The trainable draft. ``embed`` (the target's embedding table, frozen) is passed in, not owned."""

    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.c = c
        e = c.n_embd
        nt = len(c.taps)
        self.fc = nn.Parameter(torch.empty(e, nt * e))
        nn.init.normal_(self.fc, std=1.0 / math.sqrt(nt * e))
        self.enc_norm = nn.Parameter(torch.ones(e))
        self.layers = nn.ModuleList([Layer(c) for _ in range(c.n_layer)])
        self.output_norm = nn.Parameter(torch.ones(e))
        self.output = nn.Parameter(torch.empty(c.draft_vocab, e))
        nn.init.normal_(self.output, std=1.0 / math.sqrt(e))
        self.register_buffer("d2t", torch.zeros(c.draft_vocab, dtype=torch.long))
        # per-channel multipliers of the target features before ``fc`` (1 / the channel's RMS over the data):
        # the residual stream carries a few channels hundreds of times larger than the rest, which would
        # otherwise own the context rows; export folds them into ``fc`` (exactly: fc . diag(s) . f)
        self.register_buffer("feat_scale", torch.ones(nt * e))
        if c.dspark:
            self.markov_w1 = nn.Parameter(torch.randn(c.n_vocab, c.markov_rank) * 0.01)
            self.markov_w2 = nn.Parameter(torch.randn(c.draft_vocab, c.markov_rank) / math.sqrt(c.markov_rank) * 0.1)
            if c.confidence:
                self.conf_w = nn.Parameter(torch.randn(1, e + c.markov_rank) * 0.01)
                self.conf_b = nn.Parameter(torch.zeros(1))

    @property
    def first_row(self) -> int:
        return 0 if self.c.sample_from_anchor else 1

    def context(self, feats: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context K/V of the target features [T, nt*E] at positions 0..T-1."""
        g = rms_norm((feats * self.feat_scale) @ self.fc.T, self.enc_norm, self.c.norm_eps)
        pos = torch.arange(feats.shape[0])
        return [layer.kv(g, pos) for layer in self.layers]

    def blocks(self, embed: Any, tokens: torch.Tensor, anchors: torch.Tensor,
               ctx: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Final-normed hidden [nb, B, E] of the blocks at ``anchors`` (positions into ``tokens``)."""
        c = self.c
        b = c.block_size
        nb = anchors.shape[0]
        ids = torch.full((nb, b), c.mask_token, dtype=torch.long)
        ids[:, 0] = tokens[anchors]
        pos = (anchors[:, None] + torch.arange(b)[None, :]).reshape(-1)
        h = embed(ids.reshape(-1))
        t = ctx[0][0].shape[0]
        ctx_mask = torch.arange(t)[None, :] < anchors[:, None]  # rows strictly before the anchor
        for layer, (k, v) in zip(self.layers, ctx):
            h = layer(h, pos, k, v, ctx_mask, nb)
        return rms_norm(h, self.output_norm, c.norm_eps).view(nb, b, -1)

    def heads(self, hidden: torch.Tensor, prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [.., V_d], confidence logits [..] or None) of prediction rows ``hidden`` [.., E] whose
        previous tokens (target ids, for the Markov head) are ``prev`` [..]."""
        z = hidden @ self.output.T
        conf = None
        if self.c.dspark:
            e = self.markov_w1[prev]
            z = z + e @ self.markov_w2.T
            if self.c.confidence:
                conf = (torch.cat([hidden, e], dim=-1) @ self.conf_w.T).squeeze(-1) + self.conf_b
        return z, conf


def block_targets(tokens: torch.Tensor, anchors: torch.Tensor, b: int, first_row: int) -> tuple[torch.Tensor, ...]:
    """For blocks at ``anchors``: (label positions [nb, m], previous-token positions [nb, m], valid [nb, m]).

    Row i of a block (i >= first_row) predicts the token at ``a + i + 1 - first_row``; its previous token
    (the Markov head's input) is the one before that.
    """
    m = b - first_row
    off = torch.arange(m)[None, :]
    lab = anchors[:, None] + off + 1
    valid = lab < tokens.shape[0]
    lab = lab.clamp(max=tokens.shape[0] - 1)
    return lab, lab - 1, valid

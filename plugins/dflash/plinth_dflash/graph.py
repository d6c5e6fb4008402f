"""The DFlash draft graph: fused KV injection of target features, then one block forward.

Two branches, as llama.cpp's dflash decoder has:

* :meth:`DraftGraph.inject` (the embedding branch): raw target features
  ``f = concat(h_tap0, h_tap1, ...)`` -> ``g = RMSNorm_enc(fc . f)`` -> for every layer
  ``K = RoPE(k_norm(Wk . g))`` at the **target** positions and ``V = Wv . g`` (through a weightless
  RMSNorm on Gemma 4 layers; a layer without ``attn_v`` uses its raw K projection as V),
  written into the draft's :class:`plinth.graph.Cache`. One pass over all layers.
* :meth:`DraftGraph.forward_block` (the token branch): the block ``[anchor, MASK x n]``
  through the layers (Qwen3-style, or Gemma 4's with post norms, a layer scale and per-type
  head sizes and RoPE), attending non-causally over cache + block (a
  sliding-window layer sees keys with ``q_pos - k_pos < W``; a layer is causal only
  when the file says so). The block's own K/V are appended for the attention and then
  rolled back, so they never persist. DFlash2 wraps both sublayers in the block-local
  grouped dynamic convolution (:func:`block_conv`).

Weights are in GGUF layout (``[n_out, n_in]``), float32, per-tensor scales already
multiplied in (:func:`plinth_dflash.format.load_draft`).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from plinth import ops
from plinth.graph import KV, Batch, Cache

from . import constants as C
from .format import DFlashHParams

F32 = np.float32


def block_conv(x: Any, dyn: Any, base: Any, side: int, block_len: int, group_size: int) -> Any:
    """DFlash2's grouped dynamic depthwise convolution inside each block (zero left padding).

    x: [n, E] block-major rows (``n`` a multiple of ``block_len``);
    dyn: [n, 2 * Kc * G] dynamic coefficients (G = E / group_size), laid out (side, tap, group);
    base: [2, Kc, E] static kernel; side: 0 = sublayer input, 1 = sublayer output.
    y[t, c] = sum_{k < min(Kc, b)} (dyn[t, side, k, c // Gs] + base[side, k, c]) * x[t - k, c],
    where x[t - k] is zero when row t sits fewer than k rows into its block.
    Returns [n, E] float32.
    """
    xp = ops.array_module(x)
    n, e = x.shape
    kc = base.shape[1]
    g = e // group_size
    if n % block_len:
        raise ValueError(f"block_conv: {n} rows are not whole blocks of {block_len}")
    d = dyn.reshape(n, 2, kc, g)[:, side]  # [n, Kc, G]
    in_block = xp.arange(n) % block_len
    y = xp.zeros((n, e), dtype=F32)
    for k in range(min(kc, block_len)):  # taps at or past the block length shift everything out
        if k == 0:
            shifted = x
        else:
            shifted = xp.zeros_like(x)
            shifted[k:] = x[:-k]
            shifted = xp.where((in_block < k)[:, None], F32(0.0), shifted)  # no mask indexing: no device sync
        w = xp.repeat(d[:, k], group_size, axis=1) + base[side, k][None, :]
        y += w * shifted
    return y


class DraftGraph:
    """Forward pieces of one dflash draft over its own KV cache.

    embed_table: [V, E] — the table the block tokens are looked up in (own or the target's);
    head: [V, E] — the LM head (own, tied to the own embedding, or the target's).
    """

    def __init__(self, hp: DFlashHParams, weights: Mapping[str, Any], xp: Any, embed_table: Any, head: Any) -> None:
        self.hp = hp
        self.w = weights
        self.xp = xp
        self.embed_table = embed_table
        self.head = head
        factors = weights.get(C.T_ROPE_FREQS)  # llama.cpp's rope_freqs: per-pair divisors of the frequency
        full = ops.RopeCache(ops.rope_freqs(hp.n_rot, base=hp.rope_base, xp=xp, freq_factors=factors))
        # sliding layers with their own RoPE (Gemma 4 drafts): no rope_freqs there; otherwise one RoPE for all
        swa = ops.RopeCache(ops.rope_freqs(hp.rot(hp.swa_layers.index(True)), base=hp.rope_base_swa or hp.rope_base,
                                           xp=xp)) if hp.swa_rope else full
        self.ropes = [swa if hp.swa_layers[il] else full for il in range(hp.n_layer)]
        self.scales = [float(hp.attn_scale) if hp.attn_scale else 1.0 / float(hp.hd(il)) ** 0.5
                       for il in range(hp.n_layer)]

    def new_cache(self, types: Any = None) -> Cache:
        """An empty cache: one :class:`~plinth.graph.KV` a layer (``types``: its storage types)."""
        return Cache(self.hp.n_layer, self.xp, [(KV(),) for _ in range(self.hp.n_layer)], types=types)

    # ------------------------------------------------------------------ injection branch

    def fuse(self, features: Any) -> Any:
        """g = RMSNorm_enc(fc . f). features: [n, n_taps * E] -> [n, E]."""
        return ops.rms_norm(ops.linear(features, self.w["fc.weight"]), self.w["enc.output_norm.weight"],
                            self.hp.norm_eps)

    def kv(self, il: int, x: Any, cos_sin: tuple[Any, Any]) -> tuple[Any, Any]:
        """Layer ``il``'s K (k-norm, then RoPE by ``cos_sin``) and V of rows x: [n, E], each [n, n_kv, hd].

        Without ``attn_v`` the raw K projection is V (Gemma 4's attention_k_eq_v); such a V, and every V
        when the file sets ``attention.value_norm``, goes through an RMSNorm without weight (llama.cpp's
        dflash graph norms the shared V the same way)."""
        hp, w, b = self.hp, self.w, f"blk.{il}."
        n, nkv, hd = x.shape[0], hp.kv_heads(il), hp.hd(il)
        k_raw = ops.linear(x, w[b + "attn_k.weight"]).reshape(n, nkv, hd)
        shared = b + "attn_v.weight" not in w
        v = k_raw if shared else ops.linear(x, w[b + "attn_v.weight"]).reshape(n, nkv, hd)
        if shared or hp.value_norm:
            v = ops.head_rms_norm(v, None, hp.norm_eps)
        k = ops.head_rms_norm(k_raw, w[b + "attn_k_norm.weight"], hp.norm_eps)
        return ops.apply_rope(k, mode="neox", cos_sin=cos_sin), v

    def context_kv(self, il: int, g: Any, positions: Any) -> tuple[Any, Any]:
        """K (k-norm, RoPE at ``positions``) and V of fused rows g: [n, E] for layer ``il``."""
        return self.kv(il, g, self.ropes[il](positions))

    def inject(self, cache: Cache, seq: int, positions: np.ndarray, g: Any) -> None:
        """Write the context K/V of fused rows g: [n, E] at target ``positions`` into every layer: one cache
        transaction (all layers' rows land together, or none if a layer raises)."""
        positions = np.asarray(positions, dtype=np.int64)
        n = positions.size
        rows = Batch(tokens=np.zeros(n, dtype=np.int64), positions=positions, seq_ids=np.full(n, seq, dtype=np.int64),
                     output=np.zeros(n, dtype=bool))
        with cache.forward(rows):
            for il in range(self.hp.n_layer):
                k, v = self.context_kv(il, g, positions)
                cache.kv(il).update(seq, positions, k, v)

    # ------------------------------------------------------------------ token branch

    def _attention(self, il: int, u: Any, cache: Cache, seq: int, positions: np.ndarray) -> Any:
        hp, w, b = self.hp, self.w, f"blk.{il}."
        n = u.shape[0]
        q = ops.linear(u, w[b + "attn_q.weight"]).reshape(n, hp.n_head, hp.hd(il))
        q = ops.head_rms_norm(q, w[b + "attn_q_norm.weight"], hp.norm_eps)
        cs = self.ropes[il](positions)
        q = ops.apply_rope(q, mode="neox", cos_sin=cs)
        k, v = self.kv(il, u, cs)
        # the block's K/V join the cache for this forward only (rolled back by forward_block)
        kc, vc, kpos = cache.kv(il).update(seq, positions, k, v)
        window = hp.sliding_window if hp.swa_layers[il] else None
        out = ops.attention(q, kc, vc, q_pos=positions, k_pos=kpos, scale=self.scales[il],
                            causal=hp.causal_layers[il], sliding_window=window, sinks=w.get(b + "attn_sinks.weight"))
        return ops.linear(out.reshape(n, -1), w[b + "attn_output.weight"])

    def _ffn(self, il: int, x: Any) -> Any:
        w, b = self.w, f"blk.{il}."
        return ops.glu_ffn(x, w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"], w[b + "ffn_down.weight"],
                           act=self.hp.hidden_act)

    def layer(self, il: int, h: Any, cache: Cache, seq: int, positions: np.ndarray) -> Any:
        hp, w, b = self.hp, self.w, f"blk.{il}."
        n = h.shape[0]
        u = ops.rms_norm(h, w[b + "attn_norm.weight"], hp.norm_eps)
        if hp.has_conv:
            dy = ops.linear(u, w[b + "attn_conv_proj.weight"])
            u = block_conv(u, dy, w[b + "attn_conv_base"], 0, n, hp.conv_group)
        a = self._attention(il, u, cache, seq, positions)
        if hp.value_scale:  # (llama.cpp: after the output projection, before the conv and the post-norm)
            a = a * F32(hp.value_scale)
        if hp.has_conv:
            a = block_conv(a, dy, w[b + "attn_conv_base"], 1, n, hp.conv_group)
        if b + C.T_POST_ATTN_NORM in w:
            a = ops.rms_norm(a, w[b + C.T_POST_ATTN_NORM], hp.norm_eps)
        h = h + a
        v = ops.rms_norm(h, w[b + "ffn_norm.weight"], hp.norm_eps)
        if hp.has_conv:
            dy = ops.linear(v, w[b + "ffn_conv_proj.weight"])
            v = block_conv(v, dy, w[b + "ffn_conv_base"], 0, n, hp.conv_group)
        m = self._ffn(il, v)
        if hp.has_conv:
            m = block_conv(m, dy, w[b + "ffn_conv_base"], 1, n, hp.conv_group)
        if b + C.T_POST_FFN_NORM in w:
            m = ops.rms_norm(m, w[b + C.T_POST_FFN_NORM], hp.norm_eps)
        out = m + h
        if b + C.T_LAYER_OUT_SCALE in w:
            out = out * w[b + C.T_LAYER_OUT_SCALE].reshape(1)
        return out

    def forward_block(self, cache: Cache, seq: int, tokens: Any, positions: Any) -> Any:
        """Final-normed hidden states [b, E] of the block ``tokens`` at ``positions`` (one sequence).

        The cache is left exactly as it was: the block's K/V are never committed.
        """
        xp = self.xp
        positions = np.asarray(positions, dtype=np.int64)
        h = self.embed_table[xp.asarray(np.asarray(tokens, dtype=np.int64))]
        h = ops.as_f32(h, xp)
        if self.hp.embedding_scale:
            h = h * F32(self.hp.embedding_scale)
        try:
            for il in range(self.hp.n_layer):
                h = self.layer(il, h, cache, seq, positions)
        finally:
            cache.rollback_pending()
        return ops.rms_norm(h, self.w["output_norm.weight"], self.hp.norm_eps)

    def logits(self, hidden: Any) -> Any:
        """hidden: [n, E] -> [n, V].

        Only DFlash2 applies the file's logit scale and soft-cap in-graph (its selector reads raw
        logits), as llama.cpp does; DFlash and LiLiCorr logits are the plain head product (a positive
        scale and a soft-cap leave the argmax unchanged)."""
        z = ops.linear(hidden, self.head)
        if self.hp.variant == "dflash2":
            if self.hp.logit_scale:
                z = z * F32(self.hp.logit_scale)
            if self.hp.softcap > 0:
                c = F32(self.hp.softcap)
                z = self.xp.tanh(z / c) * c
        return z

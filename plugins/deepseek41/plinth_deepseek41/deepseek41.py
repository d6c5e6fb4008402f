"""DeepSeek V4.1 Flash (``deepseek41``): V4 with lagged hyper-connection mixes, no hc head, and Engram.

Everything of ``deepseek4`` (attention with its compressed streams and indexer, MoE, hash
routing, the MTP block) is reused from :mod:`.deepseek4`; what V4.1 changes, top to bottom:

* **Lagged mixes.** Each sublayer still computes (pre, post, comb) from its own input streams,
  but collapses its input with the ``pre`` of the *previous* sublayer: the attention of layer l
  with the pre of layer l-1's FFN, the FFN of layer l with the pre of layer l's attention.
  Layer 0's attention collapses with a one-hot pre selecting copy 0. post / comb are the
  current sublayer's.
* **No learned hc head.** The last FFN's pre (computed, never consumed by a sublayer) collapses
  the streams before ``output_norm``; a file with ``output_hc_*`` tensors is refused. The pre a
  sublayer hands on travels with the streams: the residual between layers is [n, hc, E + 1],
  column E holding it (so a model split into pipeline stages hands it on too).
* **Engram** (:mod:`.engram`) at the layers in ``engram.layer_ids``: hashed n-gram memory added
  into the streams before the block. The hash needs the N-1 previous token ids of the sequence,
  kept per sequence in an :class:`~.engram.EngramTokens` cache kind on layer 0 (rolled back
  with the rest of the cache).
* **Embedding rows** (an image's rows) are accepted when no layer is hash-routed: they take
  the pad id in the Engram hash, and routed layers select experts with ``exp_probs_b_vl``
  (the vision routing bias) when the file has it.
* **Shared compressed sources** (roles by tensor presence, ``stream_sources``): a compressed
  layer with a compressor is a KV source; a window-less layer without one attends to the latest
  earlier source's compressed stream (same ratio; no stream of its own in the cache). A
  compressor without a gate is allowed at ratio 1 only. Not implemented, and refused by name:
  CSA layers without their own compressor and indexer, index-key owners (``indexer.attn_k``:
  index keys derived from the shared latent) and the candidate-block keys
  (``attention.candidate_*``), whose upstream form is unknown.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import numpy as np

from plinth import ops
from plinth.errors import UserError
from plinth.graph import Batch, HParamsError, KeyReader, Step, TensorSpec

from .deepseek4 import (
    CSA,
    WINDOW,
    DeepSeek4,
    DeepSeek4Graph,
    DeepSeek4HParams,
    hc_collapse,
    hc_expand,
    hc_mix,
    read_v4_params,
    tensor_specs as v4_tensor_specs,
)
from .engram import (
    AtLeast,
    EngramHParams,
    EngramTokens,
    EngramWeights,
    advise_random_access,
    engram_mix,
    engram_rows_for_batch,
    gather_rows,
    hash_rows,
    read_engram,
)

ARCH = "deepseek41"
HC_HEAD = ("output_hc_fn.weight", "output_hc_base.weight", "output_hc_scale.weight")
# keys of V4.1's coarse candidate-block pre-selection, seen in forks; the form is unknown (refused)
CANDIDATE_KEYS = ("attention.candidate_source_layer_id", "attention.candidate_block_size",
                  "attention.candidate_top_k_blocks")


# ============================================================================ hparams

@attrs.frozen
class DeepSeek41HParams(DeepSeek4HParams):
    engram: EngramHParams | None = None  # None: no Engram layer


def load_hparams(metadata: Mapping[str, Any], source: str) -> DeepSeek41HParams:
    r = KeyReader(metadata, source, ARCH)
    fields = read_v4_params(r, metadata, source)
    for name in CANDIDATE_KEYS:
        if r.has(name):
            raise HParamsError(f"{source}: key '{r.key(name)}' (V4.1 candidate-block pre-selection) is not "
                               "supported: plinth implements V4.1 with per-layer compressors only")
    engram = read_engram(r, fields["n_layer"], fields["n_vocab"]) if r.has("engram.layer_ids") else None
    return DeepSeek41HParams(**fields, engram=engram)


# ============================================================================ tensors

def tensor_specs(hp: DeepSeek41HParams) -> list[TensorSpec]:
    """deepseek4's tensors without the hc head, plus the Engram tensors and the optional vision
    routing bias. The hc head and V4.1 sparse-attention tensors are declared optional so that a
    file carrying them is refused by name (:class:`DeepSeek41Graph`) instead of silently ignored."""
    specs = [attrs.evolve(s, required=False) if s.name in HC_HEAD or _compressor_part(s.name) else s
             for s in v4_tensor_specs(hp)]
    e, hc = hp.n_embd, hp.hc
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        if hp.attention_type(il) == CSA:
            specs.append(TensorSpec(b + "indexer.attn_k.weight", (hp.idx_head_dim, hp.head_dim), required=False))
        if not hp.is_hash(il):
            specs.append(TensorSpec(b + "exp_probs_b_vl.bias", (hp.n_expert,), required=False))
    ep = hp.engram
    if ep is not None:
        for k, il in enumerate(ep.layer_ids):
            b = f"blk.{il}."
            specs += [TensorSpec(b + "engram_embd.weight", (AtLeast(ep.rows_needed(k)), ep.key_length)),
                      TensorSpec(b + "engram_wkv.weight", ((hc + 1) * e, ep.n_cols * ep.key_length)),
                      TensorSpec(b + "engram_q.weight", (hc, e)),
                      TensorSpec(b + "engram_k.weight", (hc, e))]
    return specs


def _compressor_part(name: str) -> bool:
    """A compressor or indexer tensor: optional per layer in V4.1 (roles by presence, checked at build)."""
    return name.startswith("blk.") and (".attn_compressor_" in name or ".indexer" in name)


# ============================================================================ graph

class DeepSeek41Graph(DeepSeek4Graph):
    """Forward of a deepseek41 model: deepseek4's sublayers, wired with lagged mixes and Engram."""

    def __init__(self, hp: DeepSeek41HParams, weights: Mapping[str, Any], backend: Any) -> None:
        head = [n for n in HC_HEAD if n in weights]
        if head:
            raise UserError(f"{ARCH}: the file has {head}, but V4.1 has no learned hc head (the last FFN's "
                            "pre collapses the streams); is it a deepseek4 file with the wrong architecture?")
        owners = [n for n in weights if n.endswith("indexer.attn_k.weight")]
        if owners:
            raise UserError(f"{ARCH}: {owners[0]} makes its layer a V4.1 index-key owner (index keys derived from "
                            "a shared compressed latent), which plinth does not implement")
        super().__init__(hp, weights, backend)
        self.hp: DeepSeek41HParams = hp
        ep = hp.engram
        self.engram: dict[int, EngramWeights] = {}
        if ep is not None:
            if ep.token_map.shape[0] < hp.n_vocab:
                raise UserError(f"{ARCH}: the Engram token map has {ep.token_map.shape[0]} entries, fewer than "
                                f"n_vocab = {hp.n_vocab}")
            for il in ep.layer_ids:
                b = f"blk.{il}."
                self.engram[il] = EngramWeights(weights[b + "engram_embd.weight"], weights[b + "engram_wkv.weight"],
                                                weights[b + "engram_q.weight"], weights[b + "engram_k.weight"])
                advise_random_access(self.engram[il].table)  # fault in single rows, not read-around windows
        self.vision_bias = {il: weights[f"blk.{il}.exp_probs_b_vl.bias"] for il in range(hp.n_layer)
                            if f"blk.{il}.exp_probs_b_vl.bias" in weights}

    def stream_sources(self, hp: DeepSeek4HParams, weights: Mapping[str, Any]) -> dict[int, int]:
        """V4.1 roles by tensor presence: a compressed layer with ``attn_compressor_kv`` compresses its own
        stream (a KV source); one without reads the latest earlier source's, which must have its ratio.
        A compressor without a gate is allowed at ratio 1 only; a CSA layer must own its compressor and
        indexer (V4.1's index keys derived from a shared latent are not implemented)."""
        out: dict[int, int] = {}
        latest = None
        for il in range(hp.n_layer + hp.n_nextn):
            atype = hp.attention_type(il)
            if atype == WINDOW:
                continue
            b, r = f"blk.{il}.", hp.ratio(il)
            if b + "attn_compressor_kv.weight" in weights:
                need = [b + "attn_compressor_ape.weight", b + "attn_compressor_norm.weight"]
                if atype == CSA:
                    need += [b + n for n in ("attn_compressor_gate.weight", "indexer.proj.weight",
                                             "indexer.attn_q_b.weight", "indexer_compressor_kv.weight",
                                             "indexer_compressor_gate.weight", "indexer_compressor_ape.weight",
                                             "indexer_compressor_norm.weight")]
                missing = [n for n in need if n not in weights]
                if missing:
                    raise UserError(f"{ARCH}: layer {il} has a compressor (a KV source) but lacks {missing}")
                if b + "attn_compressor_gate.weight" not in weights and r != 1:
                    raise UserError(f"{ARCH}: layer {il}'s compressor has no gate (attn_compressor_gate), which is "
                                    f"allowed at ratio 1 only; its ratio is {r}")
                out[il] = latest = il
                continue
            if atype == CSA:
                raise UserError(f"{ARCH}: CSA layer {il} has no compressor of its own: reading a shared compressed "
                                "source with V4.1 index keys is not implemented")
            if latest is None:
                raise UserError(f"{ARCH}: layer {il} (compress ratio {r}) has no compressor, and no earlier layer "
                                "compresses a stream for it to read")
            if hp.ratio(latest) != r:
                raise UserError(f"{ARCH}: layer {il} (compress ratio {r}) would read layer {latest}'s compressed "
                                f"stream, whose ratio is {hp.ratio(latest)}; a layer must share its source's ratio")
            out[il] = latest
        return out

    def cache_layout(self) -> list[tuple[Any, ...]]:
        """deepseek4's layout; with Engram, layer 0 also keeps each sequence's last N-1 token ids."""
        layout = super().cache_layout()
        if self.engram:
            layout[0] = tuple(layout[0]) + (EngramTokens(),)
        return layout

    # -------------------------------------------------------------- the forward's pieces

    def check_rows(self, batch: Batch) -> None:
        """One sequence a row; embedding rows only without hash-routed layers."""
        if np.asarray(batch.seq_ids).ndim != 1:
            raise UserError(f"{ARCH}: a row shared by several sequences is not supported (Engram's n-gram "
                            "context and the compressed streams are per sequence); give each row one sequence")
        if batch.is_embd is not None and bool(np.any(batch.is_embd)) and self.hp.n_hash_layers:
            raise UserError(f"{ARCH}: embedding rows are not supported by a model with hash-routed layers "
                            f"(hash_layer_count = {self.hp.n_hash_layers}: routing needs token ids)")

    def embed(self, batch: Batch) -> Any:
        """The streams with the pre layer 0's attention collapses with (one-hot on copy 0): [n, hc, E + 1]."""
        X = super().embed(batch)
        pre = self.xp.zeros(X.shape[:2] + (1,), dtype=np.float32)
        pre[:, 0] = 1.0
        return self.xp.concatenate([X, pre], axis=-1)

    def streams(self, x: Any) -> Any:
        return x[:, :, :self.hp.n_embd]

    def final_norm(self, x: Any) -> Any:
        """The streams collapsed with the last FFN's pre, then ``output_norm``. x: [n, hc, E + 1] -> [n, E]."""
        e = self.hp.n_embd
        return ops.rms_norm(hc_collapse(self.xp.ascontiguousarray(x[:, :, :e]), x[:, :, e]),
                            self.w["output_norm.weight"], self.hp.norm_eps)

    def layer(self, il: int, x: Any, step: Step) -> Any:
        """Engram (at its layers), then the block with lagged mixes; the FFN's pre travels on in column E."""
        e, xp = self.hp.n_embd, self.xp
        X, pre = xp.ascontiguousarray(x[:, :, :e]), x[:, :, e]
        if il in self.engram:
            X = self.engram_block(il, X, step.once("engram", lambda: self._engram_context(step)))
        X, pre = self.lagged_block(il, X, pre, step)
        return xp.concatenate([X, pre[:, :, None]], axis=-1)

    def lagged_block(self, il: int, X: Any, pre_in: Any, step: Step) -> tuple[Any, Any]:
        """One block with lagged mixes. X: [n, hc, E]; pre_in: [n, hc] (the previous sublayer's pre).
        Returns the new streams and the FFN's pre, which the next sublayer collapses with."""
        hp, w, b = self.hp, self.w, f"blk.{il}."
        attn = hc_mix(X, w[b + "hc_attn_fn.weight"], w[b + "hc_attn_base.weight"], w[b + "hc_attn_scale.weight"], hp)
        h = ops.rms_norm(hc_collapse(X, pre_in), w[b + "attn_norm.weight"], hp.norm_eps)
        X = hc_expand(X, self.attention(il, h, step), attn)
        ffn = hc_mix(X, w[b + "hc_ffn_fn.weight"], w[b + "hc_ffn_base.weight"], w[b + "hc_ffn_scale.weight"], hp)
        h = ops.rms_norm(hc_collapse(X, attn.pre), w[b + "ffn_norm.weight"], hp.norm_eps)
        return hc_expand(X, self.moe(il, h, step, self._routing_bias(il, step)), ffn), ffn.pre

    def _routing_bias(self, il: int, step: Step) -> Any:
        """exp_probs_b, or per row exp_probs_b_vl for embedding (image) rows when the file has it."""
        is_embd = step.batch.is_embd
        if is_embd is None or il not in self.vision_bias or self.hp.is_hash(il):
            return None
        vision = step.once("vision", lambda: self.xp.asarray(np.asarray(is_embd, dtype=bool)))
        return self.xp.where(vision[:, None], self.vision_bias[il], self.w[f"blk.{il}.exp_probs_b.bias"])

    # -------------------------------------------------------------- Engram

    def _engram_context(self, step: Step) -> np.ndarray:
        """ctx uint64 [n, N] of every row (host), updating each sequence's token history in the cache."""
        batch = step.batch
        is_embd = None if batch.is_embd is None else np.asarray(batch.is_embd, dtype=bool)
        history = step.cache.find(0, EngramTokens)
        before = {seq: history.get(seq) for seq, _ in step.groups if history.get(seq) is not None}
        ctx, after = engram_rows_for_batch(np.asarray(batch.tokens), is_embd, step.groups, before, self.hp.engram)
        for seq, hist in after.items():
            history.set(seq, hist)
        return ctx

    def engram_rows(self, il: int, ctx: np.ndarray) -> np.ndarray:
        """Table rows int64 [n, n_cols] of Engram layer ``il`` for the contexts ctx: uint64 [n, N]."""
        ep = self.hp.engram
        k = ep.index(il)
        return hash_rows(ctx, ep.multipliers[k], ep.primes[k], ep.offsets[k], ep.n_head)

    def engram_block(self, il: int, X: Any, ctx: np.ndarray) -> Any:
        """X + gated Engram memory. X: [n, hc, E]; ctx: uint64 [n, N] -> [n, hc, E]."""
        w = self.engram[il]
        rows = self.engram_rows(il, ctx)
        emb = gather_rows(w.table, rows, self.xp).reshape(rows.shape[0], -1)  # [n, n_cols·dk]
        return engram_mix(X, emb, w, self.hp.norm_eps)


# ============================================================================ architecture

class DeepSeek41(DeepSeek4):
    """``deepseek41``: DeepSeek V4.1 Flash."""

    name = ARCH
    graph = DeepSeek41Graph

    def hparams(self, r: KeyReader) -> DeepSeek41HParams:
        return load_hparams(r.metadata, r.source)

    def tensors(self, hp: DeepSeek41HParams) -> list[TensorSpec]:
        return tensor_specs(hp)


__all__ = ["DeepSeek41", "DeepSeek41Graph", "DeepSeek41HParams", "load_hparams", "tensor_specs"]

"""``toy-recurrent``: a tiny hybrid architecture with recurrent state, for rollback tests.

Even layers are a gated diagonal linear recurrence (a stand-in for Mamba2: the
state after token t depends on every earlier token, so it cannot be cropped,
only restored); odd layers are causal attention over the KV cache. Both keep
their memory in the cache (a :class:`plinth.graph.Recurrent` kind on even layers, a
:class:`plinth.graph.KV` on odd ones), so speculative decoding snapshots, restores and
replays.

Recurrent layer, per channel c, with ``a = sigmoid(rec_a)``::

    s_t = a * s_{t-1} + (W_in x_t)          (s_{-1} = 0)
    y_t = W_out (s_t * sigmoid(W_gate x_t))

Use :func:`recurrent_plugin` in a registry and :func:`write_toy_recurrent` for a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import attrs
import numpy as np

from .. import ops
from ..graph import KV, BaseGraph, Recurrent, Step, attend
from ..hparams import KeyReader
from ..manifest import Manifest, ManifestPlugin
from ..tensors import TensorSpec

ARCH = "toy-recurrent"


@attrs.frozen
class ToyRecurrentHParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    norm_eps: float
    n_ctx_train: int = 256

    def is_recurrent(self, il: int) -> bool:
        return il % 2 == 0


class ToyRecurrent:
    name = ARCH

    def load_hparams(self, metadata: Mapping[str, Any], source: str) -> ToyRecurrentHParams:
        r = KeyReader(metadata, source, ARCH)
        return ToyRecurrentHParams(
            n_vocab=r.get("vocab_size"), n_embd=r.get("embedding_length"), n_layer=r.get("block_count"),
            n_head=r.get("attention.head_count"),
            norm_eps=r.get("attention.layer_norm_rms_epsilon", float, required=False, default=1e-6),
            n_ctx_train=r.get("context_length", required=False, default=256))

    def tensor_specs(self, hp: ToyRecurrentHParams) -> list[TensorSpec]:
        e = hp.n_embd
        specs = [TensorSpec("token_embd.weight", (hp.n_vocab, e)), TensorSpec("output_norm.weight", (e,)),
                 TensorSpec("output.weight", (hp.n_vocab, e))]
        for il in range(hp.n_layer):
            b = f"blk.{il}."
            specs.append(TensorSpec(b + "attn_norm.weight", (e,)))
            names = ("rec_in", "rec_gate", "rec_out") if hp.is_recurrent(il) else \
                ("attn_q", "attn_k", "attn_v", "attn_output")
            specs += [TensorSpec(b + n + ".weight", (e, e)) for n in names]
            if hp.is_recurrent(il):
                specs.append(TensorSpec(b + "rec_a", (e,)))
        return specs

    def build(self, hp: ToyRecurrentHParams, weights: Mapping[str, Any], backend: Any) -> "ToyRecurrentGraph":
        return ToyRecurrentGraph(hp, weights, backend)


class ToyRecurrentGraph(BaseGraph):
    def __init__(self, hp: ToyRecurrentHParams, weights: Mapping[str, Any], backend: Any) -> None:
        super().__init__(hp, weights, backend)
        self.decay = {il: 1.0 / (1.0 + self.xp.exp(-weights[f"blk.{il}.rec_a"]))
                      for il in range(hp.n_layer) if hp.is_recurrent(il)}

    def cache_layout(self) -> list[tuple[Any, ...]]:
        return [(Recurrent(),) if self.hp.is_recurrent(il) else (KV(),) for il in range(self.hp.n_layer)]

    def layer(self, il: int, x: Any, step: Step) -> Any:
        mix = self._recurrence if self.hp.is_recurrent(il) else self._attention
        return x + mix(il, ops.rms_norm(x, self.w[f"blk.{il}.attn_norm.weight"], self.hp.norm_eps), step)

    def _recurrence(self, il: int, x: Any, step: Step) -> Any:
        xp, w, b = self.xp, self.w, f"blk.{il}."
        u = ops.linear(x, w[b + "rec_in.weight"])
        g = 1.0 / (1.0 + xp.exp(-ops.linear(x, w[b + "rec_gate.weight"])))
        out = xp.empty_like(u)
        a = self.decay[il]
        states = step.cache.state(il)
        batch = step.batch
        for seq in np.unique(batch.seq_ids):
            rows = np.nonzero(batch.seq_ids == seq)[0]
            s = states.get(int(seq))
            s = xp.zeros(self.hp.n_embd, dtype=xp.float32) if s is None else s
            for r in rows[np.argsort(batch.positions[rows], kind="stable")]:
                s = a * s + u[r]
                out[r] = s
            states.set(int(seq), s)
        return ops.linear(out * g, w[b + "rec_out.weight"])

    def _attention(self, il: int, x: Any, step: Step) -> Any:
        hp, w, b = self.hp, self.w, f"blk.{il}."
        n, h = x.shape[0], hp.n_head
        d = hp.n_embd // h
        q = ops.linear(x, w[b + "attn_q.weight"]).reshape(n, h, d)
        k = ops.linear(x, w[b + "attn_k.weight"]).reshape(n, h, d)
        v = ops.linear(x, w[b + "attn_v.weight"]).reshape(n, h, d)
        return ops.linear(attend(il, q, k, v, step, scale=1.0 / float(d) ** 0.5).reshape(n, -1),
                          w[b + "attn_output.weight"])


def recurrent_plugin() -> ManifestPlugin:
    """A plugin providing ``toy-recurrent``, for ``make_registry`` / the ``plinth_registry`` fixture."""
    return ManifestPlugin(Manifest(name="toy-recurrent", api_version="2.0",
                                   architectures={ARCH: "plinth.testing.recurrent:ToyRecurrent"},
                                   description="test kit: tiny hybrid recurrent/attention model"))


def write_toy_recurrent(path: str | Path, *, n_embd: int = 32, n_layer: int = 4, seed: int = 0,
                        scale: float = 0.3) -> Path:
    """A random ``toy-recurrent`` GGUF with the byte vocabulary of :func:`plinth.testing.byte_vocab`."""
    from .synthetic import byte_vocab, random_tensors, write_gguf

    md = {"general.architecture": ARCH, "general.name": "toy-recurrent", f"{ARCH}.vocab_size": 257,
          f"{ARCH}.embedding_length": n_embd, f"{ARCH}.block_count": n_layer,
          f"{ARCH}.attention.head_count": 4, f"{ARCH}.context_length": 256} | byte_vocab()
    hp = ToyRecurrent().load_hparams(md, str(path))
    tensors = random_tensors(ToyRecurrent().tensor_specs(hp), seed=seed, scale=scale)
    for il in range(n_layer):
        if hp.is_recurrent(il):
            tensors[f"blk.{il}.rec_a"] = np.random.default_rng(seed + il).uniform(0.5, 3.0, n_embd).astype(np.float32)
    return write_gguf(path, md, tensors)

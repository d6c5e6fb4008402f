"""Writing a trained draft as the ``dflash`` GGUF that plinth-dflash / plinth-dspark read.

Tensor names and layouts are those of :mod:`plinth_dflash.format` (llama.cpp's dflash names) plus
:mod:`plinth_dspark.format`'s heads; the draft has no embedding of its own (the block rows look up the
target's), its own reduced head ``output.weight`` [V_d, E] with ``d2t`` [V_d] (absolute target ids).
Matrices are written Q8_0 (or F16 / F32; ``fc`` F32 when per-channel feature scales are folded into
it), norms and the small heads F32. The training recipe goes
into ``plinth.train.*`` keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

ARCH = "dflash"
#: matrices that may be quantised (everything else stays F32)
QUANTISED = ("fc.weight", "output.weight", "markov_w1.weight", "markov_w2.weight")


def draft_tensors(net: Any) -> dict[str, np.ndarray]:
    """The draft's tensors in GGUF layout (numpy, [n_out, n_in])."""
    c = net.c

    def a(t: Any) -> np.ndarray:
        return t.detach().cpu().numpy().astype(np.float32)

    out = {"fc.weight": a(net.fc * net.feat_scale[None, :]), "enc.output_norm.weight": a(net.enc_norm), "output_norm.weight": a(net.output_norm),
           "output.weight": a(net.output), "d2t": net.d2t.detach().cpu().numpy().astype(np.int64)}
    for i, layer in enumerate(net.layers):
        for name in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                     "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"):
            out[f"blk.{i}.{name}.weight"] = a(getattr(layer, name))
    if c.dspark:
        out["markov_w1.weight"] = a(net.markov_w1)
        out["markov_w2.weight"] = a(net.markov_w2)
        if c.confidence:
            out["conf_proj.weight"] = a(net.conf_w)
            out["conf_proj.bias"] = a(net.conf_b)
    if c.draft_vocab == c.n_vocab and np.array_equal(out["d2t"], np.arange(c.n_vocab)):
        del out["d2t"]
    return out


def draft_metadata(c: Any, name: str = "plinth-trained-draft") -> dict[str, Any]:
    a = ARCH
    md: dict[str, Any] = {
        "general.architecture": a,
        "general.name": name,
        f"{a}.vocab_size": c.n_vocab,
        f"{a}.embedding_length": c.n_embd,
        f"{a}.block_count": c.n_layer,
        f"{a}.attention.head_count": c.n_head,
        f"{a}.attention.head_count_kv": c.n_head_kv,
        f"{a}.attention.key_length": c.head_dim,
        f"{a}.attention.value_length": c.head_dim,
        f"{a}.feed_forward_length": c.n_ff,
        f"{a}.context_length": 8192,
        f"{a}.rope.freq_base": float(c.rope_base),
        f"{a}.attention.layer_norm_rms_epsilon": float(c.norm_eps),
        f"{a}.target_layers": [int(t) for t in c.taps],
        f"{a}.block_size": int(c.block_size),
        "tokenizer.ggml.mask_token_id": int(c.mask_token),
    }
    if c.dspark:
        md[f"{a}.sample_from_anchor"] = bool(c.sample_from_anchor)
        md[f"{a}.has_confidence_head"] = bool(c.confidence)
    return md


def export_gguf(net: Any, c: Any, path: str | Path, extra: Mapping[str, Any] | None = None, *,
                quant: str = "q8_0") -> Path:
    """Write the draft to ``path`` (atomically: a temporary file, then a rename)."""
    import gguf

    from ..convert import write_gguf

    tensors = draft_tensors(net)
    qt = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "f16": gguf.GGMLQuantizationType.F16,
          "f32": None}
    if quant not in qt:
        raise ValueError(f"quant must be one of {sorted(qt)}, not {quant!r}")
    qtypes = {}
    if qt[quant] is not None:
        for name, t in tensors.items():
            if t.ndim == 2 and (name in QUANTISED or name.startswith("blk.")) and t.shape[1] % 32 == 0:
                qtypes[name] = qt[quant]
        if "fc.weight" in qtypes and not bool((net.feat_scale == 1).all()):
            # the folded feature scales span ~3 decades within a 32-column block: Q8_0's shared block scale
            # would round the small columns away; F32 keeps them (and runs as a plain float matrix: an F16
            # one would be dequantized at every call)
            del qtypes["fc.weight"]
    md = draft_metadata(c)
    md.update(extra or {})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write_gguf(tmp, md, tensors, qtypes)
    tmp.replace(path)
    return path

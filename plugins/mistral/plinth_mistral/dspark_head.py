"""The ``mtp_dspark.*`` draft head of a Mistral Large 4 checkpoint, written as a DSpark draft GGUF.

transformers ignores these tensors and no config field describes them, so the layout is derived
from the tensor names and shapes, and anything else is refused (one line naming the tensor):

==========================================================  ===============================  =====================
checkpoint tensor (after ``mtp_dspark.``)                   shape                            GGUF (arch ``dflash``)
==========================================================  ===============================  =====================
``fc.weight``                                               [E, n_taps * E]                  ``fc.weight``
``hidden_norm.weight``                                      [E]                              ``enc.output_norm.weight``
``norm.weight``                                             [E]                              ``output_norm.weight``
``layers.N.attention_norm.weight`` / ``ffn_norm.weight``    [E]                              ``blk.N.attn_norm`` / ``ffn_norm``
``layers.N.attention.wq`` / ``wk`` / ``wv`` / ``wo``        [H*hd, E] / [Hkv*hd, E] / ... / [E, H*hd]  ``blk.N.attn_q/k/v/output``
``layers.N.attention.q_norm`` / ``k_norm``                  [hd]                             ``blk.N.attn_q_norm/k_norm``
``layers.N.feed_forward.w1`` / ``w3`` / ``w2``              [F, E] / [F, E] / [E, F]         ``blk.N.ffn_gate/up/down``
``markov_head.markov_w1.weight``                            [V, R]                           ``markov_w1.weight``
``markov_head.markov_w2.weight``                            [V, R]                           ``markov_w2.weight``
``confidence_head.proj.weight`` / ``.bias``                 [1, E + R] / [1]                 ``conf_proj.weight/bias``
``output.weight`` / ``tok_embeddings.weight`` (optional)    [V, E]                           ``output`` / ``token_embd``
==========================================================  ===============================  =====================

Derived: n_taps from ``fc``, the layer count from the contiguous ``layers.N`` indices, the head
width from ``q_norm``, the head counts from ``wq`` / ``wk`` rows, the FFN width from ``w1``, the
Markov rank R from ``markov_w1``. E and V must equal the target's. Without its own ``output`` the
draft shares the target's LM head and embedding (seed-features 2.2). Draft layers are dense
Mistral blocks (GQA with q/k RMSNorm, SwiGLU): a head whose layers carry MLA or MoE tensors does
not fit the DFlash backbone and is refused.

Not in the checkpoint, so given as converter options: ``block_size`` and ``mask_token_id``
(required), ``target_layers`` (0-based target layers whose outputs feed ``fc``; default: the last
n_taps layers, the DeepSeek-V4 MTP-derived convention, noted when used). The GGUF gets the +1 rule
(tap k = input of layer k; ``L_t`` = the pre-final-norm residual), ``sample_from_anchor`` = true
(the DeepSpec layout) and ``has_confidence_head``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from plinth.convert import SafetensorsDir, write_gguf
from plinth.errors import UserError

PREFIX = "mtp_dspark."
ARCH = "dflash"

TOP = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight",
       "markov_head.markov_w1.weight": "markov_w1.weight", "markov_head.markov_w2.weight": "markov_w2.weight",
       "confidence_head.proj.weight": "conf_proj.weight", "confidence_head.proj.bias": "conf_proj.bias",
       "output.weight": "output.weight", "tok_embeddings.weight": "token_embd.weight"}
LAYER = {"attention_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
         "attention.wq.weight": "attn_q.weight", "attention.wk.weight": "attn_k.weight",
         "attention.wv.weight": "attn_v.weight", "attention.wo.weight": "attn_output.weight",
         "attention.q_norm.weight": "attn_q_norm.weight", "attention.k_norm.weight": "attn_k_norm.weight",
         "feed_forward.w1.weight": "ffn_gate.weight", "feed_forward.w3.weight": "ffn_up.weight",
         "feed_forward.w2.weight": "ffn_down.weight"}
REQUIRED_TOP = ("fc.weight", "hidden_norm.weight", "norm.weight", "markov_head.markov_w1.weight",
                "markov_head.markov_w2.weight")


def _int_list(value: Any, what: str, source: str) -> list[int]:
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        return [int(v) for v in items]
    except (TypeError, ValueError):
        raise UserError(f"{source}: option '{what}' must be a list of integers, got {value!r}") from None


def draft_tensors(st: SafetensorsDir, source: str) -> dict[str, tuple[str, Any]]:
    """checkpoint name -> (GGUF name, shape) of every ``mtp_dspark.*`` tensor; unknown names refused."""
    out: dict[str, tuple[str, Any]] = {}
    for name in st.names():
        if not name.startswith(PREFIX):
            continue
        rest = name[len(PREFIX):]
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", rest)
        if rest in TOP:
            out[name] = (TOP[rest], st.shape(name))
        elif m and m.group(2) in LAYER:
            out[name] = (f"blk.{int(m.group(1))}.{LAYER[m.group(2)]}", st.shape(name))
        elif m and re.match(r"attention\.(wkv|kv_a|indexer)|experts\.|gate\.|shared_experts\.", m.group(2)):
            raise UserError(f"{source}: draft tensor '{name}' belongs to an MLA / MoE block; DSpark drafts run "
                            "dense GQA + SwiGLU blocks (the DFlash backbone), so this head cannot be converted")
        else:
            raise UserError(f"{source}: unexpected draft tensor '{name}'; the mtp_dspark layout is documented in "
                            "plinth_mistral.dspark_head")
    return out


def draft_layout(tensors: Mapping[str, tuple[str, Any]], n_embd: int, n_vocab: int, source: str) -> dict[str, int]:
    """Hparams derived from the shapes; a shape that does not fit is refused, naming the tensor."""
    by_gguf = {g: (name, tuple(shape)) for name, (g, shape) in tensors.items()}
    for t in REQUIRED_TOP:
        if PREFIX + t not in tensors:
            raise UserError(f"{source}: the draft head has mtp_dspark tensors but no '{PREFIX + t}'")

    def shape(g: str) -> tuple[int, ...]:
        if g not in by_gguf:
            raise UserError(f"{source}: draft tensor for GGUF '{g}' is missing")
        return by_gguf[g][1]

    def expect(g: str, want: tuple[int, ...]) -> None:
        if shape(g) != want:
            raise UserError(f"{source}: draft tensor '{by_gguf[g][0]}' has shape {list(shape(g))}, "
                            f"expected {list(want)}")

    e, v = n_embd, n_vocab
    fc = shape("fc.weight")
    if len(fc) != 2 or fc[0] != e or fc[1] % e:
        raise UserError(f"{source}: draft tensor '{PREFIX}fc.weight' has shape {list(fc)}; expected "
                        f"[{e}, n_taps * {e}] (the target's hidden size)")
    w1 = shape("markov_w1.weight")
    if len(w1) != 2 or w1[0] != v:
        raise UserError(f"{source}: draft tensor '{PREFIX}markov_head.markov_w1.weight' has shape {list(w1)}; "
                        f"expected [{v}, R] (the target's vocabulary)")
    rank = w1[1]
    expect("markov_w2.weight", (v, rank))
    expect("enc.output_norm.weight", (e,))
    expect("output_norm.weight", (e,))
    has_conf = "conf_proj.weight" in by_gguf
    if has_conf:
        expect("conf_proj.weight", (1, e + rank))
        if "conf_proj.bias" in by_gguf:
            expect("conf_proj.bias", (1,))
    for g in ("output.weight", "token_embd.weight"):
        if g in by_gguf:
            expect(g, (v, e))
    layers = sorted({int(g.split(".")[1]) for g in by_gguf if g.startswith("blk.")})
    if not layers or layers != list(range(len(layers))):
        raise UserError(f"{source}: the draft head's layers are {layers}; expected layers 0..N-1")
    hd = shape("blk.0.attn_q_norm.weight")[0]
    q, k, ff = shape("blk.0.attn_q.weight")[0], shape("blk.0.attn_k.weight")[0], shape("blk.0.ffn_gate.weight")[0]
    if q % hd or k % hd:
        raise UserError(f"{source}: draft wq/wk rows ({q}, {k}) are not multiples of the head width {hd} "
                        f"(from '{PREFIX}layers.0.attention.q_norm.weight')")
    h, hkv = q // hd, k // hd
    if h % hkv:
        raise UserError(f"{source}: draft head count {h} is not a multiple of its KV head count {hkv}")
    for il in layers:
        b = f"blk.{il}."
        for g, want in (("attn_norm.weight", (e,)), ("ffn_norm.weight", (e,)), ("attn_q.weight", (h * hd, e)),
                        ("attn_k.weight", (hkv * hd, e)), ("attn_v.weight", (hkv * hd, e)),
                        ("attn_output.weight", (e, h * hd)), ("attn_q_norm.weight", (hd,)),
                        ("attn_k_norm.weight", (hd,)), ("ffn_gate.weight", (ff, e)), ("ffn_up.weight", (ff, e)),
                        ("ffn_down.weight", (e, ff))):
            expect(b + g, want)
    return dict(n_taps=fc[1] // e, rank=rank, n_layer=len(layers), head_dim=hd, n_head=h, n_head_kv=hkv, n_ff=ff,
                has_conf=int(has_conf), own_head=int("output.weight" in by_gguf))


def write_draft(st: SafetensorsDir, tc: Mapping[str, Any], source: str, out: Path, options: Mapping[str, Any]) -> Path:
    """Write the checkpoint's ``mtp_dspark`` head as a DSpark draft GGUF at ``out``."""
    tensors = draft_tensors(st, source)
    if not tensors:
        raise UserError(f"{source}: option 'draft' given, but the checkpoint has no '{PREFIX}*' tensors")
    e, v, n_target = int(tc["hidden_size"]), int(tc["vocab_size"]), int(tc["num_hidden_layers"])
    lay = draft_layout(tensors, e, v, source)
    for opt in ("block_size", "mask_token_id"):
        if options.get(opt) in (None, ""):
            raise UserError(f"{source}: the mtp_dspark head does not record its {opt}; pass it with "
                            f"--option {opt}=N")
    block = int(options["block_size"])
    mask = int(options["mask_token_id"])
    if block < 2 or not 0 <= mask < v:
        raise UserError(f"{source}: block_size {block} must be >= 2 and mask_token_id {mask} in 0..{v - 1}")
    if options.get("target_layers") not in (None, ""):
        hf_taps = _int_list(options["target_layers"], "target_layers", source)
    else:
        hf_taps = list(range(n_target - lay["n_taps"], n_target))
        print(f"note: target_layers not given; using the last {lay['n_taps']} target layers {hf_taps} "
              "(the MTP-derived DSpark convention)", file=sys.stderr)
    if len(hf_taps) != lay["n_taps"] or not all(0 <= t < n_target for t in hf_taps):
        raise UserError(f"{source}: target_layers {hf_taps} must name {lay['n_taps']} layers (fc's width) in "
                        f"0..{n_target - 1}")
    a = ARCH
    rope = dict(tc.get("rope_parameters") or {})
    md: dict[str, Any] = {
        "general.architecture": a,
        "general.name": "mistral-large4-dspark",
        f"{a}.block_count": lay["n_layer"],
        f"{a}.embedding_length": e,
        f"{a}.feed_forward_length": lay["n_ff"],
        f"{a}.attention.head_count": lay["n_head"],
        f"{a}.attention.head_count_kv": lay["n_head_kv"],
        f"{a}.attention.key_length": lay["head_dim"],
        f"{a}.attention.value_length": lay["head_dim"],
        f"{a}.attention.layer_norm_rms_epsilon": float(tc.get("rms_norm_eps", 1e-5)),
        f"{a}.rope.freq_base": float(rope.get("rope_theta", 10000.0)),
        f"{a}.vocab_size": v,
        f"{a}.context_length": int(tc.get("max_position_embeddings", 1048576)),
        f"{a}.target_layers": [t + 1 for t in hf_taps],
        f"{a}.block_size": block,
        f"{a}.sample_from_anchor": True,
        f"{a}.has_confidence_head": bool(lay["has_conf"]),
        "tokenizer.ggml.mask_token_id": mask,
    }
    arrays = {g: st.get(name) for name, (g, _) in tensors.items()}
    write_gguf(out, md, arrays)
    return out


__all__ = ["draft_layout", "draft_tensors", "write_draft"]

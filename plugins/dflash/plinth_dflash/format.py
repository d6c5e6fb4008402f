"""Reading a ``dflash`` GGUF: typed hparams, declared tensors, weights with their scales folded in.

Three steps, as for an architecture: :func:`load_hparams` (metadata -> frozen
:class:`DFlashHParams`, every problem a named error), :func:`tensor_specs` (what
the file must hold for that hparams), :func:`load_draft` (both checked, then the
weights dequantized to float32 on the backend with every ``<name>.scale`` multiplied
into its tensor, so the injection path and the drafting path see the same scaled
weights).

The draft variant comes from the tensors, as llama.cpp's auto-detection does:
``markov_w1.weight`` is a DSpark draft (refused here: it is plinth-dspark's),
``selector_hidden.weight`` is DFlash2, ``lilicorr.*`` tensors are LiLiCorr, anything
else is DFlash.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs
import numpy as np

from plinth.errors import UserError
from plinth.graph import HParamsError, KeyReader, TensorSpec, check_tensors, scale_name

from . import constants as C


class DFlashFormatError(UserError):
    """A dflash GGUF that plinth-dflash cannot use, with the reason."""


@attrs.frozen
class LiLiCorrHParams:
    top_k: int  # K candidates per slot
    hidden: int  # D_h
    n_layer: int
    n_head: int
    mlp_ratio: float
    factor_dim: int  # F
    vector_eps: float
    logit_scale: float  # lambda

    @property
    def n_ff(self) -> int:
        return int(round(self.mlp_ratio * self.hidden))


@attrs.frozen
class DFlashHParams:
    """Everything the draft graph and the drafter read from a dflash GGUF."""

    variant: str  # "dflash", "dflash2" or "lilicorr"
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    norm_eps: float
    rope_base: float
    n_rot: int
    target_layers: tuple[int, ...]  # taps, in file order (the feature concat order)
    block_size: int
    mask_token: int
    sliding_window: int  # 0 = no SWA layer
    swa_layers: tuple[bool, ...]  # per layer: this layer uses the window
    causal_layers: tuple[bool, ...]  # per layer: causal attention (default: non-causal)
    logit_scale: float = 0.0  # DFlash2 only; 0 = none
    softcap: float = 0.0  # DFlash2 only; 0 = none
    tied: bool = False
    n_vocab: int | None = None
    conv_kernel: int = 0
    conv_group: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    lilicorr: LiLiCorrHParams | None = None
    embedding_scale: float = 0.0  # 0 = none
    attn_scale: float = 0.0  # 0 = 1 / sqrt(head_dim)
    value_scale: float = 0.0  # 0 = none
    hidden_act: str = "silu"  # "silu" or "gelu" (tanh approximation, as ggml's GELU)
    # Gemma 4 style layers (llama.cpp's gemma4 keys): sliding layers with their own head size and RoPE,
    # a KV head count per layer, V through a weightless RMSNorm
    head_count_kv: tuple[int, ...] = ()  # per layer; () = n_head_kv everywhere
    head_dim_swa: int = 0  # 0 = head_dim
    rope_base_swa: float = 0.0  # 0 = rope_base
    n_rot_swa: int = 0  # 0 = n_rot
    swa_rope: bool = False  # sliding layers use (rope_base_swa, n_rot_swa) and no rope_freqs
    value_norm: bool = False  # V = rms_norm(Wv . x) (no weight) on every layer; a layer without attn_v always norms

    @property
    def n_taps(self) -> int:
        return len(self.target_layers)

    @property
    def has_conv(self) -> bool:
        return self.conv_kernel > 0

    @property
    def max_draft(self) -> int:
        return self.block_size - 1

    def hd(self, il: int) -> int:
        """Head size of layer ``il`` (Q, K and V)."""
        return (self.head_dim_swa or self.head_dim) if self.swa_layers[il] else self.head_dim

    def kv_heads(self, il: int) -> int:
        return self.head_count_kv[il] if self.head_count_kv else self.n_head_kv

    def rot(self, il: int) -> int:
        """Rotated dims of layer ``il``."""
        return (self.n_rot_swa or self.n_rot) if self.swa_layers[il] and self.swa_rope else self.n_rot


def detect_variant(tensor_names: Any) -> str:
    names = set(tensor_names)
    if C.T_MARKOV_W1 in names:
        raise DFlashFormatError("this dflash GGUF holds 'markov_w1.weight': it is a DSpark draft, which "
                                "plinth-dflash does not run; install plinth-dspark and use --spec dspark")
    if any(n.startswith(C.LILI_PREFIX) for n in names):
        return "lilicorr"
    if C.T_SEL_HIDDEN in names:
        return "dflash2"
    return "dflash"


def _bool_array(md: Mapping[str, Any], key: str, n_layer: int, source: str) -> tuple[bool, ...]:
    value = md[key]
    arr = np.asarray(value)
    if arr.ndim == 0 or arr.dtype != np.bool_:
        raise HParamsError(
            f"{source}: '{key}' must be a bool array with one entry per layer (true = sliding-window layer); "
            f"found {'an integer' if arr.dtype.kind in 'iu' else 'a ' + arr.dtype.name} "
            f"{'value' if arr.ndim == 0 else 'array'} {arr.tolist()!r}. DFlash does not accept the "
            "'every N-th layer' integer pattern (llama.cpp #26900); re-convert the draft")
    if arr.shape != (n_layer,):
        raise HParamsError(f"{source}: '{key}' has {arr.size} entries, expected n_layer = {n_layer}")
    return tuple(bool(v) for v in arr)


def _finite(r: KeyReader, key: str, source: str) -> float:
    """An optional float key of llama.cpp's dflash graph (0 when absent: the transform is off); a
    non-finite value is refused by name."""
    value = r.get(key, float, required=False, default=0.0)
    if not np.isfinite(value):
        raise HParamsError(f"{source}: '{r.key(key)}' = {value}: must be a finite number (0 = off)")
    return float(value)


#: ``hidden_activation`` values llama.cpp's dflash graph accepts -> the FFN activation
HIDDEN_ACTS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu"}


def _hidden_act(r: KeyReader, source: str) -> str:
    name = r.get(C.KEY_HIDDEN_ACT, str, required=False, default="silu")
    if name not in HIDDEN_ACTS:
        raise HParamsError(f"{source}: '{r.key(C.KEY_HIDDEN_ACT)}' = {name!r}: a DFlash draft's FFN takes "
                           f"{', '.join(repr(k) for k in HIDDEN_ACTS)} (llama.cpp refuses others too)")
    return HIDDEN_ACTS[name]


def _flag(md: Mapping[str, Any], key: str, source: str) -> bool:
    value = md.get(key, False)
    if not isinstance(value, (bool, np.bool_)):
        raise HParamsError(f"{source}: '{key}' must be a bool, found {value!r}")
    return bool(value)


def _sliding_geometry(r: KeyReader, source: str, head_dim: int, n_rot: int, rope_base: float,
                      swa: tuple[bool, ...]) -> dict[str, Any]:
    """Sliding layers' own head size and RoPE (llama.cpp's gemma4 keys ``attention.key_length_swa``,
    ``rope.freq_base_swa``, ``rope.dimension_count_swa``); any of them gives the sliding layers their own
    RoPE, without ``rope_freqs`` (which then turns the full layers only)."""
    for name, k in (("attention.value_length", head_dim),):
        v = r.get(name, required=False, default=k)
        if v != k:
            raise HParamsError(f"{source}: '{r.key(name)}' = {v} differs from the key length {k}; a DFlash draft "
                               "has equal key and value head sizes")
    keys = [k for k in C.SWA_GEOMETRY_KEYS if r.has(k)]
    if not keys:
        return {}
    if not any(swa):
        raise HParamsError(f"{source}: {', '.join(repr(r.key(k)) for k in keys)} set, but the draft has no sliding "
                           "layer to apply it to")
    hd_swa = r.get("attention.key_length_swa", required=False, default=head_dim)
    v = r.get("attention.value_length_swa", required=False, default=hd_swa)
    if v != hd_swa:
        raise HParamsError(f"{source}: '{r.key('attention.value_length_swa')}' = {v} differs from the sliding key "
                           f"length {hd_swa}")
    rot_swa = r.rotary_dims("rope.dimension_count_swa", hd_swa)
    return dict(head_dim_swa=hd_swa, n_rot_swa=rot_swa, swa_rope=True,
                rope_base_swa=r.get("rope.freq_base_swa", float, required=False, default=rope_base))


def load_hparams(md: Mapping[str, Any], source: str, tensor_names: Any = ()) -> DFlashHParams:
    arch = md.get("general.architecture")
    if arch != C.ARCH:
        raise DFlashFormatError(f"{source}: general.architecture is {arch!r}, a DFlash draft has 'dflash'")
    variant = detect_variant(tensor_names)
    r = KeyReader(md, source, C.ARCH)
    n_embd = r.get("embedding_length")
    n_layer = r.get("block_count")
    n_head = r.get("attention.head_count")
    kv_layers = tuple(int(v) for v in r.get_key_or_arr("attention.head_count_kv", n_layer, required=False,
                                                         default=n_head))
    n_head_kv = kv_layers[0]
    head_dim = r.get("attention.key_length", required=False, default=n_embd // n_head)
    if not r.has(C.KEY_TARGET_LAYERS):
        raise HParamsError(f"{source}: DFlash model requires 'target_layers' (key '{C.ARCH}.{C.KEY_TARGET_LAYERS}')")
    taps = r.get_array(C.KEY_TARGET_LAYERS)
    if not taps:
        raise HParamsError(f"{source}: '{C.ARCH}.{C.KEY_TARGET_LAYERS}' is empty")
    if any(t < 0 for t in taps):
        raise HParamsError(f"{source}: '{C.ARCH}.{C.KEY_TARGET_LAYERS}' has negative ids {list(taps)}")
    block = r.get(C.KEY_BLOCK_SIZE, required=False, default=16)
    if block < 2:
        raise HParamsError(f"{source}: '{C.ARCH}.{C.KEY_BLOCK_SIZE}' = {block}; a block drafter needs at least 2")
    if C.KEY_MASK_TOKEN_TOK in md:
        mask = int(md[C.KEY_MASK_TOKEN_TOK])
    elif r.has(C.KEY_MASK_TOKEN):
        mask = r.get(C.KEY_MASK_TOKEN)
    else:
        raise HParamsError(f"{source}: no mask token: set '{C.KEY_MASK_TOKEN_TOK}' (or the early converter's "
                           f"'{C.ARCH}.{C.KEY_MASK_TOKEN}')")
    window = r.get(C.KEY_SWA, required=False, default=0)
    if window > 0:
        key = r.key(C.KEY_SWA_PATTERN)
        if key not in md:
            raise HParamsError(f"{source}: '{r.key(C.KEY_SWA)}' = {window} needs the per-layer bool array '{key}'")
        swa = _bool_array(md, key, n_layer, source)
    else:
        if r.has(C.KEY_SWA_PATTERN):
            _bool_array(md, r.key(C.KEY_SWA_PATTERN), n_layer, source)  # an int pattern is refused anyway
        swa = (False,) * n_layer
    causal_all = bool(md.get(r.key(C.KEY_CAUSAL), False)) or md.get(r.key(C.KEY_DECODER_ARCH)) == "laguna"
    if r.has(C.KEY_CAUSAL_LAYERS):
        causal = _bool_array(md, r.key(C.KEY_CAUSAL_LAYERS), n_layer, source)
        causal = tuple(c or causal_all for c in causal)
    else:
        causal = (causal_all,) * n_layer
    kw: dict[str, Any] = dict(
        variant=variant, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_ff=r.get("feed_forward_length"), norm_eps=r.get(C.KEY_EPS, float),
        rope_base=r.get("rope.freq_base", float, required=False, default=10000.0),
        n_rot=r.get("rope.dimension_count", required=False, default=head_dim),
        target_layers=tuple(int(t) for t in taps), block_size=block, mask_token=mask, sliding_window=window,
        swa_layers=swa, causal_layers=causal,
        logit_scale=r.get(C.KEY_LOGIT_SCALE, float, required=False, default=0.0),
        softcap=r.get(C.KEY_SOFTCAP, float, required=False, default=0.0),
        tied=bool(md.get(r.key(C.KEY_TIED), False)),
        n_vocab=r.get("vocab_size", required=False, default=None),
        embedding_scale=_finite(r, C.KEY_EMBD_SCALE, source),
        attn_scale=_finite(r, C.KEY_ATTN_SCALE, source),
        value_scale=_finite(r, C.KEY_VALUE_SCALE, source),
        hidden_act=_hidden_act(r, source),
    )
    for il, nkv in enumerate(kv_layers):
        if nkv < 1 or n_head % nkv:
            raise HParamsError(f"{source}: head_count {n_head} is not a multiple of head_count_kv {nkv}"
                               + (f" (layer {il})" if len(set(kv_layers)) > 1 else ""))
    if len(set(kv_layers)) > 1:
        kw["head_count_kv"] = kv_layers
    kw.update(_sliding_geometry(r, source, head_dim, kw["n_rot"], kw["rope_base"], swa))
    kw["value_norm"] = _flag(md, r.key(C.KEY_VALUE_NORM), source)
    conv_keys = (C.KEY_CONV_KERNEL, C.KEY_CONV_GROUP, C.KEY_SEL_RANK, C.KEY_SEL_TOP_K)
    if variant == "dflash2":
        vals = {}
        for k in conv_keys:
            if not r.has(k):
                raise HParamsError(f"{source}: a DFlash2 draft (it has '{C.T_SEL_HIDDEN}') requires "
                                   f"'{r.key(k)}'")
            vals[k] = r.get(k)
            if vals[k] <= 0:
                raise HParamsError(f"{source}: '{r.key(k)}' = {vals[k]}; DFlash2 needs every conv/selector "
                                   "size > 0")
        gs, top_k = vals[C.KEY_CONV_GROUP], vals[C.KEY_SEL_TOP_K]
        if n_embd % gs:
            raise HParamsError(f"{source}: embedding_length {n_embd} is not a multiple of "
                               f"'{r.key(C.KEY_CONV_GROUP)}' = {gs}")
        if n_embd < top_k * (top_k + 1):
            raise HParamsError(f"{source}: embedding_length {n_embd} < K*(K+1) = {top_k * (top_k + 1)} for "
                               f"selector_top_k K = {top_k}: the lattice row (K ids + K*K scores) must fit E")
        kw.update(conv_kernel=vals[C.KEY_CONV_KERNEL], conv_group=gs, selector_rank=vals[C.KEY_SEL_RANK],
                  selector_top_k=top_k)
    elif variant == "lilicorr" and r.has(C.KEY_CONV_KERNEL):
        # LiLiCorr may keep the DFlash2 grouped convolution in its backbone
        kw.update(conv_kernel=r.get(C.KEY_CONV_KERNEL), conv_group=r.get(C.KEY_CONV_GROUP))
        if kw["conv_kernel"] <= 0 or kw["conv_group"] <= 0 or n_embd % kw["conv_group"]:
            raise HParamsError(f"{source}: bad conv geometry kernel={kw['conv_kernel']} group={kw['conv_group']} "
                               f"for embedding_length {n_embd}")
    if variant == "lilicorr":
        vals = {}
        for k, cast in ((C.KEY_LILI_TOP_K, int), (C.KEY_LILI_HIDDEN, int), (C.KEY_LILI_LAYERS, int),
                        (C.KEY_LILI_HEADS, int), (C.KEY_LILI_MLP_RATIO, float), (C.KEY_LILI_FACTOR, int),
                        (C.KEY_LILI_VEC_EPS, float), (C.KEY_LILI_LAMBDA, float)):
            if not r.has(k):
                raise HParamsError(f"{source}: a LiLiCorr draft requires '{r.key(k)}' (no defaults)")
            vals[k] = r.get(k, cast)
        hidden = vals[C.KEY_LILI_HIDDEN] or n_embd
        top_k = vals[C.KEY_LILI_TOP_K]
        if top_k < 1 or top_k & (top_k - 1):
            raise HParamsError(f"{source}: '{r.key(C.KEY_LILI_TOP_K)}' = {top_k} must be a power of two")
        if vals[C.KEY_LILI_HEADS] < 1 or hidden % vals[C.KEY_LILI_HEADS]:
            raise HParamsError(f"{source}: LiLiCorr hidden size {hidden} is not a multiple of "
                               f"'{r.key(C.KEY_LILI_HEADS)}' = {vals[C.KEY_LILI_HEADS]}")
        kw["lilicorr"] = LiLiCorrHParams(
            top_k=top_k, hidden=hidden, n_layer=vals[C.KEY_LILI_LAYERS], n_head=vals[C.KEY_LILI_HEADS],
            mlp_ratio=vals[C.KEY_LILI_MLP_RATIO], factor_dim=vals[C.KEY_LILI_FACTOR],
            vector_eps=vals[C.KEY_LILI_VEC_EPS], logit_scale=vals[C.KEY_LILI_LAMBDA])
    return DFlashHParams(**kw)


def _lin(name: str, shape: tuple[int, ...], required: bool = True, bias: bool = False) -> list[TensorSpec]:
    out = [TensorSpec(name + ".weight", shape, required=required, scale=True)]
    if bias:
        out.append(TensorSpec(name + ".bias", (shape[0],), required=False))
    return out


def lilicorr_specs(hp: DFlashHParams) -> list[TensorSpec]:
    lh = hp.lilicorr
    assert lh is not None
    e, d, f, p = hp.n_embd, lh.hidden, lh.factor_dim, "lilicorr."
    specs: list[TensorSpec] = []
    specs += _lin(p + "token_proj", (d, e), required=d != e, bias=True)
    specs += _lin(p + "pass_hidden_proj", (d, e), bias=True)
    specs += [TensorSpec(p + "feat_norm.weight", (5,)), TensorSpec(p + "feat_norm.bias", (5,))]
    specs += _lin(p + "feat_up", (d, 5), bias=True) + _lin(p + "feat_down", (d, d), bias=True)
    specs += [TensorSpec(p + "slot_embd.weight", (hp.block_size - 1, d)),
              TensorSpec(p + "rank_embd.weight", (lh.top_k, d))]
    for il in range(lh.n_layer):
        b = f"{p}blk.{il}."
        specs += [TensorSpec(b + "attn_norm.weight", (d,)), TensorSpec(b + "ffn_norm.weight", (d,))]
        specs += _lin(b + "attn_qkv", (3 * d, d), bias=True) + _lin(b + "attn_output", (d, d), bias=True)
        specs += [TensorSpec(b + "attn_rel_bias", (lh.n_head, 2 * hp.block_size - 1)),
                  TensorSpec(b + "attn_same_bias", (lh.n_head,))]
        specs += _lin(b + "ffn_up", (lh.n_ff, d), bias=True) + _lin(b + "ffn_down", (d, lh.n_ff), bias=True)
    specs += [TensorSpec(p + "output_norm.weight", (d,)), TensorSpec(p + "anchor_norm.weight", (d,))]
    specs += _lin(p + "ctx_proj", (d, e), bias=True) + _lin(p + "factor_in", (d, 3 * d), bias=True)
    specs += _lin(p + "out_head", (f, d), bias=True) + _lin(p + "in_head", (f, d), bias=True)
    specs += _lin(p + "anchor_out_head", (f, d), bias=True)
    return specs


def _undeclared(specs: list[TensorSpec], names: Any, claimed: tuple[str, ...]) -> list[str]:
    """Tensors of the file that no spec (nor a spec's ``.scale`` companion) declares and no plugin claims."""
    declared = set(claimed)
    for spec in specs:
        declared.add(spec.name)
        if spec.scale:
            declared.add(scale_name(spec.name))
    return sorted(n for n in names if n not in declared and n != C.T_D2T)


def _merge_specs(base: list[TensorSpec], extra: list[TensorSpec]) -> list[TensorSpec]:
    """``extra`` replaces base specs of the same name (e.g. a reduced-vocabulary ``output.weight``)."""
    names = {s.name for s in extra}
    return [s for s in base if s.name not in names] + list(extra)


def tensor_specs(hp: DFlashHParams) -> list[TensorSpec]:
    """Names and numpy-order shapes the file must hold (``.scale`` companions are optional)."""
    e, n_in, ff = hp.n_embd, hp.n_taps * hp.n_embd, hp.n_ff
    v = hp.n_vocab if hp.n_vocab is not None else -1
    specs = [
        TensorSpec(C.T_FC, (e, n_in), scale=True),
        TensorSpec(C.T_FC_INPUT_SCALE, (1,), required=False),
        TensorSpec(C.T_ENC_NORM, (e,)),
        TensorSpec(C.T_OUTPUT_NORM, (e,)),
        TensorSpec(C.T_TOKEN_EMBD, (v, e), required=False),
        TensorSpec(C.T_OUTPUT, (v, e), required=False, scale=True),
        TensorSpec(C.T_ROPE_FREQS, (hp.n_rot // 2,), required=False),
    ]
    for il in range(hp.n_layer):
        b, hd = f"blk.{il}.", hp.hd(il)
        nq, nkv = hp.n_head * hd, hp.kv_heads(il) * hd
        specs += [
            TensorSpec(b + C.T_POST_ATTN_NORM, (e,), required=False),
            TensorSpec(b + C.T_POST_FFN_NORM, (e,), required=False),
            TensorSpec(b + C.T_LAYER_OUT_SCALE, (1,), required=False),
            TensorSpec(b + "attn_norm.weight", (e,)),
            TensorSpec(b + "attn_q.weight", (nq, e), scale=True),
            TensorSpec(b + "attn_k.weight", (nkv, e), scale=True),
            TensorSpec(b + "attn_v.weight", (nkv, e), required=False, scale=True),  # absent: K is V (normed)
            TensorSpec(b + "attn_output.weight", (e, nq), scale=True),
            TensorSpec(b + "attn_q_norm.weight", (hd,)),
            TensorSpec(b + "attn_k_norm.weight", (hd,)),
            TensorSpec(b + "attn_sinks.weight", (hp.n_head,), required=False),
            TensorSpec(b + "ffn_norm.weight", (e,)),
            TensorSpec(b + "ffn_gate.weight", (ff, e), scale=True),
            TensorSpec(b + "ffn_up.weight", (ff, e), scale=True),
            TensorSpec(b + "ffn_down.weight", (e, ff), scale=True),
        ]
        if hp.has_conv:
            g = e // hp.conv_group
            specs += [
                TensorSpec(b + "attn_conv_base", (2, hp.conv_kernel, e)),
                TensorSpec(b + "attn_conv_proj.weight", (2 * hp.conv_kernel * g, e), scale=True),
                TensorSpec(b + "ffn_conv_base", (2, hp.conv_kernel, e)),
                TensorSpec(b + "ffn_conv_proj.weight", (2 * hp.conv_kernel * g, e), scale=True),
            ]
    if hp.variant == "dflash2":
        specs += [
            TensorSpec(C.T_SEL_PRED, (v, hp.selector_rank)),
            TensorSpec(C.T_SEL_SUCC, (v, hp.selector_rank)),
            TensorSpec(C.T_SEL_HIDDEN, (hp.selector_rank, e), scale=True),
        ]
    if hp.variant == "lilicorr":
        specs += lilicorr_specs(hp)
    return specs


@attrs.frozen
class DraftFile:
    """A loaded draft: hparams, float32 weights on the backend (scales folded), and where it came from."""

    path: Path
    hparams: DFlashHParams
    weights: dict[str, Any]
    metadata: dict[str, Any]
    fc_input_scale: float | None
    tensor_types: dict[str, str]


def _tied_key_absent(md: Mapping[str, Any]) -> bool:
    return f"{C.ARCH}.{C.KEY_TIED}" not in md


#: ``extension(hp, present) -> specs``: extra tensors a plugin built on this format claims
#: (``present``: name -> (shape, GGML type) of every tensor in the file).
DraftExtension = Callable[[DFlashHParams, Mapping[str, tuple[tuple[int, ...], str]]], list[TensorSpec]]


def load_draft(path: str | Path, backend: Any, *, extension: DraftExtension | None = None,
               claimed: tuple[str, ...] = ()) -> DraftFile:
    """Load a dflash GGUF. Extension point (plinth-dspark): ``claimed`` names tensors another plugin owns (they
    neither decide the variant nor get refused, e.g. ``markov_w1.weight`` and ``d2t``), ``extension`` declares
    them; they are checked and loaded like the backbone's (scales folded in; integer tensors kept as int64)."""
    from plinth.gguf import GGUFFile
    from plinth.gguf import quants

    path = Path(path)
    if not path.is_file():
        raise DFlashFormatError(f"draft file {path} does not exist")
    gf = GGUFFile(path)
    md = dict(gf.metadata)
    hp = load_hparams(md, str(path), [n for n in gf.tensors.keys() if n not in claimed])
    if hp.n_vocab is None:
        for name in (C.T_TOKEN_EMBD, C.T_OUTPUT, C.T_SEL_PRED):
            if name in gf.tensors:
                hp = attrs.evolve(hp, n_vocab=int(gf.tensors[name].shape[0]))
                break
    present = {n: (tuple(i.shape), i.type_name) for n, i in gf.tensors.items()}
    specs = tensor_specs(hp) if extension is None else _merge_specs(tensor_specs(hp), extension(hp, present))
    if hp.n_vocab is None:  # no vocabulary-sized tensor: nothing to check against -1
        specs = [s for s in specs if -1 not in s.shape]
    found = check_tensors(specs, present, str(path))
    if C.T_D2T in gf.tensors and C.T_D2T not in claimed:
        raise DFlashFormatError(f"{path}: the draft has a reduced vocabulary ('d2t'); plinth-dflash drafts over the "
                                "target's full vocabulary only (re-convert with the full lm_head)")

    def f32(name: str) -> np.ndarray:
        info = gf.tensors[name]
        raw = gf.raw(name)
        if info.type_name in ("I64", "I32"):
            return np.asarray(raw, dtype=np.int64)
        arr = raw if info.type_name == "F32" else quants.dequantize(raw, info.ggml_type, info.shape)
        return np.asarray(arr, dtype=np.float32)

    unread = _undeclared(specs, gf.tensors.keys(), claimed)
    if unread:
        raise DFlashFormatError(f"{path}: {len(unread)} tensor(s) that no part of a {hp.variant} draft reads: "
                                f"{', '.join(repr(n) for n in unread[:8])}{' ...' if len(unread) > 8 else ''}; "
                                "computing without them would draft from another model than the file's, so the "
                                "file is refused")

    weights: dict[str, Any] = {}
    fc_in = None
    keep = _keeps_blocks(backend)
    for spec in found:
        if spec.name == C.T_FC_INPUT_SCALE:
            # NVFP4's activation global scale of fc: llama.cpp's dflash graph multiplies fc's product by
            # 'fc.scale' only; an activation scale only matters where activations are quantised to FP4, so a
            # float product has no use for it. Checked, never multiplied in (README, "Tensors").
            fc_in = float(f32(spec.name).reshape(-1)[0])
            if not (np.isfinite(fc_in) and fc_in > 0):
                raise DFlashFormatError(f"{path}: '{C.T_FC_INPUT_SCALE}' = {fc_in}: an activation scale must be "
                                        "finite and > 0")
            continue
        sname = scale_name(spec.name)
        s = None
        if spec.scale and sname in gf.tensors:
            s = f32(sname).reshape(-1)
            if s.size != 1:
                raise DFlashFormatError(f"{path}: per-tensor scale '{sname}' has {s.size} elements, expected 1")
            if not np.isfinite(s[0]) or s[0] == 0:
                raise DFlashFormatError(f"{path}: per-tensor scale '{sname}' = {s[0]}: must be finite and non-zero")
        if keep and _kept_linear(spec.name, gf.tensors[spec.name]):
            from plinth.graph import QuantWeight  # the projections stay in their blocks (and scale), as a target's do

            info = gf.tensors[spec.name]
            weights[spec.name] = QuantWeight(gf.raw(spec.name), info.ggml_type, tuple(info.shape), s)
            continue
        arr = f32(spec.name)
        if s is not None:
            arr = arr * s[0]
        weights[spec.name] = backend.asarray(np.ascontiguousarray(arr, dtype=arr.dtype if arr.dtype == np.int64
                                                                  else np.float32))
    if _tied_key_absent(md) and C.T_TOKEN_EMBD in weights and C.T_OUTPUT not in weights:
        hp = attrs.evolve(hp, tied=True)  # llama.cpp: no output head but an own embedding -> the embedding is the head
    if hp.tied and C.T_TOKEN_EMBD not in weights:
        raise DFlashFormatError(f"{path}: '{C.ARCH}.{C.KEY_TIED}' is true but the draft has no "
                                f"'{C.T_TOKEN_EMBD}' to tie its head to")
    types = {n: i.type_name for n, i in gf.tensors.items()}
    return DraftFile(path=path, hparams=hp, weights=weights, metadata=md, fc_input_scale=fc_in, tensor_types=types)


#: the draft's projections (multiplied through ``plinth.ops.linear`` only): kept in their GGUF blocks
_LINEAR = re.compile(r"(blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)|fc|output)\.weight")


def _keeps_blocks(backend: Any) -> bool:
    """Whether quantized projections stay quantized: the numpy backend, unless PLINTH_DEQUANTIZE=1 (as a target's)."""
    return getattr(backend, "name", "") == "numpy" and os.environ.get("PLINTH_DEQUANTIZE", "0") != "1"


def _kept_linear(name: str, info: Any) -> bool:
    from plinth.graph import KEPT_TYPES, block_values

    return (_LINEAR.fullmatch(name) is not None and info.type_name in KEPT_TYPES and len(info.shape) == 2
            and info.shape[1] % block_values(info.type_name) == 0)


#: ``plinth info``'s name for each draft variant.
VARIANT_LABELS = {"dflash": "DFlash", "dflash2": "DFlash2", "lilicorr": "LiLiCorr"}


def describe(metadata: Mapping[str, Any], tensors: Mapping[str, tuple[tuple[int, ...], str]], source: str, *,
             claimed: tuple[str, ...] = ()) -> list[str] | None:
    """``plinth info`` lines for a dflash GGUF, from its metadata and tensor shapes (nothing loaded).

    ``None`` for a DSpark draft (``markov_w1.weight`` present and not in ``claimed``): plinth-dspark
    describes those, calling this with its ``claimed`` tensors (the extension point of :func:`load_draft`)
    and adding the lines of its heads. The first line names the variant.
    """
    names = [n for n in tensors if n not in claimed]
    if C.T_MARKOV_W1 in names:
        return None
    hp = load_hparams(metadata, source, names)
    n_vocab = hp.n_vocab
    for name in (C.T_TOKEN_EMBD, C.T_OUTPUT, C.T_SEL_PRED):
        if n_vocab is None and name in tensors:
            n_vocab = int(tensors[name][0][0])
    lines = [f"drafter          {VARIANT_LABELS[hp.variant]}",
             f"block_size       {hp.block_size} (drafts up to {hp.max_draft} tokens per step)",
             f"target_layers    {list(hp.target_layers)}",
             f"mask_token       {hp.mask_token}",
             f"layers           {hp.n_layer} x (n_embd {hp.n_embd}, heads {hp.n_head}/{hp.n_head_kv}, "
             f"head_dim {hp.head_dim}, n_ff {hp.n_ff})",
             f"n_vocab          {n_vocab if n_vocab is not None else '- (the target head, no vocabulary tensor)'}"]
    if C.T_D2T in tensors and C.T_D2T not in claimed:
        lines.append(f"reduced_vocab    d2t ({tensors[C.T_D2T][0][0]} ids): plinth-dflash drafts over the full "
                     "vocabulary only")
    elif C.T_D2T not in tensors:
        lines.append("reduced_vocab    no (no d2t)")
    if hp.sliding_window:
        lines.append(f"sliding_window   {hp.sliding_window} on layers "
                     f"{[i for i, w in enumerate(hp.swa_layers) if w]}")
    if any(hp.causal_layers):
        lines.append(f"causal_layers    {[i for i, c in enumerate(hp.causal_layers) if c]}")
    if hp.swa_rope:
        lines.append(f"sliding_layers   head_dim {hp.hd(hp.swa_layers.index(True))}, RoPE base {hp.rope_base_swa:g} "
                     f"over {hp.n_rot_swa or hp.n_rot} dims (no rope_freqs)")
    if hp.head_count_kv:
        lines.append(f"kv_heads         per layer {list(hp.head_count_kv)}")
    k_eq_v = [il for il in range(hp.n_layer) if f"blk.{il}.attn_v.weight" not in tensors]
    if k_eq_v or hp.value_norm:
        lines.append(f"values           {'K = V (no attn_v) on layers ' + str(k_eq_v) if k_eq_v else 'own attn_v'}"
                     f"{'; every V through an RMSNorm' if hp.value_norm else '; those V through an RMSNorm'}")
    if hp.variant == "dflash2":
        lines.append(f"selector         rank {hp.selector_rank}, top-k {hp.selector_top_k}; conv kernel "
                     f"{hp.conv_kernel}, group {hp.conv_group}")
    if hp.lilicorr is not None:
        lh = hp.lilicorr
        lines.append(f"lilicorr         top-k {lh.top_k}, {lh.n_layer} layers x hidden {lh.hidden}, "
                     f"heads {lh.n_head}, factor_dim {lh.factor_dim}")
    return lines

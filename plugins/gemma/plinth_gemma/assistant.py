"""gemma4-assistant: Gemma 4's drafter (transformers' ``Gemma4AssistantForCausalLM``), as a plinth drafter.

The assistant keeps no K/V of its own: each of its layers computes only Q and attends to the K/V the
*target* stored for its last sliding and last full layer that keep K/V (the "store" layers; for a
target without KV sharing, its last sliding and last full layers). One draft step, with ``t`` the
last token (at position ``p``), ``h`` the target's final hidden state (after its output norm) of the
row that produced ``t``, and ``E_t`` the target's hidden size::

    x = pre_proj(concat(target_embd[t] * sqrt(E_t), h))                  # [2 E_t] -> [E]
    per layer:  q = rope(q_norm(attn_q(attn_norm(x))), p)               # sliding or full RoPE
                a = attn_output(attend(q, K_store, V_store))            # scale 1, keys at positions < p
                x = x + post_attention_norm(a)
                x = x + post_ffw_norm(ffn_down(gelu_tanh(ffn_gate(n)) * ffn_up(n))),  n = ffn_norm(x)
                x = x * layer_output_scale
    y = output_norm(x);  logits = token_embd @ y (tied, no soft-capping);  h = post_proj(y)   # [E] -> [E_t]

then ``t = argmax(logits)`` and the next step runs with the same position ``p`` (the assistant's
position never moves inside a draft, as transformers and llama.cpp do it). A sliding layer sees the
keys with ``p - pos < sliding_window`` (llama.cpp's window); a full layer every key before ``p``.
With ``masked_embd_centroids`` / ``masked_embd_ordering`` (transformers' ``use_ordered_embeddings``)
the logits are computed only for the tokens of the ``centroid_top_k`` best centroid clusters, the
others set below them, as transformers does (llama.cpp skips those tensors and uses the whole head;
greedy drafts differ only where the best token lies outside the chosen clusters).

The GGUF layout is llama.cpp's (``src/models/gemma4-assistant.cpp``): architecture
``gemma4-assistant``, the gemma4 keys plus ``embedding_length_out`` (the target's hidden size) and
``nextn_predict_layers`` (= ``block_count``), tensors ``token_embd``, ``output_norm``,
``nextn.pre_projection``, ``nextn.post_projection``, ``rope_freqs`` and per layer ``attn_norm``,
``attn_q``, ``attn_q_norm``, ``attn_output``, ``post_attention_norm``, ``ffn_norm``,
``ffn_{gate,up,down}``, ``post_ffw_norm``, ``layer_output_scale``; with ``--option centroids=yes``
plinth's converter also writes the centroid tensors (``gemma4-assistant.centroid_top_k``: plinth's key).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from plinth import ops
from plinth.errors import UserError
from plinth.speculative.base import BaseDrafter, Draft, DrafterRequirements, TargetOutput

ARCH = "gemma4-assistant"

T_PRE, T_POST = "nextn.pre_projection.weight", "nextn.post_projection.weight"
T_CENTROIDS, T_ORDERING = "masked_embd_centroids.weight", "masked_embd_ordering"
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_q_norm", "attn_output", "post_attention_norm", "ffn_norm", "ffn_gate",
                 "ffn_up", "ffn_down", "post_ffw_norm", "layer_output_scale")

#: keys read (under ``gemma4-assistant.``); any other key of the architecture is refused by name
KEYS = {"block_count", "context_length", "embedding_length", "embedding_length_out", "feed_forward_length",
        "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
        "attention.key_length_swa", "attention.value_length_swa", "attention.layer_norm_rms_epsilon",
        "attention.sliding_window", "attention.sliding_window_pattern", "attention.shared_kv_layers",
        "rope.freq_base", "rope.freq_base_swa", "rope.dimension_count", "rope.dimension_count_swa",
        "embedding_length_per_layer_input", "final_logit_softcapping", "nextn_predict_layers", "vocab_size",
        "centroid_top_k"}


class AssistantFormatError(UserError):
    pass


@attrs.frozen
class AssistantHParams:
    n_vocab: int
    n_embd: int
    n_embd_target: int  # embedding_length_out: the target's hidden size
    n_layer: int
    n_head: tuple[int, ...]
    n_head_kv: tuple[int, ...]  # what the target's store layers must have
    n_ff: tuple[int, ...]
    head_dim: int
    head_dim_swa: int
    n_rot: int
    n_rot_swa: int
    norm_eps: float
    rope_base: float
    rope_base_swa: float
    swa: tuple[bool, ...]
    sliding_window: int
    centroid_top_k: int = 0

    def hd(self, il: int) -> int:
        return self.head_dim_swa if self.swa[il] else self.head_dim


def _per_layer(value: Any, n: int, key: str, source: str) -> tuple[int, ...]:
    if isinstance(value, (list, tuple, np.ndarray)):
        v = [int(x) for x in value]
        if len(v) != n:
            raise AssistantFormatError(f"{source}: key '{ARCH}.{key}' holds {len(v)} values, expected {n}")
        return tuple(v)
    return (int(value),) * n


def load_hparams(md: Mapping[str, Any], source: str, n_vocab: int) -> AssistantHParams:
    if md.get("general.architecture") != ARCH:
        raise AssistantFormatError(f"{source}: architecture {md.get('general.architecture')!r}, not {ARCH!r}")
    p = ARCH + "."
    unknown = sorted(k for k in md if k.startswith(p) and k[len(p):] not in KEYS)
    if unknown:
        raise AssistantFormatError(f"{source}: key(s) plinth's gemma4-assistant does not read: {', '.join(unknown)}")

    def get(key: str, default: Any = None) -> Any:
        if p + key in md:
            v = md[p + key]
            return v.tolist() if hasattr(v, "tolist") else v
        if default is None:
            raise AssistantFormatError(f"{source}: missing required key '{p}{key}'")
        return default

    n_layer = int(get("block_count"))
    for key in ("nextn_predict_layers", "attention.shared_kv_layers"):
        if int(get(key, n_layer)) != n_layer:
            raise AssistantFormatError(f"{source}: key '{p}{key}' = {get(key)}: a Gemma 4 assistant runs all its "
                                       f"{n_layer} layers on the target's K/V")
    for key in ("embedding_length_per_layer_input",):
        if int(get(key, 0)):
            raise AssistantFormatError(f"{source}: key '{p}{key}' = {get(key)}: a Gemma 4 assistant has no "
                                       "per-layer embeddings")
    swa = get("attention.sliding_window_pattern")
    if not isinstance(swa, (list, tuple)) or len(swa) != n_layer:
        raise AssistantFormatError(f"{source}: key '{p}attention.sliding_window_pattern' must hold {n_layer} booleans")
    hd, hd_swa = int(get("attention.key_length")), int(get("attention.key_length_swa", get("attention.key_length")))
    for key, k in (("attention.value_length", hd), ("attention.value_length_swa", hd_swa)):
        if int(get(key, k)) != k:
            raise AssistantFormatError(f"{source}: key '{p}{key}' differs from the key length {k}")
    n_embd, n_out = int(get("embedding_length")), int(get("embedding_length_out"))
    n_head = _per_layer(get("attention.head_count"), n_layer, "attention.head_count", source)
    return AssistantHParams(
        n_vocab=int(get("vocab_size", n_vocab)), n_embd=n_embd, n_embd_target=n_out, n_layer=n_layer, n_head=n_head,
        n_head_kv=_per_layer(get("attention.head_count_kv", list(n_head)), n_layer, "attention.head_count_kv", source),
        n_ff=_per_layer(get("feed_forward_length"), n_layer, "feed_forward_length", source),
        head_dim=hd, head_dim_swa=hd_swa, n_rot=int(get("rope.dimension_count", hd)),
        n_rot_swa=int(get("rope.dimension_count_swa", hd_swa)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")), rope_base=float(get("rope.freq_base", 1e6)),
        rope_base_swa=float(get("rope.freq_base_swa", 1e4)), swa=tuple(bool(s) for s in swa),
        sliding_window=int(get("attention.sliding_window")), centroid_top_k=int(get("centroid_top_k", 0)))


def tensor_shapes(hp: AssistantHParams, centroids: int | None) -> dict[str, tuple[int, ...]]:
    """Every tensor a gemma4-assistant file may hold, with its numpy shape."""
    e = hp.n_embd
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (hp.n_vocab, e), "output_norm.weight": (e,),
                                       T_PRE: (e, 2 * hp.n_embd_target), T_POST: (hp.n_embd_target, e)}
    if not all(hp.swa):
        out["rope_freqs.weight"] = (hp.head_dim // 2,)
    if centroids is not None:
        out[T_CENTROIDS] = (centroids, e)
        out[T_ORDERING] = (hp.n_vocab,)
    for il in range(hp.n_layer):
        b, hd, nq = f"blk.{il}.", hp.hd(il), hp.n_head[il] * hp.hd(il)
        out.update({b + "attn_norm.weight": (e,), b + "attn_q.weight": (nq, e), b + "attn_q_norm.weight": (hd,),
                    b + "attn_output.weight": (e, nq), b + "post_attention_norm.weight": (e,),
                    b + "ffn_norm.weight": (e,), b + "ffn_gate.weight": (hp.n_ff[il], e),
                    b + "ffn_up.weight": (hp.n_ff[il], e), b + "ffn_down.weight": (e, hp.n_ff[il]),
                    b + "post_ffw_norm.weight": (e,), b + "layer_output_scale.weight": (1,)})
    return out


@attrs.frozen
class AssistantFile:
    path: Path
    hparams: AssistantHParams
    weights: dict[str, np.ndarray]


def load_assistant(path: str | Path) -> AssistantFile:
    from plinth.gguf import GGUFFile, quants

    path = Path(path)
    if not path.is_file():
        raise AssistantFormatError(f"draft file {path} does not exist")
    gf = GGUFFile(path)
    md = dict(gf.metadata)
    if "token_embd.weight" not in gf.tensors:
        raise AssistantFormatError(f"{path}: missing tensor 'token_embd.weight'")
    hp = load_hparams(md, str(path), int(gf.tensors["token_embd.weight"].shape[0]))
    centroids = gf.tensors.get(T_CENTROIDS)
    if (centroids is None) != (T_ORDERING not in gf.tensors):
        raise AssistantFormatError(f"{path}: '{T_CENTROIDS}' and '{T_ORDERING}' come together (one is missing)")
    want = tensor_shapes(hp, None if centroids is None else int(centroids.shape[0]))
    extra = sorted(set(gf.tensors) - set(want))
    if extra:
        raise AssistantFormatError(f"{path}: tensor(s) a gemma4-assistant does not read: {', '.join(extra)}")
    weights = {}
    for name, shape in want.items():
        if name not in gf.tensors:
            raise AssistantFormatError(f"{path}: missing tensor {name!r}")
        info, raw = gf.tensors[name], gf.raw(name)
        if info.type_name in ("I64", "I32"):
            arr = np.asarray(raw, dtype=np.int64)
        else:
            arr = np.asarray(raw if info.type_name == "F32" else quants.dequantize(raw, info.ggml_type, info.shape),
                             dtype=np.float32)
        if tuple(arr.shape) != shape:
            raise AssistantFormatError(f"{path}: tensor {name!r} has shape {tuple(arr.shape)}, expected {shape}")
        weights[name] = arr
    if centroids is not None:
        n_c = int(centroids.shape[0])
        if hp.n_vocab % n_c or not 0 < hp.centroid_top_k <= n_c:
            raise AssistantFormatError(f"{path}: {n_c} centroids need a vocabulary that is a multiple of them "
                                       f"({hp.n_vocab}) and '{ARCH}.centroid_top_k' in 1..{n_c} "
                                       f"(got {hp.centroid_top_k})")
    return AssistantFile(path, hp, weights)


def store_layers(target_hp: Any) -> dict[bool, int]:
    """{sliding?: layer}: the target's last layer of each kind that keeps its own K/V (what the assistant reads)."""
    out: dict[bool, int] = {}
    for il in range(int(target_hp.n_layer)):
        if target_hp.kv_source[il] == il:
            out[bool(target_hp.swa[il])] = il
    return out


class AssistantGraph:
    """The assistant's forward on one row at a time (numpy)."""

    def __init__(self, f: AssistantFile) -> None:
        hp, w = f.hparams, f.weights
        self.hp, self.w = hp, w
        self.rope = {True: ops.RopeCache(ops.rope_freqs(hp.n_rot_swa, base=hp.rope_base_swa)),
                     False: None if all(hp.swa) else ops.RopeCache(ops.rope_freqs(
                         hp.n_rot, base=hp.rope_base, freq_factors=w["rope_freqs.weight"][:hp.n_rot // 2]))}
        self.ordering = None
        if T_CENTROIDS in w:
            n_c = w[T_CENTROIDS].shape[0]
            self.ordering = w[T_ORDERING].reshape(n_c, hp.n_vocab // n_c)

    def step(self, x: np.ndarray, pos: int, kv: Mapping[bool, tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """x: [n_embd] after pre_proj -> the last residual [n_embd]; kv: {sliding?: (K, V)} already cut to the
        keys this position sees."""
        hp, w, eps = self.hp, self.w, self.hp.norm_eps
        x = x[None, :]
        for il in range(hp.n_layer):
            b, hd, n_head, swa = f"blk.{il}.", hp.hd(il), hp.n_head[il], hp.swa[il]
            q = ops.linear(ops.rms_norm(x, w[b + "attn_norm.weight"], eps), w[b + "attn_q.weight"])
            q = ops.head_rms_norm(q.reshape(1, n_head, hd), w[b + "attn_q_norm.weight"], eps)
            q = ops.apply_rope(q, mode="neox", cos_sin=self.rope[swa](np.asarray([pos])))
            k, v = kv[swa]
            n_kv = k.shape[1]
            qg = q[0].reshape(n_kv, n_head // n_kv, hd)  # [kv head, group, hd]
            s = np.einsum("hgd,nhd->hgn", qg, k)  # scale 1
            a = np.einsum("hgn,nhd->hgd", ops.softmax(s, axis=-1), v).reshape(1, n_head * hd)
            x = x + ops.rms_norm(ops.linear(a, w[b + "attn_output.weight"]), w[b + "post_attention_norm.weight"], eps)
            n = ops.rms_norm(x, w[b + "ffn_norm.weight"], eps)
            f = ops.gelu(ops.linear(n, w[b + "ffn_gate.weight"])) * ops.linear(n, w[b + "ffn_up.weight"])
            x = x + ops.rms_norm(ops.linear(f, w[b + "ffn_down.weight"]), w[b + "post_ffw_norm.weight"], eps)
            x = x * w[b + "layer_output_scale.weight"]
        return x[0]

    def logits(self, y: np.ndarray) -> np.ndarray:
        """[n_vocab] of the normed last residual ``y``: the tied head, or only the chosen clusters' tokens."""
        emb = self.w["token_embd.weight"]
        if self.ordering is None:
            return emb @ y
        top = np.argsort(-(self.w[T_CENTROIDS] @ y), kind="stable")[:self.hp.centroid_top_k]
        ids = self.ordering[top].reshape(-1)
        sel = emb[ids] @ y
        out = np.full(self.hp.n_vocab, sel.min() - 1.0, dtype=np.float32)
        out[ids] = sel
        return out

    def draft_step(self, token_embd: np.ndarray, h: np.ndarray, pos: int,
                   kv: Mapping[bool, tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """(logits [n_vocab], next h [n_embd_target]) of one draft step; ``token_embd`` already scaled."""
        w = self.w
        x = ops.linear(np.concatenate([token_embd, h]).astype(np.float32)[None], w[T_PRE])[0]
        y = ops.rms_norm(self.step(x, pos, kv)[None], w["output_norm.weight"], self.hp.norm_eps)[0]
        return self.logits(y), ops.linear(y[None], w[T_POST])[0]


class Gemma4AssistantDrafter(BaseDrafter):
    """``--spec gemma4-assistant --draft FILE.gguf`` on a gemma4 target. ``p_min``: stop the draft at the first
    token whose probability (softmax of the draft logits) is below it; ``n_min``: drop drafts shorter than it."""

    name = "gemma4-assistant"

    def __init__(self, target: Any, draft: AssistantFile, *, n_min: int = 0, p_min: float = 0.0) -> None:
        hp = draft.hparams
        self.n_min, self.p_min = int(n_min), float(p_min)
        src = draft.path.name
        if getattr(target, "arch", None) != "gemma4":
            raise UserError(f"gemma4-assistant drafter ({src}): the target is {getattr(target, 'arch', '?')!r}; a Gemma 4 "
                            "assistant attends to a gemma4 target's stored K/V")
        thp = target.hparams
        if hp.n_embd_target != int(thp.n_embd):
            raise UserError(f"gemma4-assistant drafter ({src}): made for a target of hidden size {hp.n_embd_target}, "
                            f"the target ({target.arch}) has {thp.n_embd}")
        if hp.n_vocab != int(target.n_vocab):
            raise UserError(f"gemma4-assistant drafter ({src}): vocabulary of {hp.n_vocab} tokens, the target has "
                            f"{target.n_vocab}")
        self.store = store_layers(thp)
        for il in range(hp.n_layer):
            swa = hp.swa[il]
            kind = "sliding" if swa else "full"
            if swa not in self.store:
                raise UserError(f"gemma4-assistant drafter ({src}): layer {il} is {kind} attention, but the target "
                                f"has no {kind} layer keeping K/V")
            t = self.store[swa]
            t_hd, t_kv = int(thp.hd(t)), int(thp.n_head_kv[t])
            if hp.hd(il) != t_hd or hp.n_head[il] % t_kv:
                raise UserError(f"gemma4-assistant drafter ({src}): layer {il} ({kind}) has {hp.n_head[il]} heads of "
                                f"size {hp.hd(il)}; the target's layer {t} stores {t_kv} K/V heads of size {t_hd}")
            if swa and hp.sliding_window != int(thp.sliding_window):
                raise UserError(f"gemma4-assistant drafter ({src}): sliding window {hp.sliding_window}, the "
                                f"target's is {thp.sliding_window}")
        self.target, self.draft_file = target, draft
        self.graph = AssistantGraph(draft)
        self.view = target.target_view()
        self.host = target.backend.to_numpy  # the assistant computes on the host (see the plugin README)
        self.embd_scale = np.float32(math.sqrt(int(thp.n_embd)))
        self.n_layer_target = int(thp.n_layer)
        self._h: dict[int, tuple[int, np.ndarray]] = {}  # seq -> (position of the row, its normed hidden)
        self._verify: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # seq -> (positions, normed hidden rows)
        self._kv: dict[int, dict[int, Any]] = {}

    def requirements(self) -> DrafterRequirements:
        return DrafterRequirements(taps=(self.n_layer_target,), n_embd=self.draft_file.hparams.n_embd_target,
                                   target_kv=tuple(sorted(set(self.store.values()))))

    def begin(self, seq: int, prompt_ids: Sequence[int]) -> None:
        self.end(seq)

    def end(self, seq: int) -> None:
        self._h.pop(seq, None)
        self._verify.pop(seq, None)
        self._kv.pop(seq, None)

    def process(self, out: TargetOutput) -> None:
        if out.has_embeddings:
            self.end(out.seq)
            return
        rows = out.features.get(self.n_layer_target)
        if rows is None or not len(out.positions):
            return
        self._kv[out.seq] = out.kv
        if out.phase == "verify":
            self._verify[out.seq] = (np.asarray(out.positions), rows)
        else:
            h = np.asarray(self.host(self.view.final_norm(rows[-1:])), dtype=np.float32)[0]
            self._h[out.seq] = (int(out.positions[-1]), h)

    def accept(self, seq: int, n_accepted: int) -> None:
        got = self._verify.pop(seq, None)
        if got is None:
            return
        pos, rows = got
        i = min(int(n_accepted), len(pos) - 1)
        h = np.asarray(self.host(self.view.final_norm(rows[i:i + 1])), dtype=np.float32)[0]
        self._h[seq] = (int(pos[i]), h)

    def embed(self, tok: int) -> np.ndarray:
        """The target's input row of ``tok``: its embedding times sqrt(target hidden size)."""
        return np.asarray(self.host(self.view.embed([tok])), dtype=np.float32)[0] * self.embd_scale

    def keys(self, seq: int, pos: int) -> dict[bool, tuple[np.ndarray, np.ndarray]] | None:
        """{sliding?: (K, V)} of the target's store layers, the keys position ``pos`` sees."""
        views = self._kv.get(seq)
        if not views:
            return None
        out = {}
        for swa, il in self.store.items():
            k, v, p = views[il].read()
            p = np.asarray(p)
            keep = p < pos
            if swa:
                keep &= pos - p < self.draft_file.hparams.sliding_window
            k, v = (np.asarray(self.host(a), dtype=np.float32)[keep] for a in (k, v))
            out[swa] = (k, v)
        return out

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        got = self._h.get(seq)
        if got is None or got[0] != pos - 1 or n_max <= 0:
            return Draft()
        kv = self.keys(seq, pos)
        if kv is None:
            return Draft()
        h, tok, out = got[1], int(history[-1]), []
        conf = []
        for _ in range(n_max):
            logits, h = self.graph.draft_step(self.embed(tok), h, pos, kv)
            tok = int(np.argmax(logits))
            p = float(1.0 / np.sum(np.exp(logits.astype(np.float64) - float(logits[tok]))))  # softmax at the argmax
            if p < self.p_min:
                break
            out.append(tok)
            conf.append(p)
        if len(out) < max(self.n_min, 1):
            return Draft()
        return Draft(tokens=tuple(out), confidences=np.asarray(conf))

    def draft_logits(self, seq: int, pos: int, tokens: Sequence[int]) -> np.ndarray:
        """Logits [len(tokens), n_vocab] of draft steps fed ``tokens`` in turn (tests: teacher-forced)."""
        h, kv, rows = self._h[seq][1], self.keys(seq, pos), []
        for tok in tokens:
            logits, h = self.graph.draft_step(self.embed(int(tok)), h, pos, kv)
            rows.append(logits)
        return np.stack(rows)


def describe(metadata: Mapping[str, Any], tensors: Mapping[str, tuple[tuple[int, ...], str]],
             source: str) -> list[str]:
    """``plinth info`` lines for a gemma4-assistant GGUF (nothing loaded)."""
    emb = tensors.get("token_embd.weight")
    hp = load_hparams(metadata, source, int(emb[0][0]) if emb is not None else -1)
    kinds = " ".join("S" if s else "F" for s in hp.swa)
    lines = ["drafter          gemma4-assistant (Gemma 4's assistant; --spec gemma4-assistant)",
             f"target           gemma4 of hidden size {hp.n_embd_target}, reading the K/V of its last sliding and "
             "last full layer that keep K/V",
             f"layers           {hp.n_layer} x (n_embd {hp.n_embd}, {kinds}, heads {hp.n_head[0]} over "
             f"{hp.n_head_kv[0]} K/V heads, head_dim {hp.head_dim_swa} / {hp.head_dim}, n_ff {hp.n_ff[0]})",
             f"sliding_window   {hp.sliding_window}",
             f"n_vocab          {hp.n_vocab}"]
    if T_CENTROIDS in tensors:
        lines.append(f"head             centroid-masked: {tensors[T_CENTROIDS][0][0]} clusters, the best "
                     f"{hp.centroid_top_k} scored")
    else:
        lines.append("head             the whole tied embedding")
    return lines


def make_gemma4_assistant(target: Any, options: Mapping[str, Any]) -> Gemma4AssistantDrafter:
    path = options.get("draft")
    if not path:
        raise UserError("the gemma4-assistant drafter needs its GGUF: pass --draft FILE.gguf (option 'draft')")
    be = options.get("backend")
    if isinstance(be, str) and be != getattr(target.backend, "name", be):
        raise UserError(f"the gemma4-assistant drafter follows the target's backend ({target.backend.name}); backend "
                        f"{be!r} was asked for")
    return Gemma4AssistantDrafter(target, load_assistant(path), n_min=int(options.get("n_min") or 0),
                                  p_min=float(options.get("p_min") or 0.0))


# --------------------------------------------------------------------------- converter

NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "",  # tied
    "pre_projection.weight": T_PRE,
    "post_projection.weight": T_POST,
    "masked_embedding.centroids.weight": T_CENTROIDS,
    "masked_embedding.token_ordering": T_ORDERING,
    "model.layers.{layer}.input_layernorm.weight": "blk.{layer}.attn_norm.weight",
    "model.layers.{layer}.self_attn.q_proj.weight": "blk.{layer}.attn_q.weight",
    "model.layers.{layer}.self_attn.q_norm.weight": "blk.{layer}.attn_q_norm.weight",
    "model.layers.{layer}.self_attn.o_proj.weight": "blk.{layer}.attn_output.weight",
    "model.layers.{layer}.post_attention_layernorm.weight": "blk.{layer}.post_attention_norm.weight",
    "model.layers.{layer}.pre_feedforward_layernorm.weight": "blk.{layer}.ffn_norm.weight",
    "model.layers.{layer}.post_feedforward_layernorm.weight": "blk.{layer}.post_ffw_norm.weight",
    "model.layers.{layer}.mlp.gate_proj.weight": "blk.{layer}.ffn_gate.weight",
    "model.layers.{layer}.mlp.up_proj.weight": "blk.{layer}.ffn_up.weight",
    "model.layers.{layer}.mlp.down_proj.weight": "blk.{layer}.ffn_down.weight",
    "model.layers.{layer}.layer_scalar": "blk.{layer}.layer_output_scale.weight",
}


class Gemma4AssistantConverter:
    """``Gemma4AssistantForCausalLM`` folder -> ``gemma4-assistant`` GGUF (llama.cpp's keys and names).

    ``--option centroids=yes`` also writes the centroid tensors of ``use_ordered_embeddings`` (plinth drafts
    from the chosen clusters as transformers does; llama.cpp 0.3.36 cannot open such a file). By default
    they are left out as llama.cpp's converter does, and the file opens in llama.cpp."""

    hf_arch = "Gemma4AssistantForCausalLM"

    def convert(self, model_dir: str, out_path: str, options: Mapping[str, Any]) -> list[str]:
        from plinth.convert import SafetensorsDir, map_names, read_config, write_gguf

        from .convert import gguf_metadata, tokenizer_metadata

        unknown = sorted(set(options) - {"centroids"})
        if unknown:
            raise UserError(f"the gemma4-assistant converter takes only --option centroids=yes|no, got {unknown}")
        centroids = str(options.get("centroids", "no")).lower()
        if centroids not in ("yes", "no"):
            raise UserError(f"--option centroids={options['centroids']}: expected yes or no")
        cfg = read_config(model_dir)
        source = str(Path(model_dir) / "config.json")
        text = dict(cfg.get("text_config") or {})
        if not text:
            raise UserError(f"{source}: no text_config; a Gemma4AssistantForCausalLM config holds one")
        n_layer = int(text.get("num_hidden_layers", 0))
        for key, ok in (("hidden_size_per_layer_input", (0, None)), ("enable_moe_block", (False, None)),
                        ("use_double_wide_mlp", (False, None)), ("attention_k_eq_v", (False, None))):
            if text.get(key) not in ok:
                raise UserError(f"{source}: text_config.{key} = {text.get(key)!r}: a Gemma 4 assistant has none")
        if int(text.get("num_kv_shared_layers") or n_layer) != n_layer:
            raise UserError(f"{source}: text_config.num_kv_shared_layers = {text.get('num_kv_shared_layers')}: every "
                            f"layer of a Gemma 4 assistant reads the target's K/V ({n_layer} layers)")
        if not cfg.get("tie_word_embeddings", True):
            raise UserError(f"{source}: tie_word_embeddings = false: the assistant's head is its embedding")
        text["num_kv_shared_layers"] = 0  # (gemma4's key check needs one layer keeping K/V; set below)
        md0, layout = gguf_metadata(text, source)
        notes: list[str] = []
        md = {k.replace("gemma4.", ARCH + ".", 1): v for k, v in md0.items()}
        md["general.architecture"] = ARCH
        md[f"{ARCH}.attention.shared_kv_layers"] = n_layer
        md[f"{ARCH}.embedding_length_out"] = int(cfg.get("backbone_hidden_size", 1536))
        md[f"{ARCH}.nextn_predict_layers"] = n_layer
        st = SafetensorsDir(model_dir)
        names = map_names(list(st.names()), NAMES, str(model_dir))
        tensors: dict[str, np.ndarray] = {}
        for hf, gg in names.items():
            if gg:
                tensors[gg] = st.get(hf)
        if cfg.get("use_ordered_embeddings") and centroids == "no":
            for name in (T_CENTROIDS, T_ORDERING):
                tensors.pop(name, None)
            notes.append("masked_embedding tensors left out, as llama.cpp's converter does (the draft logits cover the "
                         "whole head; llama.cpp cannot open a file with them): --option centroids=yes keeps them, "
                         "for transformers' centroid-masked logits in plinth")
        elif cfg.get("use_ordered_embeddings"):
            if T_CENTROIDS not in tensors or T_ORDERING not in tensors:
                raise UserError(f"{model_dir}: use_ordered_embeddings needs masked_embedding.centroids.weight and "
                                "masked_embedding.token_ordering")
            md[f"{ARCH}.centroid_top_k"] = int(cfg.get("centroid_intermediate_top_k", 32))
            tensors[T_ORDERING] = np.asarray(tensors[T_ORDERING], dtype=np.int32)
        else:
            for name in (T_CENTROIDS, T_ORDERING):
                if tensors.pop(name, None) is not None:
                    notes.append(f"{name} left out: use_ordered_embeddings is false (the head is the whole "
                                 "embedding)")
        for il in range(n_layer):
            name = f"blk.{il}.layer_output_scale.weight"
            if name in tensors:
                tensors[name] = np.asarray(tensors[name], dtype=np.float32).reshape(1)
        if any(not s for s in md[f"{ARCH}.attention.sliding_window_pattern"]):
            tensors["rope_freqs.weight"] = layout["rope_freqs"]
        if (Path(model_dir) / "tokenizer.json").is_file():
            md.update(tokenizer_metadata(model_dir, text, layout["n_vocab"]))
        else:
            md[f"{ARCH}.vocab_size"] = layout["n_vocab"]
            notes.append("no tokenizer.json: the file carries the vocabulary size only (the target's tokenizer is "
                         "used)")
        hp = load_hparams(md, f"converted {model_dir}", layout["n_vocab"])
        want = tensor_shapes(hp, int(tensors[T_CENTROIDS].shape[0]) if T_CENTROIDS in tensors else None)
        for name, shape in want.items():
            if name not in tensors:
                raise UserError(f"{model_dir}: missing tensor for {name!r}")
            if tuple(tensors[name].shape) != shape:
                raise UserError(f"{model_dir}: {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}")
        write_gguf(out_path, md, tensors)
        for note in notes:
            print(f"plinth-gemma: {note}", file=sys.stderr)
        return notes


__all__ = ["ARCH", "AssistantFile", "AssistantGraph", "AssistantHParams", "Gemma4AssistantConverter",
           "Gemma4AssistantDrafter", "load_assistant", "make_gemma4_assistant", "store_layers"]

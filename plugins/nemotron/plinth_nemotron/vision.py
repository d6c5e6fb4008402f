"""Image input of Nemotron-H VL models: the RADIO vision tower, pixel shuffle and the MLP projector.

An image becomes embedding rows of the text model, which enter it through the core's mixed
token / embedding batches (:class:`plinth.graph.Batch` rows with ``is_embd``):

1. preprocessing (:func:`preprocess`): decoded and resized with Pillow (bicubic, antialiased,
   on float pixels), to a patch grid close to the image's own, scaled into
   ``[min_patches, max_patches]`` and rounded to even sides (the pixel shuffle merges 2x2);
   rescaled to [0, 1], normalised with the CLIP mean / std, cut into channel-major patches;
2. the RADIO ViT (:class:`VisionTower`): patch projection, the learned position table
   bilinearly resized to the grid (square to the longer side, then cropped), ``n_prefix``
   class + register tokens in front, pre-norm LayerNorm blocks (bidirectional attention with
   biases, GELU MLP), the prefix dropped; models with an MTP head add a final LayerNorm;
3. pixel shuffle: each 2x2 block of patch features becomes one row of 4 x width;
4. the projector: RMSNorm -> linear -> ReLU² -> linear, giving ``grid / 4`` rows of the text
   model's width.

Weights are numpy arrays under the names of :data:`TENSOR_NAMES` (llama.cpp's mmproj style,
``v.*`` for the tower and ``mm.*`` for the projector). Everything runs in float32 on the host.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from plinth import ops
from plinth.errors import UserError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# ============================================================================ config

@attrs.frozen
class VisionConfig:
    """The vision tower's sizes (``clip.vision.*`` keys in a GGUF; the HF ``vision_config``)."""

    n_embd: int  # vision hidden size
    n_layer: int
    n_head: int
    n_ff: int
    patch_size: int
    n_prefix: int  # class + register tokens
    max_grid: int  # the position table is max_grid x max_grid
    text_n_embd: int
    projector_n_ff: int
    eps: float = 1e-6  # LayerNorm
    projector_eps: float = 1e-5  # the projector's RMSNorm
    downsample_ratio: float = 0.5
    final_norm: bool = False
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    min_patches: int = 1024
    max_patches: int = 13312
    video: bool = False  # the tower has a temporal (video) patch projection

    @property
    def merge(self) -> int:
        return round(1 / self.downsample_ratio)


def tensor_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Name -> numpy-order shape of every tensor the tower and projector need."""
    d, ps = cfg.n_embd, cfg.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "v.patch_embd.weight": (d, 3 * ps * ps),
        "v.position_embd.weight": (cfg.max_grid * cfg.max_grid, d),
        "v.cls_embd.weight": (cfg.n_prefix, d),
        "mm.norm.weight": (d * cfg.merge ** 2,),
        "mm.1.weight": (cfg.projector_n_ff, d * cfg.merge ** 2),
        "mm.2.weight": (cfg.text_n_embd, cfg.projector_n_ff),
    }
    if cfg.final_norm:
        shapes["v.post_ln.weight"] = (d,)
        shapes["v.post_ln.bias"] = (d,)
    for il in range(cfg.n_layer):
        b = f"v.blk.{il}."
        for ln in ("ln1", "ln2"):
            shapes[b + ln + ".weight"] = (d,)
            shapes[b + ln + ".bias"] = (d,)
        for p in ("attn_q", "attn_k", "attn_v", "attn_out"):
            shapes[b + p + ".weight"] = (d, d)
            shapes[b + p + ".bias"] = (d,)
        shapes[b + "ffn_up.weight"] = (cfg.n_ff, d)
        shapes[b + "ffn_up.bias"] = (cfg.n_ff,)
        shapes[b + "ffn_down.weight"] = (d, cfg.n_ff)
        shapes[b + "ffn_down.bias"] = (d,)
    return shapes


OPTIONAL = ("ls1", "ls2")  # per-block LayerScale vectors (absent: identity, as C-RADIO)


# ============================================================================ preprocessing

@attrs.frozen
class ImageInput:
    """patches: [gh * gw, 3 * ps * ps] normalised, channel-major, row-major patch order; grid: (gh, gw)."""

    patches: np.ndarray
    grid: tuple[int, int]

    @property
    def n_rows(self) -> int:
        """Embedding rows this image becomes in the text model (after the 2x2 pixel shuffle)."""
        return self.grid[0] * self.grid[1] // 4


def patch_grid(height: int, width: int, patch: int, merge: int, min_patches: int, max_patches: int) -> tuple[int, int]:
    """The (rows, cols) patch grid an image of height x width is resized to.

    Start from the image's own grid rounded up, scale it down into ``max_patches`` (never up
    past 1), scale it up to ``min_patches`` when smaller, then make both sides multiples of
    ``merge`` (growing a side when the budget allows, else shrinking it).
    """
    gh, gw = round(height / patch + 0.5), round(width / patch + 0.5)
    f = min(math.sqrt(max_patches / (gh * gw)), 1.0)
    gh, gw = math.floor(f * gh), math.floor(f * gw)
    if max_patches > min_patches and gh * gw < min_patches:
        f = math.sqrt(min_patches / (gh * gw))
        gh, gw = math.ceil(f * gh), math.ceil(f * gw)
    if gh % merge:
        gh = gh + merge - gh % merge if (gh + merge - gh % merge) * gw <= max_patches else max(merge, gh - gh % merge)
    if gw % merge:
        gw = gw + merge - gw % merge if gh * (gw + merge - gw % merge) <= max_patches else max(merge, gw - gw % merge)
    return gh, gw


def load_image(path: str | Path) -> np.ndarray:
    """An image file as float32 RGB [3, H, W] in 0..255 (Pillow decodes; any mode is converted to RGB)."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as exc:  # pragma: no cover - Pillow is a dependency of plinth-nemotron
        raise UserError("image input needs Pillow: pip install pillow") from exc
    try:
        with Image.open(path) as im:
            frames = int(getattr(im, "n_frames", 1))
            if frames > 1:
                raise UserError(f"{path}: an image with {frames} frames; video input is not supported by "
                                "plinth-nemotron (images only)")
            im.load()
            rgb = im.convert("RGB")
    except FileNotFoundError:
        raise UserError(f"{path}: image file not found") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise UserError(f"{path}: not a readable image ({type(exc).__name__}: {exc})") from None
    return np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1).copy()


def resize_bicubic(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """[C, H, W] float32 -> [C, height, width]: Pillow's antialiased bicubic on float ("F") planes."""
    from PIL import Image

    if image.shape[1:] == (height, width):
        return image
    planes = [np.asarray(Image.fromarray(np.ascontiguousarray(c), mode="F").resize((width, height),
                                                                                  Image.Resampling.BICUBIC))
              for c in image]
    return np.stack(planes).astype(np.float32)


def preprocess(image: np.ndarray, cfg: VisionConfig, max_patches: int | None = None) -> ImageInput:
    """[3, H, W] float pixels 0..255 -> normalised patches on the tower's grid."""
    ps, merge = cfg.patch_size, cfg.merge
    budget = max(cfg.min_patches, min(max_patches or cfg.max_patches, cfg.max_patches))
    gh, gw = patch_grid(image.shape[1], image.shape[2], ps, merge, cfg.min_patches, budget)
    x = resize_bicubic(image, gh * ps, gw * ps) / np.float32(255.0)
    x = (x - np.asarray(cfg.image_mean, np.float32)[:, None, None]) / np.asarray(cfg.image_std, np.float32)[:, None,
                                                                                                          None]
    patches = x.reshape(3, gh, ps, gw, ps).transpose(1, 3, 0, 2, 4).reshape(gh * gw, 3 * ps * ps)
    return ImageInput(np.ascontiguousarray(patches, dtype=np.float32), (gh, gw))


# ============================================================================ the tower

def _linear_resize_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in]: 1-D linear interpolation with half-pixel centres (align_corners=False)."""
    src = np.maximum((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0.0)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    w1 = src - i0
    m = np.zeros((n_out, n_in), np.float64)
    m[np.arange(n_out), i0] += 1.0 - w1
    m[np.arange(n_out), i1] += w1
    return m


def pixel_shuffle(features: np.ndarray, gh: int, gw: int) -> np.ndarray:
    """[gh * gw, D] patch features -> [gh/2 * gw/2, 4D]: each 2x2 block merged (the reference's channel order)."""
    d = features.shape[1]
    x = features.reshape(gh, gw // 2, 2 * d).transpose(1, 0, 2)
    x = np.ascontiguousarray(x).reshape(gw // 2, gh // 2, 4 * d).transpose(1, 0, 2)
    return np.ascontiguousarray(x).reshape(-1, 4 * d)


class VisionTower:
    """The RADIO ViT and the projector. weights: name -> float32 array (see :func:`tensor_shapes`)."""

    def __init__(self, cfg: VisionConfig, weights: Mapping[str, np.ndarray], source: str = "vision tower") -> None:
        self.cfg = cfg
        shapes = tensor_shapes(cfg)
        for name, shape in shapes.items():
            if name not in weights:
                raise UserError(f"{source}: missing vision tensor '{name}'")
            if tuple(weights[name].shape) != shape:
                raise UserError(f"{source}: vision tensor '{name}' has shape {tuple(weights[name].shape)}, "
                                f"expected {shape}")
        self.w = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
        self._pos: dict[tuple[int, int], np.ndarray] = {}

    def position_table(self, gh: int, gw: int) -> np.ndarray:
        """[gh * gw, D]: the learned table resized (bilinear) to m x m, m = max(gh, gw), then cropped."""
        if (gh, gw) not in self._pos:
            g, m = self.cfg.max_grid, max(gh, gw)
            table = self.w["v.position_embd.weight"].reshape(g, g, -1).astype(np.float64)
            r = _linear_resize_matrix(g, m)
            resized = np.einsum("ij,jkd,lk->ild", r, table, r)[:gh, :gw]
            self._pos[(gh, gw)] = resized.reshape(gh * gw, -1).astype(np.float32)
        return self._pos[(gh, gw)]

    def features(self, image: ImageInput) -> np.ndarray:
        """[gh * gw, D]: the tower's output for the patches (prefix tokens dropped, final norm applied)."""
        cfg, w = self.cfg, self.w
        gh, gw = image.grid
        x = ops.linear(image.patches, w["v.patch_embd.weight"]) + self.position_table(gh, gw)
        x = np.concatenate([w["v.cls_embd.weight"], x])
        n, h = x.shape[0], cfg.n_head
        hd = cfg.n_embd // h
        for il in range(cfg.n_layer):
            b = f"v.blk.{il}."
            y = ops.layer_norm(x, w[b + "ln1.weight"], w[b + "ln1.bias"], cfg.eps)
            q = ops.linear(y, w[b + "attn_q.weight"], w[b + "attn_q.bias"]).reshape(n, h, hd)
            k = ops.linear(y, w[b + "attn_k.weight"], w[b + "attn_k.bias"]).reshape(n, h, hd)
            v = ops.linear(y, w[b + "attn_v.weight"], w[b + "attn_v.bias"]).reshape(n, h, hd)
            a = ops.attention(q, k, v, scale=hd ** -0.5, causal=False).reshape(n, -1)
            a = ops.linear(a, w[b + "attn_out.weight"], w[b + "attn_out.bias"])
            x = x + (a * w[b + "ls1"] if b + "ls1" in w else a)
            y = ops.layer_norm(x, w[b + "ln2.weight"], w[b + "ln2.bias"], cfg.eps)
            f = ops.linear(ops.gelu_erf(ops.linear(y, w[b + "ffn_up.weight"], w[b + "ffn_up.bias"])),
                           w[b + "ffn_down.weight"], w[b + "ffn_down.bias"])
            x = x + (f * w[b + "ls2"] if b + "ls2" in w else f)
        x = x[cfg.n_prefix:]
        if cfg.final_norm:
            x = ops.layer_norm(x, w["v.post_ln.weight"], w["v.post_ln.bias"], cfg.eps)
        return x

    def embed(self, image: ImageInput) -> np.ndarray:
        """[gh * gw / 4, text n_embd]: the rows the image becomes in the text model."""
        gh, gw = image.grid
        if gh % self.cfg.merge or gw % self.cfg.merge:
            raise UserError(f"image grid {gh}x{gw} is not a multiple of the pixel shuffle's {self.cfg.merge}")
        x = pixel_shuffle(self.features(image), gh, gw)
        w = self.w
        x = ops.rms_norm(x, w["mm.norm.weight"], self.cfg.projector_eps)
        return ops.linear(ops.relu2(ops.linear(x, w["mm.1.weight"])), w["mm.2.weight"])


# ============================================================================ the tower's own GGUF (mmproj)

PROJECTOR_TYPE = "nemotron_h_omni"
_KEYS = {"n_embd": "embedding_length", "n_layer": "block_count", "n_head": "attention.head_count",
         "n_ff": "feed_forward_length", "patch_size": "patch_size", "n_prefix": "n_prefix_tokens",
         "max_grid": "max_grid", "text_n_embd": "projection_dim", "projector_n_ff": "projector_ff_length",
         "eps": "attention.layer_norm_epsilon", "projector_eps": "projector_rms_epsilon",
         "downsample_ratio": "downsample_ratio", "final_norm": "final_norm", "image_mean": "image_mean",
         "image_std": "image_std", "min_patches": "min_patches", "max_patches": "max_patches", "video": "video"}


def save_vision_gguf(path: str | Path, cfg: VisionConfig, weights: Mapping[str, np.ndarray]) -> Path:
    """Write the tower and projector as their own GGUF (llama.cpp's mmproj convention: arch ``clip``)."""
    from plinth.convert import write_gguf

    VisionTower(cfg, weights, str(path))  # check names and shapes before writing
    md: dict[str, Any] = {"general.architecture": "clip", "general.name": "nemotron-h-vision",
                          "clip.has_vision_encoder": True, "clip.projector_type": PROJECTOR_TYPE}
    for field, key in _KEYS.items():
        value = getattr(cfg, field)
        md[f"clip.vision.{key}"] = list(value) if isinstance(value, tuple) else value
    return write_gguf(path, md, {k: np.asarray(v, np.float32) for k, v in weights.items()})


def load_vision_gguf(path: str | Path) -> VisionTower:
    """The tower of a vision GGUF written by :func:`save_vision_gguf`; anything else is one named line."""
    from plinth.gguf import GGUFFile

    try:
        gf = GGUFFile(path)
    except FileNotFoundError:
        raise UserError(f"{path}: vision model file not found") from None
    md = gf.metadata
    if md.get("general.architecture") != "clip" or md.get("clip.projector_type") != PROJECTOR_TYPE:
        raise UserError(f"{path}: not a Nemotron-H vision tower (general.architecture "
                        f"{md.get('general.architecture')!r}, clip.projector_type {md.get('clip.projector_type')!r}; "
                        f"expected 'clip' / {PROJECTOR_TYPE!r})")
    fields = {}
    for field, key in _KEYS.items():
        k = f"clip.vision.{key}"
        if k not in md:
            raise UserError(f"{path}: missing required key '{k}'")
        v = md[k]
        if field in ("image_mean", "image_std"):
            fields[field] = tuple(float(x) for x in v)
        else:
            default = getattr(attrs.fields(VisionConfig), field).default
            fields[field] = (int if default is attrs.NOTHING else type(default))(v)
    cfg = VisionConfig(**fields)
    return VisionTower(cfg, {n: np.asarray(gf.raw(n), np.float32) for n in gf.tensors}, str(path))


def image_rows_for(model: Any, tower: VisionTower | None, image_path: str | Path,
                   max_rows: int | None = None) -> np.ndarray:
    """The embedding rows of ``image_path`` for ``model``; refused in one line when the model takes no images."""
    arch = getattr(model, "arch", "?")
    if tower is None or not str(arch).startswith("nemotron_h"):
        raise UserError(f"{getattr(model, 'path', 'the model')}: '{arch}' is a text-only model here (no vision tower "
                        "given); image input needs a Nemotron-H text model and its vision GGUF")
    return encode_image(tower, image_path, int(model.hparams.n_embd), max_rows, str(arch))


def encode_image(tower: VisionTower, image_path: str | Path, n_embd: int, max_rows: int | None = None,
                 what: str = "the text model") -> np.ndarray:
    """[n, n_embd] rows of ``image_path``; the grid is shrunk toward ``max_rows``, refused when it cannot fit."""
    if n_embd != tower.cfg.text_n_embd:
        raise UserError(f"the vision tower projects to width {tower.cfg.text_n_embd}, the text model "
                        f"({what}) has n_embd = {n_embd}; they are not one model")
    budget = None if max_rows is None else max(max_rows, 1) * tower.cfg.merge ** 2
    image = preprocess(load_image(image_path), tower.cfg, budget)
    if max_rows is not None and image.n_rows > max_rows:
        raise UserError(f"{image_path}: the image needs at least {image.n_rows} rows (grid {image.grid[0]}x"
                        f"{image.grid[1]}, min_patches {tower.cfg.min_patches}), more than the {max_rows} positions "
                        "the context leaves; use a larger context")
    return tower.embed(image)


# ============================================================================ prompts with images

def image_prompt(tokens_before: Sequence[int], image_rows: np.ndarray, tokens_after: Sequence[int], *,
                 n_ctx: int, start: int = 0, seq: int = 0) -> Any:
    """A mixed batch: token rows, the image's embedding rows, token rows (logits for the last row).

    Refused with one line when the prompt does not fit in ``n_ctx`` positions.
    """
    from plinth.graph import Batch

    n = len(tokens_before) + len(image_rows) + len(tokens_after)
    if start + n > n_ctx:
        raise UserError(f"the prompt with its image needs {start + n} positions ({len(image_rows)} image rows), "
                        f"more than the context of {n_ctx}; use a smaller image or a larger context")
    parts = []
    pos = start
    if tokens_before:
        parts.append(Batch.from_tokens(list(tokens_before), start=pos, seq=seq, output="none"))
        pos += len(tokens_before)
    parts.append(Batch.from_embeddings(image_rows, start=pos, seq=seq, output="none"))
    pos += len(image_rows)
    if tokens_after:
        parts.append(Batch.from_tokens(list(tokens_after), start=pos, seq=seq, output="none"))
    batch = Batch.concat(parts, n_embd=image_rows.shape[1])
    out = np.zeros(batch.n_rows, bool)
    out[-1] = True
    return attrs.evolve(batch, output=out)


__all__ = ["CLIP_MEAN", "CLIP_STD", "ImageInput", "VisionConfig", "VisionTower", "encode_image", "image_prompt",
           "image_rows_for",
           "load_image", "load_vision_gguf", "patch_grid", "pixel_shuffle", "preprocess", "resize_bicubic",
           "save_vision_gguf", "tensor_shapes"]

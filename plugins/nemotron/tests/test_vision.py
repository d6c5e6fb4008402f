"""Image input of Nemotron-H VL models (the RADIO tower, pixel shuffle, projector, mixed prompts).

The ``ref`` tests build transformers 5.24's ``NemotronH_Omni_Reasoning_V3`` on a tiny random
config (vision parameters redrawn, since transformers initialises biases, norms and LayerScale
to 0 / 1; the text model loaded from the same HF folder plinth converts), and compare:

* the image embeddings after the projector (``get_image_features``) within 1e-4;
* the logits of a mixed prompt (text, the image's embedding rows, text) within 1e-4;
* preprocessing of a 1024x768 PNG made in the test: the patch grid from transformers' own
  ``get_patch_grid_size``, the pixels from torch's antialiased bicubic resize of the float image
  (what transformers' torchvision backend runs), rescale and CLIP normalisation.

The default tests check the named errors and the shapes without torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.errors import UserError
from plinth.testing import load_module
from plinth_nemotron.vision import (ImageInput, VisionConfig, VisionTower, image_prompt, load_image, patch_grid,
                                    pixel_shuffle, preprocess, tensor_shapes)

HERE = Path(__file__).resolve().parent
golden = load_module(HERE / "golden" / "make_golden.py")
mtp_tests = load_module(HERE / "test_mtp.py", "nemotron_test_mtp_for_vision")

VCFG = VisionConfig(n_embd=32, n_layer=2, n_head=4, n_ff=64, patch_size=4, n_prefix=4, max_grid=16, text_n_embd=64,
                    projector_n_ff=48, final_norm=True, min_patches=16, max_patches=256)


def random_tower(cfg: VisionConfig = VCFG, seed: int = 0) -> VisionTower:
    rng = np.random.default_rng(seed)
    w = {k: (rng.standard_normal(s) * (0.2 if len(s) > 1 else 0.05) + (1.0 if "ln" in k or "norm" in k else 0.0))
         .astype(np.float32) for k, s in tensor_shapes(cfg).items()}
    return VisionTower(cfg, w)


def test_patch_grid_rules():
    assert patch_grid(768, 1024, 16, 2, 1024, 13312) == (48, 64)
    assert patch_grid(30, 30, 16, 2, 1024, 13312) == (32, 32)  # scaled up to the minimum budget
    gh, gw = patch_grid(4000, 3000, 16, 2, 1024, 13312)
    assert gh * gw <= 13312 and gh % 2 == 0 and gw % 2 == 0


def test_pixel_shuffle_merges_2x2_blocks():
    f = np.arange(4 * 6 * 2, dtype=np.float32).reshape(24, 2)  # a 4x6 grid of 2-wide features
    out = pixel_shuffle(f, 4, 6)
    assert out.shape == (6, 8)
    grid = f.reshape(4, 6, 2)
    # row 0 holds the top-left 2x2 block: (0,0), (0,1), (1,0), (1,1) (the order the reference test confirms)
    assert out[0].tolist() == np.concatenate([grid[0, 0], grid[0, 1], grid[1, 0], grid[1, 1]]).tolist()


def test_image_rows_enter_a_mixed_batch(tmp_path):
    from PIL import Image

    img = (np.random.default_rng(1).random((40, 52, 3)) * 255).astype(np.uint8)
    Image.fromarray(img).save(tmp_path / "a.png")
    x = preprocess(load_image(tmp_path / "a.png"), VCFG)
    assert x.grid == (10, 14) and x.patches.shape == (140, 48)
    rows = random_tower().embed(x)
    assert rows.shape == (35, 64) and np.isfinite(rows).all()
    batch = image_prompt([1, 2], rows, [3], n_ctx=64)
    assert batch.n_rows == 38 and batch.is_embd.sum() == 35 and batch.output.tolist().count(True) == 1


def test_bad_image_input_is_one_named_line(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    with pytest.raises(UserError, match=r"bad.png: not a readable image") as e:
        load_image(tmp_path / "bad.png")
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="image file not found"):
        load_image(tmp_path / "missing.png")
    rows = np.zeros((35, 64), np.float32)
    with pytest.raises(UserError, match=r"needs 40 positions \(35 image rows\), more than the context of 32") as e:
        image_prompt([1, 2], rows, [3, 4, 5], n_ctx=32)
    assert "\n" not in str(e.value)
    w = {k: np.zeros(s, np.float32) for k, s in tensor_shapes(VCFG).items()}
    del w["mm.1.weight"]
    with pytest.raises(UserError, match="missing vision tensor 'mm.1.weight'"):
        VisionTower(VCFG, w)


def test_vision_gguf_round_trip_and_image_on_a_text_only_model(tmp_path, spec_text_model):
    from PIL import Image
    from plinth_nemotron.vision import image_rows_for, load_vision_gguf, save_vision_gguf

    tower = random_tower()
    path = save_vision_gguf(tmp_path / "mmproj.gguf", VCFG, tower.w)
    back = load_vision_gguf(path)
    import attrs

    a, b = attrs.asdict(back.cfg), attrs.asdict(VCFG)
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-6) for k in a)  # floats kept as f32
    Image.fromarray((np.random.default_rng(3).random((40, 52, 3)) * 255).astype(np.uint8)).save(tmp_path / "a.png")
    x = preprocess(load_image(tmp_path / "a.png"), VCFG)
    np.testing.assert_array_equal(back.embed(x), tower.embed(x))
    with pytest.raises(UserError, match="is a text-only model here") as e:
        image_rows_for(spec_text_model, None, tmp_path / "a.png")
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="projects to width 64, the text model .* has n_embd = 48"):
        image_rows_for(spec_text_model, back, tmp_path / "a.png")
    with pytest.raises(UserError, match="not a Nemotron-H vision tower"):
        load_vision_gguf(spec_text_model.path)


@pytest.fixture(scope="module")
def spec_text_model(tmp_path_factory):
    from plinth.model import load_model

    reg = golden.registry()
    md = mtp_tests.tiny.metadata("M*E-", vocab=True, n_embd=48, top_k=[0, 0, 2, 0], n_ff_exp=[0, 0, 16, 0])
    return load_model(mtp_tests.tiny.write(tmp_path_factory.mktemp("txt") / "t.gguf", reg, md), registry=reg)


# --------------------------------------------------------------------------- reference (torch)

def _omni(torch, text_folder):
    from transformers import NemotronH_Omni_Reasoning_V3_Config, NemotronHForCausalLM
    from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    text = {k: v for k, v in mtp_tests.H_MTP.items() if k != "architectures"}
    cfg = NemotronH_Omni_Reasoning_V3_Config(
        vision_config=dict(model_type="radio", hidden_size=VCFG.n_embd, num_hidden_layers=VCFG.n_layer,
                           num_attention_heads=VCFG.n_head, mlp_ratio=VCFG.n_ff / VCFG.n_embd,
                           patch_size=VCFG.patch_size, max_img_size=VCFG.max_grid * VCFG.patch_size,
                           num_cls_tokens=2, num_registers=2, video_temporal_patch_size=2),
        text_config=dict(text, model_type="nemotron_h"), projector_hidden_size=VCFG.projector_n_ff,
        vision_hidden_size=VCFG.n_embd, image_token_id=100)
    cfg._attn_implementation = "eager"
    cfg.vision_config._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    model = NemotronH_Omni_Reasoning_V3(cfg).eval()
    model.language_model = NemotronHForCausalLM.from_pretrained(text_folder, dtype=torch.float32,
                                                                attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # redraw what transformers initialises to 0 / 1
        for name, p in list(model.vision_model.named_parameters()) + \
                [("vfl." + n, p) for n, p in model.vision_final_layernorm.named_parameters()] + \
                [("mm." + n, p) for n, p in model.multi_modal_projector.named_parameters()]:
            base = 1.0 if ("norm" in name and name.endswith("weight")) or "lambda1" in name else 0.0
            scale = 0.05 if p.dim() == 1 else 0.2
            p.copy_(base + scale * torch.randn(p.shape, generator=g))
    return model


def _tower_weights(model) -> dict[str, np.ndarray]:
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    w = {"v.patch_embd.weight": sd["vision_model.embeddings.patch_projection.weight"],
         "v.position_embd.weight": sd["vision_model.embeddings.position_embedding"][0],
         "v.cls_embd.weight": sd["vision_model.embeddings.cls_register_token"],
         "v.post_ln.weight": sd["vision_final_layernorm.weight"], "v.post_ln.bias": sd["vision_final_layernorm.bias"],
         "mm.norm.weight": sd["multi_modal_projector.layer_norm.weight"],
         "mm.1.weight": sd["multi_modal_projector.linear_1.weight"],
         "mm.2.weight": sd["multi_modal_projector.linear_2.weight"]}
    names = {"norm1": "ln1", "norm2": "ln2", "attention.q_proj": "attn_q", "attention.k_proj": "attn_k",
             "attention.v_proj": "attn_v", "attention.o_proj": "attn_out", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}
    for il in range(VCFG.n_layer):
        p = f"vision_model.encoder.layer.{il}."
        for hf, ours in names.items():
            for part in ("weight", "bias"):
                w[f"v.blk.{il}.{ours}.{part}"] = sd[f"{p}{hf}.{part}"]
        w[f"v.blk.{il}.ls1"] = sd[f"{p}layer_scale1.lambda1"]
        w[f"v.blk.{il}.ls2"] = sd[f"{p}layer_scale2.lambda1"]
    return w


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from plinth.convert import convert
    from plinth.model import load_model

    tmp = tmp_path_factory.mktemp("vl")
    folder = mtp_tests.write_folder(tmp / "text-hf", mtp_tests.H_MTP, seed=303)
    model = _omni(torch, folder)
    reg = golden.registry()
    convert(folder, tmp / "text.gguf", registry=reg, options={"mtp": "no"})
    return torch, model, VisionTower(VCFG, _tower_weights(model)), load_model(tmp / "text.gguf", registry=reg)


def _image(torch, grid):
    gh, gw = grid
    g = torch.Generator().manual_seed(1)
    patches = torch.randn((gh * gw, 3 * VCFG.patch_size ** 2), generator=g)
    return patches, ImageInput(patches.numpy().copy(), grid)


@pytest.mark.ref
@pytest.mark.parametrize("grid", [(6, 10), (16, 16), (20, 8)])
def test_image_embeddings_match_transformers(reference, grid):
    torch, model, tower, _ = reference
    patches, image = _image(torch, grid)
    with torch.no_grad():
        ref = model.get_image_features(patches, torch.tensor([list(grid)])).pooler_output[0].numpy()
    got = tower.embed(image)
    assert got.shape == ref.shape == (grid[0] * grid[1] // 4, 64)
    assert float(np.abs(got - ref).max()) <= 1e-4


@pytest.mark.ref
def test_mixed_prompt_logits_match_transformers(reference):
    torch, model, tower, text = reference
    patches, image = _image(torch, (6, 10))
    rows = tower.embed(image)
    before, after = [5, 17, 3], [9, 42, 7, 1]
    ids = before + [100] * len(rows) + after
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), pixel_values=patches,
                    image_grid_hw=torch.tensor([[6, 10]]), use_cache=False).logits[0].numpy()
    batch = image_prompt(before, rows, after, n_ctx=text.hparams.n_ctx_train)
    import attrs

    out = text.new_context().forward(attrs.evolve(batch, output=np.ones(batch.n_rows, bool)))
    got = text.backend.to_numpy(out.logits)
    assert got.shape == ref.shape
    assert float(np.abs(got - ref).max()) <= 1e-4


def _reference_grid_function():
    """transformers' ``get_patch_grid_size`` (a pure function); its module imports torchvision at the top, which
    does not install beside torch 2.13 here, so an empty stand-in satisfies that import while it loads."""
    import importlib
    import sys
    import types

    try:
        import torchvision  # noqa: F401
    except ImportError:
        names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                 "torchvision.transforms.v2.functional"]
        stubs = {n: types.ModuleType(n) for n in names}
        for parent, child in zip(names, names[1:]):
            setattr(stubs[parent], child.rsplit(".", 1)[1], stubs[child])
        saved = {n: sys.modules.get(n) for n in names}
        sys.modules.update(stubs)
        try:
            mod = importlib.import_module("transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni")
        finally:
            for n, m in saved.items():
                if m is None:
                    sys.modules.pop(n, None)
                else:
                    sys.modules[n] = m
            sys.modules.pop("transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni", None)
        return mod.get_patch_grid_size
    from transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni import get_patch_grid_size

    return get_patch_grid_size


@pytest.mark.ref
def test_preprocessing_of_a_real_size_png_matches_the_reference_pipeline(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from PIL import Image
    get_patch_grid_size = _reference_grid_function()

    yy, xx = np.mgrid[0:768, 0:1024]
    rgb = np.stack([(xx * 255 // 1023), (yy * 255 // 767), ((xx + yy) * 7) % 256], -1).astype(np.uint8)
    rgb[100:300, 200:600] = np.random.default_rng(2).integers(0, 256, (200, 400, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "big.png")
    cfg = VisionConfig(**{**{f.name: getattr(VCFG, f.name) for f in VisionConfig.__attrs_attrs__},
                          "patch_size": 16, "min_patches": 1024, "max_patches": 1200})
    got = preprocess(load_image(tmp_path / "big.png"), cfg)
    grid = get_patch_grid_size(768, 1024, 16, 2, 1024, 1200)
    assert got.grid == tuple(grid)
    x = torch.from_numpy(rgb.astype(np.float32)).permute(2, 0, 1)[None]
    x = torch.nn.functional.interpolate(x, size=(grid[0] * 16, grid[1] * 16), mode="bicubic", antialias=True,
                                        align_corners=False)[0] / 255.0
    x = (x - torch.tensor(cfg.image_mean)[:, None, None]) / torch.tensor(cfg.image_std)[:, None, None]
    ref = x.reshape(3, grid[0], 16, grid[1], 16).permute(1, 3, 0, 2, 4).reshape(grid[0] * grid[1], -1).numpy()
    diff = np.abs(got.patches - ref)
    print(f"preprocess max |pillow - torch| = {float(diff.max()):.3g}, mean {float(diff.mean()):.3g}")
    assert float(diff.max()) <= 5e-4, float(diff.max())


# --------------------------------------------------------------------------- plinth generate --image

@pytest.fixture(scope="module")
def vl_files(tmp_path_factory, spec_text_model):
    """A tiny VL pair: the text model (n_embd 48) and a vision GGUF projecting to 48; a PNG and a corrupt file."""
    from PIL import Image
    from plinth_nemotron.vision import save_vision_gguf

    tmp = tmp_path_factory.mktemp("vlcli")
    cfg = VisionConfig(**{**attrs_dict(VCFG), "text_n_embd": 48})
    save_vision_gguf(tmp / "mmproj.gguf", cfg, random_tower(cfg).w)
    big = VisionConfig(**{**attrs_dict(cfg), "min_patches": 4096, "max_patches": 8192})
    save_vision_gguf(tmp / "big-mmproj.gguf", big, random_tower(big).w)
    Image.fromarray((np.random.default_rng(5).random((30, 44, 3)) * 255).astype(np.uint8)).save(tmp / "a.png")
    Image.fromarray((np.random.default_rng(6).random((400, 400, 3)) * 255).astype(np.uint8)).save(tmp / "big.png")
    (tmp / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    return tmp


def attrs_dict(cfg):
    import attrs

    return {f.name: getattr(cfg, f.name) for f in attrs.fields(type(cfg))}


def _cli(capsys, *argv):
    from plinth.cli import main

    capsys.readouterr()
    rc = main(["--plugins", "nemotron", *argv])
    return rc, capsys.readouterr()


def test_generate_with_image_equals_the_python_api(spec_text_model, vl_files, capsys):
    from plinth.generate import Generator, TextStream
    from plinth_nemotron.vision import image_rows_for, load_vision_gguf

    m = str(spec_text_model.path)
    rc, got = _cli(capsys, "generate", "-m", m, "-n", "10", "--image", str(vl_files / "a.png"), "--mmproj",
                   str(vl_files / "mmproj.gguf"), "describe")
    assert rc == 0
    tower = load_vision_gguf(vl_files / "mmproj.gguf")
    rows = image_rows_for(spec_text_model, tower, vl_files / "a.png")
    assert rows.shape[1] == 48
    ids = spec_text_model.tokenizer.encode("describe", add_special=True)
    want = Generator(spec_text_model, prefix_embeddings=rows).generate(ids, 10)
    # the CLI prints the text stream: a character the last token left unfinished is dropped
    stream = TextStream(spec_text_model.tokenizer)
    text = "".join(stream.feed(t) for t in want) + stream.finish()
    assert got.out == text + "\n"
    rc, plain = _cli(capsys, "generate", "-m", m, "-n", "10", "describe")
    assert plain.out != got.out  # the image rows changed the continuation


@pytest.mark.parametrize("case, pattern", [
    ("corrupt", r"bad.jpg: not a readable image"),
    ("too-big", r"the image needs at least 1024 rows .* more than the 511 positions the context leaves"),
    ("no-mmproj", r"the vision tower of a Nemotron-H VL model is its own GGUF \(mmproj\); pass it with --mmproj"),
    ("not-a-tower", r"not a Nemotron-H vision tower"),
    ("with-spec", r"--image with --spec"),
])
def test_generate_image_errors_are_one_named_line(spec_text_model, vl_files, capsys, case, pattern):
    import re

    m = str(spec_text_model.path)
    image, mmproj, extra = str(vl_files / "a.png"), ["--mmproj", str(vl_files / "mmproj.gguf")], []
    if case == "corrupt":
        image = str(vl_files / "bad.jpg")
    elif case == "too-big":
        image, mmproj = str(vl_files / "big.png"), ["--mmproj", str(vl_files / "big-mmproj.gguf")]
    elif case == "no-mmproj":
        mmproj = []
    elif case == "not-a-tower":
        mmproj = ["--mmproj", m]
    elif case == "with-spec":
        extra = ["--spec", "ngram"]
    rc, got = _cli(capsys, "generate", "-m", m, "-n", "4", "--image", image, *mmproj, *extra, "hi")
    assert rc != 0 and got.out == ""
    lines = [x for x in got.err.splitlines() if x.startswith("plinth")]  # the rest is the load progress bar
    assert len(lines) == 1 and re.search(pattern, lines[0]), got.err


def test_image_on_a_text_only_architecture_is_refused(tmp_path, vl_files, capsys):
    from plinth.testing import byte_vocab, make_registry, tiny_metadata, write_synthetic_gguf

    reg = make_registry("llama")
    path = write_synthetic_gguf(tmp_path / "llama.gguf", "llama", {**tiny_metadata("llama", n_vocab=257),
                                                                    **byte_vocab()}, reg)
    from plinth.cli import main

    capsys.readouterr()
    rc = main(["--plugins", "llama", "generate", "-m", str(path), "-n", "4", "--image", str(vl_files / "a.png"),
               "hi"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("plinth")]
    assert rc != 0 and len(err) == 1 and "the architecture 'llama' is text-only in plinth; --image needs" in err[0]


def test_video_frames_are_refused(tmp_path):
    from PIL import Image

    frames = [Image.fromarray(np.full((8, 8, 3), i * 60, np.uint8)) for i in range(3)]
    frames[0].save(tmp_path / "clip.gif", save_all=True, append_images=frames[1:])
    with pytest.raises(UserError, match="clip.gif: an image with 3 frames; video input is not supported"):
        load_image(tmp_path / "clip.gif")


@pytest.mark.ref
def test_checkpoint_saved_by_transformers_converts_to_text_and_mmproj(reference, tmp_path):
    """save_pretrained's release names (language_model.backbone.*, vision_model.radio_model.*, mlp1.*) -> two GGUFs."""
    from plinth.convert import convert
    from plinth.model import load_model
    from plinth_nemotron.vision import load_vision_gguf

    torch, model, _, _ = reference
    model.save_pretrained(tmp_path / "saved")
    reg = golden.registry()
    convert(tmp_path / "saved", tmp_path / "vl.gguf", registry=reg)
    tower = load_vision_gguf(tmp_path / "vl.mmproj.gguf")
    text = load_model(tmp_path / "vl.gguf", registry=reg)
    patches, image = _image(torch, (6, 10))
    with torch.no_grad():
        ref = model.get_image_features(patches, torch.tensor([[6, 10]])).pooler_output[0].numpy()
        ids = [5, 17] + [100] * 15 + [9, 42]
        ref_logits = model(input_ids=torch.tensor([ids]), pixel_values=patches,
                           image_grid_hw=torch.tensor([[6, 10]]), use_cache=False).logits[0, -1].numpy()
    rows = tower.embed(image)
    assert float(np.abs(rows - ref).max()) <= 1e-4
    out = text.new_context().forward(image_prompt([5, 17], rows, [9, 42], n_ctx=text.n_ctx))
    assert float(np.abs(text.backend.to_numpy(out.logits)[-1] - ref_logits).max()) <= 1e-4

"""The example plugin's own tests: the architecture contract, the converter, the drafter."""

from __future__ import annotations

import numpy as np
import pytest

from plinth.testing import check_architecture, tiny_metadata
from plinth.testing.drafters import check_drafter_contract


@pytest.fixture
def registry(plinth_registry):
    from plinth_example.plugin import plugin

    return plinth_registry(plugin)


@pytest.mark.parametrize("backend", ["numpy", "strict"])
def test_architecture_contract(registry, tmp_path, backend):
    model = check_architecture(registry, "minidense", tiny_metadata("minidense", n_vocab=257), tmp_path,
                               backend=backend)
    assert model.new_context().cache.nbytes_by_kind() == {"kv": 0}  # one KV per layer, empty


@pytest.mark.parametrize("tied", [False, True])
def test_converter_maps_every_tensor_and_the_file_runs(registry, tmp_path, tied):
    from plinth.convert import convert, map_names
    from plinth.gguf import GGUFFile
    from plinth.model import load_model
    from plinth.testing import write_hf_folder
    from plinth_example.convert import NAMES
    from plinth_example.make_tiny import tiny_config, tiny_tensors

    cfg = tiny_config(tied=tied)
    hf = tiny_tensors(cfg, seed=3)
    folder = write_hf_folder(tmp_path / "hf", cfg, hf)
    out = convert(folder, tmp_path / "m.gguf", registry=registry)
    gf = GGUFFile(out)
    names = map_names(hf, NAMES)
    assert names["model.layers.1.mlp.down_proj.weight"] == "blk.1.ffn_down.weight"
    for hf_name, gg in names.items():
        if gg != "output.weight" or not tied:
            np.testing.assert_array_equal(gf.raw(gg), hf[hf_name])
    assert ("output.weight" in gf.tensors) == (not tied)
    model = load_model(out, registry=registry)
    assert model.tokenizer.decode(model.tokenizer.encode("hi there")) == "hi there"
    from plinth.generate import Generator

    assert len(Generator(model).generate(model.tokenizer.encode("hello"), 6)) == 6


def test_converter_refuses_an_unknown_tensor(registry, tmp_path):
    from plinth.convert import convert
    from plinth.errors import UserError
    from plinth.testing import write_hf_folder
    from plinth_example.make_tiny import tiny_config, tiny_tensors

    cfg = tiny_config()
    folder = write_hf_folder(tmp_path / "hf", cfg, tiny_tensors(cfg) | {"model.extra.weight": np.ones(3, np.float32)})
    with pytest.raises(UserError, match="no GGUF name: model.extra.weight"):
        convert(folder, tmp_path / "m.gguf", registry=registry)


def test_repeat_drafter_contract(registry, tmp_path):
    from plinth.model import load_model
    from plinth.testing import byte_vocab, write_synthetic_gguf

    md = tiny_metadata("minidense", n_vocab=257) | byte_vocab()
    model = load_model(write_synthetic_gguf(tmp_path / "m.gguf", "minidense", md, registry), registry=registry)
    drafter = registry.make_drafter("toy-repeat", model, {"n_max": 3})
    check_drafter_contract(model, lambda: drafter, [[5, 5, 5, 5, 7], [1, 2, 3]], max_tokens=12)


def test_matches_transformers_llama(registry, tmp_path):
    """Oracle: minidense is HF's Llama computation (NeoX rotation, no Q/K permutation needed)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from plinth.convert import convert
    from plinth.model import load_model
    from plinth.testing import write_hf_folder
    from plinth_example.make_tiny import tiny_config, tiny_tensors

    cfg = tiny_config()
    hf = tiny_tensors(cfg, seed=1)
    model = load_model(convert(write_hf_folder(tmp_path / "hf", cfg, hf), tmp_path / "m.gguf", registry=registry),
                       registry=registry)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in cfg.items()
                                                                   if k != "architectures"}))
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in hf.items()}, strict=True)
    tokens = [3, 200, 17, 99, 5, 256, 42]
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0].numpy()
    np.testing.assert_allclose(model.logits(tokens), want, atol=1e-4, rtol=0)

"""Bad input is refused with one line naming what failed and where.

A shared-indexer layer first in the stack, a reuse layer pointing forward (or at a layer that
itself reuses, or across RoPE/NoPE), an unknown sharing mode or indexer type, a sharing mode
that contradicts the sources, a vision tensor in a text-only checkpoint, an unknown tensor, a
missing KV projection.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.errors import UserError
from plinth.hparams import HParamsError
from plinth.tensors import TensorCheckError
from plinth.testing import load_module
from plinth_mistral.convert import metadata, text_config
from plinth_mistral.mistral_large4 import MistralLarge4

load_hparams = MistralLarge4().load_hparams

A = "mistral_large4"
golden = load_module(Path(__file__).resolve().parent / "golden" / "make_golden.py")


@pytest.fixture
def md():
    return metadata(text_config(golden.config("issue")), "issue.gguf")


def golden_config(case):
    return golden.config(case)


def refused(md, match, exc=HParamsError):
    with pytest.raises(exc) as info:
        load_hparams(md, "bad.gguf")
    msg = str(info.value)
    assert "\n" not in msg and "bad.gguf" in msg, msg
    assert match in msg, msg
    return msg


def test_the_good_file_loads(md):
    hp = load_hparams(md, "issue.gguf")
    assert hp.kv_sharing == ("store", "reuse", "reuse_but_indexer", "own")
    assert hp.roles[1] == "1: kv reuse<-0, indexer shared, rope, moe"


def test_shared_indexer_layer_first(md):
    md[f"{A}.attention.indexer.types"] = ["shared", "full", "full", "shared"]
    refused(md, "layer 0 is a 'shared' indexer layer")


def test_reuse_layer_pointing_forward(md):
    md[f"{A}.attention.kv_source_layers"] = [0, 2, 2, 3]
    del md[f"{A}.attention.kv_sharing"]
    refused(md, "layer 1 reuse layer 2's KV; a layer can only reuse an earlier layer's cache")


def test_reuse_of_a_reusing_layer(md):
    md[f"{A}.attention.kv_source_layers"] = [0, 0, 1, 3]
    del md[f"{A}.attention.kv_sharing"]
    refused(md, "which itself reuses layer 0")


def test_reuse_across_rope_and_nope(md):
    md[f"{A}.attention.kv_source_layers"] = [0, 0, 0, 0]
    del md[f"{A}.attention.kv_sharing"]
    refused(md, "layer 3 (NoPE) reuses the KV of layer 0 (RoPE)")


def test_reuse_across_a_later_store_layer_is_ambiguous(md):
    """transformers 5.24 gives layer 2 the latent of layer 1 (the latest RoPE store), not of its source 0."""
    md[f"{A}.attention.kv_source_layers"] = [0, 1, 0, 1]
    md[f"{A}.attention.indexer.types"] = ["full"] * 4
    md[f"{A}.rope.layers"] = [1] * 4
    del md[f"{A}.attention.kv_sharing"]
    refused(md, "layer 2 reuses layer 0's KV across layer 1, a later RoPE store layer")


def test_unknown_sharing_mode(md):
    md[f"{A}.attention.kv_sharing"] = ["store", "borrow", "reuse_but_indexer", "own"]
    refused(md, "layer 1 is 'borrow'; known sharing modes: own, store, reuse, reuse_but_indexer")


def test_sharing_mode_contradicting_the_sources(md):
    md[f"{A}.attention.kv_sharing"] = ["store", "reuse_but_indexer", "reuse_but_indexer", "own"]
    refused(md, "says layer 1 is 'reuse_but_indexer'")


def test_unknown_indexer_type(md):
    md[f"{A}.attention.indexer.types"] = ["full", "sparse", "full", "shared"]
    refused(md, "layer 1 is 'sparse'; known indexer types: full, shared")


def test_missing_required_key(md):
    del md[f"{A}.attention.kv_lora_rank"]
    refused(md, "missing required key 'mistral_large4.attention.kv_lora_rank'")


def write_folder(tmp_path, config, extra=None, drop=()):
    g = golden
    state = g.hf_random_state(g.config("issue"), 1)
    for name in drop:
        del state[name]
    state.update(extra or {})
    return g.write_hf_folder("issue", tmp_path / "hf", state=state, cfg=config)


def convert_error(tmp_path, folder):
    from plinth.convert import convert

    with pytest.raises(UserError) as info:
        convert(folder, tmp_path / "out.gguf", registry=golden.registry())
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def test_vision_tensor_in_a_text_only_checkpoint(tmp_path):
    cfg = golden_config("issue")
    del cfg["vision_config"]
    msg = convert_error(tmp_path, write_folder(tmp_path, cfg))
    assert "vision tensor '" in msg and "text-only checkpoint" in msg


def test_unknown_tensor(tmp_path):
    msg = convert_error(tmp_path, write_folder(tmp_path, golden_config("issue"),
                                                extra={"layers.1.attention.wk.weight": np.zeros((4, 4), np.float32)}))
    assert "unexpected tensor 'layers.1.attention.wk.weight'" in msg


def test_shared_indexer_first_refused_at_conversion(tmp_path):
    cfg = golden_config("issue")
    cfg["text_config"]["indexer_types"] = ["shared", "shared", "full", "shared"]
    assert "layer 0 is a 'shared' indexer layer" in convert_error(tmp_path, write_folder(tmp_path, cfg))


def test_missing_kv_projection_is_named(tmp_path):
    """A store layer without its KV projection: the loader names the tensor and its shape."""
    from plinth.convert import convert
    from plinth.model import load_model

    reg = golden.registry()
    folder = write_folder(tmp_path, golden_config("issue"), drop=("layers.0.attention.wkv_a_with_mqa.weight",))
    convert(folder, tmp_path / "m.gguf", registry=reg)
    with pytest.raises(TensorCheckError, match=r"missing tensor 'blk\.0\.attn_kv_a_mqa\.weight' \(expected shape "
                                               r"\[24, 64\]\)"):
        load_model(tmp_path / "m.gguf", registry=reg)

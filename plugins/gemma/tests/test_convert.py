"""plinth's Gemma4ForCausalLM converter without torch: the keys llama.cpp writes, the Gemma vocabulary,
what is left out with a note, and config features refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from plinth.convert import convert
from plinth.errors import UserError
from plinth.gguf.reader import GGUFFile
from plinth.testing import load_module, write_hf_folder

golden = load_module(Path(__file__).resolve().parent / "golden" / "make_golden.py")

#: the gemma4.* keys llama.cpp's converter writes for a model with every feature (checked live in test_interop)
LLAMA_CPP_KEYS = sorted(f"gemma4.{k}" for k in (
    "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "rope.freq_base", "rope.freq_base_swa", "attention.layer_norm_rms_epsilon",
    "expert_count", "expert_used_count", "attention.key_length", "attention.value_length",
    "final_logit_softcapping", "attention.sliding_window", "attention.shared_kv_layers",
    "embedding_length_per_layer_input", "attention.sliding_window_pattern", "attention.key_length_swa",
    "attention.value_length_swa", "expert_feed_forward_length", "rope.dimension_count",
    "rope.dimension_count_swa"))


@pytest.fixture(scope="module")
def registry():
    return golden.registry()


def read(path):
    f = GGUFFile(path)
    try:
        return dict(f.metadata), {n: tuple(i.shape) for n, i in f.tensors.items()}
    finally:
        f.close()


def test_every_feature_writes_llama_cpp_keys_and_gemma_vocab(registry, tmp_path):
    folder, cfg = golden.write_gemma_folder("all", tmp_path / "hf")
    convert(folder, tmp_path / "m.gguf", registry=registry)
    md, tensors = read(tmp_path / "m.gguf")
    assert sorted(k for k in md if k.startswith("gemma4.")) == LLAMA_CPP_KEYS
    assert list(md["gemma4.attention.sliding_window_pattern"]) == [True, False, True, True, False, False]
    assert list(md["gemma4.feed_forward_length"]) == [96, 96, 96, 192, 192, 192]  # double-wide on shared layers
    assert list(md["gemma4.attention.head_count_kv"]) == [2, 1, 2, 2, 1, 1]
    assert md["tokenizer.ggml.model"] == "gemma4"
    types = list(md["tokenizer.ggml.token_type"])
    assert types[:4] == [3, 3, 3, 3] and set(types[4:260]) == {6} and set(types[260:]) == {1}
    assert (md["tokenizer.ggml.bos_token_id"], md["tokenizer.ggml.eos_token_id"],
            md["tokenizer.ggml.padding_token_id"], md["tokenizer.ggml.unknown_token_id"]) == (2, 1, 0, 3)
    assert md["tokenizer.ggml.add_bos_token"] is True and md["tokenizer.ggml.add_space_prefix"] is False
    assert "output.weight" not in tensors  # tied
    freqs = GGUFFile(tmp_path / "m.gguf")
    try:
        rf = np.asarray(freqs.raw("rope_freqs.weight")).view(np.float32)
    finally:
        freqs.close()
    assert rf.tolist()[:4] == [1.0, 1.0, 1.0, 1.0] and set(rf[4:].tolist()) == {np.float32(1e30)}  # 0.25 of 16 pairs
    for il in (3, 4, 5):  # KV-shared layers: no K/V of their own
        assert f"blk.{il}.attn_k.weight" not in tensors and f"blk.{il}.attn_q.weight" in tensors
    assert tensors["blk.0.ffn_gate_up_exps.weight"] == (4, 48, 64)
    assert tensors["blk.0.ffn_down_exps.scale"] == (4,)


def test_kv_weights_of_shared_layers_are_left_out_with_a_note(registry, tmp_path, capsys):
    c = golden.CASES["shared"]
    state = golden.hf_random_state(c["config"], c["seed"])
    for il in (3, 4):
        state[f"model.layers.{il}.self_attn.k_proj.weight"] = np.ones((32, 64), np.float32)
    folder = write_hf_folder(tmp_path / "hf", c["config"], state)
    convert(folder, tmp_path / "m.gguf", registry=registry)
    assert "2 K/V tensors of KV-shared layers left out" in capsys.readouterr().err
    assert "blk.3.attn_k.weight" not in read(tmp_path / "m.gguf")[1]


def _folder(tmp_path, **over):
    c = golden.CASES["dense"]
    cfg = dict(c["config"], **over)
    return write_hf_folder(tmp_path / "hf", cfg, golden.hf_random_state(c["config"], c["seed"]))


@pytest.mark.parametrize("over, name", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_activation="gelu"), "hidden_activation"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                           "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                              "rope_theta": 1e6, "factor": 8.0}}), "rope_parameters.full_attention"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
                           "full_attention": {"rope_type": "proportional", "rope_theta": 1e6}}),
     "rope_parameters.sliding_attention"),
    (dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=100), "vocab_size_per_layer_input"),
    (dict(per_layer_config={"2": {"head_dim": 32, "intermediate_size": 64}}), r"per_layer_config\[2\]"),
    (dict(vocab_size=300), "300"),
])
def test_unsupported_config_is_refused_by_name(registry, tmp_path, over, name):
    with pytest.raises(UserError, match=name):
        convert(_folder(tmp_path, **over), tmp_path / "m.gguf", registry=registry)


def test_multimodal_checkpoint_converts_its_text_model(registry, tmp_path, capsys):
    """A Gemma4ForConditionalGeneration folder (the released layout): the text model under
    ``model.language_model.``, the towers left out with a note; the same file as the text-only folder."""
    from plinth.model import load_model

    c = golden.CASES["shared"]
    state = golden.hf_random_state(c["config"], c["seed"])
    text = write_hf_folder(tmp_path / "text", c["config"], state)
    mm_state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                for k, v in state.items()}
    mm_state["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = np.ones((8, 8), np.float32)
    mm_state["model.embed_vision.embedding_projection.weight"] = np.ones((64, 8), np.float32)
    cfg = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
           "text_config": {k: v for k, v in c["config"].items() if k != "architectures"},
           "vision_config": {"hidden_size": 8}, "audio_config": None, "tie_word_embeddings": True}
    mm = write_hf_folder(tmp_path / "mm", cfg, mm_state)
    convert(text, tmp_path / "text.gguf", registry=registry)
    convert(mm, tmp_path / "mm.gguf", registry=registry)
    assert "2 vision / audio tensors left out" in capsys.readouterr().err
    (md_a, t_a), (md_b, t_b) = read(tmp_path / "text.gguf"), read(tmp_path / "mm.gguf")
    assert t_a == t_b

    def plain(v):
        return v.tolist() if hasattr(v, "tolist") else v

    assert {k: plain(v) for k, v in md_a.items()} == {k: plain(v) for k, v in md_b.items()}
    ids = golden.prompts("shared")[1]
    np.testing.assert_array_equal(load_model(tmp_path / "mm.gguf", registry=registry).logits(ids),
                                  load_model(tmp_path / "text.gguf", registry=registry).logits(ids))


def test_chat_template_and_mask_token_are_written(registry, tmp_path):
    folder, _ = golden.write_gemma_folder("dense", tmp_path / "hf")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<unk>"}))
    (folder / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    convert(folder, tmp_path / "m.gguf", registry=registry)
    md, _ = read(tmp_path / "m.gguf")
    assert md["tokenizer.chat_template"].startswith("{{ bos_token }}")
    assert md["tokenizer.ggml.mask_token_id"] == 3

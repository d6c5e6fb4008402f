"""The ``mtp_dspark.*`` head of a Mistral Large 4 checkpoint becomes a DSpark draft GGUF.

The layout is derived from names and shapes (``plinth_mistral.dspark_head``); the written file is
checked against the DFlash format (plinth-dflash's own hparams reader and tensor declarations
accept its backbone, and its kind detector recognises it as a DSpark draft) and against the
DSpark tensors of seed-features section 4.2. What does not fit is refused in one line. Running
the draft through plinth-dspark is checked in ``test_dspark_lossless.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.convert import convert
from plinth.errors import UserError
from plinth.gguf import GGUFFile
from plinth.testing import load_module

golden = load_module(Path(__file__).resolve().parent / "golden" / "make_golden.py")
E, V, R, HD, H, HKV, FF = 64, 256, 12, 16, 4, 2, 80


def draft_state(n_taps=3, n_layer=2, seed=9, conf=True, own_head=False):
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    p = "mtp_dspark."
    sd = {p + "fc.weight": w(E, n_taps * E), p + "hidden_norm.weight": 1 + w(E), p + "norm.weight": 1 + w(E),
          p + "markov_head.markov_w1.weight": w(V, R), p + "markov_head.markov_w2.weight": w(V, R)}
    if conf:
        sd[p + "confidence_head.proj.weight"] = w(1, E + R)
        sd[p + "confidence_head.proj.bias"] = w(1)
    if own_head:
        sd[p + "output.weight"] = w(V, E)
    for il in range(n_layer):
        b = f"{p}layers.{il}."
        sd.update({b + "attention_norm.weight": 1 + w(E), b + "ffn_norm.weight": 1 + w(E),
                   b + "attention.wq.weight": w(H * HD, E), b + "attention.wk.weight": w(HKV * HD, E),
                   b + "attention.wv.weight": w(HKV * HD, E), b + "attention.wo.weight": w(E, H * HD),
                   b + "attention.q_norm.weight": 1 + w(HD), b + "attention.k_norm.weight": 1 + w(HD),
                   b + "feed_forward.w1.weight": w(FF, E), b + "feed_forward.w3.weight": w(FF, E),
                   b + "feed_forward.w2.weight": w(E, FF)})
    return sd


def folder_with_draft(tmp_path, draft):
    state = golden.hf_random_state(golden.config("issue"), golden.CASES["issue"]["seed"])
    state.update(draft)
    return golden.write_hf_folder("issue", tmp_path / "hf", state=state)


OPTIONS = {"draft": None, "block_size": "5", "mask_token_id": "7"}


def convert_with_draft(tmp_path, draft, **options):
    folder = folder_with_draft(tmp_path, draft)
    opts = dict(OPTIONS, draft=str(tmp_path / "draft.gguf"), **options)
    convert(folder, tmp_path / "m.gguf", registry=golden.registry(), options=opts)
    return GGUFFile(tmp_path / "draft.gguf")


def test_draft_file_layout_and_keys(tmp_path):
    gf = convert_with_draft(tmp_path, draft_state())
    md = gf.metadata
    assert md["general.architecture"] == "dflash"
    assert list(md["dflash.target_layers"]) == [2, 3, 4]  # the last three target layers, +1 rule (4 = L_t)
    assert (md["dflash.block_size"], md["tokenizer.ggml.mask_token_id"]) == (5, 7)
    assert (md["dflash.block_count"], md["dflash.attention.head_count"], md["dflash.attention.head_count_kv"],
            md["dflash.attention.key_length"], md["dflash.feed_forward_length"]) == (2, H, HKV, HD, FF)
    assert md["dflash.sample_from_anchor"] is True and md["dflash.has_confidence_head"] is True
    shapes = {n: tuple(i.shape) for n, i in gf.tensors.items()}
    assert shapes["markov_w1.weight"] == (V, R) and shapes["markov_w2.weight"] == (V, R)
    assert shapes["conf_proj.weight"] == (1, E + R) and shapes["fc.weight"] == (E, 3 * E)
    assert "output.weight" not in shapes and "token_embd.weight" not in shapes  # shared with the target


def test_draft_backbone_is_a_valid_dflash_file(tmp_path):
    """plinth-dflash's reader accepts the backbone and identifies the file as a DSpark draft."""
    fmt = pytest.importorskip("plinth_dflash.format")
    from plinth.tensors import check_tensors

    gf = convert_with_draft(tmp_path, draft_state(own_head=True), target_layers="0,2,3")
    names = set(gf.tensors)
    with pytest.raises(fmt.DFlashFormatError, match="DSpark draft"):
        fmt.load_hparams(gf.metadata, "draft.gguf", names)
    backbone = names - {"markov_w1.weight", "markov_w2.weight", "conf_proj.weight", "conf_proj.bias"}
    hp = fmt.load_hparams(gf.metadata, "draft.gguf", backbone)
    assert hp.target_layers == (1, 3, 4) and hp.n_taps == 3 and hp.block_size == 5 and hp.mask_token == 7
    present = {n: (tuple(i.shape), i.type_name) for n, i in gf.tensors.items() if n in backbone}
    found = {s.name for s in check_tensors(fmt.tensor_specs(hp), present, "draft.gguf")}
    assert backbone == found


def test_text_file_is_unchanged_by_the_draft_head(tmp_path, mistral_models):
    convert_with_draft(tmp_path, draft_state())
    from plinth.model import load_model

    model = load_model(tmp_path / "m.gguf", registry=golden.registry())
    prompt = golden.prompts("issue")[2]
    np.testing.assert_array_equal(model.logits(prompt), mistral_models("issue").logits(prompt))


def refused(tmp_path, draft, match, **options):
    with pytest.raises(UserError) as info:
        convert_with_draft(tmp_path, draft, **options)
    msg = str(info.value)
    assert "\n" not in msg and match in msg, msg


def test_missing_option(tmp_path):
    refused(tmp_path, draft_state(), "does not record its block_size", block_size="")


def test_mla_draft_layer_does_not_fit(tmp_path):
    d = draft_state()
    d["mtp_dspark.layers.0.attention.wkv_a_with_mqa.weight"] = np.zeros((24, E), np.float32)
    refused(tmp_path, d, "belongs to an MLA / MoE block")


def test_unknown_draft_tensor(tmp_path):
    d = draft_state()
    d["mtp_dspark.eh_proj.weight"] = np.zeros((E, 2 * E), np.float32)
    refused(tmp_path, d, "unexpected draft tensor 'mtp_dspark.eh_proj.weight'")


def test_fc_width_not_a_multiple_of_the_hidden_size(tmp_path):
    d = draft_state()
    d["mtp_dspark.fc.weight"] = np.zeros((E, 2 * E + 3), np.float32)
    refused(tmp_path, d, "expected [64, n_taps * 64]")


def test_markov_table_over_another_vocabulary(tmp_path):
    d = draft_state()
    d["mtp_dspark.markov_head.markov_w1.weight"] = np.zeros((V - 1, R), np.float32)
    refused(tmp_path, d, "expected [256, R] (the target's vocabulary)")


def test_target_layers_must_match_fc(tmp_path):
    refused(tmp_path, draft_state(), "must name 3 layers", target_layers="1,2")


def test_no_draft_option_writes_only_the_text_model(tmp_path, capsys):
    folder = folder_with_draft(tmp_path, draft_state())
    convert(folder, tmp_path / "m.gguf", registry=golden.registry())
    assert not (tmp_path / "draft.gguf").exists()
    assert "mtp_dspark draft head" in capsys.readouterr().err


@pytest.mark.ref
def test_transformers_ignores_the_draft_head(tmp_path):
    """The reference loads the same checkpoint without complaint and its logits match the text GGUF."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from plinth.model import load_model

    convert_with_draft(tmp_path, draft_state())
    ref = golden.hf_reference(tmp_path / "hf")
    model = load_model(tmp_path / "m.gguf", registry=golden.registry())
    prompt = golden.prompts("issue")[2]
    assert float(np.abs(model.logits(prompt) - ref.logits(prompt)).max()) <= 1e-4

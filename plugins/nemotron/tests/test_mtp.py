"""The MTP head of Nemotron-H files and the ``mtp`` drafter.

A Puzzle checkpoint with ``mtp_block_configs`` (attention, then a MoE with its own top-k and
width) and a NemotronH checkpoint with ``num_nextn_predict_layers`` are converted with their
MTP head (``blk.{n_layer}`` / ``blk.{n_layer+1}``, ``nextn.*`` tensors). Checked here: the trunk
is unchanged by the head; the ``mtp`` drafter is lossless (greedy output identical to plain
decoding, the target's cache equal to plain decoding's, the head's own cache equal to one run
over the committed rows); conversion choices and bad files are one-line named errors. The
``ref`` test evaluates the head directly on the converted weights with transformers'
``NemotronHBlock``s (transformers skips ``mtp.*`` when loading; the head's input and output
projections are written in torch from the spec).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from plinth.graph import Batch
from plinth.errors import UserError
from plinth.gguf import GGUFFile
from plinth.testing import load_module
from plinth.testing.drafters import assert_caches_equal, check_drafter_contract

HERE = Path(__file__).resolve().parent
golden = load_module(HERE / "golden" / "make_golden.py")
tiny = load_module(HERE / "tiny.py")

PUZZLE_MTP = dict(golden.CASES["puzzle"]["config"], num_nextn_predict_layers=1, mtp_block_configs=[
    {"block_type": "attention"},
    {"block_type": "moe", "num_experts_per_tok": 3, "moe_intermediate_size": 32}])
H_MTP = dict(golden.CASES["moe"]["config"], num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")
SEED = 305


def write_folder(folder: Path, config: dict, seed: int = SEED) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    golden.write_safetensors(folder / "model.safetensors", golden.hf_random_state(config, seed))
    return folder


def convert(folder: Path, out: Path, reg, **options) -> Path:
    from plinth.convert import convert as run

    run(folder, out, registry=reg, options=options or None)
    return out


@pytest.fixture(scope="module")
def reg():
    return golden.registry()


@pytest.fixture(scope="module")
def files(tmp_path_factory, reg):
    tmp = tmp_path_factory.mktemp("mtp")
    puzzle = write_folder(tmp / "puzzle-hf", PUZZLE_MTP)
    h = write_folder(tmp / "h-hf", H_MTP, seed=303)
    return {"puzzle": convert(puzzle, tmp / "puzzle.gguf", reg), "puzzle-no": convert(puzzle, tmp / "no.gguf", reg,
                                                                                       mtp="no"),
            "h": convert(h, tmp / "h.gguf", reg), "folder": puzzle, "tmp": tmp}


@pytest.fixture(scope="module")
def model(files, reg):
    from plinth.model import load_model

    return load_model(files["puzzle"], registry=reg)


@pytest.fixture(scope="module")
def spec_model(tmp_path_factory, reg):
    """A tiny hybrid target with an MTP head and a byte vocabulary (so it generates text)."""
    from plinth.model import load_model

    md = tiny.metadata("M*E-*E", vocab=True, n_embd=48, nextn_predict_layers=2,
                       top_k=[0, 0, 2, 0, 0, 3], n_ff_exp=[0, 0, 16, 0, 0, 24])
    return load_model(tiny.write(tmp_path_factory.mktemp("spec") / "mtp.gguf", reg, md, seed=4), registry=reg)


def test_converted_head_layout(files, model):
    md = GGUFFile(files["puzzle"]).metadata
    # llama.cpp's layout: one folded block (attention + MoE sub-blocks), counted in block_count
    assert md["nemotron_h_moe.block_count"] == 7 and md["nemotron_h_moe.nextn_predict_layers"] == 1
    assert list(md["nemotron_h_moe.expert_used_count"]) == [0, 2, 0, 4, 0, 1, 3]
    assert list(md["nemotron_h_moe.attention.head_count_kv"])[6] == 2
    hp = model.hparams
    assert (hp.n_layer, hp.pattern, hp.mtp_pattern, hp.n_nextn, hp.mtp_folded) == (6, "ME*EME", "*E", 1, True)
    assert hp.n_expert_used(6) == 3 and hp.n_ff_exp(6) == 32 and hp.n_head_kv[6] == 2
    assert [k for _, k, _ in hp.mtp_sublayers()] == ["attention", "moe"]
    with pytest.raises(IndexError, match="n_layer = 6 \\+ 1 MTP blocks"):
        hp.mixer(7)
    assert len(model.graph.cache_layout()) == 6  # the trunk's cache only
    names = set(GGUFFile(files["puzzle"]).tensors)
    assert {"blk.6.nextn.eh_proj.weight", "blk.6.nextn.enorm.weight", "blk.6.nextn.hnorm.weight",
            "blk.6.nextn.shared_head_norm.weight", "blk.6.ffn_up_exps.weight", "blk.6.attn_q.weight",
            "blk.6.attn_norm.weight", "blk.6.post_attention_norm.weight"} <= names
    assert not any(n.startswith("blk.7.") for n in names)
    assert model.target_view().draft_heads == ["mtp"]
    h = GGUFFile(files["h"]).metadata
    assert h["nemotron_h_moe.block_count"] == 6 and h["nemotron_h_moe.nextn_predict_layers"] == 1


def test_trunk_is_unchanged_by_the_head(files, model, reg):
    from plinth.model import load_model

    plain = load_model(files["puzzle-no"], registry=reg)
    assert "nemotron_h_moe.nextn_predict_layers" not in plain.metadata and not plain.target_view().draft_heads
    prompt = golden.prompts("puzzle")[1]
    np.testing.assert_array_equal(model.logits(prompt), plain.logits(prompt))
    # and the trunk still matches the transformers golden of the Puzzle case
    _, runs = golden_runs()
    assert float(np.abs(model.logits(runs[1][0]) - runs[1][1]).max()) <= 1e-4


def golden_runs():
    from plinth.testing import load_golden

    return load_golden(HERE / "golden" / "puzzle.npz")


def test_mtp_drafter_is_lossless(spec_model):
    model = spec_model
    from plinth_nemotron.mtp import make_mtp_drafter

    made = []

    def make():
        made.append(make_mtp_drafter(model, {"n_max": 3}))
        return made[-1]

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, 9).tolist(), [5, 6, 7, 5, 6, 7, 5, 6]]
    stats = check_drafter_contract(model, make, prompts, max_tokens=20, n_max=3)
    assert all(s.n_drafts > 0 for s in stats)
    for s in stats:  # acceptance is reported
        assert 0 <= s.n_accepted <= s.n_drafted and s.tau >= 1.0


def test_head_cache_after_drafting_equals_one_run_over_committed_rows(spec_model):
    """Incremental folding + speculative chains (rolled back) == one batch over the same rows."""
    model = spec_model
    from plinth.generate import Generator
    from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
    from plinth_nemotron.mtp import make_mtp_drafter

    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    drafter = make_mtp_drafter(model, {"n_max": 3})
    drafter.end = lambda seq: None  # keep the head's cache for inspection
    gen = SpeculativeGenerator(model, [drafter], config=SpecConfig(n_max=3, verifier="greedy"))
    out = gen.generate(prompt, 16)
    assert out == Generator(model).generate(prompt, 16)
    done = drafter._done[0]
    assert done >= len(prompt) and list(drafter._cache[0].positions(0)) == list(range(done))
    seq = (prompt + out)[:done + 1]
    head = model.target_view().draft_head("mtp")
    ctx = model.new_context(taps=head.taps)
    feats = ctx.forward(Batch.from_tokens(seq[:done], output="all")).features[head.taps[0]]
    fresh = head.new_cache()
    head.run(Batch.from_tokens(seq[1:done + 1], output="all"), head.target_rows(feats), fresh)
    assert_caches_equal(drafter._cache[0], fresh, atol=1e-4, rtol=1e-4)


def test_mtp_drafter_routed_to_nemotron_beside_deepseek41(spec_model):
    """Both nemotron and deepseek41 ship an ``mtp`` drafter; the target's architecture picks one."""
    from plinth.testing import make_registry

    try:
        full = make_registry("nemotron", "deepseek41")  # strict: a conflict would be fatal here
    except Exception as exc:  # pragma: no cover - only without the deepseek41 plugin installed
        pytest.skip(f"deepseek41 plugin not installed: {exc}")
    assert ("drafters", "mtp") not in full.conflicts()
    assert type(full.make_drafter("mtp", spec_model, {"n_max": 2})).__module__ == "plinth_nemotron.mtp"


def test_mtp_drafter_refuses_a_file_without_head(files, reg):
    from plinth.model import load_model
    from plinth_nemotron.mtp import make_mtp_drafter

    plain = load_model(files["puzzle-no"], registry=reg)
    with pytest.raises(UserError, match="has no MTP head"):
        make_mtp_drafter(plain, {})


def test_conversion_choices(files, reg, capsys):
    from plinth.cli import main

    tmp = files["tmp"]
    capsys.readouterr()
    assert main(["--plugins", "nemotron", "convert", str(files["folder"]), "-o", str(tmp / "cli-no.gguf"),
                 "--no-mtp"]) == 0
    assert "dropped" in capsys.readouterr().err
    assert "nemotron_h_moe.nextn_predict_layers" not in GGUFFile(tmp / "cli-no.gguf").metadata
    assert main(["--plugins", "nemotron", "convert", str(files["folder"]), "-o", str(tmp / "cli.gguf"),
                 "--mtp"]) == 0
    assert GGUFFile(tmp / "cli.gguf").metadata["nemotron_h_moe.nextn_predict_layers"] == 1
    plain = golden.write_hf_folder("moe", tmp / "moe-hf")
    with pytest.raises(UserError, match="mtp=yes, but the checkpoint has no MTP head"):
        convert(plain, tmp / "x.gguf", reg, mtp="yes")
    with pytest.raises(UserError, match="mtp in auto, yes, no"):
        convert(plain, tmp / "y.gguf", reg, mtp="maybe")


def test_bad_mtp_files_are_named_errors(reg):
    md = tiny.metadata("M*E*E", nextn_predict_layers=2)
    hp = reg.arch_hparams("nemotron_h_moe", md, "t.gguf")
    assert (hp.pattern, hp.mtp_pattern) == ("M*E", "*E")
    with pytest.raises(UserError, match=r"t.gguf: the 2 MTP block\(s\) after layer 2 have the pattern 'E\*'"):
        reg.arch_hparams("nemotron_h_moe", tiny.metadata("M*EE*", nextn_predict_layers=2), "t.gguf")
    with pytest.raises(UserError, match="nextn_predict_layers' = 5 must lie in 0..4"):
        reg.arch_hparams("nemotron_h_moe", tiny.metadata("M*E*E", nextn_predict_layers=5), "t.gguf")


def test_generate_cli_with_spec_mtp(spec_model, capsys):
    from plinth.cli import main

    path = str(spec_model.path)
    assert main(["--plugins", "nemotron", "generate", "-m", path, "-n", "12", "hello"]) == 0
    text = capsys.readouterr().out
    assert main(["--plugins", "nemotron", "generate", "-m", path, "-n", "12", "--spec", "mtp",
                 "--spec-n-max", "3", "--stats", "hello"]) == 0
    got = capsys.readouterr()
    assert got.out == text  # byte-identical
    assert "accept" in got.err.lower()


# --------------------------------------------------------------------------- reference (torch)

@pytest.mark.ref
@pytest.mark.parametrize("case", ["puzzle", "h"])
def test_head_matches_a_direct_evaluation(files, reg, case):
    """The head on the converted weights vs transformers' NemotronHBlocks + the spec's projections."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from plinth.model import load_model
    from transformers.models.nemotron_h import modeling_nemotron_h as nh
    from plinth_nemotron.convert import mtp_configs

    config, seed = (PUZZLE_MTP, SEED) if case == "puzzle" else (H_MTP, 303)
    m = load_model(files[case], registry=reg)
    state = {k: torch.from_numpy(v) for k, v in golden.hf_random_state(config, seed).items()}
    per, kinds = mtp_configs(config, "ref")
    eps = config["layer_norm_epsilon"]
    blocks = []
    for i, (c, kind) in enumerate(zip(per, kinds)):
        fields = {k: v for k, v in c.items() if k not in ("architectures", "block_configs", "model_type",
                                                        "mtp_block_configs", "block_type")}
        fields["layers_block_type"] = ["full_attention" if kind == "attention" else "moe"]
        fields["num_nextn_predict_layers"] = 0
        fields.pop("hybrid_override_pattern", None)
        fields.pop("mtp_hybrid_override_pattern", None)
        cfg = nh.NemotronHConfig(**fields)
        cfg._attn_implementation = "eager"
        block = nh.NemotronHBlock(cfg, layer_idx=0).eval()
        p = f"mtp.layers.{i}."
        sd = {k[len(p):]: v for k, v in state.items() if k.startswith(p) and ".mixer." in "." + k[len(p):]
              or k == p + "norm.weight"}
        sd = {k: v for k, v in sd.items() if k.startswith(("mixer.", "norm."))}
        if kind == "moe":
            for which in ("up", "down"):
                sd[f"mixer.experts.{which}_proj"] = torch.stack(
                    [sd.pop(f"mixer.experts.{j}.{which}_proj.weight") for j in range(cfg.n_routed_experts)])
        missing, unexpected = block.load_state_dict(sd, strict=False)
        assert not missing and not unexpected, (missing, unexpected)
        blocks.append(block)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    prompt = golden.prompts("puzzle")[2][:40]
    head = m.target_view().draft_head("mtp")
    ctx = m.new_context(taps=head.taps)
    h = head.target_rows(ctx.forward(Batch.from_tokens(prompt[:-1], output="all")).features[head.taps[0]])
    got = head.run(Batch.from_tokens(prompt[1:], output="all"), h, head.new_cache())
    with torch.no_grad():
        ht = torch.from_numpy(np.asarray(h))[None]
        e = state["backbone.embeddings.weight"][torch.tensor(prompt[1:])][None]
        x = torch.cat([rms(e, state["mtp.layers.0.enorm.weight"]), rms(ht, state["mtp.layers.0.hnorm.weight"])], -1)
        x = x @ state["mtp.layers.0.eh_proj.weight"].T
        n = x.shape[1]
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        for block in blocks:
            x = block(x, attention_mask=causal if block.block_type == "full_attention" else None)
        out = rms(x, state["mtp.layers.1.final_layernorm.weight"])
        logits = (out @ state["lm_head.weight"].T)[0].numpy()
    assert float(np.abs(np.asarray(got.hidden) - out[0].numpy()).max()) <= 1e-4
    assert float(np.abs(np.asarray(got.logits) - logits).max()) <= 1e-4

"""The checkpoint's ``mtp_dspark`` head, converted, drafts losslessly for the Mistral Large 4 target.

One HF-style folder (the ``issue`` case plus a random ``mtp_dspark.*`` head at O(1) scale) is converted
into the text GGUF and the DSpark draft GGUF; the draft runs through plinth-dspark (drafter ``dspark``,
option ``draft``) against the converted target. :func:`plinth.testing.drafters.check_drafter_contract`
checks that greedy output equals plain greedy decoding and that the target's cache after rollback
(latent rows and indexer keys) equals plain decoding's, with and without confidence pruning; the CLI
run ``plinth generate --spec dspark --draft FILE`` prints the plain run's text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plinth.testing import load_module

head = load_module(Path(__file__).resolve().parent / "test_dspark_head.py")
N_MAX = 5  # the converted head's block size (anchor-first: up to 5 drafts per block)
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def converted(tmp_path_factory, with_byte_vocab):
    """(target GGUF with a byte vocabulary, DSpark draft GGUF), both from one converted checkpoint."""
    tmp = tmp_path_factory.mktemp("mistral-dspark")
    head.convert_with_draft(tmp, head.draft_state(), block_size=str(N_MAX), target_layers="0,2,3")
    return with_byte_vocab(tmp / "m.gguf", tmp / "m-vocab.gguf"), tmp / "draft.gguf"


@pytest.fixture(scope="module")
def registry():
    """The Mistral plugin with plinth-dflash and plinth-dspark, as installed (entry-point names)."""
    from plinth.testing import make_registry

    return make_registry("mistral", "dflash", "dspark")


@pytest.fixture(scope="module")
def target(converted, registry):
    from plinth.model import load_model

    return load_model(converted[0], registry=registry)


def prompts():
    rng = np.random.default_rng(23)
    motif = rng.permutation(256)[:5].tolist()
    return [motif * 3 + [motif[0]], rng.permutation(256)[:9].tolist()]


@pytest.mark.parametrize("options", [{}, {"p_min": 0.4}], ids=["no-pruning", "p_min-0.4"])
def test_converted_head_is_lossless(target, converted, registry, options):
    from plinth.testing.drafters import check_drafter_contract

    draft = str(converted[1])
    made = []

    def make():
        made.append(registry.make_drafter("dspark", target, {"draft": draft, **options}))
        return made[-1]

    stats = check_drafter_contract(target, make, prompts(), max_tokens=MAX_TOKENS, n_max=N_MAX, atol=2e-5)
    assert all(s.n_drafts > 0 for s in stats)
    dr = made[-1]
    assert dr.name == "dspark" and dr.head_source == "target"  # the head shares the target's LM head
    assert dr.hp.target_layers == (1, 3, 4) and dr.ds.has_confidence_head and dr.ds.sample_from_anchor
    if options:
        assert sum(d.stats["pruned"] for d in made) > 0  # the confidence threshold did cut drafts


def test_cli_generate_with_the_converted_head(converted, capsys):
    from plinth.cli import main

    model, draft = map(str, converted)
    base = ["--plugins", "mistral,dflash,dspark", "generate", "hello", "-m", model, "-n", "12", "--temp", "0"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--spec", "dspark", "--draft", draft, "--spec-n-max", str(N_MAX), "--stats"]) == 0
    out = capsys.readouterr()
    assert out.out == plain and plain.strip()
    assert "dspark: pruned positions" in out.err

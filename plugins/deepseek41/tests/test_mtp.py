"""The ``mtp`` drafter on a deepseek4 target with an MTP block.

transformers builds no MTP module (it ignores ``mtp.*``), so there is no reference to match
here: the block's input assembly and head are checked against a direct numpy evaluation of the
formula on the file's weights (clearly a self-check of the same formula, not an independent
implementation; the block in between is the main model's block, which does match transformers),
and the drafter is checked with the lossless contract (greedy output identical to plain
decoding, the target's cache after speculation equal to plain decoding's).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import plinth
from plinth.graph import Batch
from plinth.errors import UserError
from plinth.gguf import GGUFFile
from plinth.testing import load_module, random_tensors, write_gguf
from plinth.testing.drafters import check_drafter_contract
from plinth_deepseek41.deepseek4 import load_hparams, tensor_specs
from plinth_deepseek41.mtp import MtpDrafter

golden = load_module(Path(__file__).resolve().parent / "golden" / "make_golden.py")


def with_mtp(path: Path, out: Path, seed: int = 9) -> Path:
    """A copy of a converted deepseek4 file plus one random MTP block (blk.{n_layer}.*)."""
    gf = GGUFFile(path)
    md = dict(gf.metadata)
    md["deepseek4.nextn_predict_layers"] = 1
    # as plinth's converter writes it: the ratios cover the MTP layer (a list of block_count entries with
    # nextn_predict_layers set is llama.cpp's separate MTP head file)
    md["deepseek4.attention.compress_ratios"] = [int(r) for r in md["deepseek4.attention.compress_ratios"]] + [0]
    hp = load_hparams(md, str(out))
    mtp_specs = [s for s in tensor_specs(hp) if s.name.startswith(f"blk.{hp.n_layer}.")]
    extra = random_tensors(mtp_specs, seed=seed, scale=0.3)
    extra[f"blk.{hp.n_layer}.nextn.hc_head_scale.weight"] = np.array([1.1], np.float32)
    tensors = {n: np.asarray(gf.raw(n)) for n in gf.tensors}
    return write_gguf(out, md, {**tensors, **extra})


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds4-mtp")
    reg = golden.registry()
    base = golden.plinth_model("flash", tmp, reg, vocab=True)
    return plinth.load_model(with_mtp(base.path, tmp / "mtp.gguf"), registry=reg)


def test_mtp_block_math(target):
    g, hp, w = target.graph, target.hparams, target.weights
    assert g.n_mtp == 1
    rng = np.random.default_rng(0)
    n, hc, e = 5, hp.hc, hp.n_embd
    toks = rng.integers(0, hp.n_vocab, n)
    h = rng.standard_normal((n, hc * e)).astype(np.float32)
    head = g.draft_heads()["mtp"]
    out = g.mtp(Batch.from_tokens(toks.tolist(), output="all"), h, head.new_cache())
    b = f"blk.{hp.n_layer}."

    def rms(x, wt):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + hp.norm_eps) * wt

    emb = rms(w["token_embd.weight"][toks], w[b + "nextn.enorm.weight"])
    x0 = np.stack([np.concatenate([emb, rms(h.reshape(n, hc, e)[:, c], w[b + "nextn.hnorm.weight"])], -1)
                   @ w[b + "nextn.eh_proj.weight"].T for c in range(hc)], axis=1)
    batch = Batch.from_tokens(toks.tolist(), output="all")
    cache = head.new_cache()
    with cache.forward(batch):
        x1 = g.block(hp.n_layer, x0, g.step(batch, cache))
    flat = x1.reshape(n, -1)
    mix = (flat / np.sqrt((flat ** 2).mean(-1, keepdims=True) + hp.norm_eps)) @ w[b + "nextn.hc_head_fn.weight"].T
    pre = 1 / (1 + np.exp(-(mix * w[b + "nextn.hc_head_scale.weight"][0] + w[b + "nextn.hc_head_base.weight"])))
    y = rms(((pre + hp.hc_eps)[:, :, None] * x1).sum(1),
            w[b + "nextn.shared_head_norm.weight"])
    np.testing.assert_allclose(out.logits, y @ w["output.weight"].T, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out.hidden, flat, atol=1e-5, rtol=1e-5)  # (f32 sums in another order)


def test_mtp_drafter_is_lossless(target):
    prompts = [golden.prompts("flash")[2][:11], golden.prompts("flash")[1]]
    stats = check_drafter_contract(target, lambda: MtpDrafter(target, n_draft=3), prompts, max_tokens=20,
                                   n_max=3, atol=2e-5, rtol=2e-5)
    assert sum(s.n_drafts for s in stats) > 0


def test_mtp_drafter_through_the_registry(target):
    reg = golden.registry()
    d = reg.make_drafter("mtp", target, {"n_max": 2})
    assert d.name == "mtp" and d.requirements().taps == (target.graph.wide_tap,)  # the whole streams


def test_mtp_drafter_refuses_a_file_without_mtp(tmp_path):
    plain = golden.plinth_model("hca_only", tmp_path)
    with pytest.raises(UserError, match="ships no MTP block"):
        MtpDrafter(plain)

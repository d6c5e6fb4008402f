"""plinth train-drafter: the prompt set, the data shards, the torch draft against the plugin's forward,
a short resumable training run and its export (torch pieces skip without torch)."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from plinth.train import prompts as P


def test_held_out_subjects_never_trained():
    train = P.train_prompts()
    trained = {p.subject for p in train}
    for kind in ("chat", "code", "summarise"):
        ev = P.eval_prompts(kind, n=24)
        assert len(ev) == 24
        assert all(P.held_out(p.subject) and p.subject not in trained for p in ev)
        texts = {p.text for p in train}
        assert not any(p.text in texts for p in ev)
    assert {p.kind for p in P.eval_prompts("chat")} == {"chat"}
    assert all(p.text.startswith(("Summarize", "Rewrite")) for p in P.eval_prompts("summarise"))


def test_prompt_set_is_deterministic_and_mixed():
    a = P.all_prompts(0)
    P.all_prompts.cache_clear()
    b = P.all_prompts(0)
    assert [p.text for p in a[:200]] == [p.text for p in b[:200]]
    head = a[:1000]
    share = {k: sum(p.kind == k for p in head) / len(head) for k in P.MIX}
    for k, want in P.MIX.items():
        assert abs(share[k] - want) < 0.02, (k, share)
    assert len(a) > 10000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from plinth_dflash.testkit import tiny_target

    d = tmp_path_factory.mktemp("train")
    model = tiny_target(d / "target.gguf", "llama", n_layer=3)
    return d, model


def test_generated_shards_extend_and_resume(tiny):
    from plinth.train.data import data_tokens, generate, iter_sequences, list_shards

    d, model = tiny
    prompts = [P.Prompt("chat", f"t{i}", f"hello number {i}") for i in range(12)]
    data = d / "data"
    n, a = generate(model.path, data, answer_tokens=40, shard_prompts=4, max_tokens=12, max_batch=4,
                    prompts=prompts, progress=False)
    first = list_shards(data)
    assert 1 <= len(first) < 3 and a >= 40
    n2, a2 = generate(model.path, data, answer_tokens=10_000, shard_prompts=4, max_tokens=12, max_batch=4,
                      prompts=prompts, progress=False)
    assert len(list_shards(data)) == 3 and n2 == 12 and a2 > a
    assert data_tokens(data)[:2] == (12, a2)
    for toks, npr, idx in iter_sequences(data):
        assert 0 < npr < toks.size <= npr + 13
    from plinth.errors import UserError

    with pytest.raises(UserError, match="another recipe"):
        generate(model.path, data, answer_tokens=10_000, shard_prompts=4, max_tokens=12, max_batch=4,
                 temperature=0.5, prompts=prompts, progress=False)


def test_torch_draft_equals_plugin_forward(tiny, tmp_path):
    torch = pytest.importorskip("torch")
    from plinth.speculative.base import TargetOutput
    from plinth.train.export import export_gguf
    from plinth.train.features import TargetFeatures, embed_table
    from plinth.train.model import DraftConfig, DraftNet
    from plinth_dspark.drafter import DSparkDrafter
    from plinth_dspark.format import load_dspark

    _, tgt = tiny
    hp = tgt.hparams
    v = tgt.n_vocab
    d2t = np.sort(np.random.default_rng(0).choice(v, 100, replace=False))
    c = DraftConfig(n_vocab=v, draft_vocab=100, n_embd=hp.n_embd, n_layer=2, n_head=hp.n_head[0],
                    n_head_kv=hp.n_head_kv[0], head_dim=hp.head_dim, n_ff=hp.n_ff[0], taps=(1, 3), block_size=8,
                    mask_token=5, rope_base=float(hp.rope_base), norm_eps=float(hp.norm_eps), markov_rank=16)
    torch.manual_seed(0)
    net = DraftNet(c)
    with torch.no_grad():  # norms away from 1, heads big enough to move the chain
        for p in net.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
        net.markov_w1.mul_(30)
        net.conf_w.mul_(30)
        net.d2t.copy_(torch.from_numpy(d2t))
        # per-channel feature scales over three decades (export folds them into fc)
        net.feat_scale.copy_(torch.exp(torch.empty_like(net.feat_scale).uniform_(-3.5, 3.5)))
    path = export_gguf(net, c, tmp_path / "d.gguf", quant="f32")
    toks = np.random.default_rng(1).integers(10, 200, size=40)
    feats, _ = TargetFeatures(tgt, c.taps, d2t)(toks)
    pos = 30
    dr = DSparkDrafter(tgt, load_dspark(path, tgt.backend))
    dr.begin(0, toks[:pos].tolist())
    e = hp.n_embd
    dr.process(TargetOutput(seq=0, phase="prefill", tokens=toks[:pos], positions=np.arange(pos),
                            features={t: feats[:pos, i * e:(i + 1) * e] for i, t in enumerate(c.taps)}))
    out = dr.block_outputs(0, int(toks[pos]), pos, 8)
    embed = torch.nn.Embedding.from_pretrained(torch.from_numpy(embed_table(tgt)))
    with torch.no_grad():
        ctx = net.context(torch.from_numpy(feats[:pos]))
        hid = net.blocks(embed, torch.from_numpy(toks[:pos + 1]), torch.tensor([pos]), ctx)[0]
        prev = torch.tensor([int(toks[pos])] + [int(t) for t in out["tokens"][:-1]])
        z, conf = net.heads(hid, prev)
    assert np.abs(z.numpy() - out["logits"]).max() < 1e-4 * max(1.0, np.abs(out["logits"]).max())
    np.testing.assert_allclose(torch.sigmoid(conf).numpy(), out["conf"], atol=1e-5)
    assert list(d2t[z.argmax(-1).numpy()]) == list(out["tokens"])
    assert len(set(out["tokens"].tolist())) > 1  # the chain is not trivially constant


@pytest.mark.parametrize("objective", ["dspark", "dflash"])
def test_training_resumes_and_exports(tiny, tmp_path, objective, monkeypatch):
    """DSpark trains on features recorded with the data (no target forward: refused here), DFlash on data
    without them (features computed by a target forward)."""
    pytest.importorskip("torch")
    from plinth.train import features
    from plinth.train.data import generate
    from plinth.train.trainer import TrainOptions, train

    d, model = tiny
    data = d / f"data-{objective}"
    prompts = [P.Prompt("chat", f"t{i}", f"tell me about {i}") for i in range(8)]
    recorded = objective == "dspark"
    generate(model.path, data, answer_tokens=10_000, shard_prompts=4, max_tokens=24, max_batch=4, prompts=prompts,
             progress=False, temperature=1.0, top_p=1.0, taps=(1, 3) if recorded else ())
    if recorded:
        def no_forward(*a, **k):
            raise AssertionError("recorded features were not used")

        monkeypatch.setattr(features.TargetFeatures, "__call__", no_forward)
    out = tmp_path / "draft.gguf"
    opt = TrainOptions(target=str(model.path), out=str(out), data=str(data), objective=objective, n_layer=1,
                       taps=(1, 3),
                       block_size=4, draft_vocab=64, markov_rank=8, anchors=4, seqs=2, steps=6, warmup=2,
                       save_every=1e9, threads=1, quant="f32")
    quiet = {"progress": False, "log": lambda s: None}
    first = train(attrs.evolve(opt, run_steps=3), **quiet)  # "interrupted" after 3 steps
    assert first["step"] == 3 and first["tokens"] > 0
    import torch

    st = torch.load(str(out) + ".ckpt/state.pt", weights_only=False)
    assert st["step"] == 3 and st["d2t"].size == (64 if objective == "dspark" else model.n_vocab)
    from plinth.errors import UserError

    with pytest.raises(UserError, match="other settings"):  # other settings are another run
        train(attrs.evolve(opt, anchors=5), **quiet)
    with pytest.raises(UserError, match="other settings"):  # a shorter schedule too
        train(attrs.evolve(opt, steps=2), **quiet)
    again = train(opt, **quiet)  # the same command continues where it stopped
    assert again["step"] == 6 and again["tokens"] > first["tokens"]
    assert [h["step"] for h in torch.load(str(out) + ".ckpt/state.pt", weights_only=False)["history"]] == [3, 6]
    longer = train(attrs.evolve(opt, steps=8), **quiet)  # a longer schedule continues the run
    assert longer["step"] == 8 and longer["tokens"] > again["tokens"]
    from plinth.gguf import GGUFFile

    md = GGUFFile(out).metadata
    assert md["plinth.train.steps"] == 8 and "objective" in md["plinth.train.recipe"]
    kind = "dspark" if objective == "dspark" else "dflash"
    from plinth.plugins import default_registry

    drafter = default_registry().make_drafter(kind, model, {"draft": str(out)})
    assert drafter.requirements().taps


def test_shipped_drafter_lookup(tiny, tmp_path, monkeypatch):
    """--spec dspark without --draft finds the drafter made for the target; --draft NAME finds it by name;
    without one for the target the error names the option and what is shipped."""
    from plinth.errors import UserError
    from plinth.gguf import GGUFFile
    from plinth.plugins import default_registry
    from plinth_dspark import drafters
    from plinth_dspark.testkit import write_tiny_dspark

    _, model = tiny
    monkeypatch.setattr(drafters, "HERE", tmp_path)
    reg = default_registry()
    with pytest.raises(UserError, match="pass --draft FILE.gguf.*shipped: none"):
        reg.make_drafter("dspark", model, {})
    name = GGUFFile(model.path).metadata.get("general.name")
    kw = dict(n_vocab=model.n_vocab, n_embd=model.hparams.n_embd, taps=(1, 3), block_size=4, mask_token=5)
    write_tiny_dspark(tmp_path / "other.gguf", **kw)  # no target name: never chosen by default
    with pytest.raises(UserError, match="shipped: other"):
        reg.make_drafter("dspark", model, {})
    from plinth.convert import write_gguf
    from plinth_dflash.testkit import random_draft_tensors, tiny_draft_metadata
    from plinth_dspark.testkit import dspark_tensors

    md = tiny_draft_metadata("dflash", n_vocab=model.n_vocab, n_embd=model.hparams.n_embd, taps=(1, 3), block_size=4,
                             mask_token=5)
    md[drafters.KEY_TARGET] = name
    tensors = random_draft_tensors(md, "dflash") | dspark_tensors(model.n_vocab, model.hparams.n_embd)
    write_gguf(tmp_path / "mine.gguf", md, tensors)
    assert str(reg.make_drafter("dspark", model, {}).draft_file.path) == str(tmp_path / "mine.gguf")
    assert str(reg.make_drafter("dspark", model, {"draft": "other"}).draft_file.path) == str(tmp_path / "other.gguf")
    assert str(reg.make_drafter("dspark", model, {"draft": "other.gguf"}).draft_file.path).endswith("other.gguf")


def test_recorded_features_are_the_targets(tiny, tmp_path):
    """Shards made with taps carry the features of the forwards that made the answers (prefill chunks and
    decode steps) and the target's top-k next-token logits; they match one forward over the whole sequence."""
    from plinth.graph import Batch
    from plinth.train.data import generate, list_shards

    _, model = tiny
    prompts = [P.Prompt("chat", f"t{i}", f"features {i}") for i in range(4)]
    generate(model.path, tmp_path, answer_tokens=10_000, shard_prompts=4, max_tokens=10, max_batch=4,
             prompts=prompts, progress=False, taps=(1, 3))
    with np.load(list_shards(tmp_path)[0]) as z:
        toks, off, npr = z["tokens"], z["offsets"], z["n_prompt"]
        feats, ids, val, has = z["feats"], z["top_ids"], z["top_logits"], z["has_logits"]
    e = model.hparams.n_embd
    assert feats.shape == (toks.size, 2 * e) and ids.shape[0] == toks.size
    for j in range(len(npr)):
        seq = toks[off[j]:off[j + 1]].astype(np.int64)
        ctx = model.new_context(taps=(1, 3))
        out = ctx.forward(Batch.from_tokens(seq[:-1], output="all"))
        want = np.concatenate([np.asarray(out.features[t]) for t in (1, 3)], axis=1)
        got = feats[off[j]:off[j + 1] - 1].astype(np.float32)
        np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
        h = has[off[j]:off[j + 1] - 1]
        # every answer position and the last prompt row have logits; their top-1 is the forward's argmax
        assert h[npr[j] - 1:].all() and not h[:npr[j] - 1].any()
        top = ids[off[j]:off[j + 1] - 1][np.arange(len(h)), val[off[j]:off[j + 1] - 1].astype(np.float32).argmax(1)]
        lg = np.asarray(out.logits)
        assert (top[h] == lg[h].argmax(1)).mean() > 0.9


def test_training_learns_the_targets_answers(tiny, tmp_path):
    """On greedy answers of a tiny target, a short DSpark run lifts the greedy acceptance of its training blocks
    well above the untrained draft's (the objective, the targets and the gradients line up)."""
    pytest.importorskip("torch")
    from plinth.train.data import generate
    from plinth.train.trainer import TrainOptions, train

    d, model = tiny
    data = tmp_path / "data"
    prompts = [P.Prompt("chat", f"t{i}", f"story {i} about {i * 7}") for i in range(8)]
    generate(model.path, data, answer_tokens=10_000, shard_prompts=8, max_tokens=40, max_batch=8, prompts=prompts,
             progress=False, temperature=0.0, taps=(1, 3))
    opt = TrainOptions(target=str(model.path), out=str(tmp_path / "d.gguf"), data=str(data), n_layer=1, taps=(1, 3),
                       block_size=4, draft_vocab=128, markov_rank=16, anchors=16, seqs=4, steps=120, warmup=5,
                       lr=3e-3, save_every=1e9, threads=1, quant="f32", init="random")
    last = train(opt, progress=False, log=lambda s: None)
    import torch

    hist = torch.load(str(tmp_path / "d.gguf.ckpt/state.pt"), weights_only=False)["history"]
    assert last["est_tau"] > 1.3, hist  # untrained: ~1.0 (1 in 128 draft ids right by chance)


def _write_shard(path, seqs, n_prompt):
    toks = np.concatenate(seqs).astype(np.int32)
    off = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    np.savez(path, tokens=toks, offsets=off, n_prompt=np.asarray(n_prompt, np.int32),
             prompt_index=np.arange(len(seqs), dtype=np.int64))


def test_bigram_markov_start_predicts_the_corpus_bigrams(tmp_path):
    """The Markov head's start (rank r factorisation of the answers' log bigrams) ranks each previous token's most
    frequent follower first, as a count table says (answers only: the prompt tokens' bigrams are not counted).
    A permutation's bigrams are full rank, so the rank here is the vocabulary's (the randomised SVD must then be
    exact); at rank 16 it keeps far less."""
    from plinth.train.trainer import bigram_markov

    rng = np.random.default_rng(3)
    v = 300
    follow = rng.permutation(v)  # token a is followed by follow[a] 3 times in 4, by a random token otherwise
    seqs, npr = [], []
    for _ in range(40):
        p = rng.integers(0, v, size=5)
        s = [int(rng.integers(0, v))]
        for _ in range(120):
            s.append(int(follow[s[-1]]) if rng.random() < 0.75 else int(rng.integers(0, v)))
        seqs.append(np.concatenate([p, s]))
        npr.append(5)
    _write_shard(tmp_path / "shard-00000.npz", seqs, npr)
    d2t = np.arange(v)
    w1, w2 = bigram_markov(str(tmp_path), d2t, v, rank=v, max_prev=v)
    counts = np.zeros((v, v))
    for s, n in zip(seqs, npr):
        np.add.at(counts, (s[n - 1:-1], s[n:]), 1)
    seen = np.flatnonzero(counts.sum(1) >= 8)
    assert seen.size > 100
    pred = (w1[seen] @ w2.T).argmax(1)
    agree = np.mean(pred == counts[seen].argmax(1))
    assert agree > 0.95, agree
    w1s, w2s = bigram_markov(str(tmp_path), d2t, v, rank=16, max_prev=v)
    assert w1s.shape == (v, 16) and np.mean((w1s[seen] @ w2s.T).argmax(1) == counts[seen].argmax(1)) < 0.5
    assert np.abs(w1[np.flatnonzero(counts.sum(1) == 0)]).max(initial=0.0) == 0.0  # unseen rows start at 0


def test_feature_scale_is_the_inverse_channel_rms():
    from plinth.train.trainer import feature_scale

    rng = np.random.default_rng(0)
    rms = np.exp(rng.uniform(-1, 5, size=12))  # channels from 0.4 to ~150, as a residual stream's are
    rms[5] = 0.0  # a dead channel gets the largest scale allowed (1000 / the largest RMS), not infinity
    seqs = {("s", j): (rng.standard_normal((50, 12)) * rms).astype(np.float16) for j in range(4)}
    load = lambda name, j: (np.zeros(50, np.int64), 0, (seqs[(name, j)],))
    got = feature_scale([("s", j) for j in range(4)], load, feats_of=None, rows=10_000)
    allf = np.concatenate([seqs[("s", j)] for j in range(4)]).astype(np.float64)
    want = 1.0 / np.sqrt((allf ** 2).mean(0))
    live = rms > 0
    np.testing.assert_allclose(got[live], want[live], rtol=1e-5)
    np.testing.assert_allclose(got[live] * rms[live], 1.0, rtol=0.3)  # and that is about 1 / the channel's scale
    assert got[5] == pytest.approx(1e3 * got[live].min(), rel=1e-5)


def test_a_recording_with_holes_is_refused():
    from plinth.train.data import check_recorded

    n, npr = 12, 5
    rec = [np.ones((n, 8), np.float16), np.zeros((n, 4), np.int32), np.zeros((n, 4), np.float16), np.ones(n, bool)]
    rec[0][-1] = 0  # the last token never ran: fine
    check_recorded(rec, npr, n, 0)
    hole = [a.copy() for a in rec]
    hole[3][7] = False  # an answer row without its logits
    with pytest.raises(RuntimeError, match="prompt 3: the recorder missed 0 of 11 feature rows and 1 of 7"):
        check_recorded(hole, npr, n, 3)
    hole = [a.copy() for a in rec]
    hole[0][2] = 0  # a prompt row without features
    with pytest.raises(RuntimeError, match="missed 1 of 11 feature rows"):
        check_recorded(hole, npr, n, 3)


def test_bench_spec_reports_acceptance_on_held_out_prompts(tiny, capsys):
    """plinth bench --spec: per kind tau, per-position acceptance, both speeds, identical outputs, in one run."""
    from plinth.cli import main

    _, model = tiny
    rc = main(["bench", "-m", str(model.path), "--spec", "ngram", "--prompts", "chat,code", "--n-prompts", "2",
               "--decode-tokens", "12", "--threads", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = [ln for ln in out.splitlines() if " tau " in ln]
    assert [ln.split()[0] for ln in lines] == ["chat", "code"]
    for ln in lines:
        assert "identical 2/2" in ln and "speed-up" in ln and "per position" in ln
        assert "| policy drafted " in ln and "skipped" in ln  # --spec-policy auto's decisions (the default)
    assert "policy auto;" in out
    assert main(["bench", "-m", str(model.path), "--spec", "ngram", "--prompts", "chat", "--n-prompts", "1",
                 "--decode-tokens", "8", "--threads", "1", "--spec-policy", "always"]) == 0
    out = capsys.readouterr().out
    assert "policy always;" in out and "| policy" not in out
    with pytest.raises(SystemExit):
        main(["bench", "-m", str(model.path), "--spec", "nosuchdrafter"])
    assert main(["bench", "-m", str(model.path), "--spec", "ngram", "--prompts", "poems"]) != 0
    assert "prompt kind 'poems'" in capsys.readouterr().err

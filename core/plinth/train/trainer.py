"""Training a block drafter (DSpark, or plain DFlash) for one target GGUF, resumably.

One step: ``seqs`` sequences from the data shards; for each, the target's features and next-token
logits come from plinth's own forward (:class:`plinth.train.features.TargetFeatures`), ``anchors``
block starts are drawn among its answer tokens, and every block ``[anchor, MASK x (B-1)]`` is
predicted in one draft forward (the blocks of a sequence share its context rows).

Objective (DSpark; speculators' ``dspark`` loss and DeepSpec's recipe): per prediction row ``i`` of a
block, with ``p`` the target's next-token distribution over the draft vocabulary and ``q`` the
draft's (Markov-biased) one,

    L = sum_i w_i (0.1 CE(p, q) + 0.9 TV(p, q)) / sum_i w_i  +  1.0 BCE(conf_i, 1 - TV(p, q))

with ``w_i = exp(-i / gamma)`` (gamma 4 for B = 8; rows past the sequence end weigh 0) and the
Markov head fed the previous token of the sequence (teacher forcing). ``objective="dflash"``:
no Markov / confidence head, the 1+N block (rows 1..B-1 predict), and the weighted CE alone.

Checkpoints (``<out>.ckpt/state.pt``): the weights, the optimiser, the data position, the step and
a history of figures; the same command continues an interrupted run. The GGUF ``-o`` file is
rewritten at every checkpoint, and a copy named by its training tokens is kept for curves.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import numpy as np

from ..errors import UserError


@attrs.define
class TrainOptions:
    target: str
    out: str
    data: str
    objective: str = "dspark"  # or "dflash"
    n_layer: int = 2
    taps: tuple[int, ...] = ()  # () = spread over the target
    block_size: int = 8
    draft_vocab: int = 8192
    markov_rank: int = 64
    init: str = "target"  # "target": layers from the target's first ones, its final norm, bigram Markov head; "random"
    anchors: int = 32  # blocks per sequence
    seqs: int = 4  # sequences per optimiser step
    lr: float = 6e-4
    warmup: int = 50
    steps: int = 4000
    minutes: float = 0.0  # stop after this long in this run (0: no limit)
    run_steps: int = 0  # stop after this many steps in this run (0: no limit); the schedule is unchanged
    gamma: float = 4.0
    feat_norm: bool = True  # scale each feature channel by 1 / its RMS over the data (folded into fc at export)
    ce_weight: float = 0.1  # dspark: the loss is ce_weight * CE + (1 - ce_weight) * TV
    save_every: float = 300.0  # seconds between checkpoints
    threads: int = 2
    seed: int = 0
    quant: str = "q8_0"  # "q8_0" or "f16" or "f32" for the exported matrices
    max_len: int = 1024
    cache_mb: float = 6144.0  # shards kept in memory (the epoch order visits them at random)
    eval_tau_seqs: int = 0

    def recipe(self) -> dict[str, Any]:
        """What defines the run (a resumed run must match it)."""
        keys = ("objective", "n_layer", "taps", "block_size", "draft_vocab", "markov_rank", "init", "anchors",
                "seqs", "lr", "warmup", "steps", "gamma", "seed", "ce_weight", "feat_norm")
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.asdict(self).items() if k in keys}


TOPK_ONLINE = 64  # target logits kept per position when features are computed here (as the recorder keeps)


def default_taps(n_layer: int, n: int = 4) -> tuple[int, ...]:
    """n taps spread over the target: DFlash's rule over layer outputs 1..L-3 (+1: plinth taps are layer
    inputs), with the last one moved to the residual before the final norm (it carries the next token)."""
    ids = [round(1 + i * (n_layer - 4) / (n - 1)) + 1 for i in range(n)]
    ids[-1] = n_layer
    return tuple(sorted(set(ids)))


def corpus_d2t(data_dir: str, n_vocab: int, size: int, always: tuple[int, ...] = ()) -> np.ndarray:
    """The ``size`` most frequent target tokens of the corpus in ``data_dir`` (ascending ids), plus ``always``.

    Counted: answer tokens (weight 4), the target's top-8 candidates at answer positions where the shards
    recorded its logits (weight 1: tokens it would say elsewhere, which a small corpus has not shown yet),
    prompt tokens (weight 1)."""
    from .data import list_shards

    counts = np.zeros(n_vocab, dtype=np.int64)
    for path in list_shards(data_dir):
        with np.load(path) as z:
            toks, off, npr = z["tokens"].astype(np.int64), z["offsets"], z["n_prompt"]
            answer = np.zeros(toks.size, bool)
            for j in range(len(npr)):
                answer[off[j] + npr[j]:off[j + 1]] = True
            np.add.at(counts, toks[answer], 4)
            np.add.at(counts, toks[~answer], 1)
            if "top_ids" in z.files:
                ids, val, has = z["top_ids"], z["top_logits"].astype(np.float32), z["has_logits"]
                rows = has & answer
                top = np.argsort(-val[rows], axis=1)[:, :8]
                np.add.at(counts, np.take_along_axis(ids[rows], top, axis=1).astype(np.int64).ravel(), 1)
    if not counts.any():
        raise UserError(f"{data_dir}: no training answers yet; generate data first")
    for t in always:
        counts[t] = counts.max() + 1
    order = np.argsort(-counts, kind="stable")[:size]
    return np.sort(order).astype(np.int64)


class Progress:
    """One stderr line, rewritten: step, tokens, loss, estimated acceptance, speed."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.enabled = total, enabled and sys.stderr.isatty()
        self.t0 = time.time()
        self.last = 0.0

    def update(self, step: int, fig: dict[str, float], force: bool = False) -> None:
        now = time.time()
        if not force and now - self.last < 2.0:
            return
        self.last = now
        rate = fig.get("pos_per_s", 0.0)
        left = (self.total - step) * fig.get("s_per_step", 0.0)
        line = (f"step {step}/{self.total} | {fig.get('tokens', 0) / 1e3:.0f}k tok | loss {fig.get('loss', 0):.3f} | "
                f"acc@1 {fig.get('acc1', 0):.2f} | est tau {fig.get('tau', 0):.2f} | {rate:.0f} pos/s | "
                f"eta {left / 60:.0f} min")
        if self.enabled:
            sys.stderr.write("\r" + line[:150].ljust(150))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def train(opt: TrainOptions, log: Callable[[str], None] | None = None, progress: bool = True) -> dict[str, Any]:
    """Run (or continue) the training ``opt`` describes; returns the last figures."""
    import torch

    from ..model import load_model
    from . import features as FT
    from .data import iter_sequences, list_shards
    from .export import export_gguf
    from .model import DraftConfig, DraftNet, block_targets

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    torch.set_num_threads(max(1, int(opt.threads)))
    if not 0.0 <= opt.ce_weight <= 1.0:
        raise UserError(f"--ce-weight must be within [0, 1], not {opt.ce_weight}")
    if opt.objective not in ("dspark", "dflash"):
        raise UserError(f"--objective must be dspark or dflash, not {opt.objective!r}")
    out = Path(opt.out)
    ckdir = Path(str(out) + ".ckpt")
    ckdir.mkdir(parents=True, exist_ok=True)
    state_path = ckdir / "state.pt"
    model = load_model(opt.target)
    hp = model.hparams
    n_layer_t = int(hp.n_layer)
    taps = tuple(opt.taps) or default_taps(n_layer_t)
    opt.taps = taps
    n_vocab = int(model.n_vocab)
    tok = model.tokenizer
    state = None
    if state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        # runs made before these settings existed used these values
        state["recipe"] = {"ce_weight": 0.1, "feat_norm": False, **state["recipe"]}
        state["model"].setdefault("feat_scale", None)
        diff = {k: (state["recipe"].get(k), v) for k, v in opt.recipe().items() if state["recipe"].get(k) != v}
        if set(diff) == {"steps"} and opt.steps > state["step"]:
            log(f"train: the schedule of {ckdir} goes from {state['recipe']['steps']} to {opt.steps} steps (the cosine "
                f"decay is {'stretched: the learning rate rises again' if opt.steps > state['recipe']['steps'] else 'compressed: the learning rate drops'})")
            state["recipe"] = opt.recipe()
        if state["recipe"] != opt.recipe():
            raise UserError(f"{ckdir}: the checkpoint was made with other settings {diff}; pass the same options "
                            f"to continue it, or another -o to start afresh")
        d2t = np.asarray(state["d2t"], dtype=np.int64)
        log(f"train: continuing {ckdir} at step {state['step']} ({state['tokens']} answer tokens trained)")
    else:
        always = tuple(t for t in (getattr(tok, "eos_id", None),) if t is not None)
        if opt.objective == "dflash":  # plinth-dflash drafts over the full vocabulary (no d2t)
            d2t = np.arange(n_vocab, dtype=np.int64)
        else:
            d2t = corpus_d2t(opt.data, n_vocab, min(opt.draft_vocab, n_vocab), always)
    dspark = opt.objective == "dspark"
    n_head = int(hp.n_head[0] if isinstance(hp.n_head, (tuple, list)) else hp.n_head)
    n_head_kv = int(hp.n_head_kv[0] if isinstance(hp.n_head_kv, (tuple, list)) else hp.n_head_kv)
    n_ff = int(hp.n_ff[0] if isinstance(hp.n_ff, (tuple, list)) else hp.n_ff)
    mask = mask_token(tok, n_vocab)
    cfg = DraftConfig(n_vocab=n_vocab, draft_vocab=int(d2t.size), n_embd=int(hp.n_embd), n_layer=opt.n_layer,
                      n_head=n_head, n_head_kv=n_head_kv, head_dim=int(hp.head_dim), n_ff=n_ff, taps=taps,
                      block_size=opt.block_size, mask_token=mask, rope_base=float(hp.rope_base),
                      norm_eps=float(hp.norm_eps), markov_rank=opt.markov_rank if dspark else 0,
                      confidence=dspark, sample_from_anchor=dspark)
    torch.manual_seed(opt.seed)
    net = DraftNet(cfg)
    net.d2t.copy_(torch.from_numpy(d2t))
    emb_np = FT.embed_table(model)
    embed = torch.nn.Embedding.from_pretrained(torch.from_numpy(emb_np), freeze=True)
    if state is None:
        with torch.no_grad():
            net.output.copy_(torch.from_numpy(FT.head_table(model)[d2t]))
            if opt.init == "target":
                init_from_target(net, model, n_layer_t)
                if "output_norm.weight" in model.weights:  # the draft's head reads what the target's reads
                    net.output_norm.copy_(torch.from_numpy(np.array(
                        model.backend.to_numpy(model.weights["output_norm.weight"]), dtype=np.float32)))
                if dspark:
                    w1, w2 = bigram_markov(opt.data, d2t, n_vocab, opt.markov_rank)
                    net.markov_w1.copy_(torch.from_numpy(w1))
                    net.markov_w2.copy_(torch.from_numpy(w2))
            elif opt.init != "random":
                raise UserError(f"--init must be target or random, not {opt.init!r}")
    params = [p for p in net.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=opt.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, tokens, positions = 0, 0, 0
    history: list[dict[str, Any]] = []
    data_pos = {"epoch": 0, "index": 0, "order": None}
    if state is not None:
        if state["model"]["feat_scale"] is None:
            state["model"]["feat_scale"] = torch.ones_like(net.feat_scale)
        net.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        step, tokens, positions = state["step"], state["tokens"], state["positions"]
        history, data_pos = state["history"], state["data"]
    feats_of = FT.TargetFeatures(model, taps, d2t)
    t2d = torch.full((n_vocab,), -1, dtype=torch.long)
    t2d[torch.from_numpy(d2t)] = torch.arange(d2t.size)
    from .data import read_recipe

    recorded_taps = tuple(read_recipe(opt.data).get("taps", ()))
    if recorded_taps and recorded_taps != tuple(taps):
        log(f"train: the data recorded taps {list(recorded_taps)}, this draft reads {list(taps)}: features are "
            "computed again for every sequence")
    rng = np.random.default_rng(opt.seed * 7919 + step)

    def epoch_order(epoch: int) -> list[tuple[str, int]]:
        items = []
        for p in list_shards(opt.data):
            with np.load(p) as z:
                items += [(p.name, j) for j in range(len(z["n_prompt"]))]
        r = np.random.default_rng(opt.seed + 1000 * epoch)
        idx = r.permutation(len(items))
        return [items[i] for i in idx]

    if data_pos["order"] is None:
        data_pos["order"] = epoch_order(0)
    if not data_pos["order"]:
        raise UserError(f"{opt.data}: no data shards; generate data first")
    cache: dict[str, Any] = {}  # shard name -> arrays, least recently used first, at most cache_bytes in all

    def load_seq(name: str, j: int) -> tuple[np.ndarray, int, Any]:
        """Tokens, prompt length and the recorded (features, top ids, top logits, has) or None."""
        if name in cache:
            cache[name] = cache.pop(name)
        else:
            with np.load(Path(opt.data) / name) as z:
                rec = None
                if "feats" in z.files and recorded_taps == tuple(taps):
                    rec = (z["feats"], z["top_ids"], z["top_logits"], z["has_logits"])
                cache[name] = (z["tokens"], z["offsets"], z["n_prompt"], rec)
            size = lambda v: sum(a.nbytes for a in v[:3]) + (sum(a.nbytes for a in v[3]) if v[3] else 0)
            while len(cache) > 1 and sum(size(v) for v in cache.values()) > opt.cache_mb * 2**20:
                cache.pop(next(iter(cache)))
        toks, off, npr, rec = cache[name]
        sl = slice(int(off[j]), int(off[j + 1]))
        return (np.array(toks[sl], dtype=np.int64), int(npr[j]),
                None if rec is None else tuple(a[sl] for a in rec))

    missing: set[str] = set()

    def next_seq() -> tuple[np.ndarray, int, Any]:
        while True:
            if data_pos["index"] >= len(data_pos["order"]):
                data_pos["epoch"] += 1
                data_pos["index"] = 0
                data_pos["order"] = epoch_order(data_pos["epoch"])
                log(f"\ntrain: epoch {data_pos['epoch']} over {len(data_pos['order'])} sequences")
            name, j = data_pos["order"][data_pos["index"]]
            data_pos["index"] += 1
            if not (Path(opt.data) / name).is_file():  # a shard removed since the epoch began
                if name not in missing:
                    missing.add(name)
                    log(f"\ntrain: {name} is gone from {opt.data}; its sequences are skipped this epoch")
                continue
            toks, npr, rec = load_seq(name, j)
            toks = toks[: opt.max_len]
            if rec is not None:
                rec = tuple(a[: opt.max_len] for a in rec)
            if toks.size - npr >= 3:
                return toks, npr, rec

    if state is None and opt.feat_norm:
        net.feat_scale.copy_(torch.from_numpy(feature_scale(data_pos["order"], load_seq, feats_of)))

    def lr_at(s: int) -> float:
        if s < opt.warmup:
            return opt.lr * (s + 1) / opt.warmup
        frac = min(1.0, (s - opt.warmup) / max(1, opt.steps - opt.warmup))
        return opt.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    b = cfg.block_size
    s0 = net.first_row
    m = b - s0
    wpos = torch.exp(-torch.arange(m, dtype=torch.float32) / opt.gamma)
    bar = Progress(opt.steps, enabled=progress)
    t_start = time.time() - (history[-1]["time"] if history else 0.0)  # times count over every run
    t_save = time.time()
    ema: dict[str, float] = {}
    t_step = time.time()

    def save() -> None:
        torch.save({"model": net.state_dict(), "optim": optim.state_dict(), "step": step, "tokens": tokens,
                    "positions": positions, "history": history, "data": data_pos, "recipe": opt.recipe(),
                    "d2t": d2t, "config": attrs.asdict(cfg)}, ckdir / "state.tmp")
        os.replace(ckdir / "state.tmp", state_path)
        meta = recipe_metadata(opt, step, tokens, positions, history, time.time() - t_start)
        meta["plinth.train.target_name"] = str(model.metadata.get("general.name", Path(opt.target).stem))
        export_gguf(net, cfg, out, meta, quant=opt.quant)
        export_gguf(net, cfg, ckdir / f"draft-{tokens // 1000:07d}k.gguf", meta, quant=opt.quant)  # for curves

    step_first = step
    t_run = time.time()
    while step < opt.steps:
        if opt.run_steps and step - step_first >= opt.run_steps:
            break
        if opt.minutes and time.time() - t_run > opt.minutes * 60:
            log(f"\ntrain: --minutes {opt.minutes} reached at step {step}")
            break
        for g in optim.param_groups:
            g["lr"] = lr_at(step)
        optim.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "acc1": 0.0, "tau": 0.0, "n": 0.0, "pos": 0.0}
        n_tok_step = 0
        t_feat = 0.0
        for _ in range(opt.seqs):
            toks, npr, rec = next_seq()
            t0 = time.time()
            if rec is None:  # no recorded features: one target forward now
                f_np, lg_np = feats_of(toks)
                k_top = min(TOPK_ONLINE, lg_np.shape[1])
                top = np.argpartition(-lg_np, k_top - 1, axis=1)[:, :k_top]
                rec = (f_np, d2t[top], np.take_along_axis(lg_np, top, axis=1), np.ones(toks.size, bool))
            f_np = np.asarray(rec[0], dtype=np.float32)
            t_feat += time.time() - t0
            T = toks.size
            cand = np.arange(npr, T - 1)
            k = min(opt.anchors, cand.size)
            anchors = torch.from_numpy(np.sort(rng.choice(cand, size=k, replace=False)))
            t_toks = torch.from_numpy(toks)
            ctx = net.context(torch.from_numpy(f_np))
            hidden = net.blocks(embed, t_toks, anchors, ctx)[:, s0:]  # [nb, m, E]
            lab, prev, valid = block_targets(t_toks, anchors, b, s0)
            z, conf = net.heads(hidden, t_toks[prev] if dspark else None)
            # the target's distribution for each label: its top-k logits (those in the draft vocabulary)
            ids = torch.from_numpy(np.asarray(rec[1], dtype=np.int64))[prev]  # [nb, m, K] target ids
            di = t2d[ids]  # draft indices, -1 outside d2t
            tl = torch.from_numpy(np.asarray(rec[2], dtype=np.float32))[prev].masked_fill(di < 0, float("-inf"))
            has = torch.from_numpy(np.asarray(rec[3], dtype=bool))[prev] & (di >= 0).any(-1)
            valid = valid & has
            tl = torch.where(valid[..., None], tl, torch.zeros_like(tl))
            p = torch.softmax(tl, dim=-1)
            logq = torch.gather(torch.log_softmax(z, dim=-1), -1, di.clamp_min(0))
            ce = -(p * logq).sum(-1)
            w = wpos[None, :] * valid.float()
            wsum = w.sum().clamp_min(1e-6)
            if dspark:
                tv = 1.0 - torch.minimum(p, logq.exp()).sum(-1)
                loss = (w * (opt.ce_weight * ce + (1.0 - opt.ce_weight) * tv)).sum() / wsum
                if conf is not None:
                    bce = torch.nn.functional.binary_cross_entropy_with_logits(conf, (1.0 - tv).detach(),
                                                                               reduction="none")
                    loss = loss + (w * bce).sum() / wsum
            else:
                loss = (w * ce).sum() / wsum
            (loss / opt.seqs).backward()
            with torch.no_grad():
                # greedy acceptance estimate: the draft's pick against the target's argmax (in the draft vocabulary)
                want = torch.gather(di, -1, tl.argmax(-1, keepdim=True)).squeeze(-1)
                hit = (z.argmax(-1) == want) & valid
                run = torch.cumprod(hit.float(), dim=1)
                sums["loss"] += float(loss)
                sums["acc1"] += float(hit[:, 0].float().mean())
                sums["tau"] += float((1.0 + run.sum(1)).mean())
                sums["n"] += 1
                sums["pos"] += float(valid.sum())
            n_tok_step += T - npr
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        step += 1
        tokens += n_tok_step
        positions += int(sums["pos"])
        dt = time.time() - t_step
        t_step = time.time()
        fig = {k: sums[k] / sums["n"] for k in ("loss", "acc1", "tau")}
        for k, v in fig.items():
            ema[k] = v if k not in ema else 0.95 * ema[k] + 0.05 * v
        shown = dict(ema, tokens=tokens, pos_per_s=sums["pos"] / max(dt, 1e-6), s_per_step=dt,
                     feat_share=t_feat / max(dt, 1e-6))
        bar.update(step, shown)
        if time.time() - t_save > opt.save_every or step == opt.steps:
            history.append({"step": step, "tokens": tokens, "positions": positions, "loss": ema["loss"],
                            "acc1": ema["acc1"], "est_tau": ema["tau"], "time": time.time() - t_start,
                            "epoch": data_pos["epoch"]})
            save()
            t_save = time.time()
            log(f"\ntrain: checkpoint at step {step}: {tokens} answer tokens, loss {ema['loss']:.3f}, "
                f"est tau {ema['tau']:.2f} -> {out}")
    if not history or history[-1]["step"] != step:
        history.append({"step": step, "tokens": tokens, "positions": positions, "loss": ema.get("loss"),
                        "acc1": ema.get("acc1"), "est_tau": ema.get("tau"), "time": time.time() - t_start,
                        "epoch": data_pos["epoch"]})
        save()
    bar.update(step, dict(ema, tokens=tokens), force=True)
    if progress:
        sys.stderr.write("\n")
    return history[-1]


def bigram_markov(data_dir: str, d2t: np.ndarray, n_vocab: int, rank: int, alpha: float = 1.0,
                  max_prev: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """The Markov head's start: a rank-``rank`` factorisation ``w1 [n_vocab, r]``, ``w2 [V_d, r]`` of the corpus's
    answer bigrams, ``w1[a] . w2[b] ~ log P(b | a)`` (less the row's mean) over the ``max_prev`` most frequent
    previous tokens (add-``alpha`` smoothing towards the unigram; other rows 0). The head then starts where a bigram model is
    (about a fifth of next tokens on this corpus) instead of at zero, where both factors' gradients vanish."""
    from .data import list_shards

    t2d = np.full(n_vocab, -1, dtype=np.int64)
    t2d[d2t] = np.arange(d2t.size)
    prev_l, next_l = [], []
    for path in list_shards(data_dir):
        with np.load(path) as z:
            toks, off, npr = z["tokens"].astype(np.int64), z["offsets"], z["n_prompt"]
        for j in range(len(npr)):
            s, e = int(off[j] + npr[j]), int(off[j + 1])
            if e - s >= 1 and s >= 1:
                prev_l.append(toks[s - 1:e - 1])
                next_l.append(toks[s:e])
    w1 = np.zeros((n_vocab, rank), np.float32)
    w2 = np.zeros((d2t.size, rank), np.float32)
    if not prev_l:
        return w1, w2
    prev, nxt = np.concatenate(prev_l), t2d[np.concatenate(next_l)]
    keep = nxt >= 0
    prev, nxt = prev[keep], nxt[keep]
    rows = np.argsort(-np.bincount(prev, minlength=n_vocab), kind="stable")[:max_prev]
    rows = rows[np.bincount(prev, minlength=n_vocab)[rows] > 0]
    r_of = np.full(n_vocab, -1, dtype=np.int64)
    r_of[rows] = np.arange(rows.size)
    sel = r_of[prev] >= 0
    counts = np.zeros((rows.size, d2t.size), np.float32)
    np.add.at(counts, (r_of[prev[sel]], nxt[sel]), 1.0)
    uni = (np.bincount(nxt, minlength=d2t.size) + 1.0) / (nxt.size + d2t.size)
    cond = (counts + alpha * uni[None, :]) / (counts.sum(1, keepdims=True) + alpha)
    lg = np.log(cond)
    lg -= lg.mean(1, keepdims=True)  # a row's constant is nothing to a softmax
    # a randomised truncated SVD (two power iterations): the rank-r part of an up to 8192 x V_d matrix
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(lg @ rng.standard_normal((lg.shape[1], min(rank + 16, min(lg.shape))), dtype=np.float32))
    for _ in range(2):
        q, _ = np.linalg.qr(lg @ (lg.T @ q))
    u_s, sv, vt = np.linalg.svd(q.T @ lg, full_matrices=False)
    u = q @ u_s
    k = min(rank, sv.size)
    root = np.sqrt(sv[:k])
    w1[rows, :k] = u[:, :k] * root[None, :]
    w2[:, :k] = vt[:k].T * root[None, :]
    return w1, w2


def feature_scale(order: list[tuple[str, int]], load_seq: Callable[[str, int], tuple[np.ndarray, int, Any]],
                  feats_of: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], rows: int = 16384) -> np.ndarray:
    """1 / each feature channel's RMS over up to ``rows`` positions of the first sequences of ``order``
    (recorded features where the shards have them, else a target forward)."""
    acc: np.ndarray | None = None
    n = 0
    for name, j in order:
        toks, _, rec = load_seq(name, j)
        f = np.asarray(rec[0] if rec is not None else feats_of(toks)[0], dtype=np.float64)
        sq = (f * f).sum(0)
        acc = sq if acc is None else acc + sq
        n += f.shape[0]
        if n >= rows:
            break
    if acc is None or n == 0:
        raise UserError("no sequences to measure the feature scales on; generate data first")
    rms = np.sqrt(acc / n)
    return (1.0 / np.maximum(rms, 1e-3 * max(float(rms.max()), 1e-12))).astype(np.float32)


def mask_token(tok: Any, n_vocab: int) -> int:
    """A token id that never occurs in chat text: the tokenizer's mask / pad / unknown token, else the last
    special token of the vocabulary that is not BOS / EOS."""
    for attr in ("mask_id", "pad_id", "unk_id"):
        t = getattr(tok, attr, None)
        if t is not None and 0 <= int(t) < n_vocab and t not in (getattr(tok, "bos_id", None),
                                                                   getattr(tok, "eos_id", None)):
            return int(t)
    special = [i for i in range(min(n_vocab, 64)) if str(tok.tokens[i]).startswith("<")
               and i not in (getattr(tok, "bos_id", None), getattr(tok, "eos_id", None))]
    if not special:
        return n_vocab - 1
    return special[-1]


def init_from_target(net: Any, model: Any, n_layer_t: int) -> None:
    """Draft layer i starts from target layer ``i`` (the first ones: like them, the draft's block rows start
    as token embeddings; the last layers, tried first, expect a deep residual stream and started 0.7 nats
    worse than random weights). q_norm / k_norm stay at 1 (the target has none); the copies are exact
    float32 dequantisations."""
    import torch

    from .features import layer_weights

    for i, layer in enumerate(net.layers):
        w = layer_weights(model, i)
        for name in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                     "ffn_down"):
            if name in w and tuple(w[name].shape) == tuple(getattr(layer, name).shape):
                getattr(layer, name).copy_(torch.from_numpy(w[name]))


def recipe_metadata(opt: TrainOptions, step: int, tokens: int, positions: int, history: list[dict[str, Any]],
                    seconds: float) -> dict[str, Any]:
    from .data import data_tokens, read_recipe

    data_recipe = read_recipe(opt.data)
    n_seq, n_ans, _ = data_tokens(opt.data)
    return {
        "plinth.train.recipe": json.dumps(opt.recipe(), sort_keys=True),
        "plinth.train.data": json.dumps(dict(data_recipe, sequences=n_seq, answer_tokens=n_ans), sort_keys=True),
        "plinth.train.steps": int(step),
        "plinth.train.tokens": int(tokens),
        "plinth.train.positions": int(positions),
        "plinth.train.seconds": float(round(seconds, 1)),
        "plinth.train.est_tau": float(history[-1]["est_tau"]) if history and history[-1].get("est_tau") else 0.0,
    }

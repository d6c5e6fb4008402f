"""``plinth train-drafter``: train a DSpark (or DFlash) block drafter for a target GGUF."""

from __future__ import annotations

import argparse
from typing import Any

DESCRIPTION = """\
Train a block drafter for TARGET and write it as a dflash GGUF that `plinth generate --spec dspark
--draft OUT` (or --spec dflash) reads.

1. Data (self-distilled): the training prompts (built here, no download: instructions over many
   topics, code tasks and questions about the Python standard library's own sources, summarise /
   rewrite / continue tasks over the Python documentation) are answered by TARGET itself through
   plinth's batched scheduler (temperature 0.7, top-p 0.8) into token shards under --data, until they
   hold --data-tokens answer tokens. The shards also keep the target's features at the draft's taps
   and its top-64 next-token logits, recorded from the very forwards that made the answers (f16), so
   training runs no second target forward. Shards already there are kept, so a later run extends them;
   --no-generate trains on what is there.
2. Training (torch, the `train` extra): features from plinth's own taps of TARGET (the int8 path
   the drafter sees at inference; recorded with the data, or computed when the shards lack them), each
   channel scaled by 1 / its RMS over the data (folded into fc at export; --no-feat-norm: off),
   --anchors blocks per sequence, block --block-size, the DSpark objective (--ce-weight W: W CE +
   (1 - W) TV, default 0.1, with position weights exp(-i/4), plus the confidence head's BCE against
   1 - TV; the low-rank Markov head) or --objective dflash (weighted CE). The DSpark head covers the
   --draft-vocab most frequent answer tokens (d2t); a DFlash draft has the full vocabulary (plinth-dflash
   reads no d2t), so it trains several times slower. --init target (the default) starts the draft
   layers from the target's first layers, the draft's final norm from the target's, and the Markov
   head from the corpus's answer bigrams (a rank --rank factorisation of their log probabilities), so
   the first step already predicts about as well as a bigram model.
3. Checkpoints every --save-every seconds in OUT.ckpt/ (weights, optimiser, data position): the same
   command continues an interrupted run, and another --steps (beyond the step reached) reschedules it
   (the cosine schedule stretched or compressed to the new length). OUT is rewritten at each
   checkpoint, and a copy per checkpoint (OUT.ckpt/draft-NNNk.gguf, named by answer tokens trained) is
   kept for curves of tau against training tokens (`python benchmarks/bench_drafter.py --curve`).
4. Evaluate: `plinth bench -m TARGET --spec dspark --draft OUT` decodes held-out prompts plainly and
   speculatively and prints tau, the acceptance per draft position and the speed-up.

The progress line shows steps, answer tokens trained, the loss, acc@1 and the estimated tau (greedy
acceptance of the first rows of training blocks against the target's argmax, plus one)."""


def register(sub: Any) -> None:
    p = sub.add_parser("train-drafter", help="train a DSpark / DFlash block drafter for a target GGUF (torch)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="the target model (GGUF file or known model name)")
    p.add_argument("-o", "--outfile", required=True, help="the draft GGUF to write")
    d = p.add_argument_group("data")
    d.add_argument("--data", default=None,
                   help="shard directory (default ~/.cache/plinth/train-data/<target file stem>)")
    d.add_argument("--data-tokens", type=int, default=1_000_000,
                   help="answer tokens the shards must hold before training (default 1,000,000)")
    d.add_argument("--no-generate", action="store_true", help="train on the shards present; make none")
    d.add_argument("--answer-tokens", type=int, default=320, help="most tokens per answer (default 320)")
    d.add_argument("--gen-batch", type=int, default=16, help="answers generated together (default 16)")
    m = p.add_argument_group("draft")
    m.add_argument("--objective", choices=("dspark", "dflash"), default="dspark")
    m.add_argument("--layers", type=int, default=2, help="draft layers of the target's width (default 2)")
    m.add_argument("--taps", default="", help="target feature taps, comma-separated (default: 4 spread)")
    m.add_argument("--block-size", type=int, default=8)
    m.add_argument("--draft-vocab", type=int, default=8192, help="draft head rows (d2t; default 8192)")
    m.add_argument("--rank", type=int, default=64, help="Markov head rank (dspark; default 64)")
    m.add_argument("--init", choices=("target", "random"), default="target",
                   help="target: draft layers from the target's first layers, final norm from the target's, Markov head "
                        "from the corpus's bigrams (default); random: all random")
    m.add_argument("--quant", choices=("q8_0", "f16", "f32"), default="q8_0", help="exported matrices' type")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=4000, help="optimiser steps (the schedule's length)")
    t.add_argument("--minutes", type=float, default=0.0, help="stop this run after so many minutes (0: none)")
    t.add_argument("--seqs", type=int, default=4, help="sequences per step (default 4)")
    t.add_argument("--anchors", type=int, default=32, help="blocks per sequence (default 32)")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--ce-weight", type=float, default=0.1,
                   help="dspark: the loss is W * cross-entropy + (1 - W) * total variation against the target's "
                        "next-token distribution (default 0.1, DSpark's mix)")
    t.add_argument("--no-feat-norm", dest="feat_norm", action="store_false",
                   help="feed the target's features to fc as they are (default: each channel scaled by 1 / its "
                        "RMS over the data, folded into fc at export; the residual stream's few huge channels "
                        "would otherwise own the context rows)")
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--save-every", type=float, default=300.0, help="seconds between checkpoints (default 300)")
    t.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    t.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .. import hub
    from ..errors import UserError, missing_extra

    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise missing_extra("plinth train-drafter", "train", exc) from None
    from ..train.data import data_tokens, generate
    from ..train.trainer import TrainOptions, train

    target = str(hub.resolve_model(args.target))
    data = args.data or str(Path.home() / ".cache" / "plinth" / "train-data" / Path(target).stem)
    try:
        taps = tuple(int(x) for x in args.taps.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--taps expects comma-separated layer numbers, got {args.taps!r}") from None
    if not taps:
        from ..gguf import GGUFFile
        from ..train.trainer import default_taps

        md = GGUFFile(target).metadata
        taps = default_taps(int(md[f"{md['general.architecture']}.block_count"]))
    if not args.no_generate:
        _, have, _ = data_tokens(data)
        if have < args.data_tokens:  # the answers come with the draft's features (no second target forward)
            generate(target, data, answer_tokens=args.data_tokens, max_tokens=args.answer_tokens,
                     max_batch=args.gen_batch, taps=taps)
    opt = TrainOptions(target=target, out=args.outfile, data=data, objective=args.objective, n_layer=args.layers,
                       taps=taps, block_size=args.block_size, draft_vocab=args.draft_vocab, markov_rank=args.rank,
                       init=args.init, anchors=args.anchors, seqs=args.seqs, lr=args.lr, warmup=args.warmup,
                       steps=args.steps, minutes=args.minutes, save_every=args.save_every, threads=args.threads,
                       seed=args.seed, quant=args.quant, ce_weight=args.ce_weight, feat_norm=args.feat_norm)
    last = train(opt)
    print(f"wrote {args.outfile}: step {last['step']}, {last['tokens']} answer tokens trained, "
          f"estimated tau {last['est_tau'] or 0:.2f}")
    return 0

"""``plinth embed``: embedding vectors of texts (the same vectors as the server's /v1/embeddings)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .models import MODEL_HELP
from .options import threads_arg


def register(sub: Any) -> None:
    p = sub.add_parser("embed", help="print the embedding vector of each text (JSON, one line a text)",
                       description="Embed each TEXT (or each line of stdin with -): the final hidden states pooled "
                       "(the model file's pooling, else mean; or --pooling) and L2-normalised, the LM head "
                       "skipped. Prints one JSON object a text: {\"index\", \"tokens\", \"embedding\"}.")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="the texts; '-' reads one text a line from stdin")
    p.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    p.add_argument("--pooling", default="model", choices=["model", "mean", "cls", "last"],
                   help="model (default: the file's own, else mean), mean, cls or last")
    p.add_argument("--no-normalize", action="store_true", help="print the pooled vectors as they are (not unit length)")
    p.add_argument("--backend", default="numpy", help="compute backend (numpy or cupy)")
    threads_arg(p)
    p.set_defaults(func=run_embed)


def run_embed(args: argparse.Namespace) -> int:
    from .. import hub
    from ..model import load_model
    from ..serve.embeddings import choose_pooling, embed
    from .generate import clean_text
    from .options import set_threads

    texts: list[str] = []
    for t in args.texts:
        if t == "-":
            texts.extend(line.rstrip("\n") for line in sys.stdin if line.strip())
        else:
            texts.append(clean_text(t, "the text"))
    set_threads(args)
    model = load_model(args.model or hub.DEFAULT_MODEL, backend=args.backend, registry=args.registry, progress=True)
    pooling = choose_pooling(model, args.pooling)
    tok = model.tokenizer
    ids = [tok.encode(t, add_special=True) for t in texts]
    vectors = embed(model, ids, pooling, normalize=not args.no_normalize)
    for i, (t, v) in enumerate(zip(ids, vectors)):
        print(json.dumps({"index": i, "tokens": len(t), "pooling": pooling, "embedding": v.tolist()}))
    return 0

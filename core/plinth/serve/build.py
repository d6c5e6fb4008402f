"""One server from parsed ``plinth serve`` options: the model, its drafters and its scheduler.

What ``plinth serve`` runs and what each Ray Serve replica (:mod:`plinth.serve.ray`) rebuilds from the
options it was given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UserError, missing_extra


def build_server(args: Any, *, progress: bool = False) -> Any:
    """The model, its scheduler and drafters from parsed ``plinth serve`` options (an
    ``argparse.Namespace`` with ``registry``). The scheduler is started by the app's lifespan."""
    if args.spec_synthetic is not None:
        raise UserError("--spec-synthetic is for benchmarks of `plinth generate`; a server must return the "
                        "model's own text")
    try:
        from .app import Server
    except ImportError as exc:
        raise missing_extra("plinth serve", "serve", exc) from None
    from .. import hub
    from ..model import load_model
    from ..speculative.engine import SpecConfig, drafter_names
    from .scheduler import Scheduler

    if getattr(args, "threads", None) is not None:  # (a Ray Serve replica sets its own)
        from .. import quant

        quant.set_threads(args.threads)
    names = drafter_names(args.spec, args.registry)
    model = load_model(args.model or hub.DEFAULT_MODEL, backend=args.backend, registry=args.registry,
                       n_ctx=args.n_ctx, progress=progress, cache_type_k=getattr(args, "cache_type_k", "f32"),
                       cache_type_v=getattr(args, "cache_type_v", "f32"))
    drafters = []
    if names:
        options = {"draft": args.draft, "n_max": args.spec_n_max, "n_min": args.spec_n_min, "p_min": args.spec_p_min,
                   "backend": args.backend, "ngram_max": args.spec_ngram_max, "ngram_min": args.spec_ngram_min,
                   "progress": progress, "temperature": 0.0}
        drafters = [args.registry.make_drafter(n, model, options) for n in names]
    spec = SpecConfig(n_max=args.spec_n_max, n_min=args.spec_n_min, p_min=args.spec_p_min, verifier=args.spec_verify)
    sched = Scheduler(model, drafters=drafters, spec=spec, max_batch=args.max_batch, max_queue=args.max_queue,
                      prefill_chunk=args.prefill_chunk, registry=args.registry, prompt_cache=args.prompt_cache,
                      prompt_cache_tokens=args.prompt_cache_tokens, spec_policy=getattr(args, "spec_policy", "auto"),
                      prepare=True)  # (on the scheduler thread, before the first request: its time to first token)
    stem = Path(str(model.path)).name
    stem = stem[:-5] if stem.endswith(".gguf") else stem
    aliases = tuple(a for a in (stem, args.model or hub.DEFAULT_MODEL) if a)
    origins = [o.strip() for o in (getattr(args, "allowed_origins", None) or "").split(",") if o.strip()]
    return Server(model, sched, args.model_alias or stem, aliases=aliases, spec_names=tuple(names),
                  plugins=tuple(r.name for r in args.registry.loaded), lenient=getattr(args, "lenient", False),
                  pooling=getattr(args, "pooling", "model"), allowed_origins=origins)

"""Self-distilled training data: the target answers the training prompts through plinth's batched scheduler.

Each prompt (:mod:`plinth.train.prompts`) is rendered with the target's chat template and answered
by the target itself (sampled, DeepSpec's temperature 0.7 / top-p 0.8 by default) through a
:class:`plinth.serve.scheduler.Scheduler`, so many answers share each forward. What the drafter has
to learn is exactly what the target says.

Shards: ``shard-NNNNN.npz`` in the data directory, shard ``i`` holding the answers to training
prompts ``i*S .. (i+1)*S - 1`` (``S`` = ``shard_prompts``), as

* ``tokens`` int32: every sequence (prompt then answer) one after the other,
* ``offsets`` int64 [n+1]: where each sequence starts,
* ``n_prompt`` int32 [n]: how many of its tokens are the prompt (the rest is the target's answer),
* ``prompt_index`` int64 [n]: the prompt's index in the training prompt list.

``recipe.json`` records how they were made (target file, sampling, prompt seed); a run with
another recipe in the same directory is refused. Shards are written whole (a temporary name, then a
rename), so an interrupted run loses at most the shards it was making, and the same command
continues from the first missing shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..errors import UserError

RECIPE = "recipe.json"


def shard_path(data_dir: Path, i: int) -> Path:
    return Path(data_dir) / f"shard-{i:05d}.npz"


def list_shards(data_dir: str | os.PathLike[str]) -> list[Path]:
    d = Path(data_dir)
    return sorted(d.glob("shard-*.npz")) if d.is_dir() else []


def file_digest(path: str | os.PathLike[str], n: int = 1 << 20) -> str:
    """sha1 of a file's first MiB and its size (enough to tell models apart, fast)."""
    p = Path(path)
    h = hashlib.sha1()
    with open(p, "rb") as f:
        h.update(f.read(n))
    h.update(str(p.stat().st_size).encode())
    return h.hexdigest()[:16]


def data_tokens(data_dir: str | os.PathLike[str]) -> tuple[int, int, int]:
    """(sequences, answer tokens, all tokens) over the shards present."""
    n = a = t = 0
    for p in list_shards(data_dir):
        with np.load(p) as z:
            off, npr = z["offsets"], z["n_prompt"]
            n += len(npr)
            t += int(off[-1])
            a += int(off[-1]) - int(npr.sum())
    return n, a, t


def read_recipe(data_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The recipe the shards in ``data_dir`` were made with (``recipe.json``), or {} where there is none."""
    path = Path(data_dir) / RECIPE
    return json.loads(path.read_text()) if path.is_file() else {}


def check_recipe(data_dir: Path, recipe: dict[str, Any]) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / RECIPE
    if path.is_file():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in recipe.items() if old.get(k) != v}
        if diff:
            raise UserError(f"{data_dir}: its shards were made with another recipe ({diff}); use another --data "
                            "directory or remove this one")
    else:
        path.write_text(json.dumps(recipe, indent=1, sort_keys=True))


TOP_K = 64  # target logits kept per position (the training target's support)


class FeatureRecorder:
    """A drafter that never drafts and keeps what the target showed it: per position of each sequence the
    taps' features (f16) and the top-``k`` next-token logits of the rows that had outputs.

    Run in the scheduler next to generation, it gives the trainer the features of the very forwards the
    answers came from (prefill chunks and one-row decode steps, the numerics a drafter sees at inference),
    so training needs no second target forward.
    """

    name = "recorder"

    def __init__(self, taps: tuple[int, ...], k: int = TOP_K) -> None:
        self.taps = tuple(int(t) for t in taps)
        self.k = int(k)
        self.live: dict[int, dict[int, tuple[Any, ...]]] = {}
        self.done: dict[int, dict[int, tuple[Any, ...]]] = {}

    def requirements(self) -> Any:
        from ..speculative.base import DrafterRequirements

        return DrafterRequirements(taps=self.taps)

    def begin(self, seq: int, prompt_ids: Any) -> None:
        self.live[seq] = {}

    def process(self, out: Any) -> None:
        rows = self.live.setdefault(out.seq, {})
        pos = np.asarray(out.positions, dtype=np.int64)
        f = np.concatenate([np.asarray(out.features[t], dtype=np.float16) for t in self.taps], axis=1)
        lg = None if out.logits is None else np.asarray(out.logits, dtype=np.float32)
        if lg is not None and lg.shape[0] not in (pos.size, 1):
            lg = None
        if lg is not None:
            k = min(self.k, lg.shape[1])
            idx = np.argpartition(-lg, k - 1, axis=1)[:, :k]
            val = np.take_along_axis(lg, idx, axis=1)
            lpos = pos if lg.shape[0] == pos.size else pos[-1:]
        for i, p in enumerate(pos):
            rows[int(p)] = (f[i], None, None)
        if lg is not None:
            for i, p in enumerate(lpos):
                rows[int(p)] = (rows[int(p)][0], idx[i].astype(np.int32), val[i].astype(np.float16))

    def draft(self, seq: int, n_max: int, *, history: Any, pos: int) -> Any:
        from ..speculative.base import Draft

        return Draft()

    def accept(self, seq: int, n_accepted: int) -> None:
        pass

    def end(self, seq: int) -> None:
        if seq in self.live:
            self.done[seq] = self.live.pop(seq)

    def take(self, seq: int, n: int, width: int) -> tuple[np.ndarray, ...]:
        """The finished sequence's arrays for positions 0..n-1: features [n, width] f16, top ids [n, k] i32,
        top logits [n, k] f16, has_logits [n] bool (positions the target never ran stay zero)."""
        rows = self.done.pop(seq, {})
        f = np.zeros((n, width), np.float16)
        ids = np.zeros((n, self.k), np.int32)
        val = np.zeros((n, self.k), np.float16)
        has = np.zeros(n, bool)
        for p, (fi, ii, vi) in rows.items():
            if p < n:
                f[p] = fi
                if ii is not None:
                    ids[p, :ii.size], val[p, :vi.size], has[p] = ii, vi, True
        return f, ids, val, has


def generate(target: str | os.PathLike[str], data_dir: str | os.PathLike[str], *, answer_tokens: int,
             shard_prompts: int = 64, max_tokens: int = 320, temperature: float = 0.7, top_p: float = 0.8,
             max_batch: int = 16, n_ctx: int = 1024, seed: int = 0, progress: bool = True,
             deadline: float | None = None, log: Any = None, registry: Any = None,
             prompts: Any = None, taps: tuple[int, ...] = ()) -> tuple[int, int]:
    """Extend the shards in ``data_dir`` until they hold ``answer_tokens`` answer tokens (or prompts run out).

    Returns (sequences, answer tokens) present at the end. ``deadline`` (a ``time.time()``) stops
    starting new shards after it.
    """
    from ..model import load_model
    from ..sampling import SamplerConfig
    from ..serve.scheduler import Request, Scheduler
    from . import prompts as P

    data_dir = Path(data_dir)
    recipe = {"target_digest": file_digest(target), "temperature": float(temperature), "top_p": float(top_p),
              "max_tokens": int(max_tokens), "shard_prompts": int(shard_prompts), "prompt_seed": int(seed),
              "prompt_set": P.VERSION, "taps": [int(t) for t in taps], "top_k": TOP_K if taps else 0}
    check_recipe(data_dir, recipe)
    n_have, a_have, _ = data_tokens(data_dir)
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    if a_have >= answer_tokens:
        log(f"data: {n_have} answers, {a_have} tokens in {data_dir} (>= {answer_tokens} asked): nothing to make")
        return n_have, a_have
    prompts = P.train_prompts(seed) if prompts is None else list(prompts)
    model = load_model(target, n_ctx=n_ctx, registry=registry)
    tok = model.tokenizer
    rec = FeatureRecorder(tuple(taps)) if taps else None
    if rec is not None:
        from ..speculative.engine import SpecConfig

        # "always": the recorder must see every row as its step makes it, with the step's logits (the "auto"
        # policy hands a sequence's undrafted rows over later, together, without them)
        sched = Scheduler(model, drafters=[rec], spec=SpecConfig(n_max=1), max_batch=max_batch,
                          max_queue=4 * max_batch, prompt_cache=0, prepare=True, spec_policy="always")
    else:
        sched = Scheduler(model, max_batch=max_batch, max_queue=4 * max_batch, prompt_cache=0, prepare=True)
    width = len(taps) * int(model.hparams.n_embd)
    sched.start()
    n_shards = (len(prompts) + shard_prompts - 1) // shard_prompts
    done_shards = {int(p.stem.split("-")[1]) for p in list_shards(data_dir)}
    todo = [i for i in range(n_shards) if i not in done_shards]
    lock = threading.Condition()
    results: dict[int, tuple[Any, ...]] = {}
    count = {"submitted": 0, "finished": 0}
    t0 = time.time()
    made = 0

    def submit(idx: int) -> None:
        ids = P.prompt_ids(tok, prompts[idx].text)[: n_ctx - max_tokens - 1]
        out: list[int] = []
        holder: list[Any] = []

        def emit(ev: Any) -> None:
            out.extend(t.token for t in ev.tokens)
            if ev.finish is not None:
                rec_arrays = rec.take(holder[0].seq, len(ids) + len(out) + 1, width) if rec is not None else None
                with lock:
                    results[idx] = (ids, out, ev.finish, rec_arrays)
                    count["finished"] += 1
                    lock.notify_all()

        cfg = SamplerConfig(temperature=temperature, top_p=top_p, seed=seed * 1_000_003 + idx)
        req = Request(prompt_ids=list(ids), max_tokens=max_tokens, sampling=cfg, emit=emit)
        holder.append(req)
        sched.submit(req)
        count["submitted"] += 1

    def indices() -> Iterator[int]:
        for s in todo:
            yield from range(s * shard_prompts, min((s + 1) * shard_prompts, len(prompts)))

    it = indices()
    window = 3 * max_batch
    eos = getattr(tok, "eos_id", None)
    try:
        for s in todo:
            if a_have >= answer_tokens or (deadline is not None and time.time() > deadline):
                break
            lo, hi = s * shard_prompts, min((s + 1) * shard_prompts, len(prompts))
            while True:
                with lock:
                    if all(i in results for i in range(lo, hi)):
                        break
                    while count["submitted"] - count["finished"] < window:
                        nxt = next(it, None)
                        if nxt is None:
                            break
                        submit(nxt)
                    lock.wait(1.0)
            seqs, npr, pidx, recs = [], [], [], []
            for i in range(lo, hi):
                ids, out, finish, rec_arrays = results.pop(i)
                if finish == "stop" and eos is not None and (not out or out[-1] != eos):
                    out = out + [int(eos)]  # the end of the answer is a token the drafter must predict too
                seqs.append(np.asarray(list(ids) + list(out), dtype=np.int32))
                if rec_arrays is not None:
                    recs.append([a[:len(seqs[-1])] for a in rec_arrays])
                    check_recorded(recs[-1], len(ids), len(seqs[-1]), i)
                npr.append(len(ids))
                pidx.append(i)
                a_have += len(out)
            n_have += len(seqs)
            offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([len(x) for x in seqs])
            tmp = data_dir / f".tmp-{s:05d}.npz"
            extra = {}
            if recs:
                for name, j in (("feats", 0), ("top_ids", 1), ("top_logits", 2), ("has_logits", 3)):
                    extra[name] = np.concatenate([r[j] for r in recs])
            np.savez(tmp, tokens=np.concatenate(seqs), offsets=offsets, n_prompt=np.asarray(npr, np.int32),
                     prompt_index=np.asarray(pidx, np.int64), **extra)
            os.replace(tmp, shard_path(data_dir, s))
            made += 1
            el = time.time() - t0
            if progress:
                log(f"data: shard {s} written; {n_have} answers, {a_have}/{answer_tokens} answer tokens; "
                    f"{made} shards in {el:.0f} s ({sum(len(x) for x in seqs) / max(1, hi - lo):.0f} tok/seq)")
    finally:
        sched.stop()
    return n_have, a_have


def check_recorded(rec: list[np.ndarray], n_prompt: int, n: int, prompt_index: int) -> None:
    """Refuse a sequence whose recording has holes: every position the target ran (all but the last) needs its
    features, and every one whose next token is an answer token (n_prompt - 1 .. n - 2) its logits."""
    feats, has = rec[0], rec[3]
    ran = np.abs(feats[: n - 1]).max(axis=1) > 0 if n > 1 else np.zeros(0, bool)
    need = has[max(0, n_prompt - 1): n - 1]
    if not ran.all() or not need.all():
        raise RuntimeError(f"training data, prompt {prompt_index}: the recorder missed {int((~ran).sum())} of {n - 1} "
                           f"feature rows and {int((~need).sum())} of {need.size} answer logits (the scheduler did not "
                           "show it every row with its logits); nothing written for this shard")


def iter_sequences(data_dir: str | os.PathLike[str]) -> Iterator[tuple[np.ndarray, int, int]]:
    """(tokens, n_prompt, prompt_index) of every stored sequence, shard by shard."""
    for p in list_shards(data_dir):
        with np.load(p) as z:
            toks, off, npr, pidx = z["tokens"], z["offsets"], z["n_prompt"], z["prompt_index"]
        for j in range(len(npr)):
            yield toks[off[j]:off[j + 1]], int(npr[j]), int(pidx[j])


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - the CLI's data step, also runnable alone
    import argparse

    ap = argparse.ArgumentParser(prog="python -m plinth.train.data", description=__doc__.split("\n")[0])
    ap.add_argument("target")
    ap.add_argument("data_dir")
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--shard-prompts", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--taps", default="", help="record these feature taps with the answers (comma-separated)")
    a = ap.parse_args(argv)
    from ..errors import UserError
    from ..hub import resolve_model

    try:  # (a known model name, as `plinth train-drafter` takes it, or a file)
        target = str(resolve_model(a.target))
    except UserError as e:
        ap.error(str(e))
    generate(target, a.data_dir, answer_tokens=a.tokens, max_tokens=a.max_tokens, shard_prompts=a.shard_prompts,
             max_batch=a.max_batch, taps=tuple(int(t) for t in a.taps.split(",") if t.strip()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

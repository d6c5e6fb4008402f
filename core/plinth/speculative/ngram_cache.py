"""``ngram-cache``: drafting from a table of the target's own frequent continuations, no draft model.

llama.cpp's lookup decoding can read a static n-gram cache made from a corpus. Here the corpus is the
target's own answers: the self-distilled shards ``python -m plinth.train.data`` writes for drafter
training. So the table holds the phrases that this model itself tends to produce (SmolLM2's "Here are
some", its list openings, the template's first tokens of an answer), which no prompt holds.

**The table** (:func:`build`). For every context of ``n`` tokens, ``n`` from ``n_min`` (2) to ``n_max`` (4),
whose following answer token was seen at least ``min_count`` (3) times, it keeps the token that followed
most often, if that token followed at least ``min_share`` (0.6) of the time. Contexts may reach back into
the prompt: the answer's first tokens follow the chat template's last ones.

**A draft** (:class:`NgramCacheDrafter`). The history's last tokens are looked up with the longest context
first. The kept token is drafted and appended, and the lookup repeats from the new end, up to ``n_max``
tokens or until no context is kept. The lookup is deterministic, so ``q`` is one-hot. The call costs
microseconds: the policy asks it every step and cuts its draft to the length that pays
(``plinth.speculative.policy``).

**The file**: a ``.npz`` written by ``python -m plinth.speculative.ngram_cache``. It holds ``ctx<n>``
(int32 [m, n]) and ``next<n>`` (int32 [m]) for each kept ``n``, and ``meta``, a JSON string. ``meta``
names the format, its version, the target's ``general.name`` and vocabulary size, the thresholds and
the corpus's size. A file made for another vocabulary is refused by name. Files for the known models ship
in ``plinth.speculative.caches``; ``--spec ngram-cache`` finds the loaded target's, and
``--draft FILE.npz`` names another.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..errors import UserError
from .base import BaseDrafter, Draft, DrafterRequirements

FORMAT = "plinth-ngram-cache"
VERSION = 1
HERE = Path(__file__).parent / "caches"


class NgramCacheError(UserError):
    """An n-gram cache file plinth cannot use (named in the message)."""


def build(sequences: Iterable[tuple[np.ndarray, int]], n_min: int = 2, n_max: int = 4, min_count: int = 3,
          min_share: float = 0.6) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The table of :mod:`this module <plinth.speculative.ngram_cache>` from ``(tokens, n_prompt)`` sequences:
    {n: (contexts [m, n], next tokens [m])}, contexts sorted. Only tokens at or past ``n_prompt`` are counted
    as following a context (the answers'); a context may reach into the prompt. Where two tokens tie for the
    most frequent (possible only with ``min_share`` <= 0.5), the smaller id is kept."""
    if not 1 <= n_min <= n_max:
        raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
    if min_count < 1 or not 0.0 < min_share <= 1.0:
        raise ValueError(f"need min_count >= 1 and 0 < min_share <= 1, got {min_count}, {min_share}")
    seqs = [(np.asarray(t, dtype=np.int32), int(p)) for t, p in sequences]
    out = {}
    for n in range(n_min, n_max + 1):
        parts = []
        for toks, n_prompt in seqs:
            first = max(n, n_prompt)  # the first position whose token is counted
            if toks.shape[0] > first:
                win = np.lib.stride_tricks.sliding_window_view(toks, n + 1)  # win[i] = toks[i:i+n+1]
                parts.append(win[first - n:])
        if not parts:
            out[n] = (np.zeros((0, n), np.int32), np.zeros(0, np.int32))
            continue
        pairs, counts = np.unique(np.concatenate(parts), axis=0, return_counts=True)  # (context, next), sorted
        ctx, nxt = pairs[:, :n], pairs[:, n]
        new = np.ones(len(pairs), dtype=bool)
        new[1:] = np.any(ctx[1:] != ctx[:-1], axis=1)
        starts = np.flatnonzero(new)
        group = np.cumsum(new) - 1
        total = np.add.reduceat(counts, starts)
        top = np.maximum.reduceat(counts, starts)
        at_top = np.flatnonzero(counts == top[group])  # (ascending: a group's first is its smallest next id)
        _, first_top = np.unique(group[at_top], return_index=True)
        choice = at_top[first_top]
        keep = (total >= min_count) & (top >= min_share * total)
        out[n] = (np.ascontiguousarray(ctx[starts[keep]]), np.ascontiguousarray(nxt[choice[keep]]))
    return out


def save(path: str | os.PathLike[str], table: Mapping[int, tuple[np.ndarray, np.ndarray]], meta: Mapping[str, Any]
         ) -> None:
    """Write ``table`` (:func:`build`) and ``meta`` (``target``, ``n_vocab``, ...) as a cache file."""
    arrays = {}
    for n, (ctx, nxt) in table.items():
        arrays[f"ctx{n}"] = np.asarray(ctx, dtype=np.int32)
        arrays[f"next{n}"] = np.asarray(nxt, dtype=np.int32)
    info = {"format": FORMAT, "version": VERSION, **meta, "n": sorted(int(n) for n in table),
            "entries": int(sum(len(nxt) for _, nxt in table.values()))}
    with open(path, "wb") as f:  # (np.savez_compressed on a path would add ".npz" to another suffix)
        np.savez_compressed(f, meta=np.asarray(json.dumps(info, sort_keys=True)), **arrays)


def _open(p: Path) -> tuple[Any, dict[str, Any]]:
    """(the open archive, its meta) of a cache file, its format and version checked."""
    try:
        z = np.load(p, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise NgramCacheError(f"{p}: not an n-gram cache file ({type(exc).__name__}: {exc})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise NgramCacheError(f"{p}: not an n-gram cache file (one array, not an .npz archive)")
    try:
        info = json.loads(str(z["meta"]))
    except (KeyError, ValueError) as exc:
        z.close()
        raise NgramCacheError(f"{p}: not an n-gram cache file ({type(exc).__name__}: {exc})") from None
    problem = None
    if not isinstance(info, dict):
        problem = f"{p}: 'meta' is not an object"
    elif info.get("format") != FORMAT:
        problem = f"{p}: not an n-gram cache file (meta 'format' is {info.get('format')!r}, expected {FORMAT!r})"
    elif info.get("version") != VERSION:
        problem = f"{p}: n-gram cache version {info.get('version')!r}; this plinth reads {VERSION}"
    if problem:
        z.close()
        raise NgramCacheError(problem)
    return z, info


def load(path: str | os.PathLike[str], n_vocab: int | None = None) -> tuple[dict[int, dict[tuple[int, ...], int]],
                                                                           dict[str, Any]]:
    """({n: {context: next token}}, meta) of a cache file, checked: its format, its arrays, its tokens against
    ``n_vocab`` (the target's)."""
    p = Path(path)
    z, info = _open(p)
    with z:
        return _table(p, z, info, n_vocab), info


def _table(p: Path, z: Any, info: dict[str, Any], n_vocab: int | None) -> dict[int, dict[tuple[int, ...], int]]:
    if n_vocab is not None and int(info.get("n_vocab", -1)) != int(n_vocab):
        raise NgramCacheError(f"{p}: made for a vocabulary of {info.get('n_vocab')} tokens "
                              f"({info.get('target', 'unnamed target')}), the target has {n_vocab}")
    table: dict[int, dict[tuple[int, ...], int]] = {}
    for n in info.get("n", []):
        try:
            ctx, nxt = z[f"ctx{n}"], z[f"next{n}"]
        except KeyError as exc:
            raise NgramCacheError(f"{p}: meta lists n = {n} but the file has no {exc}") from None
        if ctx.dtype != np.int32 or nxt.dtype != np.int32 or ctx.ndim != 2 or ctx.shape != (nxt.shape[0], int(n)):
            raise NgramCacheError(f"{p}: 'ctx{n}' {ctx.dtype}{list(ctx.shape)} / 'next{n}' {nxt.dtype}"
                                  f"{list(nxt.shape)}: expected int32 [m, {n}] and int32 [m]")
        bound = int(info.get("n_vocab", 0))
        for name, a in ((f"ctx{n}", ctx), (f"next{n}", nxt)):
            if a.size and (int(a.min()) < 0 or int(a.max()) >= bound):
                raise NgramCacheError(f"{p}: '{name}' holds token ids outside 0..{bound - 1} (n_vocab {bound})")
        table[int(n)] = dict(zip(map(tuple, ctx.tolist()), nxt.tolist()))
    if not table:
        raise NgramCacheError(f"{p}: the cache holds no contexts")
    return table


def shipped() -> list[Path]:
    return sorted(HERE.glob("*.npz"))


def resolve(draft: str | None, target: Any) -> Path:
    """The cache file for ``--draft`` (a path, or a shipped cache's name), or the shipped one for ``target``
    (its ``general.name`` and vocabulary size). A ``.gguf`` ``--draft`` names the file of a GGUF drafter listed
    beside this one (``--spec ngram-cache,dspark --draft d.gguf``: the option is shared): the shipped cache
    then."""
    names = {p.stem: p for p in shipped()}
    if draft and not str(draft).lower().endswith(".gguf"):
        if Path(draft).is_file():
            return Path(draft)
        if draft.removesuffix(".npz") in names:
            return names[draft.removesuffix(".npz")]
        raise NgramCacheError(f"ngram-cache: {draft!r} is neither a file nor a shipped cache "
                              f"(shipped: {', '.join(names) or 'none'})")
    name = getattr(target, "metadata", {}).get("general.name")
    for p in names.values():
        z, info = _open(p)
        z.close()
        if info.get("target") == name and int(info.get("n_vocab", -1)) == int(target.n_vocab):
            return p
    raise UserError(f"the ngram-cache drafter needs a cache made for this model ({name!r}): pass --draft FILE.npz "
                    "(made by `python -m plinth.speculative.ngram_cache`); shipped: "
                    f"{', '.join(names) or 'none'}")


class NgramCacheDrafter(BaseDrafter):
    """Drafts the kept continuations of the history's last tokens, chained (module docstring)."""

    name = "ngram-cache"

    def __init__(self, table: Mapping[int, Mapping[tuple[int, ...], int]], n_draft: int = 16) -> None:
        self.table = {int(n): t for n, t in table.items() if t}
        self.ns = sorted(self.table, reverse=True)  # the longest context first
        self.n_draft = int(n_draft)

    def requirements(self) -> DrafterRequirements:
        return DrafterRequirements(max_draft=self.n_draft)

    def draft(self, seq: int, n_max: int, *, history: Sequence[int], pos: int) -> Draft:
        longest = self.ns[0] if self.ns else 0
        h = [int(t) for t in history[-longest:]] if longest else []
        out: list[int] = []
        while len(out) < n_max:
            nxt = None
            for n in self.ns:
                if len(h) >= n:
                    nxt = self.table[n].get(tuple(h[-n:]))
                    if nxt is not None:
                        break
            if nxt is None:
                break
            out.append(nxt)
            h.append(nxt)
        return Draft(tokens=tuple(out))


def make_ngram_cache(target: Any, options: Mapping[str, Any]) -> NgramCacheDrafter:
    path = resolve(options.get("draft"), target)
    table, _ = load(path, int(target.n_vocab))
    return NgramCacheDrafter(table, n_draft=int(options.get("n_max", 16)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m plinth.speculative.ngram_cache",
        description="Make the table of the ngram-cache drafter (`--spec ngram-cache`) from the self-distilled "
                    "shards of `python -m plinth.train.data`: for each context of N_MIN..N_MAX tokens seen at least "
                    "MIN_COUNT times before an answer token, the token that followed most often, where it followed "
                    "at least MIN_SHARE of the time.")
    ap.add_argument("model", help="the target (a .gguf file or a known model name): its name and vocabulary size "
                                  "go into the file, and the data must have been made with it")
    ap.add_argument("data", help="the shards' directory (python -m plinth.train.data MODEL DIR)")
    ap.add_argument("-o", "--output", required=True, help="the .npz file to write")
    ap.add_argument("--n-min", type=int, default=2, help="shortest context (default 2)")
    ap.add_argument("--n-max", type=int, default=4, help="longest context (default 4)")
    ap.add_argument("--min-count", type=int, default=3, help="times a context must be seen (default 3)")
    ap.add_argument("--min-share", type=float, default=0.6,
                    help="share of those times its most frequent next token must hold (default 0.6)")
    a = ap.parse_args(argv)
    from ..gguf import GGUFFile
    from ..hub import resolve_model
    from ..train.data import file_digest, iter_sequences, list_shards, read_recipe

    try:
        model = resolve_model(a.model)
        md = GGUFFile(model).metadata
        if not list_shards(a.data):
            raise UserError(f"{a.data}: no shards (shard-*.npz); make them with python -m plinth.train.data")
        recipe = read_recipe(a.data)
        if recipe.get("target_digest") not in (None, file_digest(model)):
            raise UserError(f"{a.data}: its answers were made by another model file than {model}")
        tokens = md.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise UserError(f"{model}: no tokenizer.ggml.tokens: the vocabulary size is unknown")
        seqs = [(t, n_prompt) for t, n_prompt, _ in iter_sequences(a.data)]
        n_answer = int(sum(len(t) - p for t, p in seqs))
        print(f"ngram-cache: {len(seqs)} answers, {n_answer} answer tokens", file=sys.stderr)
        table = build(seqs, a.n_min, a.n_max, a.min_count, a.min_share)
        meta = {"target": md.get("general.name"), "n_vocab": len(tokens), "min_count": a.min_count,
                "min_share": a.min_share, "answers": len(seqs), "answer_tokens": n_answer,
                "data_recipe": recipe}
        save(a.output, table, meta)
    except (UserError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"ngram-cache: {', '.join(f'{len(v[1])} contexts of {n}' for n, v in table.items())} -> {a.output} "
          f"({Path(a.output).stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

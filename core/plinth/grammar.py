"""Constrained decoding: a grammar turned into a token mask, one state per sequence.

The grammar engine is llguidance (an Earley parser over a lexer, with a token trie: it computes
the set of tokens whose bytes keep the output inside the grammar). Why this library and not
xgrammar or outlines-core is in docs/serving.md; ``benchmarks/bench_grammar.py`` measures all three.

Three objects:

* :class:`Grammar`: what to constrain to, independent of any model: built by :func:`json_schema`,
  :func:`json_object`, :func:`regex`, :func:`choice`, :func:`gbnf` (llama.cpp's grammar format),
  :func:`lark` (llguidance's own format, which can embed JSON schemas: ``%json {...}``);
* :class:`Constraint`: a grammar compiled for one tokenizer (the GGUF's own vocabulary: every
  token's bytes, control tokens marked special; nothing comes from a hub), shared by every sequence
  that uses it; a grammar the engine refuses raises :class:`GrammarError` here, naming why;
* :class:`ConstraintState`: one sequence's position in the grammar: :meth:`~ConstraintState.mask`
  (the tokens allowed next), :meth:`~ConstraintState.advance` over each token the sequence keeps,
  :meth:`~ConstraintState.rollback` over tokens it drops (rejected speculative drafts),
  :meth:`~ConstraintState.fork` for another sequence continuing from the same point.

The sampler (:mod:`plinth.sampling`) takes a state or a mask and gives every token the grammar
forbids a logit of ``-inf`` before its filters; greedy decoding first checks whether the unmasked
argmax is allowed (one token's check instead of the whole vocabulary's; the same token either way).
The end-of-generation tokens are allowed exactly where the grammar may end; when it must end, they
are the only ones allowed.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Sequence

import attrs
import numpy as np

from .errors import UserError, missing_extra

__all__ = ["GrammarError", "Grammar", "Constraint", "ConstraintState", "json_schema", "json_object", "regex",
           "choice", "gbnf", "lark", "llg_tokenizer", "compile_grammar"]

#: llguidance's JSON options: compact JSON (no free whitespace between tokens: fewer tokens, and a
#: model cannot stall in whitespace), every schema keyword honoured or the schema refused
JSON_OPTIONS = {"whitespace_flexible": False, "lenient": False}


class GrammarError(UserError, ValueError):
    """A grammar or schema that cannot be used, with the reason."""


def _llg():
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - llguidance is in the serve and grammar extras
        raise missing_extra("constrained decoding", "grammar", exc) from None
    return llguidance


@attrs.frozen
class Grammar:
    """A grammar in llguidance's serialised form (``text``) and a short description for messages."""

    text: str
    describe: str


def _checked(text: str, what: str) -> Grammar:
    """A :class:`Grammar` once llguidance has validated it (without a tokenizer): :class:`GrammarError` otherwise."""
    err = _llg().LLMatcher.validate_grammar(text)
    if err and not err.startswith("WARNING"):
        raise GrammarError(f"{what}: {_first_line(err)}")
    return Grammar(text, what)


def json_schema(schema: Any, *, what: str = "json_schema") -> Grammar:
    """JSON conforming to ``schema`` (a dict or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{what} must be a JSON object (a JSON schema), got {type(schema).__name__}")
    try:
        text = _llg().LLMatcher.grammar_from_json_schema(schema, defaults=dict(JSON_OPTIONS))
    except ValueError as exc:
        raise GrammarError(f"{what}: {exc}") from None
    return _checked(text, what)


def json_object() -> Grammar:
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    return json_schema({"type": "object"}, what="json_object")


def regex(pattern: str, *, what: str = "regex") -> Grammar:
    """Text matching ``pattern`` as a whole (Rust regex syntax, as llguidance reads it)."""
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError(f"{what} must be a non-empty string")
    return _checked(_llg().LLMatcher.grammar_from_regex(pattern), what)


def choice(options: Sequence[str], *, what: str = "choice") -> Grammar:
    """Exactly one of ``options``."""
    if isinstance(options, str) or not isinstance(options, Sequence) or not options or \
            not all(isinstance(o, str) and o for o in options):
        raise GrammarError(f"{what} must be a non-empty list of non-empty strings")
    return regex("(" + "|".join(re.escape(o) for o in options) + ")", what=what)


def gbnf(text: str, *, what: str = "grammar") -> Grammar:
    """A grammar in llama.cpp's GBNF format (``root ::= ...``)."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(f"{what} must be a non-empty GBNF grammar")
    llguidance = _llg()
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        lark_text = gbnf_to_lark(text)
    except Exception as exc:  # its parser raises several kinds, each with the position
        raise GrammarError(f"{what} is not a GBNF grammar llguidance can read: {exc}") from None
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark_text), what)


def lark(text: str, *, what: str = "lark grammar") -> Grammar:
    """A grammar in llguidance's Lark-like format (``start: ...``; ``%json {schema}`` embeds a schema)."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(f"{what} must be a non-empty grammar")
    return _checked(_llg().LLMatcher.grammar_from_lark(text), what)


# ---------------------------------------------------------------------------------------------- tokenizer


class _Vocab:
    """What llguidance's LLTokenizer reads from a tokenizer: each token's bytes (control and unused tokens
    prefixed with 0xFF, llguidance's mark for a special token), the end token, and an encode function."""

    def __init__(self, tok: Any) -> None:
        from .tokenizer.core import TT_CONTROL, TT_UNKNOWN, TT_UNUSED

        special = (TT_CONTROL, TT_UNKNOWN, TT_UNUSED)
        self._tok = tok
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(tok.n_vocab):
            piece = tok.token_to_piece(i, special=True)
            if tok.token_types[i] in special:
                piece = b"\xff" + piece
                self.special_token_ids.append(i)
            self.tokens.append(piece)
        eog = sorted(tok.eog_ids)
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else (eog[0] if eog else None)
        self.bos_token_id = tok.bos_id
        self.is_tokenizer_wrapper = True

    def __call__(self, text: Any) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special=False, parse_special=False)


def llg_tokenizer(tok: Any) -> Any:
    """llguidance's tokenizer for a plinth tokenizer, built once per tokenizer (~0.5 s for 49k tokens)."""
    cached = getattr(tok, "_llg_tokenizer", None)
    if cached is not None:
        return cached
    eog = sorted(tok.eog_ids)
    if not eog:
        raise GrammarError("the model's vocabulary has no end-of-generation token, which a grammar needs to end")
    made = _llg().LLTokenizer(_Vocab(tok), n_vocab=tok.n_vocab, eos_token=eog)
    tok._llg_tokenizer = made
    return made


# ---------------------------------------------------------------------------------------------- constraint


class Constraint:
    """A :class:`Grammar` compiled for one tokenizer; :meth:`start` gives a sequence its own state."""

    def __init__(self, grammar: Grammar, tokenizer: Any, n_vocab: int | None = None) -> None:
        llguidance = _llg()
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.n_vocab = int(n_vocab if n_vocab is not None else tokenizer.n_vocab)  # the logits' width
        self._llt = llg_tokenizer(tokenizer)
        self.eog = frozenset(int(t) for t in tokenizer.eog_ids)
        self._proto = llguidance.LLMatcher(self._llt, grammar.text, log_level=0)
        if self._proto.is_error():
            raise GrammarError(f"{grammar.describe}: {_first_line(self._proto.get_error())}")

    def start(self) -> "ConstraintState":
        return ConstraintState(self, self._proto.deep_copy())


def compile_grammar(grammar: Grammar | None, tokenizer: Any, n_vocab: int | None = None) -> Constraint | None:
    """A :class:`Constraint` for ``grammar`` (None passes through)."""
    return None if grammar is None else Constraint(grammar, tokenizer, n_vocab)


class ConstraintState:
    """One sequence's place in a grammar. Not thread-safe: one sequence, one thread."""

    __slots__ = ("constraint", "_m", "_mask", "_words", "n_tokens")

    def __init__(self, constraint: Constraint, matcher: Any) -> None:
        self.constraint = constraint
        self._m = matcher
        self._mask: np.ndarray | None = None
        self._words = np.zeros((constraint._llt.vocab_size + 31) // 32, dtype=np.int32)
        self.n_tokens = 0  # tokens consumed

    # ---------------------------------------------------------------- queries

    def mask(self) -> np.ndarray:
        """bool [n_vocab]: the tokens allowed next (computed once per position)."""
        if self._mask is None:
            self._check()
            w = self._words
            self._m.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
            self._check()
            n = self.constraint.n_vocab
            bits = np.unpackbits(w.view(np.uint8), bitorder="little")
            if bits.shape[0] >= n:
                m = bits[:n].view(np.bool_)
            else:  # logits wider than the vocabulary (padded): the extra ids are never allowed
                m = np.zeros(n, dtype=np.bool_)
                m[:bits.shape[0]] = bits.view(np.bool_)
            self._mask = m
        return self._mask

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (one token's check where the mask is not computed yet)."""
        if self._mask is not None:
            return bool(self._mask[token])
        if not 0 <= token < self.constraint._llt.vocab_size:
            return False
        if token in self.constraint.eog:  # (a stopped matcher validates no token, the end ones included)
            return bool(self._m.is_accepting())
        return self._m.validate_tokens([int(token)]) == 1

    def count_allowed(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in order from here, the grammar allows."""
        return int(self._m.validate_tokens([int(t) for t in tokens])) if len(tokens) else 0

    @property
    def accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar (it may end here)."""
        return bool(self._m.is_accepting())

    @property
    def finished(self) -> bool:
        """Nothing but an end token can follow (or an end token was consumed)."""
        return bool(self._m.is_stopped())

    # ---------------------------------------------------------------- moves

    def advance(self, token: int) -> None:
        """Consume ``token`` (it must be allowed)."""
        self._mask = None
        if not self._m.consume_token(int(token)):
            raise GrammarError(f"token {int(token)} does not fit the grammar here "
                               f"({_first_line(self._m.get_error())})")
        self.n_tokens += 1

    def advance_many(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.advance(t)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens."""
        if n <= 0:
            return
        if n > self.n_tokens or not self._m.rollback(int(n)):
            raise GrammarError(f"cannot roll the grammar back by {n} tokens ({self.n_tokens} consumed)")
        self.n_tokens -= n
        self._mask = None

    def fork(self) -> "ConstraintState":
        """An independent copy at the same position."""
        s = ConstraintState(self.constraint, self._m.deep_copy())
        s.n_tokens = self.n_tokens
        s._mask = self._mask
        return s

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"{self.constraint.grammar.describe}: {_first_line(self._m.get_error())}")


def _first_line(s: str) -> str:
    s = (s or "").strip()
    return s.splitlines()[0] if s else "unknown error"


# ---------------------------------------------------------------------------------------------- command line


def add_cli_args(p: Any) -> None:
    """``--json-schema FILE`` / ``--grammar FILE`` (one of them) for ``plinth generate``."""
    g = p.add_argument_group("constrained output", "the output follows a grammar: every token it would break is "
                             "masked out before sampling (needs the 'grammar' extra: llguidance)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--json-schema", default=None, metavar="FILE",
                   help="a JSON schema file: the output is compact JSON conforming to it")
    x.add_argument("--grammar", default=None, metavar="FILE",
                   help="a GBNF grammar file (llama.cpp's format, root ::= ...): the output is a sentence of it")


def constraint_from_args(args: Any, tokenizer: Any, n_vocab: int | None = None) -> Constraint | None:
    """The :class:`Constraint` asked for by :func:`add_cli_args`'s options (None without them)."""
    path = getattr(args, "json_schema", None) or getattr(args, "grammar", None)
    if path is None:
        return None
    flag = "--json-schema" if getattr(args, "json_schema", None) else "--grammar"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise GrammarError(f"{flag} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise GrammarError(f"{flag} {path}: not UTF-8 text") from None
    what = f"{flag} {path}"
    g = json_schema(text, what=what) if flag == "--json-schema" else gbnf(text, what=what)
    return Constraint(g, tokenizer, n_vocab)

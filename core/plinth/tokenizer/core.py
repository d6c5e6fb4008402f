"""GGUF-metadata tokenizers: BPE (``gpt2``) and SentencePiece-style (``llama``)."""
from __future__ import annotations

import heapq
import warnings
from functools import lru_cache
from typing import Iterable, Sequence

from ..errors import UserError
from .pretok import PRE_NAMES, REFUSED_PRE, PreTokenizer

TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6
TT_UNDEFINED = 0  # llama.cpp's LLAMA_TOKEN_TYPE_UNDEFINED

SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")


class TokenizerError(UserError, ValueError):
    """The tokenizer metadata is missing or malformed (names the file, the key and the token index)."""


class TokenizerWarning(UserWarning):
    """A tokenizer key was ignored (a special token id outside the vocabulary)."""


class UnsupportedTokenizerError(TokenizerError):
    """Raised when the GGUF metadata names a tokenizer this package cannot build."""


_C_SPACE = " \t\n\v\f\r"  # C isspace


def _clean(text: str) -> str:
    """Text safe to encode as UTF-8: lone surrogates (undecodable input bytes) become U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        try:
            raw = text.encode("utf-8", "surrogateescape")  # the bytes surrogateescape kept
        except UnicodeEncodeError:
            raw = text.encode("utf-8", "replace")
        return raw.decode("utf-8", "replace")


# tokenizer.ggml.pre values (llama.cpp's names and their meaning) live in pretok.py.
SUPPORTED_PRE = tuple(sorted(set(PRE_NAMES) - set(REFUSED_PRE)))

# Token strings that end a generation turn, besides the declared EOS/EOT ids.
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|return|>", "<|call|>", "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>",
    "<|eom_id|>", "<end_of_utterance>",
    "[EOT]", "[EOS]", "[e~[",  # Kimi-K2, MiniMax-M2 (llama.cpp's list)
)


def _bytes_to_unicode() -> dict[int, str]:
    """The reversible byte -> printable character table of byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _describe(value) -> str:
    """A metadata value for a message: its type, and the value itself when short."""
    if isinstance(value, (list, tuple)) or hasattr(value, "shape"):
        return f"an array of {len(value)} values"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _get(md: dict, key: str, default=None):
    v = md.get(key, default)
    return default if v is None else v


def _as_list(v) -> list:
    if v is None:
        return []
    if hasattr(v, "tolist"):
        return v.tolist()
    return list(v)


class Tokenizer:
    """Common behaviour; build one with :meth:`from_metadata`."""

    model = "?"

    def __init__(self, md: dict, source: str = "GGUF metadata"):
        self.source = source
        raw_tokens = md.get("tokenizer.ggml.tokens")
        if raw_tokens is None:
            raise self._error("tokenizer.ggml.tokens", "missing: the file has no vocabulary")
        if not isinstance(raw_tokens, (list, tuple)) or not all(isinstance(t, str) for t in raw_tokens):
            raise self._error("tokenizer.ggml.tokens", f"is {_describe(raw_tokens)}, expected an array of strings")
        self.tokens: list[str] = list(raw_tokens)
        if not self.tokens:
            raise self._error("tokenizer.ggml.tokens", "is empty")
        n = len(self.tokens)
        self.token_types: list[int] = self._per_token(md, "tokenizer.ggml.token_type", int, TT_NORMAL)
        bad = next((i for i, t in enumerate(self.token_types) if not TT_UNDEFINED <= t <= TT_BYTE), None)
        if bad is not None:
            raise self._error("tokenizer.ggml.token_type", f"token {bad} has type {self.token_types[bad]}, "
                              f"expected {TT_UNDEFINED}..{TT_BYTE}")
        self.scores: list[float] = self._per_token(md, "tokenizer.ggml.scores", float, 0.0)
        self.token_to_id: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            self.token_to_id[t] = i

        def opt_id(key):
            v = md.get(key)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, int):
                raise self._error(key, f"is {_describe(v)}, expected a token id")
            if not 0 <= v < n:  # as llama.cpp: a bad special id is reported and ignored
                warnings.warn(f"{source}: key '{key}' = {v} is outside the vocabulary of {n} tokens; ignored",
                              TokenizerWarning, stacklevel=2)
                return None
            return v

        self.bos_id = opt_id("tokenizer.ggml.bos_token_id")
        self.eos_id = opt_id("tokenizer.ggml.eos_token_id")
        self.eot_id = opt_id("tokenizer.ggml.eot_token_id")
        self.eom_id = opt_id("tokenizer.ggml.eom_token_id")
        self.pad_id = opt_id("tokenizer.ggml.padding_token_id")
        self.unk_id = opt_id("tokenizer.ggml.unknown_token_id")
        self.mask_id = opt_id("tokenizer.ggml.mask_token_id")
        self.chat_template = md.get("tokenizer.chat_template")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise self._error("tokenizer.chat_template", f"is {_describe(self.chat_template)}, expected a string")
        self.pre = md.get("tokenizer.ggml.pre")
        if self.pre is not None and not isinstance(self.pre, str):
            raise self._error("tokenizer.ggml.pre", f"is {_describe(self.pre)}, expected a string")
        self._init_flags(md)

        # Tokens matched verbatim in input text: control tokens only when
        # parse_special is set, user-defined tokens always.
        self._special_ids = [i for i, t in enumerate(self.token_types) if t in (TT_CONTROL, TT_USER, TT_UNKNOWN)]
        self._special_ids.sort(key=lambda i: -len(self.tokens[i]))
        self._lstrip, self._rstrip = self._strip_attrs(md)
        self._eog = self._detect_eog()

    def _strip_attrs(self, md: dict) -> tuple[frozenset, frozenset]:
        """Special tokens that swallow ASCII whitespace on their left / right when matched
        in text, as llama.cpp sets them by pre value, architecture and model name."""
        pre = self.pre or ""
        arch = str(md.get("general.architecture") or "")
        name = str(md.get("general.name") or "").lower()

        def ids(texts):
            return {self.token_to_id[t] for t in texts if t in self.token_to_id}

        if any(k in pre for k in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
                any(k in arch for k in ("nomic-bert-moe", "jina-bert-v3")):
            return frozenset(ids(["<mask>"])), frozenset()
        if "phi-3" in name or "phi3" in name:
            right = (set(self._special_ids) | ids(["</s>"])) - ids(["<unk>", "<s>", "<|endoftext|>"])
            return frozenset(), frozenset(right)
        if "modern-bert" in name:
            return frozenset(ids(["[MASK]"])), frozenset()
        return frozenset(), frozenset()

    def _error(self, key: str, why: str) -> TokenizerError:
        return TokenizerError(f"{self.source}: key '{key}' {why}")

    def _per_token(self, md: dict, key: str, cast, default) -> list:
        """A per-token array (types, scores): one number per token, or absent."""
        raw = md.get(key)
        if raw is None:
            return [default] * len(self.tokens)
        if not hasattr(raw, "tolist") and not isinstance(raw, (list, tuple)):
            raise self._error(key, f"is {_describe(raw)}, expected an array of {len(self.tokens)} numbers")
        values = _as_list(raw)
        if len(values) != len(self.tokens):
            raise self._error(key, f"has {len(values)} entries but 'tokenizer.ggml.tokens' has {len(self.tokens)}")
        try:
            return [cast(v) for v in values]
        except (TypeError, ValueError):
            raise self._error(key, "holds values that are not numbers") from None

    def _init_flags(self, md):
        self.add_bos = bool(_get(md, "tokenizer.ggml.add_bos_token", False))
        self.add_eos = bool(_get(md, "tokenizer.ggml.add_eos_token", False))
        self.add_space_prefix = bool(_get(md, "tokenizer.ggml.add_space_prefix", False))

    # ------------------------------------------------------------------ factory
    @staticmethod
    def from_metadata(md: dict, source: str = "GGUF metadata") -> "Tokenizer":
        """The tokenizer ``tokenizer.ggml.model`` names; ``source`` (the file) starts every error message."""
        model = md.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError(f"{source}: missing key 'tokenizer.ggml.model': the file has no tokenizer "
                                 "(a tokenizer-less file can be loaded with plinth.load_model, not used for text)")
        if model == "gpt2":
            pre = md.get("tokenizer.ggml.pre") or "default"
            if isinstance(pre, str) and pre in REFUSED_PRE:
                raise UnsupportedTokenizerError(
                    f"{source}: key 'tokenizer.ggml.pre' = {pre!r}: unsupported for model 'gpt2': {REFUSED_PRE[pre]}")
            if not isinstance(pre, str) or pre not in SUPPORTED_PRE:
                raise UnsupportedTokenizerError(
                    f"{source}: key 'tokenizer.ggml.pre' = {_describe(pre)}: unsupported for model 'gpt2'; "
                    f"supported: {', '.join(SUPPORTED_PRE)}"
                )
            return BPETokenizer(md, source)
        if model == "llama":
            return SPMTokenizer(md, source)
        if model == "gemma4":  # llama.cpp reads it as byte-pair merges with the gemma4 pre-tokenizer, always
            return BPETokenizer({**md, "tokenizer.ggml.pre": "gemma4"}, source)
        raise UnsupportedTokenizerError(
            f"{source}: key 'tokenizer.ggml.model' = {_describe(model)}: unsupported; "
            f"supported: {', '.join(SUPPORTED_MODELS)}"
        )

    # ------------------------------------------------------------------ properties
    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @property
    def eog_ids(self) -> frozenset:
        return self._eog

    def is_eog(self, tid: int) -> bool:
        return tid in self._eog

    def _detect_eog(self) -> frozenset:
        s = set()
        for i in (self.eos_id, self.eot_id, self.eom_id):
            if i is not None:
                s.add(i)
        for t in _EOG_TEXTS:
            i = self.token_to_id.get(t)
            if i is not None and self.token_types[i] in (TT_CONTROL, TT_USER, TT_UNKNOWN):
                s.add(i)
        if self.eot_id is None:
            for t in ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "[EOT]"):
                i = self.token_to_id.get(t)
                if i is not None:
                    self.eot_id = i
                    break
        return frozenset(s)

    def is_special(self, tid: int) -> bool:
        return self.token_types[tid] in (TT_CONTROL, TT_UNKNOWN, TT_UNUSED)

    # ------------------------------------------------------------------ encoding
    def _partition(self, text: str, parse_special: bool) -> list:
        """Split text into [str | int] fragments around special-token strings."""
        frags: list = [text]
        for tid in self._special_ids:
            ttype = self.token_types[tid]
            if not parse_special and ttype != TT_USER:
                continue
            tok = self.tokens[tid]
            if not tok:
                continue
            out = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    out.append(f)
                    continue
                parts = f.split(tok)
                last = len(parts) - 1
                for k, p in enumerate(parts):
                    if k:
                        out.append(tid)
                        if tid in self._rstrip:
                            p = p.lstrip(_C_SPACE)
                    if k < last and tid in self._lstrip:
                        p = p.rstrip(_C_SPACE)
                    if p:
                        out.append(p)
            frags = out
        return frags

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode takes a str, got {type(text).__name__}")
        text = _clean(text)
        ids: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            ids.append(self.bos_id)
        ids.extend(self._encode_fragments(self._partition(text, parse_special), bool(ids)))
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _encode_fragments(self, frags, after_bos):  # pragma: no cover - abstract
        raise NotImplementedError

    # ------------------------------------------------------------------ decoding
    def token_to_piece(self, tid: int, special: bool = True) -> bytes:
        raise NotImplementedError

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        return b"".join(self.token_to_piece(int(i), special=not skip_special) for i in ids)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def incremental_decoder(self, skip_special: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special=skip_special)


_NO_TOKEN_TEXT = "\x00plinth:no-token\x00"


@lru_cache(maxsize=None)
def _pretokenizer(pre_type: str) -> PreTokenizer:
    return PreTokenizer(pre_type)


class BPETokenizer(Tokenizer):
    """BPE over llama.cpp's pre-tokenizer words: regex splitting chosen by
    ``tokenizer.ggml.pre``, then merges by rank.  Words are byte-level (GPT-2
    byte-to-character mapping) for most values, raw UTF-8 with ``<0xXX>`` byte
    fallback for the SPM-style ones (``gemma4``, ``sarvam-moe``...)."""

    model = "gpt2"

    def _init_flags(self, md):
        spec = PRE_NAMES[self.pre or "default"]
        self.pre_spec = spec
        self.add_bos = bool(_get(md, "tokenizer.ggml.add_bos_token", spec.add_bos)) or spec.force_bos
        self.add_eos = bool(_get(md, "tokenizer.ggml.add_eos_token", False))
        # read as llama.cpp does; for BPE it only matters when detokenizing
        self.add_space_prefix = bool(_get(md, "tokenizer.ggml.add_space_prefix", False))
        # llama.cpp's detokenizer clean-up flag (" ," -> ","...); decode here returns the
        # pieces as they are, like llama.cpp's token_to_piece
        self.clean_spaces = spec.clean_spaces
        self.add_sep = bool(_get(md, "tokenizer.ggml.add_sep_token", spec.add_sep))
        self.escape_whitespaces = spec.escape_whitespaces
        self.byte_encode = spec.byte_encode

    def __init__(self, md: dict, source: str = "GGUF metadata"):
        super().__init__(md, source)
        from tokenizers import Tokenizer as _HFTok, models, pre_tokenizers

        spec = self.pre_spec
        self._pretok = _pretokenizer(spec.type)
        self._newline_words = spec.type == "GEMMA4"  # a run of newlines that is a token stays whole
        merges = []
        vocab = dict(self.token_to_id)
        raw_merges = md.get("tokenizer.ggml.merges")
        if raw_merges is not None and not isinstance(raw_merges, (list, tuple)):
            raise self._error("tokenizer.ggml.merges", f"is {_describe(raw_merges)}, expected an array of strings")
        for i, m in enumerate(_as_list(raw_merges)):
            m = str(m)
            k = m.find(" ", 1)
            if k > 0:
                a, b = m[:k], m[k + 1:]
                for part in (a, b, a + b):
                    if part not in vocab:
                        raise self._error("tokenizer.ggml.merges", f"entry {i} ({m!r}) uses {part!r}, which is not "
                                          "in 'tokenizer.ggml.tokens' (a damaged vocabulary string?)")
                merges.append((a, b))
        # A character with no token (and, raw-UTF-8, no <0xXX> tokens for its bytes) stays a
        # symbol that no merge crosses and is dropped at the end, as in llama.cpp: it becomes
        # this stand-in id, which _encode_fragments removes.
        self._no_token = len(self.tokens)
        vocab[_NO_TOKEN_TEXT] = self._no_token
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges, fuse_unk=False,
                             byte_fallback=not self.byte_encode, unk_token=_NO_TOKEN_TEXT)
        except Exception as exc:  # the tokenizers library's own checks
            raise self._error("tokenizer.ggml.merges", f"cannot build the BPE model: {exc}") from None
        tk = _HFTok(bpe)
        if self.byte_encode:  # words arrive split; this only maps bytes to characters
            tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        self._hf = tk
        self._pieces: list[bytes] = []
        for i, t in enumerate(self.tokens):
            tt = self.token_types[i]
            if tt == TT_BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">") and not self.byte_encode:
                self._pieces.append(bytes([int(t[3:5], 16)]))
                continue
            if tt in (TT_NORMAL, TT_BYTE) or tt not in (TT_CONTROL, TT_USER, TT_UNKNOWN, TT_UNUSED):
                if not self.byte_encode:
                    self._pieces.append((t.replace("\u2581", " ") if self.escape_whitespaces else t).encode("utf-8"))
                    continue
                try:
                    self._pieces.append(bytes(_CHAR_TO_BYTE[c] for c in t))
                    continue
                except KeyError:
                    pass
            self._pieces.append(t.encode("utf-8"))

    def pre_tokenize(self, text: str) -> list[str]:
        """The words llama.cpp's pre-tokenizer makes of ``text`` (before byte mapping and merges)."""
        if self.escape_whitespaces:
            text = text.replace(" ", "\u2581")
        return self._pretok.split(text)

    def _encode_fragments(self, frags, after_bos):
        # Each text fragment becomes one or more runs of words; a run is encoded by
        # the tokenizers library (each word on its own), ids between runs are kept.
        plan: list = []  # int ids and lists of words, in order
        for f in frags:
            if isinstance(f, int):
                plan.append(f)
                continue
            run: list[str] = []
            for w in self.pre_tokenize(f):
                if self._newline_words and w.strip("\n") == "" and w in self.token_to_id:
                    if run:
                        plan.append(run)
                        run = []
                    plan.append(self.token_to_id[w])
                else:
                    run.append(w)
            if run:
                plan.append(run)
        runs = [p for p in plan if not isinstance(p, int)]
        encs = iter(self._hf.encode_batch(runs, is_pretokenized=True, add_special_tokens=False)) if runs else iter(())
        ids: list[int] = []
        for p in plan:
            if isinstance(p, int):
                ids.append(p)
            else:
                ids.extend(next(encs).ids)
        if self._no_token in ids:
            ids = [i for i in ids if i != self._no_token]
        return ids

    def token_to_piece(self, tid: int, special: bool = True) -> bytes:
        tt = self.token_types[tid]
        if not special and tt in (TT_CONTROL, TT_UNKNOWN, TT_UNUSED):
            return b""
        return self._pieces[tid]


class SPMTokenizer(Tokenizer):
    """SentencePiece-style: whitespace escaped as U+2581, highest-score bigram
    merging, then byte fallback through ``<0xXX>`` tokens."""

    model = "llama"

    def _init_flags(self, md):
        self.add_bos = bool(_get(md, "tokenizer.ggml.add_bos_token", True))
        self.add_eos = bool(_get(md, "tokenizer.ggml.add_eos_token", False))
        self.add_space_prefix = bool(_get(md, "tokenizer.ggml.add_space_prefix", True))

    def __init__(self, md: dict, source: str = "GGUF metadata"):
        super().__init__(md, source)
        if self.unk_id is None:
            self.unk_id = self.token_to_id.get("<unk>")
        self._byte_ids = [self.token_to_id.get("<0x%02X>" % b) for b in range(256)]
        self._pieces: list[bytes] = []
        for i, t in enumerate(self.tokens):
            tt = self.token_types[i]
            if tt == TT_BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                self._pieces.append(bytes([int(t[3:5], 16)]))
            elif tt in (TT_CONTROL, TT_USER, TT_UNKNOWN, TT_UNUSED):
                self._pieces.append(t.encode("utf-8"))
            else:
                self._pieces.append(t.replace("\u2581", " ").encode("utf-8"))

    def _encode_fragments(self, frags, after_bos):
        ids: list[int] = []
        prev_special = True
        for f in frags:
            if isinstance(f, int):
                ids.append(f)
                prev_special = True
                continue
            if not f:
                continue
            if self.add_space_prefix and prev_special:
                f = " " + f
            self._spm(f.replace(" ", "\u2581"), ids)
            prev_special = False
        return ids

    def _spm(self, text: str, out: list[int]) -> None:
        n = len(text)
        if n == 0:
            return
        vocab = self.token_to_id
        scores = self.scores
        # symbol i covers text[start[i]:start[i]+length[i]]; chars are code points
        start = list(range(n))
        length = [1] * n
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list = []
        merged_from: dict[str, tuple[int, int]] = {}

        def try_add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            s = text[start[left]:start[left] + length[left] + length[right]]
            tid = vocab.get(s)
            if tid is None:
                return
            heapq.heappush(heap, (-scores[tid], left, right, len(s), s))

        for i in range(n - 1):
            try_add(i, i + 1)
        while heap:
            _, left, right, size, s = heapq.heappop(heap)
            if length[left] == 0 or length[right] == 0 or length[left] + length[right] != size:
                continue
            merged_from[s] = (start[left], length[left])
            length[left] += length[right]
            length[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_add(prev[left], left)
            try_add(left, nxt[left])

        i = 0
        while i >= 0:
            self._resegment(text[start[i]:start[i] + length[i]], start[i], merged_from, text, out)
            i = nxt[i]

    def _resegment(self, s: str, pos: int, merged_from, text: str, out: list[int]) -> None:
        tid = self.token_to_id.get(s)
        if tid is not None:
            out.append(tid)
            return
        m = merged_from.get(s)
        if m is not None and len(s) > 1:
            lstart, llen = m
            # the recorded split is relative to where that merge happened; offsets
            # are recomputed from the substring itself
            left = s[:llen]
            self._resegment(left, pos, merged_from, text, out)
            self._resegment(s[llen:], pos + llen, merged_from, text, out)
            return
        for b in s.encode("utf-8"):
            bid = self._byte_ids[b]
            if bid is None:
                bid = self.token_to_id.get(chr(b)) if b < 128 else None
            if bid is None:
                bid = self.unk_id if self.unk_id is not None else 0
            out.append(bid)

    def token_to_piece(self, tid: int, special: bool = True) -> bytes:
        tt = self.token_types[tid]
        if not special and tt in (TT_CONTROL, TT_UNKNOWN, TT_UNUSED):
            return b""
        return self._pieces[tid]

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        ids = [int(i) for i in ids]
        if skip_special and ids and ids[0] == self.bos_id:
            ids = ids[1:]
        out = [self.token_to_piece(i, special=not skip_special) for i in ids]
        # the space added by add_space_prefix is removed from the first piece only
        if out and self.add_space_prefix and out[0].startswith(b" "):
            out[0] = out[0][1:]
        return b"".join(out)


class IncrementalDecoder:
    """Feed token ids one at a time; get back only complete UTF-8 text."""

    def __init__(self, tok: Tokenizer, skip_special: bool = False):
        self.tok = tok
        self.skip_special = skip_special
        self._buf = b""
        self._first = True

    def feed(self, tid: int) -> str:
        tok = self.tok
        piece = tok.token_to_piece(int(tid), special=not self.skip_special)
        if self._first:
            if self.skip_special and int(tid) == tok.bos_id:
                return ""
            if isinstance(tok, SPMTokenizer) and tok.add_space_prefix and piece.startswith(b" "):
                piece = piece[1:]
            self._first = False
        self._buf += piece
        return self._drain()

    def _drain(self) -> str:
        buf = self._buf
        # keep back an incomplete trailing UTF-8 sequence (at most 3 bytes)
        cut = len(buf)
        for back in range(1, min(4, len(buf)) + 1):
            b = buf[-back]
            if b & 0xC0 == 0x80:
                continue
            need = 1 if b < 0x80 else 2 if b >> 5 == 6 else 3 if b >> 4 == 14 else 4 if b >> 3 == 30 else 1
            if need > back:
                cut = len(buf) - back
            break
        self._buf = buf[cut:]
        return buf[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        s = self._buf.decode("utf-8", errors="replace")
        self._buf = b""
        return s

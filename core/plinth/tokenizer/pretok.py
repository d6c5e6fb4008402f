"""Pre-tokenizers for byte-level BPE, one per ``tokenizer.ggml.pre`` value llama.cpp knows.

Each pre-tokenizer type is an ordered list of regexes; every regex splits the
pieces the previous one left, and both the matched spans and the text between
matches become pieces.  The regexes are interpreted the way llama.cpp's
``unicode_regex_split`` interprets them, which is not always how the
``tokenizers`` library would:

* A regex that names a Unicode category (``\\p{L}``, ``\\p{N}``, ``\\p{P}``,
  ``\\p{M}``, ``\\p{S}`` and the letter sub-categories) runs on a *collapsed*
  copy of the text: every non-ASCII code point becomes one stand-in character
  for its category (or for "whitespace", or "other"), ASCII stays as is, and
  each ``\\p{..}`` in the regex becomes a class of its stand-in plus the
  category's ASCII members.  All letter sub-categories (``\\p{Lu}``,
  ``\\p{Ll}``...) collapse to "letter", so a regex that tells upper from lower
  case only does so for ASCII.
* A regex without categories runs on the code points, with non-ASCII
  whitespace replaced by U+000B.
* ``\\s`` is ASCII whitespace (plus the stand-in), ``\\d`` is ``[0-9]``, ``$``
  is the end of the piece (ECMAScript rules).
* Three llama.cpp regexes are not run as regexes at all but by hand-written
  code with its own behaviour: ``\\p{Han}+`` (Kimi-K2's whole pre-tokenizer),
  ``\\p{AFMoE_digits}`` and tiny_aya's digit grouping (digit runs cut into
  groups of three from the right, the first group keeping any non-digit text
  before it in the same piece).  Both are reproduced here.

Other llama.cpp regexes that are hand-coded there (GPT-2, Llama-3, Qwen2,
Qwen3.5) behave exactly like the regex on real Unicode categories, which is
what the collapsed form computes.
"""
from __future__ import annotations

import bisect
import re
import unicodedata
from typing import NamedTuple

# --- code point classes (llama.cpp's unicode flags) -----------------------------------
# The Unicode White_Space property: what llama.cpp treats as whitespace.
WHITESPACE = frozenset(
    [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
     0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)

_WS = "\x0b"  # stand-in for non-ASCII whitespace (a character ECMAScript's \s matches)
_OTHER, _NUM, _LET, _PUNCT, _MARK, _SYM = "\xd0", "\xd1", "\xd2", "\xd3", "\xd4", "\xd5"
_HAN, _HAN_OTHER = "\xd6", "\xd7"  # only in Kimi-K2's collapsed text
_CAT_CHAR = {"N": _NUM, "L": _LET, "P": _PUNCT, "M": _MARK, "S": _SYM}


# Code points Unicode 15.0 assigned (llama.cpp's tables) that Python 3.11's unicodedata
# (Unicode 14.0) does not know: (first, last, major category).
_UNICODE_15 = (
    (0x00CF3, 0x00CF3, "M"), (0x00ECE, 0x00ECE, "M"), (0x02FFC, 0x02FFF, "S"), (0x031EF, 0x031EF, "S"),
    (0x10EFD, 0x10EFF, "M"), (0x1123F, 0x11240, "L"), (0x11241, 0x11241, "M"), (0x11B00, 0x11B09, "P"),
    (0x11F00, 0x11F01, "M"), (0x11F02, 0x11F02, "L"), (0x11F03, 0x11F03, "M"), (0x11F04, 0x11F10, "L"),
    (0x11F12, 0x11F33, "L"), (0x11F34, 0x11F3A, "M"), (0x11F3E, 0x11F42, "M"), (0x11F43, 0x11F4F, "P"),
    (0x11F50, 0x11F59, "N"), (0x1342F, 0x1342F, "L"), (0x13440, 0x13440, "M"), (0x13441, 0x13446, "L"),
    (0x13447, 0x13455, "M"), (0x1B132, 0x1B132, "L"), (0x1B155, 0x1B155, "L"), (0x1D2C0, 0x1D2D3, "N"),
    (0x1DF25, 0x1DF2A, "L"), (0x1E030, 0x1E06D, "L"), (0x1E08F, 0x1E08F, "M"), (0x1E4D0, 0x1E4EB, "L"),
    (0x1E4EC, 0x1E4EF, "M"), (0x1E4F0, 0x1E4F9, "N"), (0x1F6DC, 0x1F6DC, "S"), (0x1F774, 0x1F776, "S"),
    (0x1F77B, 0x1F77F, "S"), (0x1F7D9, 0x1F7D9, "S"), (0x1FA75, 0x1FA77, "S"), (0x1FA87, 0x1FA88, "S"),
    (0x1FAAD, 0x1FAAF, "S"), (0x1FABB, 0x1FABD, "S"), (0x1FABF, 0x1FABF, "S"), (0x1FACE, 0x1FACF, "S"),
    (0x1FADA, 0x1FADB, "S"), (0x1FAE8, 0x1FAE8, "S"), (0x1FAF7, 0x1FAF8, "S"), (0x2B739, 0x2B739, "L"),
    (0x2EBF0, 0x2EE5D, "L"), (0x31350, 0x323AF, "L"),
)
_U15_FIRST = [r[0] for r in _UNICODE_15]


def category_char(cp: int) -> str:
    """The collapsed stand-in of a non-ASCII code point."""
    if cp in WHITESPACE:
        return _WS
    k = bisect.bisect_right(_U15_FIRST, cp) - 1
    if k >= 0 and cp <= _UNICODE_15[k][1]:
        return _CAT_CHAR[_UNICODE_15[k][2]]
    return _CAT_CHAR.get(unicodedata.category(chr(cp))[0], _OTHER)


def is_han(cp: int) -> bool:
    """The code point ranges llama.cpp's Kimi-K2 pre-tokenizer calls Han."""
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2EBEF or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


class _Collapse(dict):
    """A ``str.translate`` table built on demand: code point -> stand-in."""

    def __init__(self, kimi: bool = False):
        super().__init__((c, chr(c)) for c in range(128))
        self.kimi = kimi

    def __missing__(self, cp: int) -> str:
        if self.kimi and is_han(cp):
            v = _HAN if category_char(cp) == _LET else _HAN_OTHER
        else:
            v = category_char(cp)
        self[cp] = v
        return v


_COLLAPSE = _Collapse()
_COLLAPSE_KIMI = _Collapse(kimi=True)
_WS_ONLY = {cp: _WS for cp in WHITESPACE if cp >= 128}

# --- regex translation ------------------------------------------------------------------
_S_CHARS = "\\t\\n\\x0b\\x0c\\r "
_CATEGORY_CLASS = {  # stand-in plus the category's ASCII members
    "N": _NUM + "0-9",
    "L": _LET + "A-Za-z",
    "P": _PUNCT + "!-#%-*,-/:;?@\\[-\\]_{}",
    "M": _MARK,
    "S": _SYM + "$+<->^`|~",
}
_CATEGORY_NAMES = {"\\p{N}": "N", "\\p{L}": "L", "\\p{P}": "P", "\\p{M}": "M", "\\p{S}": "S",
                   "\\p{Lu}": "L", "\\p{Ll}": "L", "\\p{Lt}": "L", "\\p{Lm}": "L", "\\p{Lo}": "L"}


def uses_categories(rx: str) -> bool:
    return any(name in rx for name in _CATEGORY_NAMES)


def translate(rx: str) -> str:
    """A llama.cpp (ECMAScript) regex as a Python ``re`` pattern over the text it runs on."""
    out: list[str] = []
    inside = False
    i = 0
    n = len(rx)
    while i < n:
        c = rx[i]
        if c == "\\":
            if rx.startswith("\\p{", i):
                j = rx.index("}", i)
                cat = _CATEGORY_NAMES.get(rx[i:j + 1])
                if cat is None:
                    raise ValueError(f"unsupported category {rx[i:j + 1]} in {rx!r}")
                body = _CATEGORY_CLASS[cat]
                out.append(body if inside else "[" + body + "]")
                i = j + 1
                continue
            e = rx[i + 1]
            if e == "s":
                out.append(_S_CHARS if inside else "[" + _S_CHARS + "]")
            elif e == "S":
                if inside:
                    raise ValueError(f"\\S inside a class in {rx!r}")
                out.append("[^" + _S_CHARS + "]")
            elif e == "d":
                out.append("0-9" if inside else "[0-9]")
            elif e in "wWbB":
                raise ValueError(f"unsupported escape \\{e} in {rx!r}")
            else:
                out.append(rx[i:i + 2])
            i += 2
            continue
        if inside:
            if c == "]":
                inside = False
            elif c == "[":
                c = "\\["  # literal in ECMAScript; Python would warn of a nested set
            out.append(c)
        elif c == "[":
            inside = True
            out.append(c)
            if rx.startswith("[^", i):
                out.append("^")
                i += 1
            if rx.startswith("]", i + 1):  # an empty class in ECMAScript, a literal in Python
                raise ValueError(f"empty class in {rx!r}")
        elif c == "$":
            out.append("\\Z")
        else:
            out.append(c)
        i += 1
    return "".join(out)


# --- the pre-tokenizer types (llama.cpp's LLAMA_VOCAB_PRE_TYPE_* regex lists) ----------------
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_LLAMA3 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
           "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_QWEN2 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
          "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_CJK_DEEPSEEK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_CJK_DEEPSEEK3 = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK3_WORDS = ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
                    "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*"
                    "|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
_CASED_WORDS = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
                + _CONTRACTIONS + "?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
                "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*" + _CONTRACTIONS + "?")
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_NEWLINES = "[^\\n]+|[\\n]+"
KIMI_K2_RX = "\\p{Han}+"
AFMOE_DIGITS_RX = "\\p{AFMoE_digits}"
TINY_AYA_DIGITS_RX = "\\d{1,3}(?=(?:\\d{3})*\\b)"


def _lookahead_cased(letter: str) -> str:
    """GPT-4o's cased-word regex as llama.cpp rewrites it (lookaheads instead of Lu/Ll)."""
    up = f"((?=[{letter}])([^a-z]))"
    low = f"((?=[{letter}])([^A-Z]))"
    return (f"[^\\r\\n\\p{{L}}\\p{{N}}]?{up}*{low}+{_CONTRACTIONS}?|[^\\r\\n\\p{{L}}\\p{{N}}]?{up}+{low}*"
            f"{_CONTRACTIONS}?|\\p{{N}}{{1,3}}| ?[^\\s\\p{{L}}\\p{{N}}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


PRE_TYPES: dict[str, tuple[str, ...]] = {
    "DEFAULT": ("[\\p{P}\\$\\+<=>\\^~\\|]+", _GPT2, "\\p{N}+", "[0-9][0-9][0-9]"),
    "LLAMA3": (_LLAMA3,),
    "DBRX": (_LLAMA3,),
    "SMAUG": (_LLAMA3,),
    "CHATGLM4": (_LLAMA3,),
    "JAIS2": (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
              "|\\s*[\\r\\n]+" + "".join(f"|\\s{{{k}}}(?!\\S)" for k in (512, 256, 128, 64, 32, 16, 8, 4))
              + "|\\s{1,2}(?!\\S)|\\s{1}",),
    "DEEPSEEK_LLM": (
        "[\r\n]",
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
        "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
        "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
        "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
        "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
        "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
        "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134"
        "\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
        "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
        "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
        "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
        "\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        "\\s+$",
        _CJK_DEEPSEEK,
        "\\p{N}+",
    ),
    "DEEPSEEK3_LLM": ("\\p{N}{1,3}", _CJK_DEEPSEEK3, _DEEPSEEK3_WORDS),
    "SPARK2_5": ("\\p{N}{1,3}", _CJK_DEEPSEEK3,
                 _DEEPSEEK3_WORDS.replace("+[\r\n]*|\\s*[\r\n]+|", "+|[\r\n]|"), "\\p{N}"),
    "YOUTU": (
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c"
        "\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        _CASED_WORDS + "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "DEEPSEEK_CODER": ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _CJK_DEEPSEEK, "\\p{N}"),
    "FALCON": ("[\\p{P}\\$\\+<=>\\^~\\|`]+", _GPT2, "[0-9][0-9][0-9]"),
    "STARCODER": ("\\p{N}", _GPT2),
    "GPT2": (_GPT2,),
    "QWEN2": (_QWEN2,),
    "QWEN35": (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+"
               "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "BLOOM": (_BLOOM,),
    "VIKING": (_BLOOM, "\\p{N}"),
    "TEKKEN": ("[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?"
               "((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*"
               "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "CHAMELEON": ("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", "\\p{N}",
                  "[\\p{P}!-/:-@\\[-`{-~]", _GPT2),
    "GPT4O": (_lookahead_cased("\\p{L}"),),
    "GRANITE_EMB_MULTI": (_lookahead_cased("\\p{L}\\p{M}"),),
    "TINY_AYA": (TINY_AYA_DIGITS_RX, _CASED_WORDS + "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*"
                 "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
    "KIMI_K2": (KIMI_K2_RX,),
    "SUPERBPE": ("\\p{N}+", "(?=(\\d{3})+(?!\\d))"),
    "BAILINGMOE": ("'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
                   "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",),
    "SEED_CODER": (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+"
                   "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "UFAKZEKA": ("[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
                 "|\\s+(?!\\S)|\\s+",),
    "GROK_2": (_QWEN2,),
    "AFMOE": (AFMOE_DIGITS_RX,
              "[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf"
              "\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af"
              "\u1100-\u11ff]+",
              "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
              "| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
    "LAGUNA": (_NEWLINES, _QWEN2),
    "EXAONE_MOE": (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}"
                   "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",),
    "GEMMA4": (_NEWLINES,),
    "SARVAM_MOE": (_NEWLINES,),
    "MINICPM5": ("\\p{N}{1,3}", _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+"
                 "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
    "WHITESPACE": ("\\S+",),
}
for _alias, _same in (("MPT", "GPT2"), ("OLMO", "GPT2"), ("JAIS", "GPT2"), ("TRILLION", "GPT2"),
                      ("GRANITE_DOCLING", "GPT2"), ("REFACT", "STARCODER"), ("COMMAND_R", "STARCODER"),
                      ("SMOLLM", "STARCODER"), ("CODESHELL", "STARCODER"), ("EXAONE", "STARCODER"),
                      ("MINERVA", "STARCODER"), ("MELLUM2", "STARCODER"), ("STABLELM2", "QWEN2"),
                      ("HUNYUAN", "QWEN2"), ("SOLAR_OPEN", "QWEN2"), ("PORO", "BLOOM"), ("GPT3_FINNISH", "BLOOM"),
                      ("HUNYUAN_DENSE", "DEEPSEEK3_LLM"), ("JOYAI_LLM", "DEEPSEEK3_LLM"), ("HY_V4", "DEEPSEEK3_LLM"),
                      ("MINIMAX_M2", "GPT4O")):
    PRE_TYPES[_alias] = PRE_TYPES[_same]

# Types whose words are BPE'd as raw UTF-8 (no GPT-2 byte mapping; byte fallback through <0xXX>).
RAW_UTF8_TYPES = frozenset({"GEMMA4", "SARVAM_MOE", "WHITESPACE"})


class PreSpec(NamedTuple):
    """What a ``tokenizer.ggml.pre`` value means to llama.cpp."""
    type: str
    ignore_merges: bool = False
    add_bos: bool = False          # default when the file has no tokenizer.ggml.add_bos_token
    clean_spaces: bool = True      # detokenizer clean-up of " ," " ." " 's" ...
    escape_whitespaces: bool = False  # spaces become U+2581 before splitting (SPM-style BPE)
    add_sep: bool = False
    force_bos: bool = False        # add_bos is on whatever the file says (Gemma 4)

    @property
    def byte_encode(self) -> bool:
        return self.type not in RAW_UTF8_TYPES


def _names(names: str, *args, **kw) -> dict:
    spec = PreSpec(*args, **kw)
    return {n: spec for n in names.split()}


# tokenizer.ggml.pre -> PreSpec, as llama.cpp's vocabulary loader maps them.
PRE_NAMES: dict[str, PreSpec] = {
    **_names("default", "DEFAULT"),
    **_names("minicpm5", "MINICPM5", ignore_merges=True),
    **_names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", "LLAMA3",
             ignore_merges=True, add_bos=True),
    **_names("deepseek-llm", "DEEPSEEK_LLM", clean_spaces=False),
    **_names("deepseek-coder", "DEEPSEEK_CODER", clean_spaces=False),
    **_names("deepseek-v3", "DEEPSEEK3_LLM", clean_spaces=False),
    **_names("spark2_5", "SPARK2_5", clean_spaces=False),
    **_names("youtu", "YOUTU", clean_spaces=False, ignore_merges=True),
    **_names("falcon", "FALCON"),
    **_names("mpt", "MPT"),
    **_names("starcoder", "STARCODER"),
    **_names("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert exaone4",
             "GPT2"),
    **_names("jais-2", "JAIS2"),
    **_names("gemma4 granite-embed-multi-311m", "GEMMA4", escape_whitespaces=True, force_bos=True),
    **_names("sarvam-moe", "SARVAM_MOE", escape_whitespaces=True, clean_spaces=False),
    **_names("jina-v1-en jina-v2-code roberta-bpe", "GPT2", add_sep=True),
    **_names("whitespace", "WHITESPACE"),
    **_names("refact", "REFACT"),
    **_names("command-r", "COMMAND_R", clean_spaces=False),
    **_names("qwen2 deepseek-r1-qwen kormo f2llmv2", "QWEN2", clean_spaces=False),
    **_names("qwen35", "QWEN35", clean_spaces=False),
    **_names("stablelm2", "STABLELM2"),
    **_names("olmo", "OLMO"),
    **_names("dbrx", "DBRX"),
    **_names("smaug-bpe", "SMAUG"),
    **_names("poro-chat", "PORO", clean_spaces=False),
    **_names("chatglm-bpe", "CHATGLM4"),
    **_names("glm4 glm5", "CHATGLM4", ignore_merges=True),
    **_names("viking", "VIKING", clean_spaces=False),
    **_names("jais", "JAIS"),
    **_names("tekken", "TEKKEN", clean_spaces=False, ignore_merges=True, add_bos=True),
    **_names("smollm", "SMOLLM", clean_spaces=False),
    **_names("codeshell", "CODESHELL"),
    **_names("bloom", "BLOOM"),
    **_names("gpt3-finnish", "GPT3_FINNISH"),
    **_names("exaone", "EXAONE"),
    **_names("exaone-moe", "EXAONE_MOE"),
    **_names("chameleon", "CHAMELEON", add_bos=True, clean_spaces=False),
    **_names("minerva-7b", "MINERVA"),
    **_names("megrez", "QWEN2"),
    **_names("gpt-4o llama4 kanana2 talkie", "GPT4O", clean_spaces=False),
    **_names("granite-embed-multi-97m", "GRANITE_EMB_MULTI", clean_spaces=False, ignore_merges=True),
    **_names("tiny_aya cohere2moe", "TINY_AYA", clean_spaces=False),
    **_names("superbpe", "SUPERBPE", clean_spaces=False),
    **_names("trillion", "TRILLION", clean_spaces=False),
    **_names("granite-docling", "GRANITE_DOCLING", clean_spaces=False),
    **_names("bailingmoe bailingmoe2 llada-moe", "BAILINGMOE", clean_spaces=False),
    **_names("seed-coder", "SEED_CODER", clean_spaces=False),
    **_names("hunyuan", "HUNYUAN", clean_spaces=False),
    **_names("hunyuan-dense", "HUNYUAN_DENSE", clean_spaces=False),
    **_names("hy_v4", "HY_V4", clean_spaces=False),
    **_names("joyai-llm", "JOYAI_LLM", clean_spaces=False),
    **_names("kimi-k2", "KIMI_K2", clean_spaces=False),
    **_names("ufakzeka", "UFAKZEKA", clean_spaces=False),
    **_names("grok-2", "GROK_2", clean_spaces=False),
    **_names("afmoe", "AFMOE", clean_spaces=False),
    **_names("laguna", "LAGUNA", clean_spaces=False),
    **_names("minimax-m2", "MINIMAX_M2", clean_spaces=False),
    **_names("solar-open", "SOLAR_OPEN", clean_spaces=False),
    **_names("mellum2", "MELLUM2"),
    # not a llama.cpp name; files plinth loaded before (GPT-NeoX's pre-tokenizer is GPT-2's)
    **_names("gpt-neox", "GPT2"),
}
# Values llama.cpp knows but plinth refuses for model 'gpt2': value -> why (one line).
REFUSED_PRE: dict[str, str] = {
    "whitespace": "it belongs to tokenizer model 'whitespace' (llama.cpp's whitespace-dropping word "
                  "session), which plinth does not implement; under model 'gpt2' llama.cpp itself aborts "
                  "on consecutive spaces",
}


# --- the splitter ------------------------------------------------------------------------------
_KIMI_PATTERN = re.compile(
    "[" + _HAN + _HAN_OTHER + "]+"
    "|[^\\r\\n" + _LET + "A-Za-z" + _HAN + _NUM + "0-9]?[" + _LET + "A-Za-z]+"
    "(?:'[sStTmMdD]|'[rR][eE]|'[vV][eE]|'[lL][lL])?"
    "|[" + _NUM + "0-9]{1,3}"
    "| ?[^" + _S_CHARS + _LET + "A-Za-z" + _HAN + _NUM + "0-9]+[\\r\\n]*"
    "|[" + _S_CHARS + "]*[\\r\\n]+|[" + _S_CHARS + "]+(?![^" + _S_CHARS + "])|[" + _S_CHARS + "]+"
)
_DIGIT_RUN = re.compile("[0-9" + _NUM + "]+")

# text views a step runs on
_VIEW_COLLAPSED, _VIEW_CODEPOINTS, _VIEW_KIMI = 0, 1, 2


def _compile(rx: str):
    """One split step: (kind, pattern, view)."""
    if rx == KIMI_K2_RX:
        return ("regex", _KIMI_PATTERN, _VIEW_KIMI)
    if rx in (AFMOE_DIGITS_RX, TINY_AYA_DIGITS_RX):
        return ("digits", _DIGIT_RUN, _VIEW_COLLAPSED)
    collapsed = uses_categories(rx)
    if collapsed and any(ord(c) >= 128 for c in rx):
        raise ValueError(f"regex mixes categories and non-ASCII text: {rx!r}")
    return ("regex", re.compile(translate(rx)), _VIEW_COLLAPSED if collapsed else _VIEW_CODEPOINTS)


class PreTokenizer:
    """Splits text into words the way llama.cpp's pre-tokenizer of one type does."""

    def __init__(self, pre_type: str):
        self.type = pre_type
        self.steps = [_compile(rx) for rx in PRE_TYPES[pre_type]]

    def split(self, text: str) -> list[str]:
        if not text:
            return []
        views: dict[int, str] = {}

        def view(k: int) -> str:
            v = views.get(k)
            if v is None:
                if k == _VIEW_COLLAPSED:
                    v = text.translate(_COLLAPSE)
                elif k == _VIEW_KIMI:
                    v = text.translate(_COLLAPSE_KIMI)
                else:
                    v = text.translate(_WS_ONLY)
                views[k] = v
            return v

        segs = [(0, len(text))]
        for kind, pat, k in self.steps:
            t = view(k)
            out: list[tuple[int, int]] = []
            add = out.append
            for a, b in segs:
                if kind == "digits":
                    _digit_groups(pat, t, a, b, add)
                    continue
                prev = a
                for m in pat.finditer(t, a, b):
                    s, e = m.span()
                    if s > prev:
                        add((prev, s))
                    if e > s:
                        add((s, e))
                    prev = e
                if prev < b:
                    add((prev, b))
            segs = out
        return [text[a:b] for a, b in segs]


def _digit_groups(pat, t: str, a: int, b: int, add) -> None:
    """Digit runs cut in threes from the right; the first cut of a run also takes
    the non-digit text since the previous cut (llama.cpp's AFMoE/tiny_aya splitter)."""
    prev = a
    for m in pat.finditer(t, a, b):
        s, e = m.span()
        cut = s + (e - s) % 3
        if cut == s:
            cut += 3
        while True:
            add((prev, cut))
            prev = cut
            if cut >= e:
                break
            cut += 3
    if prev < b:
        add((prev, b))

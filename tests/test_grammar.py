"""Constrained decoding (plinth.grammar): the token mask of JSON schemas, regexes, choices and GBNF grammars
on a plinth tokenizer, its per-sequence state (advance, roll back, fork), the sampler under a mask, and
speculative verification under a grammar (a forbidden draft is rejected; greedy output equals constrained
plain decoding; rejection sampling keeps the masked distribution).

The vocabulary: the 256 byte tokens, a few multi-byte tokens (so a token can cross JSON's lexical
boundaries), a control token and the end token.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from plinth import grammar as G
from plinth.sampling import Sampler, SamplerConfig
from plinth.speculative.verify import GreedyVerifier, RejectionVerifier, verify_draft
from plinth.tokenizer import Tokenizer
from plinth.tokenizer.core import _BYTE_TO_CHAR

MULTI = ['{"', '":', '",', '"}', "true", "false", "null", "name", " the", "12", "ab", '"]']


def _vocab_md() -> dict:
    tokens = [_BYTE_TO_CHAR[b] for b in range(256)]
    tokens += ["".join(_BYTE_TO_CHAR[b] for b in m.encode()) for m in MULTI]
    tokens += ["<|ctl|>", "<|end|>"]
    types = [1] * (256 + len(MULTI)) + [3, 3]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": [],
            "tokenizer.ggml.eos_token_id": len(tokens) - 1}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_metadata(_vocab_md())


def END(tok) -> int:
    return tok.n_vocab - 1


def CTL(tok) -> int:
    return tok.n_vocab - 2


def piece(tok, text: str) -> int:
    """The multi-byte token for ``text`` (or its byte)."""
    if len(text.encode()) == 1:
        return text.encode()[0]
    return 256 + MULTI.index(text)


def walk(state, tok, ids, end=True) -> bool:
    """Feed ids (then the end token): True when every one was allowed before it was consumed."""
    for t in list(ids) + ([END(tok)] if end else []):
        if not state.mask()[t] or not state.allows(t):
            return False
        state.advance(t)
    return True


def byte_ids(text: str) -> list[int]:
    return list(text.encode())


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_schema_walks_a_valid_document_and_refuses_an_invalid_one(tok):
    c = G.Constraint(G.json_schema(SCHEMA), tok)
    good = [*byte_ids('{"name":"Ada'), piece(tok, '",'), *byte_ids('"age":36,"tags":["a","b'), piece(tok, '"]'),
            *byte_ids("}")]
    assert tok.decode(good) == '{"name":"Ada","age":36,"tags":["a","b"]}'
    s = c.start()
    assert walk(s, tok, good) and s.finished
    # where the grammar forces text ('{"name":' here), only the tokenizer's own tokenization of it is allowed
    # (this tokenizer has no merges: bytes), not a multi-byte token that spells the same
    s = c.start()
    assert s.mask().sum() == 1 and s.mask()[ord("{")] and not s.mask()[piece(tok, '{"')]
    for bad in ('{"name":"Ada"}', '{"name":"Ada","age":-1}', '{"name":"toolongname","age":1}',
                '{"name":"A","age":1,"x":2}', '{"name":"A","age":1,"tags":["c"]}', '{"name":"A","age":1.5}',
                '{ "name":"A","age":1}'):  # (compact JSON: no free whitespace)
        assert not walk(c.start(), tok, byte_ids(bad)), bad


def test_end_token_only_where_the_grammar_may_end_and_alone_at_its_end(tok):
    s = G.Constraint(G.json_schema({"type": "integer"}), tok).start()
    assert not s.mask()[END(tok)]
    s.advance(piece(tok, "12"))
    m = s.mask()
    assert m[END(tok)] and m[ord("3")] and not m[ord("a")]  # "12" may end or go on
    s = G.Constraint(G.choice(["yes", "no"]), tok).start()
    for t in byte_ids("yes"):
        s.advance(t)
    m = s.mask()
    assert m[END(tok)] and m.sum() == 1 and s.finished and s.accepting and s.allows(END(tok))
    s.advance(END(tok))
    assert s.finished


def test_control_tokens_never_allowed_inside_text(tok):
    s = G.Constraint(G.json_schema({"type": "string"}), tok).start()
    s.advance(ord('"'))
    m = s.mask()
    assert m[ord("x")] and not m[CTL(tok)] and not m[END(tok)]


def test_mask_and_single_token_check_agree(tok):
    rng = np.random.default_rng(0)
    c = G.Constraint(G.json_schema(SCHEMA), tok)
    text = '{"name":"Zed","age":7,"tags":["b","a"]}'
    s = c.start()
    for t in byte_ids(text):
        probe = s.fork()
        m = probe.mask()
        for cand in rng.choice(tok.n_vocab, 40, replace=False).tolist() + [t, END(tok)]:
            assert bool(m[cand]) == s.allows(cand), (text, cand)
        s.advance(t)


def test_rollback_and_fork_restore_the_same_masks(tok):
    c = G.Constraint(G.json_schema(SCHEMA), tok)
    ids = byte_ids('{"name":"Bo","age":12}')
    s = c.start()
    masks = []
    for t in ids:
        masks.append(s.mask().copy())
        s.advance(t)
    f = s.fork()
    s.rollback(5)
    assert s.n_tokens == len(ids) - 5
    assert np.array_equal(s.mask(), masks[len(ids) - 5])
    assert f.n_tokens == len(ids) and f.mask()[END(tok)] and not s.mask()[END(tok)]  # the fork kept its place
    s.advance(ids[len(ids) - 5])
    assert np.array_equal(s.mask(), masks[len(ids) - 4])
    with pytest.raises(G.GrammarError):
        s.rollback(100)
    with pytest.raises(G.GrammarError, match="does not fit"):
        s.advance(ord("q"))


def test_regex_choice_and_gbnf(tok):
    s = G.Constraint(G.regex(r"[0-9]{3}-[a-z]+"), tok).start()
    assert walk(s, tok, byte_ids("123-ab"))
    assert not walk(G.Constraint(G.regex(r"[0-9]{3}-[a-z]+"), tok).start(), tok, byte_ids("12-ab"))
    opts = ["a.b", "(x|y)", 'say "hi"']  # regex characters and quotes are literal
    for o in opts:
        assert walk(G.Constraint(G.choice(opts), tok).start(), tok, byte_ids(o))
    assert not walk(G.Constraint(G.choice(opts), tok).start(), tok, byte_ids("axb"))
    g = G.gbnf('root ::= answer " " answer\nanswer ::= "yes" | "no"')
    assert walk(G.Constraint(g, tok).start(), tok, byte_ids("yes no"))
    assert not walk(G.Constraint(g, tok).start(), tok, byte_ids("yes maybe"))
    assert walk(G.Constraint(G.json_object(), tok).start(), tok, byte_ids('{"k":[1,{"z":null}]}'))
    assert not walk(G.Constraint(G.json_object(), tok).start(), tok, byte_ids("[1]"))


def test_refusals_name_the_problem(tok):
    with pytest.raises(G.GrammarError, match="uniqueItems"):
        G.Constraint(G.json_schema({"type": "array", "uniqueItems": True}), tok)
    with pytest.raises(G.GrammarError, match="not valid JSON"):
        G.json_schema("{nope")
    with pytest.raises(G.GrammarError, match="must be a JSON object"):
        G.json_schema([1, 2])
    with pytest.raises(G.GrammarError, match="GBNF"):
        G.gbnf("root ::= (")
    with pytest.raises(G.GrammarError):
        G.Constraint(G.regex("[a-"), tok)
    with pytest.raises(G.GrammarError, match="non-empty list"):
        G.choice([])
    with pytest.raises(G.GrammarError, match="non-empty list"):
        G.choice("abc")


# ---------------------------------------------------------------------------------------------- sampler


def test_greedy_under_a_mask_takes_the_best_allowed_token_both_ways(tok):
    """The greedy fast path (check the unmasked argmax) and the masked argmax give the same tokens."""
    rng = np.random.default_rng(1)
    c = G.Constraint(G.json_schema(SCHEMA), tok)
    greedy = Sampler(SamplerConfig(temperature=0))
    a, b = c.start(), c.start()
    out_a, out_b = [], []
    for _ in range(400):
        lg = rng.standard_normal(tok.n_vocab).astype(np.float32)
        ta = greedy.token(lg, None, a)
        tb = greedy.token(lg, None, b.mask().copy())  # an explicit mask: no fast path
        allowed = np.flatnonzero(b.mask())
        assert ta == tb == int(allowed[np.argmax(lg[allowed])])
        out_a.append(ta)
        out_b.append(tb)
        if ta == END(tok):
            break
        a.advance(ta)
        b.advance(tb)
    assert out_a == out_b and out_a[-1] == END(tok)
    json.loads(tok.decode(out_a[:-1]))  # a random model forced into the schema ends with valid JSON


def test_sampling_under_a_mask_is_the_renormalised_distribution(tok):
    rng = np.random.default_rng(2)
    inside = G.Constraint(G.json_schema(SCHEMA), tok).start()  # inside a string: most tokens allowed
    for t in byte_ids('{"name":"A'):
        inside.advance(t)
    after = G.Constraint(G.json_schema(SCHEMA), tok).start()  # after a number: a few allowed (the subset path)
    for t in byte_ids('{"name":"A","age":1'):
        after.advance(t)
    assert after.mask().sum() < 20 < inside.mask().sum()
    lg = rng.standard_normal(tok.n_vocab).astype(np.float32)
    for s, cfg in ((s, cfg) for s in (inside, after) for cfg in (
            SamplerConfig(temperature=0.8), SamplerConfig(temperature=1.3, top_k=40, top_p=0.9, min_p=0.01))):
        p = Sampler(cfg).probs(lg, None, s)
        m = s.mask()
        assert p[~m].sum() == 0.0 and abs(p.sum() - 1) < 1e-12
        if cfg.top_k == 0:
            x = np.where(m, lg.astype(np.float64), -np.inf) / cfg.temperature
            want = np.exp(x - x.max())
            np.testing.assert_allclose(p, want / want.sum(), rtol=1e-9, atol=1e-15)
        smp = Sampler(attrs_evolve(cfg, seed=5))
        draws = [smp.token(lg, None, s) for _ in range(300)]
        assert all(m[d] for d in draws)
        # the draw is that of sample() from the same generator state
        a, b = Sampler(attrs_evolve(cfg, seed=9)), Sampler(attrs_evolve(cfg, seed=9))
        assert [a.token(lg, None, s) for _ in range(20)] == [b.sample(lg, None, s).token for _ in range(20)]


def attrs_evolve(cfg, **kw):
    import attrs

    return attrs.evolve(cfg, **kw)


def test_mask_width_must_match_and_an_empty_mask_is_an_error(tok):
    s = Sampler(SamplerConfig(temperature=0))
    with pytest.raises(ValueError, match="covers"):
        s.token(np.zeros(10, np.float32), None, np.ones(9, bool))
    with pytest.raises(ValueError, match="no token"):
        s.token(np.zeros(10, np.float32), None, np.zeros(10, bool))


def test_padded_logits_never_allow_the_padding(tok):
    c = G.Constraint(G.json_schema({"type": "string"}), tok, n_vocab=tok.n_vocab + 30)
    m = c.start().mask()
    assert m.shape[0] == tok.n_vocab + 30 and not m[tok.n_vocab:].any() and m[ord('"')]


# ---------------------------------------------------------------------------------------------- speculative


def _constrained_greedy(tok, c, logits_fn, n):
    """Plain constrained greedy decoding over a logits function of the history."""
    s, hist, out = c.start(), [], []
    smp = Sampler(SamplerConfig(temperature=0))
    for _ in range(n):
        t = smp.token(logits_fn(hist), hist, s)
        s.advance(t)
        out.append(t)
        if t == END(tok):
            break
        hist.append(t)
    return out


def test_greedy_verification_under_a_grammar_equals_constrained_decoding(tok):
    """A deterministic "model" (logits from a hash of the history); drafts are a mix of the constrained
    choice, the unconstrained argmax (often forbidden) and random tokens: the kept tokens are exactly
    those of constrained plain decoding, and every forbidden draft is rejected."""
    c = G.Constraint(G.json_schema(SCHEMA), tok)

    def logits_fn(hist):
        r = np.random.default_rng(abs(hash(tuple(hist))) % (2 ** 32))
        return r.standard_normal(tok.n_vocab).astype(np.float32)

    want = _constrained_greedy(tok, c, logits_fn, 200)
    assert want[-1] == END(tok)
    rng = np.random.default_rng(3)
    smp = Sampler(SamplerConfig(temperature=0))
    s, hist, got, forbidden_drafts = c.start(), [], [], 0
    while not got or got[-1] != END(tok):
        k = int(rng.integers(0, 6))
        draft, h = [], list(hist)
        for j in range(k):
            kind = rng.integers(0, 3)
            t = int(np.argmax(logits_fn(h))) if kind == 0 else int(rng.integers(0, tok.n_vocab)) if kind == 1 \
                else (want[len(hist) + j] if len(hist) + j < len(want) else END(tok))
            draft.append(t)
            h.append(t)
        rows = np.stack([logits_fn(hist + draft[:i]) for i in range(k + 1)])
        probe = s.fork()
        n_ok = probe.count_allowed(draft)
        res = verify_draft(GreedyVerifier(), smp, draft, None, rows, hist, None, s)
        assert res.n_accepted <= n_ok
        forbidden_drafts += n_ok < k
        kept = draft[:res.n_accepted] + [res.next_token]
        got += kept
        hist += kept
        assert s.n_tokens == len(got)
    assert got[:len(want)] == want and len(got) == len(want)
    assert forbidden_drafts > 0


def test_rejection_verification_under_a_grammar_keeps_the_masked_distribution(tok):
    """The first emitted token of a rejection-verified step is distributed as the masked p of row 0, forbidden
    drafts (q puts mass on them) are never kept, and the grammar state ends on exactly the emitted tokens."""
    c = G.Constraint(G.choice(["ab", "ac", "b", "cab"]), tok)
    rng = np.random.default_rng(4)
    lg = rng.standard_normal((3, tok.n_vocab)).astype(np.float32)
    lg[:, [ord("a"), ord("b"), ord("c"), piece(tok, "ab")]] += 3.0
    smp = Sampler(SamplerConfig(temperature=1.0))
    start = c.start()
    p0 = smp.probs(lg[0], [], start)
    q = np.zeros((2, tok.n_vocab))
    q[0, [ord("x"), ord("a"), piece(tok, "ab")]] = [0.5, 0.3, 0.2]  # x is forbidden
    q[1, [ord("c"), ord("z")]] = [0.5, 0.5]
    counts = np.zeros(tok.n_vocab)
    vr = np.random.default_rng(5)
    for _ in range(4000):
        d0 = int(vr.choice(tok.n_vocab, p=q[0]))
        d1 = int(vr.choice(tok.n_vocab, p=q[1]))
        s = start.fork()
        res = verify_draft(RejectionVerifier(), smp, [d0, d1], q, lg, [], vr, s)
        emitted = [d0, d1][:res.n_accepted] + [res.next_token]
        assert all(t != ord("x") and t != ord("z") for t in emitted[:res.n_accepted])
        assert s.n_tokens == len(emitted)
        check = start.fork()
        for t in emitted:
            assert check.allows(t)
            check.advance(t)
        counts[emitted[0]] += 1
    freq = counts / counts.sum()
    nz = p0 > 0.01
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(p0))
    np.testing.assert_allclose(freq[nz], p0[nz], atol=0.03)

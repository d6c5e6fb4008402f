"""Constrained decoding through the generation loops: plinth.generate.Generator (plain), SpeculativeGenerator
(ngram and a random DFlash draft) and the server's scheduler (batched, some requests speculative), on a tiny
random model with the byte vocabulary.

* greedy under a JSON schema: the speculative output equals constrained plain decoding token for token (a
  drafted token the grammar forbids is rejected), and a reply that ended is valid JSON of the schema;
* the scheduler's batched constrained requests equal their lone constrained runs;
* seeded sampling (rejection verification) under the schema stays inside it.
"""

from __future__ import annotations

import json

import pytest
from plinth import grammar as G
from plinth.generate import Generator
from plinth.sampling import Sampler, SamplerConfig
from plinth.speculative.engine import SpecConfig, SpeculativeGenerator
from plinth.speculative.ngram import NgramDrafter
from plinth.testing.scheduling import run_requests

SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5},
                                           "b": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "c": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 3}},
          "required": ["a", "b", "c"], "additionalProperties": False}
# prompts whose text holds JSON, so that the ngram drafter proposes JSON-like drafts (some fit, some do not)
PROMPTS = [b'{"a":"hi","b":12,"c":["x"]} {"a":"hi","b":12,"c":["x"]} {"a":"',
           b'{"b":7} {"a":"yy"} {"a":"q","b":1,"c":[]} {"a":"q","b":1,',
           b"Hello there", b"abcabcabcabc"]
MAX = 48


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from plinth_dflash.testkit import tiny_target

    return tiny_target(tmp_path_factory.mktemp("gdec") / "t.gguf", "qwen3", seed=5)


@pytest.fixture(scope="module")
def constraint(model):
    return G.Constraint(G.json_schema(SCHEMA), model.tokenizer, model.n_vocab)


@pytest.fixture(scope="module")
def dflash_path(model, tmp_path_factory):
    from plinth_dflash.testkit import write_tiny_draft

    hp = model.hparams
    taps = sorted({0, int(hp.n_layer) - 1})
    return write_tiny_draft(tmp_path_factory.mktemp("gdec") / "dflash.gguf", "dflash", n_embd=int(hp.n_embd),
                            n_vocab=model.n_vocab, n_layer=1, n_head=4, n_head_kv=2, head_dim=16, n_ff=96,
                            taps=taps, block_size=6, mask_token=0, scale=0.3, seed=2)


def drafter(model, name, dflash_path):
    if name == "ngram":
        return NgramDrafter(n_match_max=3, n_match_min=1)
    from plinth_dflash.drafter import make_dflash

    return make_dflash(model, {"draft": str(dflash_path)})


def check_json(model, ids):
    """An output that ended (by the end token, so it is complete) is JSON of the schema."""
    v = json.loads(model.tokenizer.decode(ids))
    assert set(v) == {"a", "b", "c"} and isinstance(v["a"], str) and len(v["a"]) <= 5
    assert isinstance(v["b"], int) and 0 <= v["b"] <= 999 and len(v["c"]) <= 3
    return v


def plain(model, constraint, prompt, sampling=None):
    gen = Generator(model, Sampler(sampling or SamplerConfig(temperature=0)), constraint=constraint)
    out = list(gen.tokens(list(prompt), max_tokens=MAX))
    return out, gen.stats.stop_reason


@pytest.mark.parametrize("name", ["ngram", "dflash"])
def test_speculative_greedy_under_a_schema_equals_constrained_plain_decoding(model, constraint, dflash_path, name):
    ended = 0
    for prompt in PROMPTS:
        want, why = plain(model, constraint, prompt)
        gen = SpeculativeGenerator(model, [drafter(model, name, dflash_path)], config=SpecConfig(n_max=4),
                                   sampler=SamplerConfig(temperature=0))
        gen.constraint = constraint
        got = list(gen.tokens(list(prompt), max_tokens=MAX))
        assert got == want, (name, prompt)
        if why == "end of generation token":
            check_json(model, want)
            ended += 1
        assert gen.stats.n_drafted > 0
    assert ended >= 2
    free = list(Generator(model, Sampler(SamplerConfig(temperature=0))).tokens(list(PROMPTS[2]), max_tokens=MAX))
    with pytest.raises(Exception):
        json.loads(model.tokenizer.decode(free))  # (without the grammar the random model writes no JSON)


def test_drafts_the_grammar_forbids_are_rejected(model, constraint):
    """An oracle drafter proposing the unconstrained greedy continuation: the grammar rejects most of it, and
    the output is still the constrained one."""
    free = list(Generator(model, Sampler(SamplerConfig(temperature=0))).tokens(list(PROMPTS[2]), max_tokens=MAX))

    class Unconstrained(NgramDrafter):
        name = "unconstrained"

        def draft(self, seq, n_max, *, history, pos):
            from plinth.speculative.base import Draft

            k = len(history) - len(PROMPTS[2])
            return Draft(tokens=tuple(free[k:k + n_max]) if k < len(free) else ())

    want, _ = plain(model, constraint, PROMPTS[2])
    gen = SpeculativeGenerator(model, [Unconstrained()], config=SpecConfig(n_max=4),
                               sampler=SamplerConfig(temperature=0))
    gen.constraint = constraint
    assert list(gen.tokens(list(PROMPTS[2]), max_tokens=MAX)) == want
    assert gen.stats.n_drafted > gen.stats.n_accepted


def test_seeded_sampling_with_rejection_stays_in_the_schema(model, constraint, dflash_path):
    cfg = SamplerConfig(temperature=0.9, top_k=50, seed=11)
    for name in ("ngram", "dflash"):
        gen = SpeculativeGenerator(model, [drafter(model, name, dflash_path)], config=SpecConfig(n_max=4, seed=3),
                                   sampler=Sampler(cfg))
        gen.constraint = constraint
        out = list(gen.tokens(list(PROMPTS[0]), max_tokens=200))
        assert gen.stats.stop_reason == "end of generation token", gen.stats.stop_reason
        check_json(model, out)
    out, why = plain(model, constraint, PROMPTS[1], cfg)
    assert why == "end of generation token"
    check_json(model, out)


def test_scheduler_batched_constrained_requests_equal_lone_runs(model, constraint, dflash_path):
    from plinth.serve.scheduler import Scheduler

    sched = Scheduler(model, drafters=[NgramDrafter(n_match_max=3, n_match_min=1)], spec=SpecConfig(n_max=4), max_batch=8)
    sched.start()
    try:
        cases = [(p, c, s) for p in PROMPTS for c, s in ((True, True), (True, False), (False, False))]
        outs = run_requests(sched, [dict(prompt_ids=list(prompt), max_tokens=MAX, speculative=spec,
                                         constraint=constraint.start() if constrained else None)
                                    for prompt, constrained, spec in cases])
    finally:
        sched.stop()
    for (prompt, constrained, _), out in zip(cases, outs):
        want, _ = plain(model, constraint if constrained else None, prompt)
        assert out == want, (prompt, constrained)


def test_generate_cli_json_schema_and_grammar(model, tmp_path, capsys):
    from plinth.cli import main as plinth_main

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text('root ::= "answer: " ("yes" | "no") "."\n')
    path = str(model.path)
    for extra in ([], ["--spec", "ngram", "--spec-n-max", "4"]):
        capsys.readouterr()
        assert plinth_main(["generate", "-m", path, PROMPTS[0].decode(), "-n", "200", "--json-schema", str(schema),
                            *extra]) == 0
        out = capsys.readouterr().out[:-1]
        v = json.loads(out)
        assert set(v) == {"a", "b", "c"}
        assert plinth_main(["generate", "-m", path, "Hi", "-n", "50", "--grammar", str(gbnf), "--temperature", "0.8",
                            "--seed", "2", *extra]) == 0
        assert capsys.readouterr().out[:-1] in ("answer: yes.", "answer: no.")
    assert plinth_main(["generate", "-m", path, "Hi", "--json-schema", str(tmp_path / "missing.json")]) != 0
    assert "missing.json" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "array", "uniqueItems": true}')
    assert plinth_main(["generate", "-m", path, "Hi", "--json-schema", str(bad)]) != 0
    assert "uniqueItems" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plinth_main(["generate", "-m", path, "Hi", "--json-schema", str(schema), "--grammar", str(gbnf)])

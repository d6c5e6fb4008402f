"""gemma4-assistant against transformers 5.24's Gemma4AssistantForCausalLM (marker ``ref``; needs torch).

A tiny random Gemma 4 target and a tiny random assistant (every parameter drawn, norm weights and
``layer_scalar`` included; the ``token_ordering`` a random permutation) are written as HF folders.
transformers runs the target on the prompt (``return_shared_kv_states``, its last hidden state) and
the assistant as its ``Gemma4AssistantCandidateGenerator`` does (constant position, the last
token's target embedding beside the last hidden state, cross-attention to the target's store
layers); plinth converts both folders, runs the target through a context and the drafter on that
context's K/V (``TargetOutput.kv``). The draft logits agree within 1e-4 at every step (the same
tokens fed to both) and the greedy drafts are the same. Prompts stay shorter than the sliding
window: transformers' assistant mask keeps the last ``W`` keys before the position, llama.cpp's
(and plinth's) the keys less than ``W`` positions back, one key fewer once the context outgrows
the window.
"""

from __future__ import annotations

import numpy as np
import pytest

from plinth.speculative.base import TargetOutput, target_kv_views

pytestmark = pytest.mark.ref

ATOL = 1e-4
N_STEPS = 4


def _hf(tf, af, prompt, n_steps):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    target = transformers.Gemma4ForCausalLM.from_pretrained(tf, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    asst, info = transformers.Gemma4AssistantForCausalLM.from_pretrained(
        af, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    asst.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
        t0 = int(out.logits[0, -1].argmax())
        h = out.hidden_states[-1][:, -1:]
        kv = dict(out.shared_kv_states)
        pos = torch.tensor([[len(prompt)]])
        tok, logits, tokens = torch.tensor([[t0]]), [], []
        mask = torch.ones(1, len(prompt) + 1, dtype=torch.long)
        for _ in range(n_steps):
            x = torch.cat([target.get_input_embeddings()(tok), h], dim=-1)
            o = asst(inputs_embeds=x, attention_mask=mask, position_ids=pos, shared_kv_states=kv, use_cache=False)
            logits.append(o.logits[0, -1].numpy())
            tok = o.logits.argmax(dim=-1)
            tokens.append(int(tok))
            h = o.last_hidden_state
    return t0, np.stack(logits), tokens


def _plinth(tg, ag, prompt, tokens):
    from plinth.batch import Batch
    from plinth.model import load_model
    from plinth.testing import make_registry
    from plinth_gemma.assistant import Gemma4AssistantDrafter, load_assistant
    from plinth_gemma.plugin import plugin

    model = load_model(tg, registry=make_registry(plugin))
    drafter = Gemma4AssistantDrafter(model, load_assistant(ag))
    req = drafter.requirements()
    ctx = model.new_context(taps=req.taps, cache_type_k="f32", cache_type_v="f32")
    batch = Batch.from_tokens(prompt, start=0, output="last")
    out = ctx.forward(batch)
    drafter.begin(0, prompt)
    drafter.process(TargetOutput(seq=0, phase="prefill", tokens=batch.tokens, positions=batch.positions,
                                 features={t: out.features[t] for t in req.taps}, logits=out.logits,
                                 kv=target_kv_views(ctx.cache, req, 0)))
    t0 = int(np.argmax(np.asarray(out.logits)[-1]))
    logits = drafter.draft_logits(0, len(prompt), [t0, *tokens[:-1]])
    draft = drafter.draft(0, len(tokens), history=[*prompt, t0], pos=len(prompt))
    return t0, logits, list(draft.tokens)


@pytest.mark.parametrize("target,assistant", [("plain", "plain"), ("shared", "ordered"), ("plain", "ordered")])
@pytest.mark.parametrize("n_prompt", [1, 7])
def test_draft_logits_match_transformers(tmp_path, target, assistant, n_prompt):
    from plinth_gemma.testkit import convert_pair

    tf, tg, af, ag = convert_pair(tmp_path, target, assistant)
    prompt = np.random.default_rng(n_prompt).integers(0, 256, n_prompt).tolist()
    t0, ref, ref_tokens = _hf(tf, af, prompt, N_STEPS)
    p0, got, tokens = _plinth(tg, ag, prompt, ref_tokens)
    assert p0 == t0
    finite = np.ones(ref.shape, bool)
    if assistant == "ordered":  # masked logits: the same clusters chosen, compared there
        finite = ref > ref.min(axis=1, keepdims=True)
        assert np.array_equal(finite, got > got.min(axis=1, keepdims=True))
        assert 0 < finite.sum() < finite.size
    diff = float(np.max(np.abs(np.where(finite, got - ref, 0.0))))
    assert diff < ATOL, diff
    print(f"{target}/{assistant}, prompt {n_prompt}: max |plinth - transformers| = {diff:.2e} over {N_STEPS} steps")
    assert tokens == ref_tokens

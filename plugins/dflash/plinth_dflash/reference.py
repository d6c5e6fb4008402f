"""The authors' torch reference (PyPI ``dflash``, z-lab) driven round by round, and plinth driven the same way.

Only :func:`reference_rounds` and the ``hf_*`` builders need torch, transformers and
``dflash`` (``pip install torch==2.13.0 transformers==5.24.0; pip install --no-deps dflash``);
:func:`plinth_rounds` needs neither. Both follow ``dflash.model.dflash_generate`` at
temperature 0: prefill, then per round one draft block ``[anchor, MASK x (b-1)]`` at
positions ``start..start+b-1``, a target verify of the drafted block, greedy acceptance,
and the accepted rows' features becoming the next context. Each round records the draft
logits of block rows 1..b-1, the drafted tokens and the accepted length.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

QWEN3_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_target(model: Any) -> Any:
    """A transformers Qwen3ForCausalLM holding the weights of a plinth ``qwen3`` model (tied head)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hp = model.hparams
    if model.arch != "qwen3":
        raise ValueError(f"hf_target supports qwen3 targets, not {model.arch}")
    cfg = Qwen3Config(hidden_size=hp.n_embd, intermediate_size=hp.n_ff[0], num_hidden_layers=hp.n_layer,
                      num_attention_heads=hp.n_head[0], num_key_value_heads=hp.n_head_kv[0], head_dim=hp.head_dim,
                      vocab_size=hp.n_vocab, rms_norm_eps=hp.norm_eps, max_position_embeddings=4096,
                      rope_parameters={"rope_type": "default", "rope_theta": float(hp.rope_base[0])},
                      tie_word_embeddings="output.weight" not in model.weights, attention_bias=False)
    cfg._attn_implementation = "eager"
    m = Qwen3ForCausalLM(cfg).eval().to(torch.float32)
    sd = {"model.embed_tokens.weight": model.weights["token_embd.weight"],
          "model.norm.weight": model.weights["output_norm.weight"]}
    if "output.weight" in model.weights:
        sd["lm_head.weight"] = model.weights["output.weight"]
    for name, arr in model.weights.items():
        if name.startswith("blk."):
            _, il, rest = name.split(".", 2)
            sd[f"model.layers.{il}.{QWEN3_LAYER[rest]}"] = arr
    missing, unexpected = m.load_state_dict({k: torch.from_numpy(np.asarray(v).copy()) for k, v in sd.items()},
                                            strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"hf_target: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        m.tie_weights()
    return m


def hf_draft(model_dir: Any) -> Any:
    """The reference DFlashDraftModel / DFlash2DraftModel of an HF draft folder."""
    import json
    from pathlib import Path

    import torch
    from dflash.model import DFlash2DraftModel, DFlashDraftModel
    from transformers import Qwen3Config

    from plinth.convert import SafetensorsDir

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    cls = {"DFlashDraftModel": DFlashDraftModel, "DFlash2DraftModel": DFlash2DraftModel}[raw["architectures"][0]]
    cfg = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    for k in ("dflash_config", "num_target_layers", "block_size", "layer_types"):
        if k in raw:
            setattr(cfg, k, raw[k])
    cfg._attn_implementation = "sdpa"
    m = cls(cfg).eval().to(torch.float32)
    st = SafetensorsDir(model_dir)
    sd = {n: torch.from_numpy(np.array(st.get(n))) for n in st.names()}
    missing, unexpected = m.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise RuntimeError(f"hf_draft: missing {missing}, unexpected {unexpected}")
    return m


def reference_rounds(target: Any, draft: Any, prompt: Sequence[int], block: int, rounds: int) -> list[dict[str, Any]]:
    """Run the z-lab reference for ``rounds`` draft/verify rounds at block size ``block`` (greedy)."""
    import torch
    from dflash.model import (DFlash2DraftModel, _crop_to, _make_cache, _output_head, _raw_input_embeddings,
                              extract_context_feature)

    out_rounds: list[dict[str, Any]] = []
    with torch.inference_mode():
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        n_p = ids.shape[1]
        total = n_p + rounds * block + 2
        output_ids = torch.full((1, total), int(draft.mask_token_id), dtype=torch.long)
        position_ids = torch.arange(total).unsqueeze(0)
        cache_t, cache_d = _make_cache(target.config), _make_cache(draft.config)
        o = target(ids, position_ids=position_ids[:, :n_p], past_key_values=cache_t, use_cache=True,
                   output_hidden_states=True)
        output_ids[:, :n_p] = ids
        output_ids[:, n_p] = torch.argmax(o.logits[:, -1], dim=-1)
        hidden = extract_context_feature(o.hidden_states, draft.target_layer_ids)
        start = n_p
        head = _output_head(target)
        for _ in range(rounds):
            blk = output_ids[:, start:start + block].clone()
            noise = _raw_input_embeddings(target, blk)
            dh = draft(target_hidden=hidden, noise_embedding=noise,
                       position_ids=position_ids[:, start - hidden.shape[1]:start + block],
                       past_key_values=cache_d, use_cache=True)[:, 1 - block:, :]
            _crop_to(cache_d, start)
            logits = draft.compute_logits(dh, head)
            if isinstance(draft, DFlash2DraftModel):
                toks = draft.propose(dh, blk[:, 0], head, 0.0)[0]
            else:
                toks = torch.argmax(logits, dim=-1)
            blk[:, 1:] = toks
            o = target(blk, position_ids=position_ids[:, start:start + block], past_key_values=cache_t,
                       use_cache=True, output_hidden_states=True)
            post = torch.argmax(o.logits, dim=-1)
            acc = int((blk[:, 1:] == post[:, :-1]).cumprod(dim=1).sum(dim=1)[0].item())
            output_ids[:, start:start + acc + 1] = blk[:, :acc + 1]
            output_ids[:, start + acc + 1] = post[:, acc]
            out_rounds.append({"logits": logits[0].float().numpy().copy(), "tokens": toks[0].numpy().copy(),
                               "accepted": acc, "start": start})
            start += acc + 1
            _crop_to(cache_t, start)
            hidden = extract_context_feature(o.hidden_states, draft.target_layer_ids)[:, :acc + 1, :]
    return out_rounds


def plinth_rounds(target: Any, drafter: Any, prompt: Sequence[int], block: int, rounds: int,
                  seq: int = 0) -> list[dict[str, Any]]:
    """The same rounds through plinth's drafter contract (begin / process / draft / accept)."""
    from plinth.graph import Batch
    from plinth.speculative.base import TargetOutput

    be = target.backend
    ctx = target.new_context(taps=drafter.requirements().taps)
    prompt = [int(t) for t in prompt]
    drafter.begin(seq, prompt)
    out = ctx.forward(Batch.from_tokens(prompt, seq=seq, output="last"))
    drafter.process(TargetOutput(seq=seq, phase="prefill", tokens=np.asarray(prompt), positions=np.arange(len(prompt)),
                                 features=out.features))
    history = prompt + [int(np.argmax(be.to_numpy(out.logits)[-1]))]
    rounds_out: list[dict[str, Any]] = []
    for _ in range(rounds):
        start = len(history) - 1
        n = block - 1
        logits = be.to_numpy(drafter.draft_logits(seq, history[-1], start, n))
        d = drafter.draft(seq, n, history=history, pos=start)
        toks = list(d.tokens)
        verify = [history[-1]] + toks
        vo = ctx.forward(Batch.from_tokens(verify, start=start, seq=seq, output="all"))
        post = np.argmax(be.to_numpy(vo.logits), axis=-1)
        acc = 0
        while acc < len(toks) and toks[acc] == int(post[acc]):
            acc += 1
        drafter.process(TargetOutput(seq=seq, phase="verify", tokens=np.asarray(verify),
                                     positions=np.arange(start, start + len(verify)), features=vo.features))
        drafter.accept(seq, acc)
        ctx.cache.seq_rm(seq, start + acc + 1)
        history = history + toks[:acc] + [int(post[acc])]
        rounds_out.append({"logits": np.asarray(logits), "tokens": np.asarray(toks), "accepted": acc, "start": start})
    return rounds_out

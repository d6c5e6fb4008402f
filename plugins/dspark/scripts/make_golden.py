"""Golden outputs of speculators' DSparkDraftModel (speculators==0.9.0) for plinth-dspark's comparison.

Run with the speculators environment (``make test-ref-speculators`` builds it):

    .venv-speculators/bin/python plugins/dspark/scripts/make_golden.py OUT.npz [--check-training]
    .venv-speculators/bin/python plugins/dspark/scripts/make_golden.py OUT.npz --dflash   # DFlash / DFlash2 cases
    .venv-speculators/bin/python plugins/dspark/scripts/make_golden.py OUT.npz --gemma4-verifier
                                         # DSpark drafts as speculators builds them for a Gemma 4 verifier

Every case: a tiny qwen3-backbone DSpark draft (E = 64, 2 layers, vocabulary 96) with every weight redrawn
at O(1) scale by numpy (speculators NaN-initialises embed_tokens / lm_head and draws markov_w1 at std 0.01),
random context features, and the inference pass composed from speculators' own modules:
fc -> hidden_norm -> layers (eager attention, the block sees every context row and itself) -> norm ->
lm_head -> MarkovHead chained greedily -> ConfidenceHead. The npz holds the weights under speculators'
checkpoint names (``w/<name>``), the config (``config_json``) and per case the inputs and outputs.
"""

from __future__ import annotations

import json
import sys
import types

import numpy as np

VOCAB, E, LAYERS, HEADS, KV, FF, MASK = 64, 32, 2, 4, 2, 48, 63
TAPS = (0, 1)
CASES = []  # (name, block_size, sample_from_anchor, draft_vocab, confidence head)
for b in (4, 7, 16):
    for anchor_first in (True, False):
        for vd in (VOCAB, 40):
            for conf in (True, False):
                CASES.append((f"b{b}-{'af' if anchor_first else 'ba'}-v{vd}-{'conf' if conf else 'noconf'}",
                              b, anchor_first, vd, conf))
RANK = 8
N_CTX = 9


def _stub_datasets() -> None:
    """speculators' package import pulls `datasets` through eagle3's data module, unused here."""
    m = types.ModuleType("datasets")

    def attr(name: str) -> type:
        if name.startswith("__"):  # module introspection (inspect, pickling) must see a plain module
            raise AttributeError(name)
        return type(name, (), {})

    m.__getattr__ = attr  # type: ignore[attr-defined]
    sys.modules.setdefault("datasets", m)


def is_backbone(name: str) -> bool:
    return name.startswith(("fc.", "hidden_norm.", "layers.", "norm.", "embed_tokens."))


def build(block: int, anchor_first: bool, vd: int, conf: bool, seed: int, tl=None, non_causal: bool = False):
    import torch
    from transformers import Qwen3Config

    _stub_datasets()
    from speculators.models.dspark import DSparkDraftModel
    from speculators.models.dspark.config import DSparkSpeculatorConfig

    if tl is None:
        tl = Qwen3Config(vocab_size=VOCAB, hidden_size=E, intermediate_size=FF, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=E // HEADS, rms_norm_eps=1e-6,
                         rope_theta=10000.0, max_position_embeddings=4096, attention_bias=False)
    tl._attn_implementation = "eager"
    cfg = DSparkSpeculatorConfig(transformer_layer_config=tl, draft_vocab_size=vd, block_size=block,
                                 aux_hidden_state_layer_ids=list(TAPS), mask_token_id=MASK,
                                 sample_from_anchor=anchor_first, markov_rank=RANK, markov_head_type="vanilla",
                                 enable_confidence_head=conf, confidence_head_with_markov=True,
                                 sliding_window_non_causal=non_causal)
    model = DSparkDraftModel(cfg).eval()
    rng = np.random.default_rng(seed)
    rng_bb = np.random.default_rng(0)  # one backbone for every case; the heads differ
    sd = {}
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        r = rng_bb if is_backbone(name) else rng
        if name.endswith("norm.weight"):
            arr = 1.0 + 0.1 * r.standard_normal(shape)
        elif "markov" in name or "embed_tokens" in name:
            arr = 0.5 * r.standard_normal(shape)
        else:
            arr = 0.2 * r.standard_normal(shape)
        sd[name] = arr.astype(np.float16).astype(np.float32)  # f16-exact: the golden file stores them as f16
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(sd[name]))
        if vd < VOCAB:
            t_ids = np.sort(rng.choice(VOCAB, size=vd, replace=False))
            d2t = t_ids - np.arange(vd)  # speculators stores offsets: target = draft + d2t[draft]
            t2d = np.zeros(VOCAB, dtype=bool)
            t2d[t_ids] = True
            model.d2t.copy_(torch.from_numpy(d2t))
            model.t2d.copy_(torch.from_numpy(t2d))
            sd["d2t"], sd["t2d"] = d2t.astype(np.int64), t2d
    return model, cfg, sd


def speculators_masks(model, p: int, b: int) -> list:
    """Per layer, speculators' own eager mask (``create_anchor_block_mask_mod`` + ``create_float_mask``) for one
    block of ``b`` rows anchored at position ``p`` over base rows 0..p (row p, the anchor's own base row, is
    hidden by the mask): full layers see every context row and the whole block, sliding layers context rows
    at >= p - sliding_window and, unless ``sliding_window_non_causal``, the block causally."""
    import torch
    from speculators.models.attention import create_float_mask
    from speculators.models.dflash.attention import create_anchor_block_mask_mod

    def mask(window):
        mod, q_len, kv_len = create_anchor_block_mask_mod(
            document_ids=torch.zeros(p + 1, dtype=torch.long), total_seq_len=p + 1,
            anchor_positions=torch.tensor([p]), block_size=b, sliding_window=window,
            sliding_window_non_causal=model.sliding_window_non_causal)
        return create_float_mask(mod, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, dtype=torch.float32)

    full, sliding = mask(None), mask(model.sliding_window) if model.uses_sliding_window_attn else None
    return [sliding if il in model.sliding_window_indices else full for il in range(len(model.layers))]


def inference(model, feats: np.ndarray, anchor: int, n: int, masked: bool = False):
    """The oracle's inference pass for one block of ``n`` prediction rows after context rows 0..P-1.

    ``masked``: through speculators' own masks (sliding layers), with the base rows 0..P (a zero row P)."""
    import torch

    cfg = model.config
    s = 0 if cfg.sample_from_anchor else 1
    p = feats.shape[0]
    b = n + s
    with torch.no_grad():
        ids = torch.full((1, b), cfg.mask_token_id, dtype=torch.long)
        ids[0, 0] = anchor
        x = model.embed_tokens(ids)
        if masked:
            base = np.concatenate([feats, np.zeros((1, feats.shape[1]), np.float32)])
            ctx = model.hidden_norm(model.fc(torch.from_numpy(base)[None]))
            pos = torch.cat([torch.arange(p + 1), torch.arange(p, p + b)])[None]
            masks = speculators_masks(model, p, b)
        else:
            ctx = model.hidden_norm(model.fc(torch.from_numpy(feats)[None]))
            pos = torch.arange(p + b)[None]
            masks = [None] * len(model.layers)
        pe = model.rotary_emb(x, pos)
        for layer, m in zip(model.layers, masks):
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=m,  # [1, 1, b, P + 1 + b] or None
                      position_ids=pos, position_embeddings=pe)
        hidden = model.norm(x)[0, s:]  # [n, E]
        z = model.lm_head(hidden)  # [n, V_d]
        mh = model.markov_head
        prev = torch.tensor([anchor])
        outs, toks, embs = [], [], []
        for i in range(n):
            e = mh.prev_embeddings(prev)  # [1, R]
            out = z[i:i + 1] + mh.block_bias(prev_token_ids=prev[None], hidden_states=hidden[None, i:i + 1],
                                             prev_emb=e[None])[0]
            d = out.argmax(-1)
            t = d + model.d2t[d] if model.use_draft_vocab else d
            outs.append(out[0])
            toks.append(int(t))
            embs.append(e[0])
            prev = t
        logits = torch.stack(outs)
        conf = None
        if model.confidence_head is not None:
            conf = torch.sigmoid(model.confidence_head(torch.cat([hidden, torch.stack(embs)], dim=-1)))
    return logits.numpy(), np.array(toks, dtype=np.int64), None if conf is None else conf.numpy()


def check_training_forward(model, feats: np.ndarray, anchor: int, n: int, logits: np.ndarray, toks) -> float:
    """speculators' training forward with the greedy chain as ground truth: the anchored block's biased logits
    must equal the inference pass (returns the max difference). One anchor at position P."""
    import torch

    cfg = model.config
    s = 0 if cfg.sample_from_anchor else 1
    b = cfg.block_size
    p = feats.shape[0]
    seq = [0] * p + [anchor] + list(toks) + [0] * (b + 2)
    total = len(seq)
    hs = np.zeros((total, feats.shape[1]), dtype=np.float32)
    hs[:p] = feats
    loss_mask = torch.zeros(1, total, dtype=torch.long)
    loss_mask[0, p] = 1
    captured = {}
    orig = model.markov_head.block_bias

    def spy(**kw):
        out = orig(**kw)
        captured["bias"] = out
        return out

    model.markov_head.block_bias = spy
    base = {}
    orig_head = model.lm_head.forward

    def head_spy(h):
        out = orig_head(h)
        base["z"] = out
        return out

    model.lm_head.forward = head_spy
    try:
        with torch.no_grad():
            model(hidden_states=torch.from_numpy(hs)[None], input_ids=torch.tensor([seq]), loss_mask=loss_mask,
                  verifier_last_hidden_states=torch.zeros(1, total, E), document_ids=torch.zeros(1, total, dtype=torch.long),
                  max_anchors=1, loss_implementation="eager")
    except Exception:  # the loss may complain about the toy setup; the captured tensors are what we compare
        pass
    finally:
        model.markov_head.block_bias = orig
        model.lm_head.forward = orig_head
    if "bias" not in captured or "z" not in base:
        return float("nan")
    full = (base["z"].view(1, b, -1) + captured["bias"])[0, s:s + len(toks)].numpy()
    return float(np.abs(full - logits[:full.shape[0]]).max())


DFLASH_CASES = [(variant, b) for variant in ("dflash", "dflash2") for b in (4, 8)]


def build_dflash(variant: str, block: int, seed: int):
    """speculators' DFlashDraftModel / DFlash2DraftModel (1+N layout), every weight redrawn at O(1) scale."""
    import torch
    from transformers import Qwen3Config

    _stub_datasets()
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dflash2 import DFlash2DraftModel
    from speculators.models.dflash2.config import DFlash2SpeculatorConfig

    tl = Qwen3Config(vocab_size=VOCAB, hidden_size=E, intermediate_size=FF, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=E // HEADS, rms_norm_eps=1e-6,
                     rope_theta=10000.0, max_position_embeddings=4096, attention_bias=False)
    tl._attn_implementation = "eager"
    kw = dict(transformer_layer_config=tl, draft_vocab_size=VOCAB, block_size=block,
              aux_hidden_state_layer_ids=list(TAPS), mask_token_id=MASK, sample_from_anchor=False)
    if variant == "dflash2":
        cfg = DFlash2SpeculatorConfig(**kw, conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=4)
        model = DFlash2DraftModel(cfg).eval()
    else:
        cfg = DFlashSpeculatorConfig(**kw)
        model = DFlashDraftModel(cfg).eval()
    rng = np.random.default_rng(seed)
    sd = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("verifier_"):
                continue
            shape = tuple(p.shape)
            if name.endswith("norm.weight"):
                arr = 1.0 + 0.1 * rng.standard_normal(shape)
            elif "base_kernel" in name or "codebook" in name or "embed_tokens" in name:
                arr = 0.5 * rng.standard_normal(shape)
            else:
                arr = 0.2 * rng.standard_normal(shape)
            sd[name] = arr.astype(np.float16).astype(np.float32)
            p.copy_(torch.from_numpy(sd[name]))
    return model, cfg, sd


def dflash_inference(model, feats: np.ndarray, anchor: int):
    """Logits [B-1, V] of a full 1+N block ``[anchor, MASK x (B-1)]`` after context rows 0..P-1 (no selector)."""
    import torch

    b = model.config.block_size
    p = feats.shape[0]
    with torch.no_grad():
        ids = torch.full((1, b), model.config.mask_token_id, dtype=torch.long)
        ids[0, 0] = anchor
        x = model.embed_tokens(ids)
        ctx = model.hidden_norm(model.fc(torch.from_numpy(feats)[None]))
        pos = torch.arange(p + b)[None]
        pe = model.rotary_emb(x, pos)
        for layer in model.layers:
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_ids=pos,
                      position_embeddings=pe)
        return model.lm_head(model.norm(x))[0, 1:].numpy()


def main_dflash(out: str) -> None:
    rng = np.random.default_rng(8)
    arrays, meta = {}, {}
    for ci, (variant, block) in enumerate(DFLASH_CASES):
        name = f"{variant}-b{block}"
        model, cfg, sd = build_dflash(variant, block, seed=200 + ci)
        for k, v in sd.items():
            arrays[f"{name}/w/{k}"] = v.astype(np.float16)
        meta[name] = dict(kind=variant, block_size=block, config=json.loads(cfg.to_json_string()))  # the golden file's key
        feats = rng.standard_normal((N_CTX, len(TAPS) * E)).astype(np.float32)
        anchor = int(rng.integers(0, VOCAB - 1))
        arrays[f"{name}/feats"] = feats
        arrays[f"{name}/anchor"] = np.array([anchor])
        arrays[f"{name}/logits"] = dflash_inference(model, feats, anchor)
    arrays["meta_json"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez_compressed(out, **arrays)
    print(f"wrote {out}: {len(DFLASH_CASES)} DFlash/DFlash2 cases")


def main(out: str, check: bool) -> None:
    rng = np.random.default_rng(7)
    arrays = {}
    meta = {}
    for ci, (name, block, af, vd, conf) in enumerate(CASES):
        model, cfg, sd = build(block, af, vd, conf, seed=100 + ci)
        for k, v in sd.items():
            if k.startswith("verifier_"):  # the training-only verifier head/norm: not part of a checkpoint
                continue
            key = f"backbone/w/{k}" if is_backbone(k) else f"{name}/w/{k}"
            arrays[key] = v.astype(np.float16) if v.dtype == np.float32 else v
        meta[name] = dict(block_size=block, sample_from_anchor=af, draft_vocab_size=vd, conf=conf,
                          config=json.loads(cfg.to_json_string()))
        feats = rng.standard_normal((N_CTX, len(TAPS) * E)).astype(np.float32)
        anchor = int(rng.integers(0, VOCAB - 1))
        n = block if af else block - 1
        logits, toks, cf = inference(model, feats, anchor, n)
        arrays[f"{name}/feats"] = feats
        arrays[f"{name}/anchor"] = np.array([anchor])
        arrays[f"{name}/logits"] = logits
        arrays[f"{name}/tokens"] = toks
        if cf is not None:
            arrays[f"{name}/conf"] = cf
        if check and ci % 4 == 0:
            diff = check_training_forward(model, feats, anchor, n, logits, toks)
            print(f"{name}: training forward vs inference pass max |diff| = {diff:.2e}")
    arrays["meta_json"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez_compressed(out, **arrays)
    print(f"wrote {out}: {len(CASES)} cases")


#: (name, block size, sample_from_anchor, draft vocabulary, sliding_window_non_causal)
GEMMA4_VERIFIER_CASES = [("g4v-b6-af-causal", 6, True, VOCAB, False), ("g4v-b7-ba-noncausal", 7, False, 40, True),
                         ("g4v-b4-ba-causal", 4, False, VOCAB, False)]


def gemma4_verifier_layer_config():
    """The draft decoder config speculators itself builds for a Gemma 4 verifier (``create_transformer_layer_config``,
    the default training path): a Qwen3 config with the verifier's ``hidden_activation`` (gelu_pytorch_tanh), its
    sliding ``head_dim`` (16 here, not E / heads), its sliding RoPE, a sliding then a full layer. The window is
    wider than context + block: speculators' window counts back from the anchor, llama.cpp's (and plinth's) from
    each query, so the two agree only where the window does not cut."""
    import tempfile

    _stub_datasets()
    from speculators.train.cli import create_transformer_layer_config
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    with tempfile.TemporaryDirectory() as d:
        Gemma4TextConfig(vocab_size=VOCAB, hidden_size=E, intermediate_size=FF, num_hidden_layers=4,
                         num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=16, global_head_dim=32,
                         hidden_size_per_layer_input=0,
                         layer_types=["sliding_attention"] * 3 + ["full_attention"]).save_pretrained(d)
        return create_transformer_layer_config(d, num_layers=LAYERS, draft_arch="qwen3", hidden_act=None,
                                               sliding_window=64, full_attention_indices=[1])


def main_gemma4_verifier(out: str) -> None:
    rng = np.random.default_rng(9)
    arrays, meta = {}, {}
    for ci, (name, block, af, vd, non_causal) in enumerate(GEMMA4_VERIFIER_CASES):
        tl = gemma4_verifier_layer_config()
        model, cfg, sd = build(block, af, vd, True, seed=300 + ci, tl=tl, non_causal=non_causal)
        for k, v in sd.items():
            if not k.startswith("verifier_"):
                arrays[f"{name}/w/{k}"] = v.astype(np.float16) if v.dtype == np.float32 else v
        meta[name] = dict(block_size=block, sample_from_anchor=af, draft_vocab_size=vd, conf=True,
                          config=json.loads(cfg.to_json_string()))
        feats = rng.standard_normal((N_CTX, len(TAPS) * E)).astype(np.float32)
        anchor = int(rng.integers(0, VOCAB - 1))
        logits, toks, cf = inference(model, feats, anchor, block if af else block - 1, masked=True)
        arrays[f"{name}/feats"] = feats
        arrays[f"{name}/anchor"] = np.array([anchor])
        arrays[f"{name}/logits"] = logits
        arrays[f"{name}/tokens"] = toks
        arrays[f"{name}/conf"] = cf
    arrays["meta_json"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez_compressed(out, **arrays)
    print(f"wrote {out}: {len(GEMMA4_VERIFIER_CASES)} cases over speculators' Gemma 4 verifier draft config")


if __name__ == "__main__":
    if "--gemma4-verifier" in sys.argv:
        main_gemma4_verifier(sys.argv[1])
    elif "--dflash" in sys.argv:
        main_dflash(sys.argv[1])
    else:
        main(sys.argv[1], "--check-training" in sys.argv)

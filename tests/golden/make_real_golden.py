"""Write the golden reference files of the two real models (SmolLM2-135M, Gemma-3-270M).

Run by hand (needs torch and transformers, ``pip install -e '.[ref]'``)::

    python tests/golden/make_real_golden.py             # both models
    python tests/golden/make_real_golden.py gemma3      # one model

The reference is Hugging Face transformers (``LlamaForCausalLM`` /
``Gemma3ForCausalLM``, float32, eager attention) built from a config derived
from the GGUF metadata and loaded with the GGUF weights dequantized to float32
by plinth's GGUF reader (whose dequantizers are bit-exact with gguf-py, see
``tests/test_quants.py``). Nothing comes from the Hugging Face hub. The GGUF -> Hugging Face weight mapping
is :mod:`plinth.testing.hf_weights`, shared with ``plugins/llama/tests/golden/make_golden.py``. The
attention scale of Gemma-3 is ``query_pre_attn_scalar ** -0.5``; GGUF has no key for it; llama.cpp
uses ``head_dim`` except for the 27B model, so this script sets ``query_pre_attn_scalar = head_dim``
(256 for the 270M model).

For each of five prompts (prose, code, chat-formatted, unicode, a longer
passage) the reference produces a 64-token greedy continuation (cached decode,
ignoring end-of-generation tokens), then one teacher-forced forward over
prompt + continuation. ``real/<model>.npz`` keeps, per position of that
forward: the logits at a fixed random subset of vocabulary columns, the top-8
ids and logits, and the greedy step margins. That is enough to check plinth to
1e-4 without storing full logit rows. The text transformers' GGUF tokenizer
decodes from each continuation is stored too (for the CLI test).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from plinth.testing.hf_weights import hf_state_dict, load_hf_state

HERE = Path(__file__).resolve().parent
OUT = HERE / "real"

N_GREEDY = 64
N_COLUMNS = 256  # random vocabulary columns kept per position
TOP_K = 8
COLUMN_SEED = 1234

MODELS: dict[str, dict[str, Any]] = {
    "smollm2": dict(name="smollm2-135m-instruct", arch="llama"),
    "gemma3": dict(name="gemma3-270m", arch="gemma3"),
}

LONG_PASSAGE = (
    "The history of the bicycle is a story of many small improvements. The first machines, built in the "
    "early nineteenth century, had no pedals at all: the rider sat on a wooden frame and pushed along the "
    "ground with both feet. Later designers attached cranks to the front wheel, and because one turn of the "
    "pedals meant one turn of the wheel, the front wheel grew larger and larger to go faster. These tall "
    "machines were fast but dangerous, and a sudden stop could throw the rider over the handlebars. The "
    "so-called safety bicycle solved the problem with a chain that drove the rear wheel, so both wheels "
    "could be the same modest size. Pneumatic tyres, invented a few years later, made the ride far more "
    "comfortable on rough roads. Within a decade the bicycle had changed how people travelled to work, how "
    "they spent their weekends, and even how women dressed. In many cities today, the bicycle is again "
    "seen as a practical answer to traffic and pollution, and engineers are still refining its frame, "
    "gears and brakes. Summarise the main stages of this history in one sentence:"
)

# (kind, text, chat): chat prompts are rendered with the model's own chat template, as `plinth generate --chat`
PROMPTS: list[tuple[str, str, bool]] = [
    ("prose", "The old lighthouse keeper climbed the stairs every evening, and", False),
    ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', False),
    ("chat", "What are three common uses of copper?", True),
    ("unicode", "Übersetzung ins Deutsche: «Café», naïve façade — 東京は日本の首都です。 🚀 Ελληνικά:", False),
    ("long", LONG_PASSAGE, False),
]


# --------------------------------------------------------------------------- plinth side (no torch)

def gguf_path(model: str) -> Path:
    from plinth import hub

    return hub.resolve_model(MODELS[model]["name"])


def tokenizer(model: str) -> Any:
    from plinth.gguf import GGUFFile
    from plinth.tokenizer import Tokenizer

    return Tokenizer.from_metadata(dict(GGUFFile(gguf_path(model)).metadata))


def prompt_ids(tok: Any, text: str, chat: bool) -> list[int]:
    """Token ids exactly as ``plinth generate [--chat]`` makes them."""
    from plinth.generate import render_chat

    if chat and not tok.chat_template:
        # gemma-3-270m's GGUF carries no chat template (plinth's --chat refuses it): Gemma's turn markup by hand
        rendered = f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
        return tok.encode(rendered, add_special=True, parse_special=True)
    if chat:
        rendered = render_chat(tok.chat_template, [{"role": "user", "content": text}], tok)
        return tok.encode(rendered, add_special=False, parse_special=True)
    return tok.encode(text, add_special=True)


def columns(n_vocab: int) -> np.ndarray:
    """The fixed random vocabulary columns whose logits are stored, sorted."""
    rng = np.random.default_rng(COLUMN_SEED)
    return np.sort(rng.choice(n_vocab, N_COLUMNS, replace=False)).astype(np.int64)


def load(model: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(info, runs) of ``real/<model>.npz``; each run: kind, chat, text, prompt, greedy, cols, vals, top_ids,
    top_vals (all per position of the teacher-forced forward over prompt + greedy[:-1])."""
    with np.load(OUT / f"{model}.npz") as z:
        rec = {k: z[k] for k in z.files}
    info = json.loads(str(rec["info"]))
    runs = []
    for i, p in enumerate(info["prompts"]):
        runs.append(dict(
            kind=p["kind"], chat=p["chat"], text=p["text"], reference_text=p["reference_text"],
            prompt=rec[f"prompt_{i}"].astype(np.int64).tolist(), greedy=rec[f"greedy_{i}"].astype(np.int64).tolist(),
            vals=rec[f"vals_{i}"], top_ids=rec[f"top_ids_{i}"].astype(np.int64), top_vals=rec[f"top_vals_{i}"],
            margins=rec[f"margins_{i}"],
        ))
    return info, runs


# --------------------------------------------------------------------------- reference side (torch)

def dequantized_weights(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(metadata, GGUF tensor name -> float32 array in numpy order) of a GGUF file."""
    from plinth.gguf import GGUFFile, quants

    gf = GGUFFile(path)
    out = {}
    for name, info in gf.tensors.items():
        raw = gf.raw(name)
        arr = raw if info.type_name == "F32" else quants.dequantize(raw, info.ggml_type, info.shape)
        out[name] = np.array(arr, dtype=np.float32)  # a writable copy (F32 views of the file are read-only)
    return dict(gf.metadata), out


def hf_config(arch: str, md: dict[str, Any], tied: bool) -> Any:
    import transformers

    def key(k: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{k}", default)

    n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", n_embd // n_head))
    common = dict(
        vocab_size=int(key("vocab_size", len(md["tokenizer.ggml.tokens"]))),
        hidden_size=n_embd,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=int(key("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings=tied,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    if arch == "llama":
        assert int(key("rope.dimension_count", head_dim)) == head_dim
        cfg = transformers.LlamaConfig(
            hidden_act="silu", attention_bias=False, mlp_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}, **common)
    elif arch == "gemma3":
        assert key("rope.scaling.type") is None, "rope scaling on global layers is not mapped here"
        n_layer = common["num_hidden_layers"]
        cfg = transformers.Gemma3TextConfig(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=head_dim,  # llama.cpp: 1/sqrt(head_dim) for every size but 27B
            sliding_window=int(key("attention.sliding_window")),
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layer)],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 1e6))},
                "sliding_attention": {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 1e4))},
            },
            final_logit_softcapping=key("final_logit_softcapping"), attn_logit_softcapping=key("attn_logit_softcapping"),
            **common,
        )
    else:
        raise ValueError(arch)
    cfg._attn_implementation = "eager"
    return cfg


def hf_model(model: str) -> tuple[Any, dict[str, Any]]:
    """(the transformers model on the dequantized GGUF weights, GGUF metadata)."""
    import torch
    import transformers

    arch = MODELS[model]["arch"]
    md, w = dequantized_weights(gguf_path(model))
    tied = "output.weight" not in w
    cfg = hf_config(arch, md, tied)
    cls = {"llama": transformers.LlamaForCausalLM, "gemma3": transformers.Gemma3ForCausalLM}[arch]
    torch.manual_seed(0)
    net = cls(cfg).to(torch.float32).eval()
    sd = hf_state_dict(arch, w, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    return load_hf_state(net, sd, model, tied=tied), md


def hf_greedy(net: Any, prompt: list[int], n_new: int) -> tuple[list[int], list[float]]:
    """Greedy continuation with the KV cache (end-of-generation tokens do not stop it) and each step's
    top-1/top-2 logit margin."""
    import torch

    new, margins = [], []
    with torch.no_grad():
        out = net(input_ids=torch.tensor([prompt]), use_cache=True)
        step = out.logits[0, -1]
        for i in range(n_new):
            top2 = torch.topk(step, 2).values
            margins.append(float(top2[0] - top2[1]))
            tok = int(torch.argmax(step))
            new.append(tok)
            if i == n_new - 1:
                break
            out = net(input_ids=torch.tensor([[tok]]), cache=out.cache, use_cache=True)
            step = out.logits[0, -1]
    return new, margins


def hf_logits(net: Any, ids: list[int]) -> np.ndarray:
    """float32 [n, n_vocab]: teacher-forced logits at every position of ``ids``."""
    import torch

    with torch.no_grad():
        return net(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def hf_tokenizer(model: str) -> Any:
    """transformers' own tokenizer built from the GGUF file (local, no hub)."""
    from transformers import AutoTokenizer

    path = gguf_path(model)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def reference(model: str, with_plinth: bool = True) -> dict[str, Any]:
    """The golden record of ``model`` computed with transformers; with ``with_plinth`` also the full-vocab
    max |plinth - transformers| per prompt (recorded in info for the report, not checked against)."""
    import torch
    import transformers

    t0 = time.perf_counter()
    net, md = hf_model(model)
    tok = tokenizer(model)
    hf_tok = hf_tokenizer(model)
    plinth_model = None
    if with_plinth:
        import plinth

        plinth_model = plinth.load_model(gguf_path(model))
    n_vocab = net.config.vocab_size
    cols = columns(n_vocab)
    rec: dict[str, Any] = {"columns": cols.astype(np.int32)}
    infos = []
    for i, (kind, text, chat) in enumerate(PROMPTS):
        ids = prompt_ids(tok, text, chat)
        greedy, margins = hf_greedy(net, ids, N_GREEDY)
        full = ids + greedy[:-1]
        logits = hf_logits(net, full)
        # the teacher-forced forward picks the same tokens as the cached decode
        assert logits[len(ids) - 1:].argmax(-1).tolist() == greedy, f"{model}/{kind}: cached != full forward"
        top = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP_K]
        rec[f"prompt_{i}"] = np.asarray(ids, dtype=np.int32)
        rec[f"greedy_{i}"] = np.asarray(greedy, dtype=np.int32)
        rec[f"vals_{i}"] = logits[:, cols].astype(np.float32)
        rec[f"top_ids_{i}"] = top.astype(np.int32)
        rec[f"top_vals_{i}"] = np.take_along_axis(logits, top, -1).astype(np.float32)
        rec[f"margins_{i}"] = np.asarray(margins, dtype=np.float32)
        eog = next((j for j, t in enumerate(greedy) if tok.is_eog(t)), len(greedy))
        hf_text = hf_tok.decode(greedy[:eog], skip_special_tokens=True)
        p = {"kind": kind, "text": text, "chat": chat, "n_prompt": len(ids), "reference_text": hf_text,
             "n_until_eog": eog, "min_margin": float(min(margins)),
             "hf_tokenizer_same_ids": hf_tok.encode(text, add_special_tokens=True) == ids if not chat else None,
             "chat_template": bool(tok.chat_template) if chat else None}
        if plinth_model is not None:
            ours = plinth_model.logits(full)
            p["plinth_max_abs_diff"] = float(np.abs(ours - logits).max())
        infos.append(p)
        print(f"  {model}/{kind}: {len(ids)} prompt tokens, min greedy margin {p['min_margin']:.3g}"
              + (f", max |plinth - hf| {p['plinth_max_abs_diff']:.3g}" if "plinth_max_abs_diff" in p else ""),
              flush=True)
    rec["info"] = np.asarray(json.dumps({
        "model": model, "name": MODELS[model]["name"], "file": gguf_path(model).name, "arch": MODELS[model]["arch"],
        "n_vocab": n_vocab, "n_greedy": N_GREEDY, "top_k": TOP_K, "column_seed": COLUMN_SEED, "prompts": infos,
        "reference": f"transformers {transformers.__version__}, torch {torch.__version__}, float32, eager attention, "
                     f"{type(net).__name__} on plinth-dequantized GGUF weights",
        "seconds": round(time.perf_counter() - t0, 1),
    }, sort_keys=True, ensure_ascii=False))
    return rec


def f64_floor(model: str, index: int = 2) -> None:
    """Print how far transformers-f32 and plinth (its f32-activation kernels) are from transformers-f64 on
    prompt ``index`` (f32's floor)."""
    import torch

    import plinth
    import plinth.quant as quant

    quant._state["i8"] = False  # the int8 activations are held to llama.cpp's bar, not to f32's

    tok = tokenizer(model)
    _, text, chat = PROMPTS[index]
    ids = prompt_ids(tok, text, chat)
    net, _ = hf_model(model)
    ours = plinth.load_model(gguf_path(model)).logits(ids)
    f32 = hf_logits(net, ids)
    with torch.no_grad():
        f64 = net.to(torch.float64)(input_ids=torch.tensor([ids])).logits[0].numpy()
    print(f"{model}/{PROMPTS[index][0]}: max |plinth - hf f32| {np.abs(ours - f32).max():.3g}, "
          f"|plinth - hf f64| {np.abs(ours - f64).max():.3g}, |hf f32 - hf f64| {np.abs(f32 - f64).max():.3g}, "
          f"max |logit| {np.abs(f64).max():.1f}")


def main(argv: list[str]) -> int:
    import torch

    torch.set_num_threads(2)
    if argv[:1] == ["--f64-floor"]:
        for model in argv[1:] or list(MODELS):
            f64_floor(model)
        return 0
    OUT.mkdir(exist_ok=True)
    for model in argv or list(MODELS):
        rec = reference(model)
        path = OUT / f"{model}.npz"
        np.savez_compressed(path, **rec)
        print(f"{model}: wrote {path.relative_to(HERE)} ({path.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

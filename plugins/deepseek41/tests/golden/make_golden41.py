"""Write the golden reference files of plinth-deepseek41's ``deepseek41`` (tiny random V4.1 models).

Run by hand (needs torch and transformers, ``pip install -e '.[ref]'``)::

    python plugins/deepseek41/tests/golden/make_golden41.py            # all cases
    python plugins/deepseek41/tests/golden/make_golden41.py lag_flash  # one case

No implementation of V4.1 is public, so each case starts from a deepseek4 case of
``make_golden.py`` (its random HF weights) and adds what V4.1 changes:

* the GGUF (``deepseek41_file``): the deepseek4 file plinth's converter writes from those
  weights, relabelled ``deepseek41``, without the hc head (``output_hc_*``), plus the case's
  Engram keys and tensors drawn with numpy (the table stored as BF16, rounded here so that the
  reference sees the very values plinth reads);
* the reference (``reference``): transformers' ``DeepseekV4ForCausalLM`` on the same weights,
  re-wired for the lag: each decoder layer's forward is replaced by one that calls the layer's
  own modules (``attn_hc`` / ``ffn_hc`` = ``DeepseekV4HyperConnection``, ``self_attn``, ``mlp``,
  its norms) but collapses with the previous sublayer's ``pre`` (read out of the hyper-connection's
  forward: its first sigmoid, + hc_eps, checked against the collapse it returns), a one-hot
  pre before layer 0 and the last FFN's pre in place of the hc head. Engram is a direct torch
  evaluation of the spec's formula, with the hash in Python integers (mod 2^64) — written from
  the spec text, not from plinth's code.

For prompts of 1, 7, 40 and 301 tokens it stores the logits of one forward and a 32-token greedy
continuation (``generate`` with transformers' cache, which re-runs the patched layers; by
full forwards where a layer reads a shared compressed source: ``share_sources`` hands a reader
layer's attention the source layer's compressor applied to the source's input, without a cache).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np

from plinth.testing import load_module

HERE = Path(__file__).resolve().parent
v4 = load_module(HERE / "make_golden.py")

PROMPT_LENGTHS = v4.PROMPT_LENGTHS
N_GREEDY = v4.N_GREEDY

# Engram of a case: layers, heads, N, key width, pad id, primes per layer (offsets are their running sums),
# the multiplier range (up to 2^64: products wrap), a token map folding the vocabulary, spare table rows.
CASES: dict[str, dict[str, Any]] = {
    # V4's "flash" weights (window, CSA 4, HCA 8, two hash layers, hc 4) with the lag and no Engram
    "lag_flash": dict(base="flash", engram=None),
    # two streams, YaRN, Engram at layers 0 and 2: trigrams, two heads, wrapping multipliers, folded ids
    "engram_hc2": dict(base="yarn_hc2", engram=dict(
        seed=711, layer_ids=[0, 2], n_head=2, max_ngram=3, key_length=32, pad_id=3, mult_bits=64, spare=5,
        primes=[[31, 37, 41, 43], [47, 53, 59, 61]], fold=200)),
    # three streams, HCA only, no hash layer, Engram at layer 1: bigrams, three heads, multipliers < 2^37
    "engram_hca": dict(base="hca_only", engram=dict(
        seed=712, layer_ids=[1], n_head=3, max_ngram=2, key_length=32, pad_id=0, mult_bits=37, spare=0,
        primes=[[67, 71, 73]], fold=256)),
    # shared compressed sources: HCA layers 0 and 2 compress, layer 3 has no compressor and reads layer 2's
    # stream (the latest earlier source); Engram at the reader
    "shared_hca": dict(base=dict(seed=505, prompt_seed=605, config=dict(
        v4._COMMON, num_hidden_layers=4, layer_types=[v4.H, v4.S, v4.H, v4.H], compress_rates={v4.C: 4, v4.H: 8},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"])), readers=[3], engram=dict(
        seed=713, layer_ids=[3], n_head=2, max_ngram=2, key_length=32, pad_id=1, mult_bits=37, spare=0,
        primes=[[53, 59]], fold=256)),
    # a compressor without a gate (allowed at ratio 1 only): HCA at ratio 1, no attn_compressor_gate in the file
    # (one row an entry: the softmax over one slot is 1 whatever the gate; the reference keeps its gate)
    "gateless_r1": dict(base=dict(seed=506, prompt_seed=606, config=dict(
        v4._COMMON, num_hidden_layers=3, hc_mult=2, layer_types=[v4.H, v4.S, v4.H],
        compress_rates={v4.C: 4, v4.H: 1}, mlp_layer_types=["moe"] * 3)), drop=["attn_compressor_gate"],
        engram=None),
}


def v4_case(case: str) -> dict[str, Any]:
    """The deepseek4 weights a case starts from: a case of make_golden.py, or its own (seed, prompt_seed, config)."""
    base = CASES[case]["base"]
    return v4.CASES[base] if isinstance(base, str) else base


def base_config(case: str) -> dict[str, Any]:
    return v4_case(case)["config"]


def readers(case: str) -> list[int]:
    """Compressed layers without a compressor of their own (they read an earlier layer's stream)."""
    return list(CASES[case].get("readers", []))


def prompts(case: str) -> list[list[int]]:
    from plinth.testing.golden import random_prompts

    return random_prompts(v4_case(case)["prompt_seed"], base_config(case)["vocab_size"], PROMPT_LENGTHS)


def write_hf_folder(case: str, folder: Path) -> Path:
    """The case's deepseek4 weights as an HF folder (all of them: the reference keeps readers' compressors)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(base_config(case), indent=1))
    v4.write_safetensors(folder / "model.safetensors", v4.hf_random_state(base_config(case), v4_case(case)["seed"]))
    return folder


# --------------------------------------------------------------------------- Engram constants and tensors

def bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 -> the nearest BF16 value (ties to even), as float32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def engram_constants(case: str) -> dict[str, Any] | None:
    """The case's Engram hparams as plain Python values (the GGUF keys' contents)."""
    spec = CASES[case]["engram"]
    if spec is None:
        return None
    rng = np.random.default_rng(spec["seed"])
    v = base_config(case)["vocab_size"]
    n_e, n = len(spec["layer_ids"]), spec["max_ngram"]
    top = 1 << spec["mult_bits"]
    mult = [int(x) | 1 for x in rng.integers(1, top - 1, n_e * n, dtype=np.uint64, endpoint=True)]
    primes = [p for layer in spec["primes"] for p in layer]
    offsets = [o for layer in spec["primes"] for o in np.concatenate([[0], np.cumsum(layer)[:-1]]).tolist()]
    token_map = rng.integers(0, spec["fold"], v).tolist()
    return dict(layer_ids=list(spec["layer_ids"]), n_head=spec["n_head"], max_ngram=n, key_length=spec["key_length"],
                pad_id=spec["pad_id"], multipliers=mult, primes=primes, offsets=[int(o) for o in offsets],
                token_map=[int(t) for t in token_map], spare=spec["spare"])


def engram_tensors(case: str) -> dict[str, np.ndarray]:
    """GGUF-named Engram tensors (float32; the table already BF16-rounded)."""
    c = engram_constants(case)
    if c is None:
        return {}
    cfg = base_config(case)
    e, hc = cfg["hidden_size"], cfg["hc_mult"]
    rng = np.random.default_rng(CASES[case]["engram"]["seed"] + 1)
    n_cols = (c["max_ngram"] - 1) * c["n_head"]
    dk = c["key_length"]
    out = {}
    for k, il in enumerate(c["layer_ids"]):
        cols = slice(k * n_cols, (k + 1) * n_cols)
        rows = max(o + p for o, p in zip(c["offsets"][cols], c["primes"][cols])) + c["spare"]
        b = f"blk.{il}."
        out[b + "engram_embd.weight"] = bf16_round(rng.standard_normal((rows, dk)).astype(np.float32))
        out[b + "engram_wkv.weight"] = (rng.standard_normal(((hc + 1) * e, n_cols * dk)) /
                                        np.sqrt(n_cols * dk)).astype(np.float32)
        # RMSNorm weights (a reference initialises them to 1): drawn around 1 with either sign
        out[b + "engram_q.weight"] = (rng.choice([-1.0, 1.0], (hc, e)) * rng.uniform(0.5, 1.5, (hc, e))).astype(np.float32)
        out[b + "engram_k.weight"] = (rng.choice([-1.0, 1.0], (hc, e)) * rng.uniform(0.5, 1.5, (hc, e))).astype(np.float32)
    return out


def engram_metadata(c: dict[str, Any], arch: str = "deepseek41") -> tuple[dict[str, Any], dict[str, str]]:
    """The ``engram.*`` keys and their forced integer types (uint64 hash constants)."""
    p = f"{arch}.engram."
    md = {p + "layer_ids": c["layer_ids"], p + "head_count": c["n_head"], p + "max_ngram_size": c["max_ngram"],
          p + "key_length": c["key_length"], p + "pad_id": c["pad_id"], p + "multipliers": c["multipliers"],
          p + "primes": c["primes"], p + "offsets": c["offsets"], p + "token_map": c["token_map"]}
    return md, {p + "multipliers": "u64", p + "primes": "u64", p + "offsets": "u64"}


# --------------------------------------------------------------------------- the plinth file

def relabel(md: dict[str, Any], arch: str = "deepseek41") -> dict[str, Any]:
    """A deepseek4 file's metadata under another architecture name (deepseek41 inherits every key)."""
    out = {}
    for k, v in md.items():
        out[arch + k[len("deepseek4"):] if k.startswith("deepseek4.") else k] = v
    out["general.architecture"] = arch
    return out


def deepseek41_parts(case: str, tmp: Path, reg: Any = None) -> tuple[dict[str, Any], dict[str, np.ndarray],
                                                                      dict[str, str]]:
    """(metadata, tensors, forced int types) of the case's deepseek41 file."""
    from plinth.convert import convert
    from plinth.gguf import GGUFFile

    reg = reg or v4.registry()
    folder = write_hf_folder(case, tmp / f"{case}-hf")
    gf = GGUFFile(convert(folder, tmp / f"{case}-v4.gguf", registry=reg))
    md = relabel(dict(gf.metadata))
    dropped = tuple(f"blk.{il}.attn_compressor_" for il in readers(case))
    dropped += tuple(f"blk.{il}.{name}" for il in range(base_config(case)["num_hidden_layers"])
                     for name in CASES[case].get("drop", []))
    tensors = {n: np.array(gf.raw(n)) for n in gf.tensors if not n.startswith(("output_hc_",) + dropped)}
    forced: dict[str, str] = {}
    c = engram_constants(case)
    if c is not None:
        emd, forced = engram_metadata(c)
        md.update(emd)
        tensors.update(engram_tensors(case))
    return md, tensors, forced


def write_file(path: Path, md: dict[str, Any], tensors: dict[str, np.ndarray], forced: dict[str, str]) -> Path:
    """Write a deepseek41 GGUF (Engram tables as BF16)."""
    import gguf
    from plinth.convert import write_gguf

    qtypes = {n: gguf.GGMLQuantizationType.BF16 for n in tensors if n.endswith("engram_embd.weight")}
    return write_gguf(path, md, tensors, qtypes, int_types=forced)


def deepseek41_file(case: str, tmp: Path, reg: Any = None) -> Path:
    md, tensors, forced = deepseek41_parts(case, tmp, reg)
    return write_file(tmp / f"{case}.gguf", md, tensors, forced)


def plinth_model(case: str, tmp: Path, reg: Any = None, vocab: bool = False) -> Any:
    """Load the case's deepseek41 file (``vocab``: with a byte-level tokenizer of the 256 ids, no end token)."""
    import plinth

    reg = reg or v4.registry()
    md, tensors, forced = deepseek41_parts(case, tmp, reg)
    if vocab:
        from plinth.testing import byte_vocab

        md.update(byte_vocab())
        md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"][:256]
        md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"][:256]
        del md["tokenizer.ggml.eos_token_id"]
    return plinth.load_model(write_file(tmp / f"{case}{'-vocab' if vocab else ''}.gguf", md, tensors, forced),
                             registry=reg)


# --------------------------------------------------------------------------- reference (torch)

MASK64 = (1 << 64) - 1


def engram_rows_python(tokens: list[int], t: int, c: dict[str, Any], k: int) -> list[int]:
    """Table rows of token t (position t of ``tokens``) for Engram layer k, in Python integers."""
    n, hh = c["max_ngram"], c["n_head"]
    n_cols = (n - 1) * hh

    def mapped(i: int) -> int:
        if i < 0:
            return c["pad_id"]  # before the sequence start
        tok = tokens[i]
        return c["token_map"][tok] if 0 <= tok < len(c["token_map"]) else c["pad_id"]

    mult = c["multipliers"][k * n:(k + 1) * n]
    primes = c["primes"][k * n_cols:(k + 1) * n_cols]
    offsets = c["offsets"][k * n_cols:(k + 1) * n_cols]
    rolling = (mapped(t) * mult[0]) & MASK64
    rows = []
    for s in range(1, n):
        rolling ^= (mapped(t - s) * mult[s]) & MASK64
        for h in range(hh):
            b = (s - 1) * hh + h
            rows.append(rolling % primes[b] + offsets[b])
    return rows


def engram_torch(X: Any, tokens: list[int], start: int, c: dict[str, Any], k: int, w: dict[str, Any],
                 eps: float) -> Any:
    """X [1, S, hc, E] (positions start..start+S-1 of ``tokens``) + the gated Engram value."""
    import torch

    S, hc, e = X.shape[1], X.shape[2], X.shape[3]
    rows = torch.tensor([engram_rows_python(tokens, start + i, c, k) for i in range(S)])
    emb = w["table"][rows].reshape(S, -1)
    kv = emb @ w["wkv"].T
    keys, value = kv[:, :hc * e].reshape(S, hc, e), kv[:, hc * e:]

    def rms(a: Any) -> Any:
        return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps)

    k_ = rms(keys) * w["k"]
    q_ = rms(X[0].float()) * w["q"]
    s = (k_ * q_).sum(-1) / e ** 0.5
    gate = torch.sigmoid(torch.sign(s) * torch.sqrt(torch.clamp(s.abs(), min=1e-6)))
    return X + (gate.unsqueeze(-1) * value.unsqueeze(-2)).unsqueeze(0)


def hc_weights(hc_module: Any, X: Any) -> tuple[Any, Any, Any]:
    """(post, comb, pre) of transformers' DeepseekV4HyperConnection on X.

    Its forward returns (post, comb, collapsed) and consumes pre; pre is its first sigmoid (+ hc_eps),
    read with a torch function mode and checked against the collapse it returned."""
    import torch
    from torch.overrides import TorchFunctionMode

    class FirstSigmoid(TorchFunctionMode):
        value = None

        def __torch_function__(self, func, types_, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.sigmoid and self.value is None:
                self.value = out
            return out

    mode = FirstSigmoid()
    with mode:
        post, comb, collapsed = hc_module(X)
    pre = mode.value + hc_module.hc_eps
    torch.testing.assert_close((pre.unsqueeze(-1) * X).sum(dim=2), collapsed, atol=1e-6, rtol=1e-6)
    return post, comb, pre


def lagged_reference_model(case: str, folder: Path) -> Any:
    """transformers' DeepseekV4ForCausalLM on the case's weights, re-wired as V4.1 (see the module doc)."""
    import torch

    model = v4.reference_model(folder)
    c = engram_constants(case)
    eng = {}
    if c is not None:
        t = engram_tensors(case)
        for k, il in enumerate(c["layer_ids"]):
            b = f"blk.{il}."
            eng[il] = (k, {"table": torch.from_numpy(t[b + "engram_embd.weight"]),
                           "wkv": torch.from_numpy(t[b + "engram_wkv.weight"]),
                           "q": torch.from_numpy(t[b + "engram_q.weight"]),
                           "k": torch.from_numpy(t[b + "engram_k.weight"])})
    eps = model.config.rms_norm_eps
    state: dict[str, Any] = {"pre": None, "tokens": []}

    def lagged_forward(self: Any, hidden_states: Any, input_ids: Any = None, **kwargs: Any) -> Any:
        start = int(kwargs["position_ids"][0, 0])
        if self.layer_idx == 0:
            state["tokens"] = state["tokens"][:start] + input_ids[0].tolist()
            carry = torch.zeros(hidden_states.shape[:3], dtype=hidden_states.dtype)
            carry[..., 0] = 1.0  # one-hot: copy 0
        else:
            carry = state["pre"]
        if self.layer_idx in eng:
            k, w = eng[self.layer_idx]
            hidden_states = engram_torch(hidden_states, state["tokens"], start, c, k, w, eps)
        post, comb, pre_attn = hc_weights(self.attn_hc, hidden_states)
        attn_output, _ = self.self_attn(self.input_layernorm((carry.unsqueeze(-1) * hidden_states).sum(dim=2)),
                                        **kwargs)
        hidden_states = post.unsqueeze(-1) * attn_output.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2),
                                                                                      hidden_states)
        post, comb, pre_ffn = hc_weights(self.ffn_hc, hidden_states)
        mlp_output = self.mlp(self.post_attention_layernorm((pre_attn.unsqueeze(-1) * hidden_states).sum(dim=2)),
                              input_ids=input_ids)
        state["pre"] = pre_ffn
        return post.unsqueeze(-1) * mlp_output.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), hidden_states)

    for layer in model.model.layers:
        layer.forward = types.MethodType(lagged_forward, layer)
    share_sources(model, readers(case))
    # no learned hc head: the last FFN's pre collapses the streams
    model.model.hc_head.forward = lambda x: (state["pre"].unsqueeze(-1) * x).sum(dim=2)
    return model


def share_sources(model: Any, reader_layers: list[int]) -> None:
    """Make each reader layer's attention use the latest earlier compressing layer's compressor on that
    layer's own input (recorded by a forward pre-hook), i.e. attend to the source's compressed stream.
    Only for forwards without a cache (the reference then decodes greedily by full forwards)."""
    import torch

    layers = model.model.layers
    saved: dict[int, Any] = {}

    class SharedCompressor(torch.nn.Module):
        def __init__(self, src: int) -> None:
            super().__init__()
            self.src = src

        def forward(self, hidden_states: Any, q_residual: Any, position_ids: Any, cache: Any, layer_idx: int) -> Any:
            if cache is not None:
                raise RuntimeError("the shared-source reference runs without a cache")
            return layers[self.src].self_attn.compressor(saved[self.src], q_residual, position_ids, None, self.src)

    for il in reader_layers:
        src = max(j for j in range(il) if j not in reader_layers and layers[j].self_attn.compressor is not None)
        layers[src].self_attn.compressor.register_forward_pre_hook(
            lambda mod, args, src=src: saved.__setitem__(src, args[0]))
        layers[il].self_attn.compressor = SharedCompressor(src)


def reference(case: str, folder: Path) -> list[tuple[list[int], np.ndarray, list[int]]]:
    import torch

    model = lagged_reference_model(case, folder)
    out = []
    with torch.no_grad():
        for p in prompts(case):
            ids = torch.tensor([p])
            logits = model(ids, use_cache=False).logits[0].float().numpy()
            if readers(case):  # greedy by full forwards (no cache)
                seq = list(p)
                for _ in range(N_GREEDY):
                    seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
                gen = seq[len(p):]
            else:
                gen = model.generate(ids, max_new_tokens=N_GREEDY, do_sample=False,
                                     min_new_tokens=N_GREEDY)[0, len(p):].tolist()
            out.append((p, logits, gen))
    return out


def info(case: str) -> dict[str, Any]:
    """What a golden file records of its case (compared with ``CASES`` by the tests)."""
    return {"base": CASES[case]["base"], "engram": CASES[case]["engram"], "readers": readers(case),
            "drop": CASES[case].get("drop", [])}


def make(case: str, tmp: Path) -> Path:
    folder = write_hf_folder(case, tmp / case)
    return v4.save_runs(case, info(case), reference(case, folder))


def main(argv: list[str]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for case in argv or sorted(CASES):
            print(make(case, Path(tmp)))


if __name__ == "__main__":
    main(sys.argv[1:])

"""Host round trips (device-to-host transfers) per decode step and per speculative step.

Usage: python benchmarks/bench_host_syncs.py [--steps 8] [--max-tokens 24] [--sites]

Every architecture and every drafter runs on the strict backend (``plinth.testing.strict``:
numpy underneath, cupy's rules on top), which counts each transfer a GPU would make:
``float()``/``int()``/``.item()``/``.tolist()``/``.get()``/``asnumpy``, and ops whose output
size depends on the data. Models are tiny synthetic GGUFs (the counts do not depend on
size). A decode step is one plain generation-loop step (decode forward + sampling); a
speculative step is one draft + verify + rollback step of the speculative engine.
``--sites`` prints where each drafter's transfers come from.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "nemotron_h", "nemotron_h_moe", "toy-recurrent")
DRAFTERS = ("ngram", "draft", "dflash", "dflash2", "lilicorr")


def write_target(d: Path, arch: str) -> tuple[Path, object]:
    """A tiny GGUF of ``arch`` with the byte vocabulary, and a registry that loads it (with ``strict``)."""
    from plinth.testing import byte_vocab, load_module, make_registry, tiny_metadata, write_synthetic_gguf
    from plinth.testing.recurrent import recurrent_plugin, write_toy_recurrent

    reg = make_registry("llama", "nemotron", recurrent_plugin())
    path = d / f"{arch}.gguf"
    if arch == "toy-recurrent":
        return write_toy_recurrent(path, seed=3), reg
    if arch.startswith("nemotron"):
        tiny = load_module(ROOT / "plugins" / "nemotron" / "tests" / "tiny.py")
        pattern = "M*EM-E" if arch == "nemotron_h_moe" else "M*-M"
        md = tiny.metadata(pattern, vocab=True, n_embd=48)
        return tiny.write(path, reg, md, seed=11), reg
    extra = {"attention__sliding_window": 5, "n_layer": 7} if arch == "gemma3" else {}
    md = tiny_metadata(arch, n_vocab=257, **extra) | byte_vocab()
    return write_synthetic_gguf(path, arch, md, reg, seed=4, drop=("output.weight",)), reg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="plain decode steps per architecture")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per speculative run")
    parser.add_argument("--n-max", type=int, default=4, help="draft length")
    parser.add_argument("--sites", action="store_true", help="print where the speculative transfers come from")
    args = parser.parse_args()

    import plinth
    from plinth.speculative.draft_model import DraftModelDrafter
    from plinth.speculative.ngram import NgramDrafter
    from plinth.testing import decode_step_transfers, speculative_step_transfers

    prompt = [3, 17, 42, 8, 23, 3, 17, 42, 8, 23, 3, 17]
    worst = 0
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        print("host round trips per plain decode step (strict backend; decode forward + sampling)")
        print(f"{'architecture':<16} {'steps':>5} {'min':>4} {'max':>4} {'mean':>6}")
        models = {}
        for arch in ARCHS:
            path, reg = write_target(d, arch)
            model = models[arch] = plinth.load_model(path, backend="strict", registry=reg)
            counts = decode_step_transfers(model, prompt, args.steps)
            worst = max(worst, max(counts))
            print(f"{arch:<16} {len(counts):>5} {min(counts):>4} {max(counts):>4} {sum(counts) / len(counts):>6.2f}")

        from plinth_dflash.drafter import make_dflash
        from plinth_dflash.testkit import write_tiny_draft

        target = models["qwen3"]
        factories = {
            "ngram": lambda: NgramDrafter(n_match_max=3, n_match_min=1, n_draft=args.n_max),
            "draft": lambda: DraftModelDrafter(models["llama"], n_draft=args.n_max),
        }
        for kind in ("dflash", "dflash2", "lilicorr"):
            draft = write_tiny_draft(d / f"{kind}.gguf", kind, n_vocab=257, mask_token=255, taps=(1, 2),
                                     block_size=6, n_embd=target.hparams.n_embd)
            factories[kind] = (lambda p: lambda: make_dflash(target, {"draft": str(p)}))(draft)
        print()
        print(f"host round trips per speculative step (strict backend; target qwen3, n_max {args.n_max}, greedy)")
        print(f"{'drafter':<10} {'steps':>5} {'total':>6} {'per step':>9}")
        for name in DRAFTERS:
            r = speculative_step_transfers(target, factories[name], prompt, args.max_tokens, args.n_max)
            print(f"{name:<10} {r.n_steps:>5} {r.total:>6} {r.per_step:>9.2f}")
            if args.sites:
                for where, n in sorted(r.sites.items(), key=lambda kv: -kv[1]):
                    print(f"{'':<12}{n:>5}  {where}")
    print()
    print(f"worst plain decode step: {worst} host round trip(s) (contract: <= 1)")
    sys.exit(0 if worst <= 1 else 1)


if __name__ == "__main__":
    main()

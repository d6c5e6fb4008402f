"""Write the llama.cpp-converted fixtures of plinth-mimo (``llamacpp/<case>.gguf`` + ``<case>.npz``).

Run by hand (needs torch, transformers, tokenizers and the llama-cpp-python 0.3.36 sdist's llama.cpp
tree, fetched by ``plinth.testing.interop.llama_cpp_sources`` or given as ``PLINTH_LLAMA_CPP_SRC``)::

    python plugins/mimo/tests/llamacpp/make_fixtures.py

Each case of ``mimo_cases.FIXTURES`` is drawn with transformers (every parameter redrawn, rounded to
values float16 holds), saved with ``save_pretrained`` beside a 300-token byte-level BPE, converted by
llama.cpp's own ``convert_hf_to_gguf.py --outtype f16`` (lossless for these weights) and run by
transformers (float32, eager). ``<case>.gguf`` is llama.cpp's file as written; ``<case>.npz`` holds the
prompts, transformers' logits for each (every row of a short prompt, every 16th and the last 8 of
the 300-token one: ``rows_i``) and its 32-token greedy continuation of each.

Two harness changes around llama.cpp's converter (:func:`convert_with_llama_cpp`):

* its pre-tokenizer lookup by hash is answered ``gpt-2`` (a 300-token test vocabulary has no known hash);
* it reads ``config.json`` as written instead of through transformers' ``AutoConfig``: transformers 5.24
  knows ``mimo_v2_flash`` and turns the release's top-level rope keys into per-layer-type
  ``rope_parameters``, which llama.cpp 0.3.36's MiMo converter cannot read (``KeyError:
  'partial_rotary_factor'``); with a transformers that does not know the model it reads the file as
  here. The folder's config carries the release's spellings (``hybrid_layer_pattern``,
  ``swa_num_key_value_heads``, ``rope_theta`` / ``swa_rope_theta`` / ``partial_rotary_factor``, ...),
  with transformers' defaults for the rope values, so both programs read one model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
N_GREEDY = 32

_RUNNER = """
import runpy, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/gguf-py")
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
def _as_written(*args, **kwargs):
    raise ValueError("read config.json as written")
base.AutoConfig.from_pretrained = _as_written
sys.argv = [sys.argv[1] + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def cases_module() -> Any:
    from plinth.testing import load_module

    return load_module(HERE.parent / "mimo_cases.py")


def convert_with_llama_cpp(folder: Path, out: Path, *extra: str, src: Path | None = None) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on ``folder`` (its own code; the two answers above)."""
    from plinth.testing.interop import llama_cpp_sources

    src = src or llama_cpp_sources()
    if src is None:
        raise RuntimeError("llama.cpp's converter is not available (the llama-cpp-python sdist could not be fetched)")
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", _RUNNER, str(src), str(folder), "--outfile", str(out), *extra],
                       env=env, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"llama.cpp's converter failed on {folder}:\n" + "\n".join(r.stderr.splitlines()[-12:]))
    return out


def stored_rows(n: int) -> np.ndarray:
    """The logit rows kept for a prompt of ``n`` tokens: all of a short one, every 16th and the last 8 of a long one."""
    return np.arange(n, dtype=np.int32) if n <= 16 else np.unique(np.r_[np.arange(0, n, 16), np.arange(n - 8, n)]).astype(np.int32)


def greedy(model: Any, ids: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def main() -> int:
    m = cases_module()
    for case in m.FIXTURES:
        with tempfile.TemporaryDirectory() as tmp:
            folder, ref = m.write_folder(case, Path(tmp) / "hf", for_llama_cpp=True, f16=True)
            gguf = convert_with_llama_cpp(folder, HERE / f"{case}.gguf", "--outtype", "f16")
            rec: dict[str, Any] = {"config": json.dumps(m.CASES[case]["config"])}
            for i, p in enumerate(m.prompts()):
                rec[f"prompt_{i}"] = np.asarray(p, np.int32)
                rows = stored_rows(len(p))
                rec[f"rows_{i}"] = rows
                rec[f"logits_{i}"] = m.reference_logits(ref, p)[rows].astype(np.float32)
                rec[f"greedy_{i}"] = np.asarray(greedy(ref, p, N_GREEDY), np.int32)
            np.savez_compressed(HERE / f"{case}.npz", **rec)
            print(gguf, gguf.stat().st_size, (HERE / f"{case}.npz").stat().st_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

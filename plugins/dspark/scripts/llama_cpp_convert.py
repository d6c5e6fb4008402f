"""Run llama.cpp's ``convert_hf_to_gguf.py`` (from the llama-cpp-python 0.3.36 sources) on a Gemma4DSparkModel
folder with its config read from config.json as written.

    python plugins/dspark/scripts/llama_cpp_convert.py LLAMA_CPP_SRC FOLDER --outfile OUT --target-model-dir T

llama.cpp's converter loads a config through transformers' AutoConfig; transformers 5.x's Gemma4TextConfig
folds ``global_head_dim`` and ``num_global_key_value_heads`` into ``per_layer_config``, which llama.cpp's
Gemma4DSparkModel (unlike its Gemma4Model) does not read, so it fails with KeyError 'global_head_dim'. Only
that class's config loading is replaced; every other step is llama.cpp's own.
"""
import json
import runpy
import sys
from pathlib import Path

src = Path(sys.argv[1])
sys.path[:0] = [str(src / "gguf-py"), str(src)]
import conversion.base as base  # noqa: E402

orig = base.ModelBase.load_hparams


def load_hparams(dir_model, is_mistral_format):
    cfg = json.loads((Path(dir_model) / "config.json").read_text())
    if "Gemma4DSparkModel" in (cfg.get("architectures") or []):
        return cfg
    return orig(dir_model, is_mistral_format)


base.ModelBase.load_hparams = staticmethod(load_hparams)
sys.argv = [str(src / "convert_hf_to_gguf.py")] + sys.argv[2:]
runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")

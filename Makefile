# Two entry points for a fresh machine:
#   make demo   installs plinth and its bundled plugins into .venv and generates text with the default model
#   make test   installs the same plus the test tools and runs the whole default test suite
# Opt-in suites: make test-ref (torch + transformers), make test-peer (llama-cpp-python, plus torch +
# transformers for the agreement bar), make test-gpu, make test-fuzz (600 mutated GGUF files),
# make test-interop (llama.cpp's converter -> plinth, plinth's converters -> llama.cpp),
# make test-browser (Debian chromium + playwright: the chat page in a real headless browser),
# make test-ray (a two-node Ray cluster on loopback: Ray Serve replicas, a model split over Ray actors).

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
PLUGINS = $(sort $(dir $(wildcard plugins/*/pyproject.toml)))
PROMPT ?= Write one sentence about the sea.

.PHONY: install demo test test-ref test-interop test-lossless test-ref-speculators test-ref-mlx-dspark test-peer test-kv-accuracy test-gpu test-fuzz test-browser test-clients test-ray bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[test,serve]" $(foreach p,$(PLUGINS),-e $(p))

demo: install
	$(BIN)/plinth generate --chat --stats "$(PROMPT)"

test: install
	$(BIN)/python -m pytest -q

test-ref: install
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[ref]"
	$(BIN)/python -m pytest -q -m ref

# speculators pins transformers<=5.19.0 (the [ref] extra has 5.24.0): its own venv, --no-deps, and a stub
# module for `datasets` (imported through its eagle3 package, unused by the inference pass).
SPEC_VENV ?= .venv-speculators
test-ref-speculators: install
	test -x $(SPEC_VENV)/bin/python || $(PYTHON) -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0 transformers==5.19.0 \
		safetensors loguru pydantic-settings openai hs-connectors==0.9.0 typer rich numpy
	$(SPEC_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps speculators==0.9.0
	PLINTH_SPECULATORS_PYTHON=$(abspath $(SPEC_VENV))/bin/python $(BIN)/python -m pytest -q -m speculators

# the second DSpark oracle: mlx-dspark on mlx's CPU build, in its own venv
MLX_VENV ?= .venv-mlx
test-ref-mlx-dspark: install
	test -x $(MLX_VENV)/bin/python || $(PYTHON) -m venv $(MLX_VENV)
	$(MLX_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "mlx[cpu]==0.32.4" mlx-dspark==0.20.3 numpy
	PLINTH_MLX_DSPARK_PYTHON=$(abspath $(MLX_VENV))/bin/python $(BIN)/python -m pytest -q -m mlx_dspark

# llama.cpp's converter and gguf-py (from the llama-cpp-python sdist, fetched once) write tiny random checkpoints of
# every architecture both engines share; plinth must match transformers on them, and llama.cpp on plinth's files
test-interop: install
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[peer,ref]"
	$(BIN)/python -m pytest -q -m interop

# the full differential run of issue 33 (every drafter x n_max on every prompt, both real models, ~35 min)
test-lossless: install
	$(BIN)/python -m pytest -q -m slow tests/test_lossless_real.py

test-peer: install
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[peer,ref]"
	$(BIN)/python -m pytest -q -m peer

# issue 37: a q4_0 K/V cache's top-1 agreement with the f32 cache against llama.cpp's with its f16 cache
# (SmolLM2, 1024 tokens; the full figures: benchmarks/bench_kv_accuracy.py)
test-kv-accuracy: install
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[peer]"
	$(BIN)/python -m pytest -q -s -m peer tests/test_kv_accuracy.py

test-gpu: install
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[cuda]"
	$(BIN)/python -m pytest -q -m gpu

test-fuzz: install
	$(BIN)/python -m pytest -q -s -m fuzz tests/test_fuzz.py

test-browser: install
	apt-get update -q && apt-get install -y -q chromium chromium-driver
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[browser]"
	$(BIN)/python -m pytest -q -m browser

# plinth serve through the client libraries people use (llm, litellm, langchain-openai), in their own venv
CLIENTS_VENV ?= .venv-clients
test-clients: install
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install --quiet --disable-pip-version-check llm litellm langchain-openai
	PLINTH_CLIENTS_PYTHON=$(abspath $(CLIENTS_VENV))/bin/python $(BIN)/python -m pytest -q -m clients tests/test_serve_clients.py

# Ray's services bind every interface: the suite runs in a network namespace that has only
# loopback (unshare -rn), so nothing it starts can be reached from outside this machine
test-ray: install
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[ray,serve]"
	unshare -rn sh -c 'ip link set lo up && RAY_USAGE_STATS_ENABLED=0 OPENBLAS_NUM_THREADS=1 \
		$(BIN)/python -m pytest -q -s -p no:warnings -m ray tests/test_ray.py'

bench: install
	$(BIN)/python benchmarks/bench_plugins.py

# llama.cpp's own llama-server (CPU only) built from the llama-cpp-python 0.3.36 sdist's vendored sources into
# ~/.cache/plinth/llama-server (PLINTH_LLAMA_SERVER_DIR), for benchmarks/bench_serve_peer.py; ~15 min on 2 cores
.PHONY: peer-server
peer-server: install
	$(BIN)/python benchmarks/build_llama_server.py

clean:
	rm -rf $(VENV) $(SPEC_VENV) $(MLX_VENV) $(CLIENTS_VENV)

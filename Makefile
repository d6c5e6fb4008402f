# Two entry points for a fresh machine:
#   make demo   installs plinth and its bundled plugins into .venv and generates text with the default model
#   make test   installs the same plus the test tools and runs the whole default test suite
# Opt-in suites: make test-ref (torch + transformers), make test-peer (llama-cpp-python, plus torch +
# transformers for the agreement bar), make test-gpu, make test-fuzz (600 mutated GGUF files),
# make test-browser (Debian chromium + playwright: the chat page in a real headless browser).

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
PLUGINS = $(sort $(dir $(wildcard plugins/*/pyproject.toml)))
PROMPT ?= Write one sentence about the sea.

.PHONY: install demo test test-ref test-peer test-gpu test-fuzz test-browser bench clean

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

test-peer: install
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[peer,ref]"
	$(BIN)/python -m pytest -q -m peer

test-gpu: install
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[cuda]"
	$(BIN)/python -m pytest -q -m gpu

test-fuzz: install
	$(BIN)/python -m pytest -q -s -m fuzz tests/test_fuzz.py

test-browser: install
	apt-get update -q && apt-get install -y -q chromium chromium-driver
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[browser]"
	$(BIN)/python -m pytest -q -m browser

bench: install
	$(BIN)/python benchmarks/bench_plugins.py

clean:
	rm -rf $(VENV)

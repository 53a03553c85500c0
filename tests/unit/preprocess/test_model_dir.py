"""Model directories: the shipped demo model, the build script, and HF config variants."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dynamo.preprocess import ModelDir, demo_model_path, load_model_dir, tokenizer_checksum

REPO = Path(__file__).resolve().parents[3]
DEMO_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def load_build_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "build_demo_model", REPO / "scripts" / "build_demo_model.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_model_loads(demo_model: ModelDir) -> None:
    tok = demo_model.tokenizer
    assert demo_model.context_length == 8192
    assert demo_model.vocab_size == tok.vocab_size == 4096
    assert demo_model.bos_token == "<|begin_of_text|>"
    assert demo_model.bos_token_id == tok.token_to_id("<|begin_of_text|>")
    assert demo_model.eos_token == "<|eot_id|>"
    names = ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"]
    assert demo_model.eos_token_ids == tuple(tok.token_to_id(n) for n in names)
    assert demo_model.chat_template is not None
    assert demo_model.tokenizer_checksum.startswith("sha256:")
    text = "Round trip: déjà vu, 北京, 🚀 and code `x = 1`."
    assert tok.decode(tok.encode(text)) == text


def test_demo_model_is_small_and_shipped_as_built() -> None:
    root = demo_model_path()
    assert sorted(p.name for p in root.iterdir()) == sorted(DEMO_FILES)
    assert sum(p.stat().st_size for p in root.iterdir()) < 1_000_000


def test_build_script_is_deterministic_and_matches_shipped_files(tmp_path: Path) -> None:
    load_build_script().write_model(tmp_path)
    for name in DEMO_FILES:
        assert (tmp_path / name).read_bytes() == (demo_model_path() / name).read_bytes(), name


def test_checksum_depends_on_contents_not_location(tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(demo_model_path(), copy)
    assert tokenizer_checksum(copy) == tokenizer_checksum(demo_model_path())
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] += " "
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_checksum(copy) != tokenizer_checksum(demo_model_path())
    (copy / "config.json").write_text("{}")  # config.json does not define the tokenizer
    assert load_model_dir(copy).tokenizer_checksum == tokenizer_checksum(copy)


def make_model(
    root: Path,
    tokenizer_config: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(demo_model_path() / "tokenizer.json", root / "tokenizer.json")
    for name, data in (
        ("tokenizer_config.json", tokenizer_config),
        ("config.json", config),
        ("generation_config.json", generation_config),
    ):
        if data is not None:
            (root / name).write_text(json.dumps(data))
    return root


def test_special_tokens_as_added_token_dicts_and_config_eos(tmp_path: Path) -> None:
    root = make_model(
        tmp_path,
        tokenizer_config={
            "bos_token": {"content": "<|begin_of_text|>", "special": True},
            "eos_token": {"content": "<|end_of_text|>"},
            "unk_token": None,
            "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}",
        },
        config={"max_position_embeddings": 4096, "eos_token_id": 4084, "vocab_size": 5000},
    )
    model = load_model_dir(root)
    assert model.special_tokens == {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
    }
    eos = model.tokenizer.token_to_id("<|end_of_text|>")
    assert model.eos_token_ids == tuple(dict.fromkeys([eos, 4084]))
    assert model.context_length == 4096 and model.vocab_size == 5000
    assert model.chat_template is not None
    assert model.chat_template.render([{"role": "user", "content": "x"}]) == "<|begin_of_text|>x"


def test_generation_config_eos_takes_priority_over_config(tmp_path: Path) -> None:
    root = make_model(
        tmp_path,
        config={"max_position_embeddings": 128, "eos_token_id": 1},
        generation_config={"eos_token_id": [4084, 4085]},
    )
    assert load_model_dir(root).eos_token_ids == (4084, 4085)


def test_chat_template_sources_priority(tmp_path: Path) -> None:
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    root = make_model(
        tmp_path, tokenizer_config={"chat_template": named}, config={"n_positions": 64}
    )
    model = load_model_dir(root)
    assert model.chat_template is not None
    assert model.chat_template.names == ["default", "tool_use"]
    (root / "chat_template.jinja").write_text("J")
    extra = root / "additional_chat_templates"
    extra.mkdir()
    (extra / "tool_use.jinja").write_text("JT")
    model = load_model_dir(root)
    assert model.chat_template is not None
    user = [{"role": "user", "content": "x"}]
    assert model.chat_template.render(user) == "J"
    assert model.chat_template.render(user, tools=[]) == "JT"


def test_context_length_sources(tmp_path: Path) -> None:
    nested = make_model(tmp_path / "a", config={"text_config": {"max_position_embeddings": 32768}})
    assert load_model_dir(nested).context_length == 32768
    from_tokenizer = make_model(tmp_path / "b", tokenizer_config={"model_max_length": 2048})
    assert load_model_dir(from_tokenizer).context_length == 2048
    unset = make_model(tmp_path / "c", tokenizer_config={"model_max_length": 10**30})
    with pytest.raises(ValueError, match="context length"):
        load_model_dir(unset)
    assert load_model_dir(unset, context_length=1000).context_length == 1000
    model = load_model_dir(unset, context_length=1000)
    assert model.chat_template is None and model.eos_token_ids == ()


def test_bad_directories(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_model_dir(tmp_path)
    root = make_model(tmp_path / "m", config={"max_position_embeddings": 10})
    (root / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_dir(root)
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(ValueError, match="does not compile"):
        load_model_dir(root)

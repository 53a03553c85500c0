"""``ModelDir``: what the frontend reads from a Hugging Face style model directory.

``tokenizer.json``; ``tokenizer_config.json`` (chat template, bos/eos and other special tokens);
``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` (which take priority, as in
transformers); ``config.json`` (context length, vocab size); ``generation_config.json`` (EOS ids).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamo.preprocess.chat_template import ChatTemplate
from dynamo.preprocess.tokenizer import Tokenizer

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# config.json keys that hold the context length, most specific first (as vLLM looks them up).
_CONTEXT_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "model_max_length",
)
# Files whose bytes define tokenization and stop behaviour: the tokenizer checksum covers them.
_CHECKSUM_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
_UNSET_MODEL_MAX_LENGTH = 10**12  # transformers writes ~1e30 when a tokenizer has no limit


def demo_model_path() -> Path:
    """The demo model that ships in the package (built by ``scripts/build_demo_model.py``)."""
    return Path(__file__).resolve().parent.parent / "models" / "demo"


@dataclass(frozen=True, slots=True)
class ModelDir:
    """A loaded model directory. Immutable; share one per model."""

    path: Path
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    context_length: int
    vocab_size: int
    tokenizer_checksum: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")


def load_model_dir(path: str | Path, *, context_length: int | None = None) -> ModelDir:
    """Load ``path``. ``context_length`` overrides what ``config.json`` says.

    Raises FileNotFoundError without a ``tokenizer.json``, ValueError for unusable files (bad
    JSON, a template that does not compile, no context length anywhere and none given).
    """
    root = Path(path)
    tokenizer_file = root / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {root}")
    tokenizer = Tokenizer.from_file(tokenizer_file)
    tokenizer_config = _read_json(root / "tokenizer_config.json")
    config = _read_json(root / "config.json")
    generation_config = _read_json(root / "generation_config.json")
    special_tokens = _special_tokens(tokenizer_config, _read_json(root / "special_tokens_map.json"))
    sources = _chat_template_sources(root, tokenizer_config)
    bos = special_tokens.get("bos_token")
    return ModelDir(
        path=root,
        tokenizer=tokenizer,
        chat_template=ChatTemplate(sources, special_tokens) if sources else None,
        context_length=context_length or _context_length(root, config, tokenizer_config),
        vocab_size=max(_int(config.get("vocab_size")) or 0, tokenizer.vocab_size),
        tokenizer_checksum=tokenizer_checksum(root),
        special_tokens=special_tokens,
        eos_token_ids=_eos_token_ids(tokenizer, special_tokens, config, generation_config),
        bos_token_id=tokenizer.token_to_id(bos) if bos else None,
    )


def _tokenizer_files(root: Path) -> list[str]:
    names = [name for name in _CHECKSUM_FILES if (root / name).is_file()]
    extra = root / "additional_chat_templates"
    if extra.is_dir():
        names += sorted(f"{extra.name}/{p.name}" for p in extra.glob("*.jinja"))
    return names


def pipeline_files(path: str | Path) -> list[str]:
    """The files (relative names) :func:`load_model_dir` reads: what a frontend on another host
    needs from the worker's model directory (never the weights)."""
    root = Path(path)
    extra = [name for name in ("config.json",) if (root / name).is_file()]
    return _tokenizer_files(root) + extra


def tokenizer_checksum(path: str | Path) -> str:
    """``sha256:<hex>`` over the tokenizer-defining files present in ``path`` (name + bytes).

    Two directories with identical tokenizer files give the same checksum wherever they live.
    """
    root = Path(path)
    digest = hashlib.sha256()
    for name in _tokenizer_files(root):
        data = (root / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return f"sha256:{digest.hexdigest()}"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special_tokens(
    tokenizer_config: dict[str, Any], special_map: dict[str, Any]
) -> dict[str, str]:
    tokens: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        content = _token_content(tokenizer_config.get(name))
        if content is None:
            content = _token_content(special_map.get(name))
        if content is not None:
            tokens[name] = content
    return tokens


def _chat_template_sources(root: Path, tokenizer_config: dict[str, Any]) -> dict[str, str]:
    sources: dict[str, str] = {}
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        sources["default"] = jinja_file.read_text(encoding="utf-8")
    extra = root / "additional_chat_templates"
    if extra.is_dir():
        for template_file in sorted(extra.glob("*.jinja")):
            sources[template_file.stem] = template_file.read_text(encoding="utf-8")
    if sources:
        return sources  # separate template files take priority over tokenizer_config
    template = tokenizer_config.get("chat_template")
    if isinstance(template, str):
        return {"default": template}
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        for item in template:
            if isinstance(item, dict) and isinstance(item.get("template"), str):
                sources[str(item.get("name", "default"))] = item["template"]
    return sources


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _context_length(root: Path, config: dict[str, Any], tokenizer_config: dict[str, Any]) -> int:
    for section in (config, config.get("text_config") or {}):
        for key in _CONTEXT_LENGTH_KEYS:
            value = _int(section.get(key))
            if value is not None and value > 0:
                return value
    value = _int(tokenizer_config.get("model_max_length"))
    if value is not None and 0 < value < _UNSET_MODEL_MAX_LENGTH:
        return value
    raise ValueError(f"cannot find the context length of {root}; pass one explicitly")


def _ids(value: Any) -> list[int]:
    if isinstance(value, list):
        return [v for v in value if _int(v) is not None]
    single = _int(value)
    return [] if single is None else [single]


def _eos_token_ids(
    tokenizer: Tokenizer,
    special_tokens: dict[str, str],
    config: dict[str, Any],
    generation_config: dict[str, Any],
) -> tuple[int, ...]:
    """The tokenizer's eos token, then generation_config's eos ids (config.json's if absent)."""
    ids: list[int] = []
    eos = special_tokens.get("eos_token")
    eos_id = tokenizer.token_to_id(eos) if eos else None
    if eos_id is not None:
        ids.append(eos_id)
    source = generation_config if "eos_token_id" in generation_config else config
    ids += _ids(source.get("eos_token_id"))
    return tuple(dict.fromkeys(ids))

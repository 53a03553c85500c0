"""Tiny random Hugging Face models built at test time: a BPE tokenizer trained on a little text
(with the demo model's chat template) and random weights (``initializer_range`` 0.2, so greedy
choices are far from ties), saved with ``save_pretrained``. Each architecture is built once per
test session (``build``).

``DYN_TEST_DEVICE=cuda`` runs the PyTorch engine's tests and transformers' reference outputs on
the GPU (``TEST_DEVICE``; CPU otherwise): the GPU check (``scripts/gpu_check.sh``) does that."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from dynamo.preprocess import demo_model_path

SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
TEST_DEVICE = os.environ.get("DYN_TEST_DEVICE", "cpu")
"""Where the engine under test and transformers' reference run: ``cpu`` or ``cuda``."""
ARCHS = ("llama", "llama31", "mistral", "qwen2", "qwen3", "llama_hd64")
_built: dict[str, Path] = {}

_TEXT = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "A serving framework schedules requests, caches key and value blocks, and streams tokens.",
    "Paged attention reads each sequence's blocks through its block table.",
    "Prefix caching lets a second request reuse the blocks of the first one.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
    "Questions and answers: what is the capital of France? Paris is the capital of France.",
] * 20


def _train_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TEXT, trainer)
    tok.save(str(out / "tokenizer.json"))
    demo = json.loads((demo_model_path() / "tokenizer_config.json").read_text())
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": demo["chat_template"],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 512,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return int(tok.get_vocab_size())


def _config(arch: str, vocab: int, eos: int, bos: int) -> object:
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        rms_norm_eps=1e-6,
        eos_token_id=eos,
        bos_token_id=bos,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "llama_hd64":  # head_dim 64: what vLLM's CPU attention kernels support
        return transformers.LlamaConfig(**{**common, "hidden_size": 256, "intermediate_size": 256})
    if arch == "llama31":  # Llama 3.1's rotary scaling, with a short original context
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return transformers.LlamaConfig(rope_parameters=rope, **common)
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=None, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=32, **common)  # head_dim != hidden / heads
    raise ValueError(arch)


def build(arch: str, root: Path) -> Path:
    """The model directory of ``arch`` (built under ``root`` the first time)."""
    if arch in _built and _built[arch].is_dir():
        return _built[arch]
    import torch
    import transformers

    out = root / f"tiny-{arch}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    vocab = _train_tokenizer(out)
    tok = json.loads((out / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    config = _config(arch, vocab, ids["<|eot_id|>"], ids["<|begin_of_text|>"])
    seeds = {"llama": 1, "qwen2": 2, "qwen3": 3, "mistral": 4, "llama31": 5, "llama_hd64": 6}
    torch.manual_seed(seeds[arch])
    model = transformers.AutoModelForCausalLM.from_config(config)
    if arch == "qwen2":  # biases start at zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.2)
    if arch == "qwen3":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.2)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.2)
    model.save_pretrained(out)
    _built[arch] = out
    return out


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' ``generate`` (greedy, fp32) on the model: the reference output ids."""
    import torch
    import transformers

    model = _hf_models.get(model_dir)
    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = model.to(TEST_DEVICE)
        model.eval()
        model.generation_config.eos_token_id = None  # compare fixed lengths (ignore_eos)
        _hf_models[model_dir] = model
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=TEST_DEVICE),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


_hf_models: dict[Path, object] = {}


def hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> list[float]:
    """transformers' log-probability of each prompt token after the first."""
    import torch

    hf_greedy(model_dir, prompt[:1], 1)  # loads and caches the model
    model = _hf_models[model_dir]
    with torch.no_grad():
        ids = torch.tensor([prompt], device=TEST_DEVICE)
        logits = model(ids).logits[0, :-1].float().cpu()  # type: ignore[operator]
    lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(prompt[1:]).unsqueeze(1))
    return [float(v) for v in lp.squeeze(1)]

"""MockerConfig: reference defaults, flags with DYN_* twins, validation."""

from __future__ import annotations

import argparse

import pytest

from dynamo.mocker.config import MockerConfig


def parse(argv: list[str]) -> MockerConfig:
    parser = argparse.ArgumentParser()
    MockerConfig.add_arguments(parser)
    return MockerConfig.from_args(parser.parse_args(argv))


def test_defaults_match_the_reference() -> None:
    c = parse([])
    assert (c.num_gpu_blocks, c.block_size, c.max_num_seqs, c.max_num_batched_tokens) == (
        16384,
        64,
        256,
        8192,
    )
    assert c.enable_prefix_caching and c.enable_chunked_prefill
    assert (c.preemption_mode, c.speedup_ratio, c.decode_speedup_ratio) == ("lifo", 1.0, 1.0)
    assert (c.data_parallel_size, c.num_workers, c.startup_time) == (1, 1, None)
    assert (c.disaggregation_mode, c.kv_transfer_bandwidth, c.kv_bytes_per_token) == (
        "agg",
        64.0,
        None,
    )
    assert c == MockerConfig()


def test_flags_and_env_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_BLOCK_SIZE", "16")
    monkeypatch.setenv("DYN_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("DYN_SPEEDUP_RATIO", "0")
    c = parse(
        [
            "--num-gpu-blocks-override",
            "100",
            "--no-enable-chunked-prefill",
            "--disaggregation-mode",
            "decode",
            "--kv-bytes-per-token",
            "131072",
            "--model-path",
            "/models/x",
            "--block-size",
            "32",  # the flag beats its environment twin
        ]
    )
    assert (c.num_gpu_blocks, c.block_size, c.speedup_ratio) == (100, 32, 0.0)
    assert not c.enable_prefix_caching and not c.enable_chunked_prefill
    assert (c.disaggregation_mode, c.kv_bytes_per_token) == ("decode", 131072)
    assert c.served_model_name == "/models/x"
    assert c.endpoint_for("ns") == "dyn://ns.backend.generate"
    assert parse(["--disaggregation-mode", "prefill"]).endpoint_for("ns") == (
        "dyn://ns.prefill.generate"
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"block_size": 0},
        {"num_gpu_blocks": -1},
        {"preemption_mode": "random"},
        {"disaggregation_mode": "both"},
        {"speedup_ratio": -1.0},
        {"decode_speedup_ratio": 0.0},
        {"kv_transfer_bandwidth": -5.0},
        {"context_length": 0},
        {"vocab_size": 2, "special_token_ids": frozenset({0, 1})},
    ],
)
def test_validation(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        MockerConfig(**bad)  # type: ignore[arg-type]


def test_bad_choice_fails_at_parse_time() -> None:
    with pytest.raises(SystemExit):
        parse(["--preemption-mode", "random"])

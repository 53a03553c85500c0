"""`dynamo serve` validates every flag before starting anything and passes each to its process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dynamo import serve
from dynamo.serve_args import build_parser, plan


@pytest.fixture
def no_children(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a child process was started")

    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus", "1"], "unrecognized arguments: --bogus 1"),
        (["--max-inflight", "8"], "unrecognized arguments"),  # no abbreviations
        (["--block-size", "0"], "block_size must be positive"),
        (["--max-inflight-requests", "0"], "at least 1"),
        (["--overload-status", "500"], "invalid choice"),
        (["--speedup-ratio", "fast"], "invalid float value"),
        (["--workers", "0"], "--workers must be at least 1"),
        (["--model-path", "/nonexistent/model"], "no tokenizer.json"),
        (["--system-port", "9100", "--workers", "2"], "same port for all 2 workers"),
        (["--in-process", "--system-port", "9100", "--workers", "2"], "same port for all 2"),
        (["--discovery-backend", "memory"], "invalid choice"),  # file or etcd only
        (["--request-plane", "local"], "unrecognized arguments"),  # serve wires the planes
    ],
)
def test_bad_flags_fail_before_anything_starts(
    no_children: None, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        serve.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr()
    assert message in err.err
    assert "dynamo serve: model" not in err.out  # no banner


def test_each_flag_goes_to_its_process() -> None:
    p = plan(
        ["--max-inflight-requests", "8", "--speedup-ratio", "2", "--log-level", "DEBUG"]
        + ["--no-router-kv-events", "--no-enable-prefix-caching", "--http-port", "0"]
        + ["--router-mode", "kv", "--model-name", "m", "--overload-status", "503"]
    )
    assert "--max-inflight-requests=8" in p.frontend_argv
    assert "--no-router-kv-events" in p.frontend_argv
    assert "--router-mode=kv" in p.frontend_argv and "--http-port=0" in p.frontend_argv
    assert "--speedup-ratio=2.0" in p.engine_argv
    assert "--no-enable-prefix-caching" in p.engine_argv and "--model-name=m" in p.engine_argv
    assert "--log-level=DEBUG" in p.frontend_argv and "--log-level=DEBUG" in p.engine_argv
    assert not any("inflight" in a or "router" in a for a in p.engine_argv)
    assert not any("speedup" in a or "prefix" in a for a in p.frontend_argv)
    # The configs the children will build from those argvs.
    assert (p.frontend.max_inflight, p.frontend.overload_status) == (8, 503)
    assert p.frontend.kv.use_kv_events is False and p.frontend.router_mode == "kv"
    assert p.engine_config.speedup_ratio == 2.0 and p.engine_config.enable_prefix_caching is False
    # Flags not given are not passed (the children read the same DYN_* environment).
    assert not any(a.startswith("--block-size") for a in p.engine_argv)


def test_serve_flags_have_env_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_SERVE_WORKERS", "3")
    assert plan([]).args.workers == 3


def test_help_groups_flags_by_process() -> None:
    text = build_parser().format_help()
    sections = {
        title: text.index(title)
        for title in (
            "dynamo serve:",
            "frontend and workers (passed to every process):",
            "frontend (passed to the frontend process):",
            "workers (passed to every worker process):",
        )
    }
    order = sorted(sections.values())
    frontend_at = sections["frontend (passed to the frontend process):"]
    workers_at = sections["workers (passed to every worker process):"]

    def section_of(flag: str) -> int:
        at = text.index(f"\n  {flag}")
        return max(s for s in order if s < at)

    assert section_of("--max-inflight-requests") == frontend_at
    assert section_of("--speedup-ratio") == workers_at
    assert section_of("--workers") == sections["dynamo serve:"]


def test_serve_help_from_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from dynamo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    assert "workers (passed to every worker process)" in capsys.readouterr().out
    assert sys.modules["dynamo.serve"] is serve


def test_rendered_flags_parse_back_to_the_same_values() -> None:
    import argparse

    from dynamo.serve_args import _render

    p = argparse.ArgumentParser()
    actions = [
        (p.add_argument("--tag", action="append"), ["u", "v"]),
        (p.add_argument("--pair", nargs=2), ["1", "2"]),
        (p.add_argument("--x", type=float), -1.5),  # a negative number stays a value
        (p.add_argument("--flag", action=argparse.BooleanOptionalAction), False),
        (p.add_argument("--on", action="store_true"), True),
    ]
    argv = [tok for action, value in actions for tok in _render(action, value)]
    parsed = vars(p.parse_args(argv))
    assert parsed == {a.dest: v for a, v in actions}


def test_prefill_and_decode_workers_get_their_role() -> None:
    p = plan(["--prefill-workers", "1", "--decode-workers", "2", "--speedup-ratio", "0"])
    assert p.roles == ("prefill", "decode", "decode")
    assert "--disaggregation-mode=prefill" in p.worker_argv("prefill")
    assert "--speedup-ratio=0.0" in p.worker_argv("decode")
    assert p.worker_config("decode").disaggregation_mode == "decode"
    assert plan([]).roles == ("agg", "agg")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill-workers", "1"], "--prefill-workers needs --decode-workers"),
        (["--decode-workers", "-1"], "must be >= 0"),
        (["--disaggregation-mode", "prefill"], "unrecognized arguments"),  # serve sets roles
    ],
)
def test_bad_disaggregation_flags(
    no_children: None, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit):
        serve.main(argv)
    assert message in capsys.readouterr().err


def test_engine_pytorch_takes_the_pytorch_flags(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from dynamo.pytorch.config import TorchEngineConfig
    from tests.tiny_models import build

    model = build("llama", tmp_path)
    p = plan(
        ["--engine", "pytorch", "--model-path", str(model), "--kv-cache-memory", "16MiB"]
        + ["--dtype", "bfloat16", "--router-mode", "kv", "--workers", "1"]
    )
    assert p.worker_module == "dynamo.pytorch" and p.roles == ("agg",)
    argv = p.worker_argv("agg")
    assert "--kv-cache-memory=16777216" in argv and "--dtype=bfloat16" in argv
    assert "--disaggregation-mode=agg" in argv
    assert "--disaggregation-mode=decode" in p.worker_argv("decode")  # roles: like the mocker
    assert p.worker_config("prefill").disaggregation_mode == "prefill"
    config = p.worker_config("agg")
    assert isinstance(config, TorchEngineConfig) and config.kv_cache_memory == 16 << 20
    assert p.frontend.router_mode == "kv"
    assert "--engine" in build_parser("pytorch").format_help()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine", "pytorch"], "--engine pytorch needs --model-path"),
        (["--engine", "pytorch", "--speedup-ratio", "2"], "unrecognized arguments"),
        (["--engine", "vllm-ish"], "invalid choice"),
        (["--engine", "pytorch", "--model-path", "dynamo/models/demo"], "or *.bin weights"),
        (["--engine", "pytorch", "--decode-workers", "-1"], "must be >= 0"),
    ],
)
def test_bad_engine_flags_fail_before_anything_starts(
    no_children: None, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    pytest.importorskip("torch")
    with pytest.raises(SystemExit) as exit_info:
        serve.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_in_process_serving_gets_the_worker_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_HEALTH_CHECK_ENABLED", raising=False)
    monkeypatch.setenv("DYN_STRICT_STREAM_VALIDATION", "1")
    options = plan(
        ["--in-process", "--health-check-enabled", "--canary-wait-time=2"]
    ).worker_options
    assert options.strict_validation is True
    assert options.health_check.enabled is True and options.health_check.canary_wait_s == 2.0

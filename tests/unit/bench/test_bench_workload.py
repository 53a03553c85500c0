"""Workload shapes of dynamo bench: exact prompt lengths with the demo tokenizer and chat
template, shared prefixes, multi-turn growth, Mooncake trace parsing and prefix reproduction."""

from __future__ import annotations

import json
import random
from array import array
from pathlib import Path
from typing import Any

import pytest

from dynamo.bench.prompts import PromptBuilder
from dynamo.bench.request import RequestRecord, RequestSpec
from dynamo.bench.trace import TraceError, TraceWorkload, load_trace
from dynamo.bench.workload import (
    MultiTurnWorkload,
    PrefixWorkload,
    SyntheticWorkload,
    spec_from_fit,
)
from dynamo.preprocess import ModelDir, demo_model_path, load_model_dir

FORMS = [("chat", "ids"), ("completions", "ids"), ("completions", "text")]


@pytest.fixture(scope="module")
def model() -> ModelDir:
    return load_model_dir(demo_model_path())


@pytest.fixture(scope="module")
def builders(model: ModelDir) -> dict[tuple[str, str], PromptBuilder]:
    return {form: PromptBuilder(model, api=form[0], prompt_format=form[1]) for form in FORMS}


def server_tokens(builder: PromptBuilder, spec: RequestSpec) -> list[int]:
    """The token ids the frontend computes for this request (same tokenizer and template)."""
    if spec.messages is not None:
        return builder.encode(builder.render_chat(spec.messages))
    if isinstance(spec.prompt, list):
        return list(spec.prompt)
    assert isinstance(spec.prompt, str)
    return builder._tok.encode(spec.prompt, add_special_tokens=True)


def first_specs(workload: object, n: int) -> list[RequestSpec]:
    specs = []
    for session, _ in zip(workload.sessions(), range(n), strict=False):  # type: ignore[attr-defined]
        spec = session.next(None)
        assert spec is not None
        specs.append(spec)
    return specs


@pytest.mark.parametrize("form", FORMS)
def test_synthetic_prompts_have_exact_lengths(
    builders: dict[tuple[str, str], PromptBuilder], form: tuple[str, str]
) -> None:
    builder = builders[form]
    workload = SyntheticWorkload(builder, isl=100, osl=7, isl_stddev=40, seed=3)
    specs = first_specs(workload, 40)
    lengths = {spec.expected_prompt_tokens for spec in specs}
    assert len(lengths) > 10  # the spread is real
    for spec in specs:
        assert len(server_tokens(builder, spec)) == spec.expected_prompt_tokens
        assert spec.max_tokens == 7
    assert form[0] != "chat" or all(s.messages and s.messages[0]["role"] == "user" for s in specs)


@pytest.mark.parametrize("total", [28, 29, 64, 128, 1000, 3000])
def test_chat_lengths_include_the_template_overhead(
    builders: dict[tuple[str, str], PromptBuilder], total: int
) -> None:
    builder = builders[("chat", "ids")]
    assert builder.overhead == 27  # BOS, system header + default system prompt, user, assistant
    rng = random.Random(total)
    for _ in range(5):
        _, messages, _ = builder.fit([], total, rng)
        assert messages is not None
        assert builder.count_chat(messages) == total


def test_lengths_below_the_overhead_are_refused(
    builders: dict[tuple[str, str], PromptBuilder],
) -> None:
    with pytest.raises(ValueError, match="below this prompt form's minimum of 27"):
        builders[("chat", "ids")].fit([], 20, random.Random(0))
    with pytest.raises(ValueError, match="below"):
        SyntheticWorkload(builders[("chat", "ids")], isl=10, osl=1)
    assert builders[("completions", "ids")].fit([], 1, random.Random(0))[2] is not None


@pytest.mark.parametrize("form", FORMS)
def test_prefix_groups_share_exactly_their_prefix(
    builders: dict[tuple[str, str], PromptBuilder], form: tuple[str, str]
) -> None:
    builder = builders[form]
    workload = PrefixWorkload(builder, groups=3, prefix_len=96, suffix_len=40, osl=4, seed=1)
    specs = first_specs(workload, 12)
    tokens = [server_tokens(builder, spec) for spec in specs]
    groups = [spec.group for spec in specs]
    assert set(groups) == {0, 1, 2}, "every group is used"
    assert groups != [i % 3 for i in range(12)], "groups are drawn at random, not cycled"
    again = [
        spec.group
        for spec in first_specs(
            PrefixWorkload(builder, groups=3, prefix_len=96, suffix_len=40, osl=4, seed=1), 12
        )
    ]
    assert again == groups, "the draw is seeded"
    for spec, ids in zip(specs, tokens, strict=True):
        assert len(ids) == spec.expected_prompt_tokens == 136
    for i in range(12):
        for j in range(i + 1, 12):
            shared = _common_prefix(tokens[i], tokens[j])
            if specs[i].group == specs[j].group:
                assert 96 <= shared < 136
            else:
                assert shared < 96


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("groups", [1, 3, 16, 17])
def test_prefix_requests_are_randrange_groups_and_fit_prompts(
    builders: dict[tuple[str, str], PromptBuilder], form: tuple[str, str], groups: int
) -> None:
    """The sessions' inlined draws are ``pick.randrange(groups)`` and ``spec_from_fit`` of the
    group's words, request for request (the replay's results depend on both)."""
    builder = builders[form]
    workload = PrefixWorkload(builder, groups=groups, prefix_len=40, suffix_len=9, osl=3, seed=5)
    rng, pick = random.Random(5), random.Random(5 ^ 0x6A0)
    for index, spec in enumerate(first_specs(workload, 40)):
        group = pick.randrange(groups)
        want = spec_from_fit(
            builder, workload.prefixes[group], 49, 3, rng, session=index, group=group
        )
        assert spec == want


def test_packed_prefix_prompts_are_the_same_ids(
    builders: dict[tuple[str, str], PromptBuilder],
) -> None:
    builder = builders[("completions", "ids")]
    kw: dict[str, Any] = {"groups": 4, "prefix_len": 40, "suffix_len": 9, "osl": 3, "seed": 2}
    plain = first_specs(PrefixWorkload(builder, **kw), 30)
    packed = first_specs(PrefixWorkload(builder, packed=True, **kw), 30)
    for a, b in zip(plain, packed, strict=True):
        assert isinstance(b.prompt, array) and b.prompt.typecode == "I"
        assert b.prompt.tolist() == a.prompt
        b.prompt = a.prompt
        assert a == b


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _record(spec: RequestSpec, text: str, ok: bool = True) -> RequestRecord:
    record = RequestRecord(start=0.0, max_tokens=spec.max_tokens, expected_prompt_tokens=0)
    record.text = text
    if not ok:
        record.error = "http_503"
    return record


@pytest.mark.parametrize("form", FORMS)
def test_multi_turn_sessions_extend_the_conversation(
    builders: dict[tuple[str, str], PromptBuilder], form: tuple[str, str]
) -> None:
    builder = builders[form]
    workload = MultiTurnWorkload(builder, turns=3, isl=40, osl=5, seed=2)
    session = next(iter(workload.sessions()))
    first = session.next(None)
    assert first is not None and first.turn == 1
    assert len(server_tokens(builder, first)) == first.expected_prompt_tokens == 40
    answer = " alpha beta gamma"
    second = session.next(_record(first, answer))
    assert second is not None and second.turn == 2
    ids_1, ids_2 = server_tokens(builder, first), server_tokens(builder, second)
    assert len(ids_2) == second.expected_prompt_tokens
    assert second.expected_prompt_tokens >= 40 + 40
    if form[0] == "chat":
        assert second.messages is not None
        assert [m["role"] for m in second.messages] == ["user", "assistant", "user"]
        assert second.messages[1]["content"] == answer
        assert second.messages[0] == first.messages[0]  # type: ignore[index]
    else:
        assert _common_prefix(ids_1, ids_2) >= len(ids_1) - 1
    third = session.next(_record(second, "done"))
    assert third is not None and third.turn == 3
    assert session.next(_record(third, "x")) is None  # three turns


def test_a_failed_turn_ends_the_session(builders: dict[tuple[str, str], PromptBuilder]) -> None:
    workload = MultiTurnWorkload(builders[("chat", "ids")], turns=5, isl=40, osl=5)
    session = next(iter(workload.sessions()))
    first = session.next(None)
    assert first is not None
    assert session.next(_record(first, "", ok=False)) is None


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_trace_replay_reproduces_prefix_sharing(
    tmp_path: Path, builders: dict[tuple[str, str], PromptBuilder]
) -> None:
    rows: list[dict[str, object]] = [
        {"timestamp": 1000, "input_length": 40, "output_length": 3, "hash_ids": [1, 2, 3]},
        {"timestamp": 0, "input_length": 50, "output_length": 4, "hash_ids": [1, 2, 9, 10]},
        {"timestamp": 500, "input_length": 70, "output_length": 5, "hash_ids": [7]},
    ]
    entries = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    assert [e.timestamp_ms for e in entries] == [0, 500, 1000]  # ordered by time
    builder = builders[("completions", "ids")]
    workload = TraceWorkload(builder, entries, block_size=16, speedup=2.0)
    sessions = list(workload.sessions())
    assert [s.arrival for s in sessions] == [0.0, 0.25, 0.5]
    specs = [s.next(None) for s in sessions]
    a, b, c = (server_tokens(builder, spec) for spec in specs if spec is not None)
    assert [len(a), len(b), len(c)] == [50, 70, 40]
    assert a[:32] == c[:32] and a[32:48] != c[32:48]  # hash ids 1, 2 shared, then 9 vs 3
    assert b[:16] == workload.block(7)  # 70 > 1 block: the rest is unique filler
    assert workload.block(1) == TraceWorkload(builder, entries, block_size=16).block(1)
    assert workload.duration_s == 0.5


def test_trace_replay_in_chat_keeps_exact_lengths(
    tmp_path: Path, builders: dict[tuple[str, str], PromptBuilder]
) -> None:
    rows: list[dict[str, object]] = [
        {"timestamp": t, "input_length": 60 + t, "output_length": 2, "hash_ids": [1, 2, t]}
        for t in range(5)
    ]
    builder = builders[("chat", "ids")]
    workload = TraceWorkload(builder, load_trace(write_trace(tmp_path / "t.jsonl", rows)))
    tokens = []
    for session in workload.sessions():
        spec = session.next(None)
        assert spec is not None
        tokens.append(server_tokens(builder, spec))
        assert len(tokens[-1]) == spec.expected_prompt_tokens
    assert all(_common_prefix(tokens[0], t) >= 50 for t in tokens[1:])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"timestamp": 0, "output_length": 3, "hash_ids": []}',
         "line 2: missing field 'input_length'"),
        ('{"timestamp": 0, "input_length": 3, "output_length": 3}',
         "line 2: missing field 'hash_ids'"),
        ('{"input_length": 3, "output_length": 3, "hash_ids": []}',
         "line 2: missing field 'timestamp'"),
        ('{"timestamp": 0, "input_length": "3", "output_length": 3, "hash_ids": []}',
         "line 2: field 'input_length' must be an integer >= 1"),
        ('{"timestamp": 0, "input_length": 3, "output_length": 3, "hash_ids": [1.5]}',
         "line 2: field 'hash_ids' must be a list"),
        ("[1, 2]", "line 2: expected a JSON object"),
        ("{oops", "line 2: not valid JSON"),
    ],
)  # fmt: skip
def test_bad_trace_lines_name_the_line_and_field(tmp_path: Path, line: str, message: str) -> None:
    good = '{"timestamp": 0, "input_length": 3, "output_length": 3, "hash_ids": [1]}'
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(TraceError, match=message.replace("[", r"\[")) as info:
        load_trace(path)
    assert str(path) in str(info.value)


def test_empty_or_missing_traces_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TraceError, match="has no requests"):
        load_trace(tmp_path / "empty.jsonl")
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")


def test_trace_inputs_below_the_chat_overhead_are_refused(
    tmp_path: Path, builders: dict[tuple[str, str], PromptBuilder]
) -> None:
    row = {"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}
    entries = load_trace(write_trace(tmp_path / "t.jsonl", [row]))
    with pytest.raises(TraceError, match="line 1: input_length 5 is below"):
        TraceWorkload(builders[("chat", "ids")], entries)
    TraceWorkload(builders[("completions", "ids")], entries)  # token ids: any length works

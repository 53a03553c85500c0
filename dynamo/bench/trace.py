"""Mooncake-format trace replay.

A trace is JSONL, one request per line: ``timestamp`` (ms since the trace began),
``input_length`` and ``output_length`` (tokens), and ``hash_ids`` (one id per block of
``block_size`` input tokens; equal ids mean equal token blocks, which is how a trace records
prefix sharing). Each hash id maps deterministically (seeded by the id) to a block of words,
so requests that share leading hash ids share that many leading blocks of tokens. Input
beyond ``len(hash_ids) * block_size`` is filled with tokens unique to the request.
Requests start at ``timestamp / speedup``.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec

from dynamo.bench.draw import choices
from dynamo.bench.prompts import PromptBuilder
from dynamo.bench.workload import Session, SingleRequest, spec_from_fit

REQUIRED_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_BLOCK_CACHE = 4096


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file, line and field."""


@dataclass(frozen=True, slots=True)
class TraceEntry:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_entry(raw: bytes, where: str, line: int) -> TraceEntry:
    """One JSONL line; raises TraceError naming ``where`` (``FILE line N``) and the field."""
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object")
    for name in REQUIRED_FIELDS:
        if name not in obj:
            raise TraceError(f"{where}: missing field {name!r}")
    timestamp = obj["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or timestamp < 0:
        raise TraceError(f"{where}: field 'timestamp' must be a number >= 0 (milliseconds)")
    for name in ("input_length", "output_length"):
        if not _is_int(obj[name]) or obj[name] < 1:
            raise TraceError(f"{where}: field {name!r} must be an integer >= 1")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of integers >= 0")
    return TraceEntry(
        float(timestamp), obj["input_length"], obj["output_length"], tuple(hash_ids), line
    )


def load_trace(path: str | Path) -> list[TraceEntry]:
    """All entries of a Mooncake JSONL file, ordered by timestamp (blank lines skipped)."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise TraceError(f"cannot read trace {file}: {exc.strerror or exc}") from None
    entries: list[TraceEntry] = []
    for number, raw in enumerate(data.splitlines(), start=1):
        if raw.strip():
            entries.append(parse_entry(raw, f"{file} line {number}", number))
    if not entries:
        raise TraceError(f"trace {file} has no requests")
    entries.sort(key=lambda entry: entry.timestamp_ms)
    return entries


class TraceWorkload:
    """Replays ``entries`` (see the module docstring). ``speedup`` > 1 compresses time."""

    name = "trace"
    collect_text = False

    def __init__(
        self,
        builder: PromptBuilder,
        entries: list[TraceEntry],
        *,
        block_size: int = 512,
        speedup: float = 1.0,
        seed: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError("the trace block size must be at least 1")
        if not speedup > 0:
            raise ValueError("the trace speedup must be > 0")
        minimum = max(1, builder.overhead)
        for entry in entries:
            if entry.input_length < minimum:
                raise TraceError(
                    f"trace line {entry.line}: input_length {entry.input_length} is below the "
                    f"prompt's minimum of {minimum} tokens (chat template); use --api completions"
                )
        self._builder = builder
        self.entries = entries
        self._block_size = block_size
        self._speedup = speedup
        self._seed = seed
        self._blocks: OrderedDict[int, list[int]] = OrderedDict()

    def block(self, hash_id: int) -> list[int]:
        """The words of one hash id's block: the same ids for the same hash id, always."""
        words = self._blocks.get(hash_id)
        if words is None:
            rng = random.Random(hash_id * 1_000_003 + self._seed)
            words = choices(rng, self._builder.words, self._block_size)
            self._blocks[hash_id] = words
            if len(self._blocks) > _BLOCK_CACHE:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(hash_id)
        return words

    @property
    def duration_s(self) -> float:
        """The replay's length (last arrival), after the speedup."""
        return (self.entries[-1].timestamp_ms - self.entries[0].timestamp_ms) / 1000 / self._speedup

    def sessions(self) -> Iterator[Session]:
        rng = random.Random(self._seed)
        builder = self._builder
        start = self.entries[0].timestamp_ms
        for index, entry in enumerate(self.entries):
            content = entry.input_length - builder.overhead
            words: list[int] = []
            for hash_id in entry.hash_ids:
                if len(words) >= content:
                    break
                words += self.block(hash_id)
            spec = spec_from_fit(
                builder,
                words[:content],
                entry.input_length,
                entry.output_length,
                rng,
                session=index,
            )
            arrival = (entry.timestamp_ms - start) / 1000 / self._speedup
            yield SingleRequest(spec, arrival=arrival)

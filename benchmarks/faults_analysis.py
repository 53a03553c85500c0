"""The fault benchmark's analysis (``benchmarks/faults.py``): the processes' JSONL log lines
parsed into migrations and the parts of their gap, the timing model's floor for the workload
(a Monte Carlo of the engine alone) and the percentiles the report quotes."""

from __future__ import annotations

import datetime
import json
import random
import statistics
from collections import defaultdict
from dataclasses import dataclass

from launcher import Child

from dynamo.mocker.config import MockerConfig
from dynamo.mocker.timing import decode_ms, prefill_ms


@dataclass
class Migration:
    """One migration as the frontend logged it, and the new attempt's first token."""

    request_id: str
    kind: str
    at: float
    first_token: dict[str, float] | None = None  # the new worker's debug line, parsed


def log_records(lines: list[str]) -> list[dict[str, object]]:
    out = []
    for line in lines:
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            when = datetime.datetime.fromisoformat(rec["time"].replace("Z", "+00:00"))
            rec["t"] = when.timestamp()
            out.append(rec)
    return out


def find_migrations(
    frontend: list[str], workers: list[list[str]]
) -> tuple[list[Migration], int, dict[str, float]]:
    """The frontend's migrations, each with the first-token line of its continuation, the
    median prompt length of the requests (their first attempts), and when each request's first
    attempt made its first token (its worker's line; the baseline of the ``return`` part)."""
    found: list[Migration] = []
    for rec in log_records(frontend):
        msg = str(rec["message"])
        if msg.startswith("migrating request "):
            rid = msg.split()[2].split("-")[0]
            kind = msg.split("(", 1)[1].split(",", 1)[0]
            found.append(Migration(rid, kind, float(str(rec["t"]))))
    firsts: dict[str, list[tuple[float, dict[str, float]]]] = defaultdict(list)
    for lines in workers:
        for rec in log_records(lines):
            msg = str(rec["message"])
            if msg.startswith("first token of "):
                rid = msg.split()[3].split("-")[0]
                fields = {k: float(v) for k, v in (kv.split("=") for kv in msg.split()[4:])}
                firsts[rid].append((float(str(rec["t"])), fields))
    for m in found:
        after = sorted((f for f in firsts.get(m.request_id, []) if f[0] > m.at), key=lambda f: f[0])
        if after:
            m.first_token = {"t": after[0][0], **after[0][1]}
    isls = [min(f["prompt_tokens"] for _, f in v) for v in firsts.values()]
    first_made = {rid: min(t for t, _ in v) for rid, v in firsts.items()}
    return found, round(statistics.median(isls)) if isls else 0, first_made


def prefill_pass_at(victim: Child, t: float) -> float:
    """Seconds of the prefill pass the killed worker was running at ``t`` (0: none); its
    ``prefill pass:`` debug lines say when each such pass started and would have ended."""
    passes = [rec for rec in log_records(victim.lines) if rec["t"] <= t]  # type: ignore[operator]
    for rec in reversed(passes):
        msg = str(rec["message"])
        if msg.startswith("prefill pass: "):
            fields = {k: float(v) for k, v in (kv.split("=") for kv in msg.split()[2:])}
            ends = float(str(rec["t"])) + fields["ends_in_ms"] / 1000
            return fields["pass_ms"] / 1000 if ends > t else 0.0
    return 0.0


def model_floor(
    isl: int, osl: int, workers: int, concurrency: int, trials: int = 20000
) -> dict[str, list[float]]:
    """(p50, p99) ms of the added gap the timing model alone gives (FACTS §6.4, the mocker's
    default pool; no CPU, no transport): a Monte Carlo of one kill. Each worker decodes
    ``concurrency / workers`` streams (D per pass) and prefills the closed loop's new arrivals
    (P(isl) + D passes); the killed worker's streams, ``isl`` + U(0, osl) tokens long, are
    spread evenly over the survivors (``spread``), or over the survivors not in a new request's
    prefill pass when there is one (``avoid_prefill``: the frontend's continuation placement);
    a survivor batches the ones it gets into one prefill pass after its pass in progress; the
    pass the killed worker was running is lost (stall), and its streams' next token was due at
    its end (as the measured figure counts it)."""
    rng = random.Random(0)
    k = max(1, concurrency // workers)
    total = MockerConfig().total_kv_tokens
    d = decode_ms(k * (isl + osl // 2), total)
    pf = prefill_ms(isl) + d
    in_prefill = min(1.0, k / (osl * d / 1000) * pf / 1000)  # share of time in such passes
    survivors = max(1, workers - 1)
    out: dict[str, list[float]] = {}
    for placement in ("spread", "avoid_prefill"):
        added: list[float] = []
        for _ in range(trials // k + 1):
            lengths = [isl + rng.randrange(osl) for _ in range(k)]
            in_pass = rng.random() < in_prefill  # the killed worker was in a prefill pass
            stall = rng.uniform(0, pf) if in_pass else rng.uniform(0, d)
            due = pf if in_pass else d  # its streams' next token, after the last (>= stall)
            busy = [rng.random() < in_prefill for _ in range(survivors)]
            targets = [i for i in range(survivors) if not busy[i]]
            if placement == "spread" or not targets:
                targets = list(range(survivors))
            for j, target in enumerate(targets):
                group = lengths[j :: len(targets)]
                if group:
                    left = rng.uniform(0, pf) if busy[target] else rng.uniform(0, d)
                    t = stall + left + prefill_ms(sum(group)) + d - due
                    added += [t] * len(group)
        out[placement] = added
    return out


def with_detection(floor: list[float], detect_ms: list[float]) -> list[float]:
    """The model floor's migrations, each delayed by a detection time drawn from this run's
    (kill to the frontend's decision): the added gap with nothing else in the way (no frontend,
    request plane or return path; a CPU to spare)."""
    if not detect_ms:
        return []
    rng = random.Random(1)
    return [f + rng.choice(detect_ms) for f in floor]


def p50_p99(values: list[float]) -> tuple[float, float]:
    return round(pct(values, 0.5), 1), round(pct(values, 0.99), 1)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

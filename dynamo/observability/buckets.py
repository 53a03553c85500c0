"""The reference histogram bucket rule (FACTS §10.1)."""

from __future__ import annotations

import math
import os


def _round_2sig(x: float) -> float:
    if x == 0:
        return 0.0
    digits = 2 - int(math.floor(math.log10(abs(x)))) - 1
    return round(x, digits)


def log_buckets(minimum: float, maximum: float, count: int) -> list[float]:
    """``[0] + [round_2sig(exp(ln min + (ln max - ln min) * i / (n - 1))) for i in 1..n-1]``,
    deduplicated."""
    lo, hi = math.log(minimum), math.log(maximum)
    out = [0.0]
    for i in range(1, count):
        value = _round_2sig(math.exp(lo + (hi - lo) * i / (count - 1)))
        if value not in out:
            out.append(value)
    return out


def env_buckets(name: str, minimum: float, maximum: float, count: int) -> list[float]:
    """Buckets overridable by ``DYN_METRICS_{name}_{MIN,MAX,COUNT}``."""
    env = os.environ
    return log_buckets(
        float(env.get(f"DYN_METRICS_{name}_MIN", minimum)),
        float(env.get(f"DYN_METRICS_{name}_MAX", maximum)),
        int(env.get(f"DYN_METRICS_{name}_COUNT", count)),
    )


def exponential_buckets(start: float, factor: float, count: int) -> list[float]:
    """``start * factor**i`` for ``i`` in ``0..count-1`` (Prometheus' ``exponential_buckets``,
    which the reference's router overhead histograms use)."""
    return [start * factor**i for i in range(count)]

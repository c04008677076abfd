"""Percentiles, medians and ratios that tolerate missing figures (``None``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

QUANTILES = (10, 50, 90, 99)  # p10: the least disturbed requests on a shared machine


def pct(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile, linear between closest ranks (numpy's default); None if
    empty."""
    s = sorted(values)
    if not s:
        return None
    k = (len(s) - 1) * q / 100
    f = math.floor(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def pcts(
    values: Iterable[float], qs: Iterable[int] = QUANTILES
) -> dict[str, float | None]:
    """``{"p10": ..., "p50": ...}`` of ``values``."""
    values = list(values)
    return {f"p{q}": pct(values, q) for q in qs}


def med(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None if there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(a: float | None, b: float | None) -> float | None:
    """Return a / b, or None when either is missing or b is zero."""
    return a / b if a is not None and b else None


def diff(a: float | None, b: float | None) -> float | None:
    """Return a - b, or None when either is missing."""
    return a - b if a is not None and b is not None else None


def hist_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative (le, count) buckets."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q / 100 * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le  # above the last finite bucket: its bound, a lower bound
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return None

"""Read Prometheus text from our processes' /metrics: histograms summed over their label
sets, deltas between two scrapes, and percentiles from bucket counts.

A percentile from buckets is only known to lie in a bucket; ``quantile`` returns that
bucket's upper edge (a bound, as the reports print it: "<= X ms").
"""

from __future__ import annotations

import math
import urllib.request


def scrape(url: str, timeout: float = 5.0) -> str | None:
    """``url``/metrics as text; None when it cannot be read."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
            return r.read().decode()
    except OSError:
        return None


def gauge(text: str, name: str) -> float | None:
    """The value of an unlabelled sample ``name``."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def histogram(text: str, name: str) -> dict | None:
    """Histogram ``name``, every label set added up: ``{"buckets": {le: cumulative count},
    "sum": s, "count": n}``; None when absent."""
    buckets: dict[str, float] = {}
    total_sum = total_count = 0.0
    found = False
    for line in text.splitlines():
        if not line.startswith(name + "_"):
            continue
        head, value = line.rsplit(" ", 1)
        if head.startswith(name + "_bucket"):
            le = head.split('le="', 1)[1].split('"', 1)[0]
            buckets[le] = buckets.get(le, 0.0) + float(value)
            found = True
        elif head.split("{", 1)[0] == name + "_sum":
            total_sum += float(value)
        elif head.split("{", 1)[0] == name + "_count":
            total_count += float(value)
    return {"buckets": buckets, "sum": total_sum, "count": total_count} if found else None


def delta(before: dict | None, after: dict | None) -> dict | None:
    """``after - before`` of two ``histogram`` results (a missing ``before`` counts as zero)."""
    if after is None:
        return None
    before = before or {"buckets": {}, "sum": 0.0, "count": 0.0}
    return {"buckets": {le: n - before["buckets"].get(le, 0.0) for le, n in after["buckets"].items()},
            "sum": after["sum"] - before["sum"], "count": after["count"] - before["count"]}


def _edges(hist: dict | None) -> tuple[list[tuple[float, float]], float]:
    """(upper edge, cumulative count) ascending, +Inf last; and the total count."""
    edges = sorted((math.inf if le == "+Inf" else float(le), n) for le, n in (hist or {}).get("buckets", {}).items())
    return edges, (edges[-1][1] if edges else 0.0)


def quantile(hist: dict | None, q: float) -> float | None:
    """Upper edge of the bucket holding quantile ``q`` (inf when it is the +Inf bucket)."""
    edges, total = _edges(hist)
    if total <= 0:
        return None
    rank = max(1.0, math.ceil(q * total))
    return next(edge for edge, n in edges if n >= rank)


def top_bucket(hist: dict | None) -> tuple[float, float] | None:
    """(lower, upper) edges of the highest non-empty bucket: where the largest sample lies."""
    edges, total = _edges(hist)
    if total <= 0:
        return None
    lower = 0.0
    for edge, n in edges:
        if n >= total:
            return lower, edge
        lower = edge
    return None


def over(hist: dict | None, bound: float) -> float:
    """Samples above ``bound`` (which must be a bucket edge)."""
    edges, total = _edges(hist)
    below = max((n for edge, n in edges if edge <= bound + 1e-12), default=0.0)
    return total - below

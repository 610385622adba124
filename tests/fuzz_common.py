"""Shared by tests/test_fuzz_*.py: example counts, status tallies and body checks.

``OMNI_FUZZ_EXAMPLES`` sets the examples per fuzz test (default: a CI-sized count). With
``OMNI_FUZZ_REPORT=path.json`` every fuzz module adds its tallies (inputs by status code)
to that file when it ends; docs/reliability.md records a full run.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("OMNI_FUZZ_EXAMPLES", "0") or 0) or None


def examples(default: int, scale: int = 1) -> int:
    return EXAMPLES * scale if EXAMPLES is not None else default


def fuzz_settings(default: int, *, scale: int = 1, **kw):
    """Hypothesis settings for a fuzz test (``default`` examples, or ``scale`` times
    $OMNI_FUZZ_EXAMPLES): no example database, no deadline, no health checks (inputs go to
    real processes, so timing varies with the machine's load)."""
    return settings(max_examples=examples(default, scale), deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), **kw)


TRACEBACK_MARKERS = (b"Traceback (most recent call last)", b'File "/', b".py\", line ")


def has_traceback(data: bytes | str) -> bool:
    if isinstance(data, str):
        data = data.encode("utf-8", "replace")
    return any(m in data for m in TRACEBACK_MARKERS)


class Tally:
    """Inputs by (group, outcome); written to $OMNI_FUZZ_REPORT when the module ends."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.counts: dict[str, Counter] = {}

    def add(self, group: str, outcome) -> None:
        self.counts.setdefault(group, Counter())[str(outcome)] += 1

    def total(self, group: str | None = None) -> int:
        groups = [self.counts.get(group, Counter())] if group else self.counts.values()
        return sum(sum(c.values()) for c in groups)

    def flush(self) -> None:
        lines = [f"{self.module}: {g}: {sum(c.values())} inputs: "
                 + ", ".join(f"{k}={v}" for k, v in sorted(c.items())) for g, c in sorted(self.counts.items())]
        print("\n" + "\n".join(lines))
        path = os.environ.get("OMNI_FUZZ_REPORT")
        if not path:
            return
        p = Path(path)
        data = json.loads(p.read_text()) if p.exists() else {}
        mod = data.setdefault(self.module, {})
        for g, c in self.counts.items():
            have = Counter(mod.get(g, {}))
            have.update(c)
            mod[g] = dict(sorted(have.items()))
        p.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")

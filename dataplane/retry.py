"""When and how soon a failed engine leg is tried again, on another worker.

Only before the client has received a byte, and only for failures that are the engine's
(unreachable, 5xx, overloaded 429/503, timed out): a 4xx is the request's own fault and
would fail anywhere. The pause before each further attempt grows exponentially with
jitter, so a fleet-wide hiccup does not turn into a synchronized retry storm. A failed
engine's ``Retry-After`` concerns that engine: it goes to the control plane with the
failure report, which keeps the engine out of rotation that long (for every request),
and to the client when no other worker could take the request.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from dataplane.upstream import UpstreamError

RETRYABLE = frozenset({0, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 2               # further workers to try after the first failed
    base_delay_s: float = 0.02
    max_delay_s: float = 1.0
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def retryable(self, exc: UpstreamError, attempt: int) -> bool:
        return attempt < self.attempts and (exc.upstream_status or 0) in RETRYABLE

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt number ``attempt`` (1 = the first retry)."""
        backoff = min(self.base_delay_s * (2 ** (attempt - 1)), self.max_delay_s)
        return self.rng.uniform(0, backoff)            # "full jitter"


def retry_after_s(exc: UpstreamError) -> float:
    """The engine's Retry-After in seconds (0 when absent or an HTTP date)."""
    value = (exc.headers or {}).get("Retry-After", "")
    try:
        return min(max(float(value), 0.0), 3600.0)
    except ValueError:
        return 0.0

"""When and how soon a failed engine leg is tried again, on another worker.

Only before the client has received a byte, and only for failures that are the engine's
(unreachable, 5xx, overloaded 429/503, timed out): a 4xx is the request's own fault and
would fail anywhere. The pause before each further attempt is ``omni_runtime.retry``'s, the
policy of every retried thing: exponential with full jitter, so a fleet-wide hiccup does not
turn into a synchronized retry storm. A failed engine's ``Retry-After`` concerns that engine:
it goes to the control plane with the failure report, which keeps the engine out of rotation
that long (for every request), and to the client when no other worker could take the request.
"""

from __future__ import annotations

from dataplane.upstream import UpstreamError
from omni_runtime.retry import Retry, retryable_error

BASE_DELAY_S = 0.02     # the first retry's jitter window, doubling up to
MAX_DELAY_S = 1.0


def leg_retry(attempts: int) -> Retry:
    """Aggregated and decode legs: ``attempts`` further workers after the first failed."""
    return Retry(attempts=attempts, base_s=BASE_DELAY_S, max_s=MAX_DELAY_S)


def _prefill_retryable(exc: BaseException) -> bool:
    # A P that answered 200 without kv_transfer_params lacks a kv_producer connector:
    # another P may have one.
    return retryable_error(exc) or (isinstance(exc, UpstreamError) and exc.upstream_status == 200)


def prefill_retry(attempts: int) -> Retry:
    """Sequential prefill legs: ``attempts`` further prefill workers after the first failed."""
    return Retry(attempts=attempts, base_s=BASE_DELAY_S, max_s=MAX_DELAY_S, retryable=_prefill_retryable)


def retry_after_s(exc: UpstreamError) -> float:
    """The engine's Retry-After in seconds (0 when absent or an HTTP date)."""
    value = (exc.headers or {}).get("Retry-After", "")
    try:
        return min(max(float(value), 0.0), 3600.0)
    except ValueError:
        return 0.0

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

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from dataplane.upstream import UpstreamError
from omni_runtime.retry import Retry, retryable_error

if TYPE_CHECKING:
    from dataplane.metrics import DataPlaneMetrics

log = logging.getLogger(__name__)

BASE_DELAY_S = 0.02     # the first retry's jitter window, doubling up to
MAX_DELAY_S = 1.0

OnRetry = Callable[[int, float, BaseException], None]


def counted(metrics: DataPlaneMetrics, prefill: bool = False) -> OnRetry:
    """The ``on_retry`` hook of a leg's policy: one WARNING line naming the failed worker,
    and its count in ``omni_dp_upstream_errors``."""
    def on_retry(attempt: int, delay: float, exc: BaseException) -> None:
        assert isinstance(exc, UpstreamError)        # the legs retry nothing else
        worker = exc.worker_id
        if prefill:
            log.warning("prefill on %s failed (%s); trying another prefill worker", worker, exc.message,
                        extra={"worker": worker})
        else:
            log.warning("worker %s failed before the first byte (%s %s); trying another worker",
                        worker, exc.upstream_status, exc.message, extra={"worker": worker})
        metrics.upstream_errors.labels(worker, str(exc.upstream_status)).inc()
    return on_retry


def leg_retry(attempts: int, on_retry: OnRetry | None = None) -> Retry:
    """Aggregated and decode legs: ``attempts`` further workers after the first failed."""
    return Retry(attempts=attempts, base_s=BASE_DELAY_S, max_s=MAX_DELAY_S, on_retry=on_retry)


def _prefill_retryable(exc: BaseException) -> bool:
    # A P that answered 200 without kv_transfer_params lacks a kv_producer connector:
    # another P may have one.
    return retryable_error(exc) or (isinstance(exc, UpstreamError) and exc.upstream_status == 200)


def prefill_retry(attempts: int, on_retry: OnRetry | None = None) -> Retry:
    """Sequential prefill legs: ``attempts`` further prefill workers after the first failed."""
    return Retry(attempts=attempts, base_s=BASE_DELAY_S, max_s=MAX_DELAY_S, retryable=_prefill_retryable,
                 on_retry=on_retry)


def retry_after_s(exc: UpstreamError) -> float:
    """The engine's Retry-After in seconds (0 when absent or an HTTP date)."""
    value = (exc.headers or {}).get("Retry-After", "")
    try:
        return min(max(float(value), 0.0), 3600.0)
    except ValueError:
        return 0.0

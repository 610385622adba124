"""Pooled HTTP connections to the engines, and the one way a leg is opened."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass

import aiohttp
import orjson

from dataplane.auth import client_authorization
from dataplane.errors import APIError
from engine_api.answers import upstream_message

log = logging.getLogger(__name__)


@dataclass
class UpstreamConfig:
    connect_timeout_s: float = 5.0
    # Longest silence on an open upstream connection (no byte for this long = failed leg).
    read_timeout_s: float = 600.0
    # Whole prefill leg (request sent to answer read): P answers with one token, so a P
    # that takes longer than this is stuck, not slow.
    prefill_timeout_s: float = 300.0
    engine_api_key: str = ""
    pool_size: int = 0            # 0 = unlimited connections per engine
    forward_client_auth: bool = False   # send the client's Authorization instead of engine_api_key


# Engine answers the client hears as they are (before the first byte): "too busy, come
# back later" is true of the fleet too, and a client's backoff needs the real status.
PASS_THROUGH_STATUSES = (429, 503)
_RETRY_AFTER = re.compile(r"[ -~]{1,64}")   # printable ASCII, bounded: a seconds count or an HTTP date


class UpstreamError(APIError):
    """A leg failed on the engine's side: 502 to the client, with the engine's words."""

    def __init__(self, worker_id: str, message: str, upstream_status: int, status: int = 502,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, upstream_status=upstream_status, headers=headers)
        self.worker_id = worker_id


def _retry_after(resp: aiohttp.ClientResponse) -> dict[str, str] | None:
    value = resp.headers.get("Retry-After", "").strip()
    return {"Retry-After": value} if _RETRY_AFTER.fullmatch(value) else None


def dp_rank(endpoint) -> int:
    """The DP rank placement chose on a data-parallel worker's endpoint; -1 when there is none."""
    return endpoint.dp_rank if endpoint.dp_size > 1 else -1


def _timed_out(worker_id: str, url: str) -> UpstreamError:
    # upstream_status 504, not 0: a slow engine is not an unreachable one, so the control
    # plane counts a failure but does not take the worker out of rotation.
    return UpstreamError(worker_id, f"worker {worker_id} ({url}) timed out", 504, status=504)


class Upstream:
    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # aiohttp sets TCP_NODELAY on every connection it opens (base_protocol).
        connector = aiohttp.TCPConnector(limit=self.config.pool_size, limit_per_host=0,
                                         keepalive_timeout=60, enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s,
                                        sock_read=self.config.read_timeout_s)
        # No cookie jar: engine cookies are never a client's business (nor shared between
        # clients), and an empty jar still costs a filter and an update per leg.
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar(),
                                              auto_decompress=False, skip_auto_headers=("User-Agent",))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def prefill_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.config.prefill_timeout_s, connect=self.config.connect_timeout_s)

    async def open(self, worker_id: str, url: str, body: bytes, request_id: str,
                   timeout: aiohttp.ClientTimeout | None = None,
                   trace: dict[str, str] | None = None, dp_rank: int = -1) -> aiohttp.ClientResponse:
        """POST a leg and return the response once its status is 200.

        Engine 4xx answers are the client's fault and pass through with their status;
        anything else the engine or the network does wrong becomes an UpstreamError.
        ``trace``: W3C trace-context headers for this leg (``RequestTracker.leg``).
        ``dp_rank`` >= 0: the engine's data-parallel rank, as vLLM's ``X-data-parallel-rank``.
        """
        assert self._session is not None
        # Identity: the relay passes engine bytes on as they are, so they must not be
        # compressed (aiohttp would otherwise offer gzip/deflate on our behalf).
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id, "Accept-Encoding": "identity"}
        if self.config.engine_api_key:
            headers["Authorization"] = f"Bearer {self.config.engine_api_key}"
        if self.config.forward_client_auth and client_authorization.get():   # only when configured
            headers["Authorization"] = client_authorization.get()
        if trace:
            headers.update(trace)
        if dp_rank >= 0:
            headers["X-data-parallel-rank"] = str(dp_rank)
        try:
            resp = await self._session.post(url, data=body, headers=headers,
                                            **({"timeout": timeout} if timeout is not None else {}))
        except asyncio.TimeoutError:
            log.warning("worker %s (%s) timed out", worker_id, url)
            raise _timed_out(worker_id, url) from None
        except (aiohttp.ClientConnectionError, OSError) as exc:
            err = UpstreamError(worker_id, f"cannot reach worker {worker_id} ({url}): "
                                f"{type(exc).__name__} {exc}".strip(), 0)
            log.warning("%s", err.message)
            raise err from None
        if resp.status == 200:
            return resp
        try:
            data = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            data = b""
        finally:
            resp.release()
        message = upstream_message(data) or resp.reason or "no message"
        if 400 <= resp.status < 500 and resp.status not in (408, 429):
            raise APIError(resp.status, message, type_=None)
        status = resp.status if resp.status in PASS_THROUGH_STATUSES else 502
        log.warning("worker %s returned %d: %s", worker_id, resp.status, message[:200])
        raise UpstreamError(worker_id, f"worker {worker_id} returned {resp.status}: {message}", resp.status,
                            status=status, headers=_retry_after(resp) if status != 502 else None)


async def read_body(worker_id: str, resp: aiohttp.ClientResponse) -> bytes:
    """Read a whole (small, non-streamed) answer; a broken read is the engine's failure.

    On any interruption the connection is closed rather than pooled, so an engine sees a
    cancelled client as a disconnect and aborts the request.
    """
    try:
        data = await resp.read()
    except asyncio.TimeoutError:
        resp.close()
        log.warning("worker %s timed out answering", worker_id)
        raise _timed_out(worker_id, str(resp.url)) from None
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
        resp.close()
        err = UpstreamError(worker_id, f"worker {worker_id} broke off its answer: "
                            f"{type(exc).__name__} {exc}".strip(), 0)
        log.warning("%s", err.message)
        raise err from None
    except BaseException:
        resp.close()
        raise
    resp.release()
    return data

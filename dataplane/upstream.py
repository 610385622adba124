"""Pooled HTTP connections to the engines, and the one way a leg is opened.

The connections are ``engine_api.client``'s: a lean keep-alive HTTP/1.1 client, since
aiohttp's ClientSession was a fifth of the data plane's CPU per request.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from dataplane.auth import client_authorization
from dataplane.errors import APIError
from engine_api.answers import upstream_message
from engine_api.client import EngineClient, EngineClientError, EngineConnectError, EngineResponse

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
    # Idle engine connections are closed after this: below uvicorn's 5 s keep-alive (vLLM,
    # SGLang), so the engine rarely closes one just as a request goes out on it.
    keepalive_s: float = 4.0
    forward_client_auth: bool = False   # send the client's Authorization instead of engine_api_key


# Engine answers the client hears as they are (before the first byte): "too busy, come
# back later" is true of the fleet too, and a client's backoff needs the real status.
PASS_THROUGH_STATUSES = (429, 503)
_RETRY_AFTER = re.compile(r"[ -~]{1,64}")   # printable ASCII, bounded: a seconds count or an HTTP date


class UpstreamError(APIError):
    """A leg failed on the engine's side: 502 to the client, with the engine's words."""

    def __init__(self, worker_id: str, message: str, upstream_status: int | None, status: int = 502,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, upstream_status=upstream_status, headers=headers)
        self.worker_id = worker_id


def _retry_after(resp: EngineResponse) -> dict[str, str] | None:
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
        self._client: EngineClient | None = None
        self._control: EngineClient | None = None    # the metaserver's (layerwise), made on first use

    async def start(self) -> None:
        # Identity: the relay passes engine bytes on as they are, so they must not be
        # compressed. The engine key goes on every leg unless the client's own may replace it.
        headers = [("Content-Type", "application/json"), ("Accept-Encoding", "identity")]
        if self.config.engine_api_key and not self.config.forward_client_auth:
            headers.append(("Authorization", f"Bearer {self.config.engine_api_key}"))
        self._client = EngineClient(connect_timeout_s=self.config.connect_timeout_s,
                                    read_timeout_s=self.config.read_timeout_s, pool_size=self.config.pool_size,
                                    keepalive_s=self.config.keepalive_s, default_headers=headers)

    async def close(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._control is not None:
            self._control.close()

    async def hand_over(self, url: str, body: bytes, request_id: str) -> None:
        """POST a layerwise request to the control plane's metaserver, which sends its prefill
        leg (``metaserver.server.body_url``). Not an engine: no engine key and no client
        credentials go with it. An APIError (502) when it is not taken; no worker is to blame."""
        if self._control is None:
            self._control = EngineClient(connect_timeout_s=self.config.connect_timeout_s,
                                         read_timeout_s=self.config.connect_timeout_s,
                                         default_headers=[("Content-Type", "application/json")])
        try:
            resp = await self._control.post(url, body, [("X-Request-Id", request_id)])
            try:
                data = await resp.read()
            finally:
                resp.release()
        except (TimeoutError, EngineClientError, OSError) as exc:
            raise APIError(502, f"the metaserver did not take the request: {type(exc).__name__} {exc}".strip(),
                           type_=None) from None
        if resp.status != 200:
            raise APIError(502, f"the metaserver did not take the request: {resp.status} {upstream_message(data)}",
                           type_=None)

    def prefill_timeout(self) -> float:
        """Seconds for a whole prefill leg, answer read included."""
        return self.config.prefill_timeout_s

    def _headers(self, request_id: str, trace: dict[str, str] | None, dp_rank: int) -> list[tuple[str, str]]:
        headers = [("X-Request-Id", request_id)]
        if self.config.forward_client_auth:
            auth = client_authorization.get() or (
                f"Bearer {self.config.engine_api_key}" if self.config.engine_api_key else "")
            if auth:
                headers.append(("Authorization", auth))
        if trace:
            headers.extend(trace.items())
        if dp_rank >= 0:
            headers.append(("X-data-parallel-rank", str(dp_rank)))
        return headers

    async def open(self, worker_id: str, url: str, body: bytes, request_id: str,
                   total_timeout_s: float | None = None,
                   trace: dict[str, str] | None = None, dp_rank: int = -1) -> EngineResponse:
        """POST a leg and return the response once its status is 200.

        Engine 4xx answers are the client's fault and pass through with their status;
        anything else the engine or the network does wrong becomes an UpstreamError.
        ``total_timeout_s``: the whole leg, answer read included (the prefill leg's).
        ``trace``: W3C trace-context headers for this leg (``RequestTracker.leg``).
        ``dp_rank`` >= 0: the engine's data-parallel rank, as vLLM's ``X-data-parallel-rank``.
        """
        assert self._client is not None
        headers: list[tuple[str, str]] | bytes
        if not trace and dp_rank < 0 and not self.config.forward_client_auth and request_id.isprintable():
            # The common leg: its one header line encoded here (an id has no CR or LF: printable).
            headers = b"X-Request-Id: %b\r\n" % request_id.encode("utf-8", "surrogateescape")
        else:
            headers = self._headers(request_id, trace, dp_rank)
        try:
            resp = await self._client.post(url, body, headers, total_timeout_s=total_timeout_s)
        except TimeoutError:
            log.warning("worker %s (%s) timed out", worker_id, url, extra={"worker": worker_id})
            raise _timed_out(worker_id, url) from None
        except (EngineConnectError, OSError) as exc:
            err = UpstreamError(worker_id, f"cannot reach worker {worker_id} ({url}): "
                                f"{type(exc).__name__} {exc}".strip(), 0)
            log.warning("%s", err.message, extra={"worker": worker_id})
            raise err from None
        except EngineClientError as exc:
            # The engine was reached and took the request, then closed or answered garbage:
            # a failed leg (retried elsewhere, counted by the breaker), not proof that the
            # engine is unreachable, which would take it out of rotation at once.
            err = UpstreamError(worker_id, f"worker {worker_id} ({url}) failed the request: "
                                f"{type(exc).__name__} {exc}".strip(), 502)
            log.warning("%s", err.message, extra={"worker": worker_id})
            raise err from None
        if resp.status == 200:
            return resp
        try:
            data = await resp.read()
        except (TimeoutError, EngineClientError):
            data = b""
        finally:
            resp.release()
        message = upstream_message(data) or resp.reason or "no message"
        if 400 <= resp.status < 500 and resp.status not in (408, 429):
            raise APIError(resp.status, message, type_=None)
        status = resp.status if resp.status in PASS_THROUGH_STATUSES else 502
        log.warning("worker %s returned %d: %s", worker_id, resp.status, message[:200], extra={"worker": worker_id})
        raise UpstreamError(worker_id, f"worker {worker_id} returned {resp.status}: {message}", resp.status,
                            status=status, headers=_retry_after(resp) if status != 502 else None)


async def read_body(worker_id: str, resp: EngineResponse) -> bytes:
    """Read a whole (small, non-streamed) answer; a broken read is the engine's failure.

    On any interruption the connection is closed rather than pooled, so an engine sees a
    cancelled client as a disconnect and aborts the request.
    """
    try:
        data = await resp.read()
    except TimeoutError:
        resp.close()
        log.warning("worker %s timed out answering", worker_id, extra={"worker": worker_id})
        raise _timed_out(worker_id, resp.url) from None
    except EngineClientError as exc:
        resp.close()
        # 502, not 0: it answered, so it is reachable (see relay_stream).
        err = UpstreamError(worker_id, f"worker {worker_id} broke off its answer: "
                            f"{type(exc).__name__} {exc}".strip(), 502)
        log.warning("%s", err.message, extra={"worker": worker_id})
        raise err from None
    except BaseException:
        resp.close()
        raise
    resp.release()
    return data

"""The metaserver: where a layerwise decode engine asks for its prefill.

vLLM-Ascend's MooncakeLayerwiseConnector on D POSTs its KV destination (block ids, host,
port, engine id) to ``/v1/metaserver``. Once every prompt of the request has reported,
the metaserver picks a prefill worker, sends it the request with D's parameters, and
answers D when P is done (``{"status":"ok"}``) or failed (502). D waits on that answer
before it decodes, so a failed prefill fails fast instead of hanging.

The request itself does not ride the placement session (one large prompt there would hold
up every placement behind it): the data plane that placed it POSTs it to
``/v1/metaserver/body/<placement id>`` with the request's token before it sends D the
request (``engine_api.metaserver.body_url``), and the session carries only ids.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import secrets
from typing import Any
from urllib.parse import urlsplit

import orjson
from aiohttp import web

from engine_api.answers import upstream_message
from engine_api.bodies import prefill_body
from engine_api.client import EngineClient, EngineClientError
from engine_api.metaserver import BODY_ROUTE
from metaserver.ids import candidates, engine_request_ids
from metaserver.pending import PendingPrefill, PendingTable
from metaserver.ports import ControlPlanePort
from omni_runtime import cancel_and_wait
from omni_runtime.retry import Retry
from protos import omni_proxy_pb2 as pb

log = logging.getLogger(__name__)

class PrefillFailed(Exception):
    """A prefill leg's failure, by the engine's status (0: no answer), for the retry policy."""

    def __init__(self, upstream_status: int) -> None:
        super().__init__(upstream_status)
        self.upstream_status = upstream_status


MAX_BODY_BYTES = 64 << 20     # a request handed over for its prefill leg (the data plane allows 32 MiB)


WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]", "*"}
CHAT_PATH = "/v1/chat/completions"


class Metaserver:
    """Hosted by the control plane, seen through ``control_plane`` (``metaserver/ports.py``);
    told of layerwise placements (:meth:`register`) and ended requests (:meth:`drop`) by the
    hooks the composition root subscribes it to."""

    def __init__(self, control_plane: ControlPlanePort, *, prefill_retries: int = 1, timeout_s: float = 120.0,
                 connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0, engine_api_key: str = "") -> None:
        self.control_plane = control_plane
        self.table = PendingTable()
        self.prefill_retries = prefill_retries
        # The prefill leg's retries, on other prefill workers: the policy of every retried
        # thing (omni_runtime.retry: full jitter, never after a 4xx).
        self.retry = Retry(attempts=prefill_retries)
        self.timeout_s = timeout_s
        self._client = EngineClient(connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s,
                                    default_headers={"Authorization": f"Bearer {engine_api_key}"}
                                    if engine_api_key else {})
        self._reaper: asyncio.Task | None = None
        self.calls = {"ok": 0, "failed": 0, "unknown": 0, "duplicate": 0, "forbidden": 0}

    @staticmethod
    def url_for(host: str, port: int) -> str:
        if host.strip() in WILDCARD_HOSTS:
            raise ValueError(f"the metaserver address {host!r} is a wildcard: decode engines must be "
                             "able to call it, so set metaserver_host to a routable address")
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{port}/v1/metaserver"

    async def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap())

    async def stop(self) -> None:
        await cancel_and_wait(self._reaper)
        for entry in self.table.entries():
            self.drop(entry.placement_id)
        self._client.close()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/metaserver", self.handle)
        app.router.add_post("/v1/metaserver" + BODY_ROUTE, self.handle_body)

    # ------------------------------------------------------------------ control-plane hooks

    def register(self, req: pb.PlaceRequest, placement: pb.Placement) -> bool:
        """Wait for this layerwise request's decode call; False when its ids are taken.

        The data plane makes every engine request id unique, so a clash means a buggy or
        hostile caller: the request already waiting keeps its ids and its entry is never
        overwritten. (A second decode call for an id that has already reported is refused
        in ``handle`` unless it repeats the first, so a KV destination cannot be replaced.)
        """
        entry = PendingPrefill(
            placement_id=req.request_id, engine_request_id=req.engine_request_id or req.request_id,
            # (a data plane of an earlier release still sends the body on the session)
            path=req.path or "/v1/completions", body=req.body, model=req.model,
            prompt_tokens=req.prompt_tokens, max_tokens=req.max_tokens,
            expected=engine_request_ids(req.engine_request_id or req.request_id, req.path == CHAT_PATH,
                                        req.num_prompts),
            block_hashes=list(req.block_hashes), token=secrets.token_urlsafe(18), trace=dict(req.trace_headers),
            decode_host=_ip_literal(placement.decode.url))
        if self.table.add(entry):
            # Only the decode engine placed for this request learns the token.
            placement.metaserver_url = f"{placement.metaserver_url}?token={entry.token}"
            return True
        self.calls["duplicate"] += 1
        log.warning("layerwise %s: refused, an engine request id of it is already pending", entry.placement_id)
        return False

    def drop(self, placement_id: str, reason: str = "the request ended before its prefill") -> None:
        entry = self.table.pop(placement_id)
        if entry is None:
            return
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
        if entry.result is not None and not entry.result.done():
            entry.result.set_result(reason)

    # ------------------------------------------------------------------ HTTP

    async def handle(self, http: web.Request) -> web.Response:
        try:
            data = orjson.loads(await http.read())
        except orjson.JSONDecodeError:
            return _error(400, "body is not valid JSON")
        except web.HTTPRequestEntityTooLarge as exc:   # JSON like every other answer here
            return _error(413, exc.text or "body too large")
        if not isinstance(data, dict) or not isinstance(data.get("request_id"), str):
            return _error(400, "expected a JSON object with a string request_id")
        entry, child = None, ""
        for cid in candidates(data["request_id"]):
            entry = self.table.find(cid)
            if entry is not None:
                child = cid
                break
        if entry is None:
            self.calls["unknown"] += 1
            return _error(404, f"no pending request {data['request_id'][:128]!r}")   # never echo a huge id
        if not hmac.compare_digest(http.query.get("token", ""), entry.token) or \
                (entry.decode_host and http.remote and _ip(http.remote) != entry.decode_host):
            # Anyone else answering for D could choose where P pushes the KV.
            self.calls["forbidden"] += 1
            log.warning("layerwise %s: metaserver call refused from %s (not the placed decode engine)",
                        entry.placement_id, http.remote)
            return _error(403, "only the decode engine placed for this request may call for its prefill")
        if child in entry.params and entry.params[child] != data:   # a retry repeats itself exactly
            self.calls["duplicate"] += 1
            return _error(409, f"request {child!r} has already reported its KV destination")
        entry.params[child] = data
        if entry.result is None:
            entry.result = asyncio.get_running_loop().create_future()
        self._maybe_dispatch(entry)
        error = await asyncio.shield(entry.result)
        if error is None:
            self.calls["ok"] += 1
            return web.json_response({"status": "ok"})
        self.calls["failed"] += 1
        return _error(502, error)

    async def handle_body(self, http: web.Request) -> web.Response:
        """The data plane hands the request over (once, before D has it): what P is sent."""
        entry = self.table.get(http.match_info["placement_id"])
        if entry is None:
            self.calls["unknown"] += 1
            return _error(404, "no pending request with this placement id")
        if not hmac.compare_digest(http.query.get("token", ""), entry.token):
            self.calls["forbidden"] += 1
            return _error(403, "the token is not this request's")
        if entry.body:
            self.calls["duplicate"] += 1
            return _error(409, "this request has been handed over already")
        if (http.content_length or 0) > MAX_BODY_BYTES:
            return _error(413, f"body over {MAX_BODY_BYTES} bytes")
        body = bytearray()
        async for chunk in http.content.iter_any():    # (the app's 1 MiB limit is for D's calls)
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                return _error(413, f"body over {MAX_BODY_BYTES} bytes")
        if not body:
            return _error(400, "empty body")
        entry.body = bytes(body)
        self._maybe_dispatch(entry)
        return web.json_response({"status": "ok"})

    # ------------------------------------------------------------------ prefill

    def _maybe_dispatch(self, entry: PendingPrefill) -> None:
        """Send P the request once every prompt's decode call and the request itself are in."""
        if entry.complete and entry.body and entry.result is not None and entry.task is None:
            entry.task = asyncio.create_task(self._dispatch(entry))

    def _prefill_params(self, entry: PendingPrefill) -> dict[str, Any]:
        first = dict(entry.params[entry.expected[0]])
        if len(entry.expected) > 1:
            first["batch_kv_transfer_params"] = {cid: entry.params[cid] for cid in entry.expected}
        return first

    async def _dispatch(self, entry: PendingPrefill) -> None:
        error: str | None = "no prefill attempted"
        try:
            body = prefill_body(orjson.loads(entry.body), self._prefill_params(entry))
            tried: list[str] = []
            while True:
                placement = await self.control_plane.place(pb.PlaceRequest(
                    request_id=entry.placement_id, model=entry.model, leg=pb.LEG_PREFILL,
                    prompt_tokens=entry.prompt_tokens, max_tokens=entry.max_tokens, exclude_workers=tried,
                    block_hashes=entry.block_hashes, trace_headers=entry.trace))   # (its span: the request's trace)
                if placement.error:
                    error = placement.error_message
                    return
                p = placement.prefill
                trace = {**entry.trace, "X-data-parallel-rank": str(p.dp_rank)} if p.dp_size > 1 else entry.trace
                status, message = await self._send_prefill(p.url + entry.path, body, entry.engine_request_id, trace)
                if status == 200:
                    await self.control_plane.report(pb.LifecycleEvent(request_id=entry.placement_id,
                                                                      kind=pb.EVENT_PREFILL_DONE))
                    error = None
                    return
                error = f"prefill worker {p.worker_id} failed: {message}"
                log.warning("layerwise %s: %s", entry.engine_request_id, error)
                await self.control_plane.report(pb.LifecycleEvent(
                    request_id=entry.placement_id, kind=pb.EVENT_LEG_FAILED, worker_id=p.worker_id,
                    upstream_status=status, message=message))
                tried.append(p.worker_id)
                # Another prefill worker, after a pause, unless the request itself was at fault (4xx).
                pause = self.retry.next_delay(PrefillFailed(status), len(tried))
                if pause is None:
                    return
                await self.retry.sleep(pause)
        except asyncio.CancelledError:
            error = "cancelled"
            raise
        finally:
            if entry.result is not None and not entry.result.done():
                entry.result.set_result(error)

    async def _send_prefill(self, url: str, body: bytes, request_id: str,
                            trace: dict[str, str] | None = None) -> tuple[int, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id, **(trace or {})}
        try:
            resp = await self._client.post(url, body, headers)
            try:
                data = await resp.read()
            finally:
                resp.release()      # pooled when read whole; dropped otherwise
            return resp.status, ("" if resp.status == 200 else f"{resp.status} {upstream_message(data)}")
        except (TimeoutError, EngineClientError, OSError) as exc:
            return 0, f"{type(exc).__name__} {exc}".strip()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.timeout_s / 4))
            for entry in self.table.older_than(self.timeout_s):
                log.warning("layerwise %s: no metaserver call within %.0fs", entry.engine_request_id, self.timeout_s)
                self.drop(entry.placement_id, "timed out waiting for the decode engine")


def _ip(host: str) -> str:
    try:
        return ipaddress.ip_address(host.strip("[]")).compressed
    except ValueError:
        return ""


def _ip_literal(url: str) -> str:
    """The host of ``url`` when it is an IP address (a name is not compared: DNS may differ)."""
    return _ip(urlsplit(url).hostname or "")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"status": "error", "error": {"message": message, "code": status}}, status=status)

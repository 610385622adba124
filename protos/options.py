"""gRPC channel and server options, one set for both ends of every connection.

Keepalive has two sides that must agree. A client that pings more often than the server
permits collects "ping strikes" and is sent GOAWAY ``too_many_pings``: with gRPC's server
defaults (no pings without an active call, at most one every 5 minutes without data) a
client pinging every 10 s lost its session after about 40 s of quiet. The server here
accepts pings down to half the client's interval, with or without calls in flight.

Message sizes are explicit on both sides. Only placements can be large (a layerwise
placement carries the client's body, up to the data plane's 32 MiB): :data:`BULK_METHODS`
may receive up to :data:`MAX_MESSAGE_BYTES`, every other method :data:`MAX_SMALL_MESSAGE_BYTES`
(checked by the control plane's ``grpc_guard`` before a message is decoded). gRPC's own
``max_receive_message_length`` is one value for the whole server, so it stays the bulk one;
a caller without a valid token never gets a message read at all (``controlplane/auth.py``).
"""

from __future__ import annotations

CLIENT_KEEPALIVE_MS = 10_000        # the data plane pings this often when the stream is quiet
KEEPALIVE_TIMEOUT_MS = 5_000        # and gives the peer this long to answer
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_SMALL_MESSAGE_BYTES = 1024 * 1024
# The methods whose requests may be large: placements (PlaceRequest.body). Full gRPC paths.
BULK_METHODS = frozenset({"/omni_proxy.v1.Scheduler/Session", "/omni_proxy.v1.Scheduler/Place",
                          "/omni_proxy.v1.Admin/Explain"})
# The session socket's first frame, read before its token is checked (protos/framing.py).
MAX_OPENING_FRAME_BYTES = 8 * 1024
# The largest latency target PlaceRequest.ttft_slo_ms / tpot_slo_ms may carry (a day): the data
# plane's X-SLO-* headers and the control plane's [slo] keys are held to it alike.
MAX_SLO_MS = 86_400_000.0


def max_request_bytes(method: str) -> int:
    """The largest request message ``method`` (a full gRPC path) accepts."""
    return MAX_MESSAGE_BYTES if method in BULK_METHODS else MAX_SMALL_MESSAGE_BYTES


def client_options(keepalive_ms: int = CLIENT_KEEPALIVE_MS) -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # A replica that comes back is found within a couple of seconds, not gRPC's 2 minutes.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]


def server_options(min_client_keepalive_ms: int = 1_000) -> list[tuple[str, int]]:
    """Accept client pings as often as every ``min_client_keepalive_ms`` / 2."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", max(min_client_keepalive_ms // 2, 100)),
        ("grpc.http2.max_ping_strikes", 0),          # 0: never GOAWAY a client for pinging
        # The server pings too, so a data plane that vanished without closing its
        # connection is noticed and its session ends.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # No bandwidth-delay probing: with it a stream's receive window grows to megabytes, and
        # a call refused for its token before its message is read still had that much of it
        # taken in (8 unauthenticated 58 MiB calls: +12 to +67 MB; without: +1.3 MB). On
        # loopback a 32 MiB placement takes no longer (88-89 ms against 95-109 ms).
        ("grpc.http2.bdp_probe", 0),
    ]

"""Bad input on the control plane's gRPC API: out-of-range messages and raw bytes.

Every field of every request message is drawn from hypothesis strategies built from the
proto descriptors: huge, negative, NaN and infinite numbers, huge and odd strings, enum
values nobody defined, nested messages and maps. Raw bytes go to every method as a
serialized message (a raw channel with identity serializers) and on the Session stream.
Every call answers a status among OK / INVALID_ARGUMENT / NOT_FOUND / ALREADY_EXISTS with a
message, never UNKNOWN or INTERNAL; no detail carries a traceback; each malformed message
logs one line (controlplane/grpc_guard.py), not a traceback; and the control plane still
places requests afterwards.
"""

from __future__ import annotations

import asyncio
import math
import struct

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import given
from hypothesis import strategies as st

from protos import omni_proxy_pb2 as pb
from protos import omni_proxy_pb2_grpc as pb_grpc
from tests.conftest import start_cluster, wait_until
from tests.fuzz_common import Tally, fuzz_settings, has_traceback

TALLY = Tally("grpc")
WORKER = "fuzz-target-7f3a"      # never drawn at random: random ids cannot drain or remove it
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.ALREADY_EXISTS}

# ------------------------------------------------------------------ strategies from descriptors

INT_EDGES = {32: [0, 1, -1, 2**31 - 1, -(2**31)], 64: [0, 1, -1, 2**63 - 1, -(2**63), 2**62, 2**53 + 1]}
UINT_EDGES = {32: [0, 1, 2**32 - 1, 2**31], 64: [0, 1, 2**64 - 1, 2**63, 2**63 - 1]}
odd_text = st.one_of(
    st.text(max_size=64),
    st.sampled_from(["", " ", "a", "\x00", "\ud7ff\ue000", "../../etc", "http://", "http://[::1", "tcp://*:1",
                     "ipc:///tmp/x", "http://127.0.0.1:0", "https://h:99999", "ftp://x", "x" * 300, "%s%n",
                     "BOTH", "nan", "inf", "-1", "1e400", "\u202e", "http://a b", "http://127.0.0.1:1/v1"]),
    st.integers(1000, 200_000).map(lambda n: "y" * n),   # huge strings (gRPC allows 64 MiB here)
)
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e308, 5e-324, 1.0]))


def _float32(x: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _scalar(field) -> st.SearchStrategy:
    t = field.type
    if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return st.integers(-(2**31), 2**31 - 1) | st.sampled_from(INT_EDGES[32])
    if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return st.integers(-(2**63), 2**63 - 1) | st.sampled_from(INT_EDGES[64])
    if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1) | st.sampled_from(UINT_EDGES[32])
    if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1) | st.sampled_from(UINT_EDGES[64])
    if t == FD.TYPE_DOUBLE:
        return floats
    if t == FD.TYPE_FLOAT:
        return floats.map(_float32)
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_STRING:
        return odd_text
    if t == FD.TYPE_BYTES:
        return st.binary(max_size=256)
    if t == FD.TYPE_ENUM:
        # proto3 enums are open: any int32 is a legal wire value, defined or not
        return st.sampled_from([v.number for v in field.enum_type.values]) | st.integers(-(2**31), 2**31 - 1)
    raise AssertionError(f"no strategy for {field.full_name}")


def _is_map(field) -> bool:
    return field.type == FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _is_repeated(field) -> bool:
    label = getattr(field, "label", None)
    if label is not None:
        return label == FD.LABEL_REPEATED
    return field.is_repeated


def message(cls, depth: int = 0) -> st.SearchStrategy:
    """A message of type ``cls`` with a random subset of its fields set to hostile values."""
    desc = cls.DESCRIPTOR
    parts = {}
    for f in desc.fields:
        if _is_map(f):
            key = _scalar(f.message_type.fields_by_name["key"])
            vf = f.message_type.fields_by_name["value"]
            val = (message(vf.message_type._concrete_class, depth + 1) if vf.type == FD.TYPE_MESSAGE
                   else _scalar(vf))
            parts[f.name] = st.dictionaries(key, val, max_size=4)
        elif f.type == FD.TYPE_MESSAGE:
            if depth >= 3:
                continue
            sub = message(f.message_type._concrete_class, depth + 1)
            parts[f.name] = st.lists(sub, max_size=3) if _is_repeated(f) else sub
        else:
            parts[f.name] = st.lists(_scalar(f), max_size=8) if _is_repeated(f) else _scalar(f)

    @st.composite
    def build(draw):
        msg = cls()
        names = draw(st.lists(st.sampled_from(sorted(parts)), unique=True)) if parts else []
        for name in names:
            value = draw(parts[name])
            f = desc.fields_by_name[name]
            if f.containing_oneof is not None and msg.WhichOneof(f.containing_oneof.name):
                continue
            if _is_map(f):
                target = getattr(msg, name)
                for k, v in value.items():
                    if f.message_type.fields_by_name["value"].type == FD.TYPE_MESSAGE:
                        target[k].CopyFrom(v)
                    else:
                        target[k] = v
            elif f.type == FD.TYPE_MESSAGE:
                if isinstance(value, list):
                    getattr(msg, name).extend(value)
                else:
                    getattr(msg, name).CopyFrom(value)
            elif isinstance(value, list):
                getattr(msg, name).extend(value)
            else:
                setattr(msg, name, value)
        return msg

    return build()


def _methods():
    """(service stub class, method name, request class) for every unary method."""
    out = []
    for service in pb.DESCRIPTOR.services_by_name.values():
        for m in service.methods:
            if m.client_streaming or m.server_streaming:
                continue
            out.append((service.name, m.name, m.input_type._concrete_class))
    return out


METHODS = _methods()
MUTATING = {("Admin", "Drain"), ("Admin", "Undrain"), ("Admin", "RemoveWorker"), ("Registry", "Deregister")}


# ------------------------------------------------------------------ the live control plane

@pytest.fixture(scope="module")
def cluster():
    c = start_cluster({WORKER: "both"})
    try:
        yield c
    finally:
        c.group.close()
        TALLY.flush()


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(cluster.cp.address) as ch:
        yield ch


def _record(group: str, code: grpc.StatusCode, details: str | None) -> None:
    TALLY.add(group, code.name)
    assert code in ALLOWED, (group, code, details)
    if code != grpc.StatusCode.OK:
        assert details, (group, code)
    assert not has_traceback(details or ""), details


def _call(channel, service: str, method: str, request: bytes, group: str) -> None:
    call = channel.unary_unary(f"/omni_proxy.v1.{service}/{method}", request_serializer=None,
                               response_deserializer=None)
    try:
        answer = call(request, timeout=20)
    except grpc.RpcError as exc:
        _record(group, exc.code(), exc.details())
        return
    _record(group, grpc.StatusCode.OK, None)
    if method in ("Place", "Explain"):     # a placement error is an answer, but never a bug's
        placement = pb.Placement.FromString(answer)
        TALLY.add(group + " placement", pb.ErrorCode.Name(placement.error))
        assert placement.error != pb.INTERNAL, placement
        assert not has_traceback(placement.error_message + placement.explanation), placement


def _places(channel) -> None:
    stub = pb_grpc.SchedulerStub(channel)
    placement = stub.Place(pb.PlaceRequest(request_id="after-fuzz", model="sim-model", leg=pb.LEG_ENTRY,
                                           prompt_tokens=8, max_tokens=8), timeout=10)
    assert placement.error == pb.OK and placement.decode.worker_id == WORKER, placement
    stub.Report(pb.LifecycleEvent(request_id="after-fuzz", kind=pb.EVENT_FINISHED), timeout=10)


def _cp_log(cluster) -> str:
    return cluster.cp.log_path.read_text(errors="replace")


MARKER_LINE = "malformed /omni_proxy.v1.Admin/ListWorkers message"


def _all_logged(cluster, channel) -> None:
    """Wait for proof that every line the control plane logs for the calls made so far is in
    its log: a malformed marker call (ListWorkers), whose own line is written after theirs."""
    seen = _cp_log(cluster).count(MARKER_LINE)
    marker = channel.unary_unary("/omni_proxy.v1.Admin/ListWorkers", request_serializer=None,
                                 response_deserializer=None)
    with pytest.raises(grpc.RpcError) as refused:
        marker(b"\xff\xff\xff", timeout=20)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    asyncio.run(wait_until(lambda: _cp_log(cluster).count(MARKER_LINE) > seen, timeout=10,
                           what="the marker call's log line"))


# ------------------------------------------------------------------ tests

@pytest.mark.timeout(600)
@pytest.mark.parametrize("service,method,request_cls", METHODS, ids=[f"{s}.{m}" for s, m, _ in METHODS])
def test_hostile_fields(cluster, channel, service, method, request_cls):
    """Well-formed messages with hostile values in any field."""
    mutating = (service, method) in MUTATING

    @fuzz_settings(40)
    @given(msg=message(request_cls))
    def run(msg):
        if mutating and hasattr(msg, "worker_id") and msg.worker_id == WORKER:
            msg.worker_id += "-x"
        _call(channel, service, method, msg.SerializeToString(), f"fields {service}.{method}")

    try:
        run()
    finally:
        asyncio.run(cluster.restore())
    _places(channel)


def _valid_bases() -> dict[str, object]:
    """A valid request per message type: near-valid inputs change a few of its fields."""
    return {
        "PlaceRequest": pb.PlaceRequest(request_id="fz", model="sim-model", leg=pb.LEG_ENTRY, prompt_tokens=16,
                                        max_tokens=16, path="/v1/completions", engine_request_id="fz-1",
                                        num_prompts=1),
        "LifecycleEvent": pb.LifecycleEvent(request_id="fz", kind=pb.EVENT_FINISHED),
        "RegisterRequest": pb.RegisterRequest(url="http://127.0.0.1:1", role=pb.ROLE_BOTH, model="fz-model",
                                              worker_id="fz-registered"),
        "HeartbeatRequest": pb.HeartbeatRequest(worker_id="fz-registered"),
        "SetWeightRequest": pb.SetWeightRequest(worker_id="fz-registered", weight=1.0),
        "WorkerRef": pb.WorkerRef(worker_id="fz-registered"),
    }


@st.composite
def near_valid(draw, cls):
    """A valid message of ``cls`` with one to three fields replaced by hostile values."""
    base = _valid_bases().get(cls.DESCRIPTOR.name, cls())
    hostile = draw(message(cls))
    names = sorted(f.name for f, _ in hostile.ListFields())
    if not names:
        return base
    chosen = set(draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)))
    for name in names:
        if name not in chosen:
            hostile.ClearField(name)
    out = cls()
    out.CopyFrom(base)
    for name in chosen:
        out.ClearField(name)
    out.MergeFrom(hostile)
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("service,method,request_cls", METHODS, ids=[f"{s}.{m}" for s, m, _ in METHODS])
def test_near_valid_messages(cluster, channel, service, method, request_cls):
    """A valid request with a few hostile fields: reaches the checks past the first one."""

    @fuzz_settings(40)
    @given(msg=near_valid(request_cls))
    def run(msg):
        if getattr(msg, "worker_id", None) == WORKER or str(cluster.sims[WORKER].port) in getattr(msg, "url", ""):
            return
        _call(channel, service, method, msg.SerializeToString(), f"near-valid {service}.{method}")

    try:
        run()
    finally:
        asyncio.run(cluster.restore())
    _places(channel)


@pytest.mark.timeout(600)
def test_admin_values_on_a_real_worker(cluster, channel):
    """SetWeight and AddWorker with hostile values aimed at the worker that serves."""

    @fuzz_settings(60)
    @given(weight=floats)
    def run(weight):
        req = pb.SetWeightRequest(worker_id=WORKER, weight=weight)
        _call(channel, "Admin", "SetWeight", req.SerializeToString(), "SetWeight on the real worker")

    try:
        run()
    finally:
        asyncio.run(cluster.restore())
    _places(channel)


garbage = st.one_of(
    st.binary(min_size=1, max_size=512),
    st.sampled_from([b"\xff", b"\x08", b"\x0a\xff\xff\xff\xff\x0f", b"\x0a\x05ab",
                     b"\x12\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
                     b"\x07", b"\x0b", b"\x0c", b"\x80" * 11, b"\x0a\x02\xc3\x28"]),   # truncated, bad tags, bad UTF-8
)


@pytest.mark.timeout(600)
def test_random_bytes_on_every_method(cluster, channel):
    """Bytes that are (mostly) not a valid message: INVALID_ARGUMENT, one log line each."""
    before = _cp_log(cluster).count("controlplane.grpc_guard")
    refused = 0

    @fuzz_settings(200, scale=4)
    @given(which=st.sampled_from(METHODS), data=garbage)
    def run(which, data):
        nonlocal refused
        service, method, cls = which
        if (service, method) in MUTATING:
            try:
                parsed = cls.FromString(data)
                if getattr(parsed, "worker_id", None) == WORKER:
                    return
            except Exception:   # noqa: BLE001
                pass
        group = "random bytes (all unary methods)"
        n = TALLY.counts.get(group, {}).get("INVALID_ARGUMENT", 0)
        _call(channel, service, method, data, group)
        refused += TALLY.counts[group].get("INVALID_ARGUMENT", 0) - n

    try:
        run()
    finally:
        asyncio.run(cluster.restore())
    _places(channel)
    log = _cp_log(cluster)
    assert "Traceback" not in log
    assert "DecodeError] raised by servicer" not in log
    # Not every refusal is a decode failure (a valid decode can fail validation), but every
    # decode failure wrote exactly one line: counted once the marker's line is there too.
    _all_logged(cluster, channel)
    lines = _cp_log(cluster).count("controlplane.grpc_guard") - before - 1
    assert 1 <= lines <= refused


def test_one_malformed_message_one_line(cluster, channel):
    before = _cp_log(cluster)
    _call(channel, "Scheduler", "Place", b"\xff\xff\xff", "one line")
    _all_logged(cluster, channel)     # then the marker's line: nothing else in between
    new = _cp_log(cluster)[len(before):].strip().splitlines()
    assert len(new) == 2 and "malformed /omni_proxy.v1.Scheduler/Place message" in new[0], new
    assert MARKER_LINE in new[1], new


@pytest.mark.timeout(600)
def test_random_bytes_on_the_session_stream(cluster, channel):
    """A data plane's session that sends bytes that are not a message is ended with
    INVALID_ARGUMENT; the control plane goes on placing."""
    stream = channel.stream_stream("/omni_proxy.v1.Scheduler/Session", request_serializer=None,
                                   response_deserializer=None)

    @fuzz_settings(30)
    @given(frames=st.lists(garbage, min_size=1, max_size=3))
    def run(frames):
        def requests():
            yield pb.DataPlaneMessage(open=pb.SessionOpen(node_id="fuzz")).SerializeToString()
            yield from frames

        code, details = grpc.StatusCode.OK, None
        try:
            for _ in stream(requests(), timeout=20):
                pass
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
        _record("random bytes on Session", code, details)

    run()
    _places(channel)
    assert "Traceback" not in _cp_log(cluster)

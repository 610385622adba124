"""dataplane/admission.py in process: the in-flight limit, the priority queue, token buckets."""

from __future__ import annotations

import asyncio

import pytest

from dataplane.admission import (Admission, AdmissionConfig, Limit, RateLimiter, load_rate_limits,
                                 request_priority)
from dataplane.errors import APIError


class FakeRequest(dict):
    def __init__(self, headers=None, remote="127.0.0.1"):
        super().__init__()
        self.headers = headers or {}
        self.remote = remote


async def test_fast_path_and_release():
    a = Admission(AdmissionConfig(max_inflight=2, max_queued=0))
    await a.acquire()
    await a.acquire()
    assert a.inflight == 2
    with pytest.raises(APIError) as e:
        await a.acquire()
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
    a.release()
    a.release()
    assert a.inflight == 0 and a.queued == 0


async def test_queue_orders_by_priority_then_arrival():
    a = Admission(AdmissionConfig(max_inflight=1, max_queued=10, queue_timeout_s=10))
    await a.acquire()
    order = []

    async def waiter(name, prio):
        await a.acquire(prio)
        order.append(name)
        a.release()

    tasks = [asyncio.create_task(waiter(n, p)) for n, p in (("low", 5), ("first0", 0), ("high", -3),
                                                             ("second0", 0))]
    for _ in range(5):
        await asyncio.sleep(0)
    assert a.queued == 4
    a.release()
    await asyncio.gather(*tasks)
    assert order == ["high", "first0", "second0", "low"]
    assert a.inflight == 0 and a.queued == 0


async def test_queue_full_and_timeout_are_429():
    a = Admission(AdmissionConfig(max_inflight=1, max_queued=1, queue_timeout_s=0.05))
    await a.acquire()
    waiting = asyncio.create_task(a.acquire())
    await asyncio.sleep(0)
    with pytest.raises(APIError) as full:
        await a.acquire()
    assert full.value.status == 429 and "waiting" in full.value.message
    with pytest.raises(APIError) as late:
        await waiting
    assert late.value.status == 429 and late.value.headers["Retry-After"] == "1"
    assert a.queued == 0 and a.rejected_full == 1 and a.rejected_timeout == 1
    a.release()
    assert a.inflight == 0


async def test_cancelled_waiter_leaves_and_handed_slot_is_not_lost():
    a = Admission(AdmissionConfig(max_inflight=1, max_queued=4, queue_timeout_s=10))
    await a.acquire()
    gone = asyncio.create_task(a.acquire())
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert a.queued == 0
    # a waiter cancelled just after the slot was handed to it passes the slot on
    racer = asyncio.create_task(a.acquire())
    await asyncio.sleep(0)
    a.release()            # hands the slot to racer (not yet resumed)
    racer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await racer
    assert a.inflight == 0 and a.queued == 0


async def test_many_timeouts_keep_the_heap_bounded():
    a = Admission(AdmissionConfig(max_inflight=1, max_queued=8, queue_timeout_s=0))
    await a.acquire()
    for _ in range(500):
        with pytest.raises(APIError):
            await a.acquire()
    assert a.queued == 0 and len(a._heap) <= 64 + 1


def test_priority_sources_and_range():
    assert request_priority(FakeRequest(), {}) == 0
    assert request_priority(FakeRequest(), {"priority": -7}) == -7
    assert request_priority(FakeRequest({"X-Priority": " 3 "}), {"priority": -7}) == 3
    for headers, body in (({"X-Priority": "high"}, {}), ({}, {"priority": 1.5}), ({}, {"priority": True}),
                          ({}, {"priority": 2 ** 40}), ({"X-Priority": str(-2 ** 40)}, {})):
        with pytest.raises(APIError) as e:
            request_priority(FakeRequest(headers), body)
        assert e.value.status == 400


def test_token_bucket_rate_and_retry_after():
    now = [100.0]
    rl = RateLimiter(Limit(requests_per_s=2, burst=2), {"vip": Limit(requests_per_s=100, burst=100)},
                     clock=lambda: now[0])
    rl.check("a")
    rl.check("a")
    with pytest.raises(APIError) as e:
        rl.check("a")
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
    for _ in range(50):
        rl.check("vip")
    now[0] += 0.5            # one request's worth refilled
    rl.check("a")
    with pytest.raises(APIError):
        rl.check("a")


def test_prompt_token_bucket():
    now = [0.0]
    rl = RateLimiter(Limit(prompt_tokens_per_s=100, prompt_tokens_burst=1000), {}, clock=lambda: now[0])
    rl.check("a", 900)
    with pytest.raises(APIError) as e:
        rl.check("a", 300)
    assert e.value.headers["Retry-After"] == "2"
    now[0] += 2
    rl.check("a", 300)


def test_buckets_are_bounded_and_refilled_ones_dropped_first():
    now = [0.0]
    rl = RateLimiter(Limit(requests_per_s=1, burst=1), {}, max_buckets=100, clock=lambda: now[0])
    for i in range(10_000):
        rl.check(f"client-{i}")
        now[0] += 0.001
    assert len(rl) <= 100
    # every bucket has refilled after 1 s idle: new clients replace them without loss
    now[0] += 5
    for i in range(50):
        rl.check(f"new-{i}")
    assert len(rl) <= 100


def test_rate_limit_file(tmp_path):
    f = tmp_path / "limits.toml"
    f.write_text("[default]\nrequests_per_s = 5\n\n[keys.alice]\nrequests_per_s = 50\nburst = 80\n"
                 "prompt_tokens_per_s = 1000\n")
    default, keys = load_rate_limits(str(f))
    assert default == Limit(5, 5, 0, 0)
    assert keys["alice"] == Limit(50, 80, 1000, 1000)
    for text, needle in (("[default]\nrequests_per_s = -1\n", "default.requests_per_s"),
                         ("[default]\nrps = 1\n", "unknown keys"), ("[other]\n", "unknown tables"),
                         ("[default\n", "not valid TOML")):
        f.write_text(text)
        with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
            load_rate_limits(str(f))
    with pytest.raises(ValueError, match="--rate-limits"):
        load_rate_limits(str(tmp_path / "missing.toml"))


def test_client_identity():
    from dataplane.admission import client_identity

    class Keys:
        def who(self, presented):
            return "alice" if presented == "sk-a" else None

    r = FakeRequest({"Authorization": "Bearer sk-a"}, remote="10.0.0.9")
    assert client_identity(r, Keys()) == "alice"
    assert client_identity(r).startswith("key-") and len(client_identity(r)) == 16
    assert client_identity(FakeRequest({"Authorization": "Bearer sk-b"}), Keys()).startswith("key-")
    assert client_identity(FakeRequest(remote="10.0.0.9")) == "ip-10.0.0.9"
    r["api_key_name"] = "bob"     # an auth middleware that records the name wins
    assert client_identity(r, Keys()) == "bob"

"""omni_runtime.retry: the one retry policy (backoff with full jitter, attempt cap, deadline,
never a 4xx, hooks). An injected clock and sleep: nothing here really waits."""

from __future__ import annotations

import random

import pytest

from omni_runtime.retry import Retry, retryable_error


class FakeTime:
    """A clock that only the fake sleep moves."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class StatusError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"status {status}")
        self.upstream_status = status


def failing(errors: list[BaseException], result: str = "ok"):
    """An operation that raises each of ``errors`` in turn, then returns ``result``."""
    calls = []

    async def op() -> str:
        calls.append(len(calls))
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return result
    return op, calls


def test_full_jitter_stays_within_the_growing_window():
    policy = Retry(base_s=0.1, max_s=1.0, rng=random.Random(7))
    for attempt, window in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0), (200, 1.0)]:
        draws = [policy.delay(attempt) for _ in range(500)]
        assert all(0.0 <= d <= window for d in draws), (attempt, max(draws))
        # Full jitter: the draws spread over the whole window, not a band near its top.
        assert min(draws) < window * 0.1 and max(draws) > window * 0.9, (attempt, min(draws), max(draws))


@pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
async def test_a_4xx_is_never_retried(status):
    fake = FakeTime()
    op, calls = failing([StatusError(status)])
    hooked = []
    policy = Retry(attempts=5, clock=fake.clock, sleep=fake.sleep, on_retry=lambda *a: hooked.append(a))
    with pytest.raises(StatusError):
        await policy.call(op)
    assert len(calls) == 1 and fake.slept == [] and hooked == []


@pytest.mark.parametrize("status", [0, 429, 500, 502, 503, 504])
async def test_engine_failures_are_retried_until_the_attempt_cap(status):
    fake = FakeTime()
    op, calls = failing([StatusError(status)] * 10)
    policy = Retry(attempts=3, clock=fake.clock, sleep=fake.sleep)
    with pytest.raises(StatusError):
        await policy.call(op)
    assert len(calls) == 4 and len(fake.slept) == 3        # the first try and three retries


async def test_success_after_failures_returns_the_result_and_a_first_success_never_sleeps():
    fake = FakeTime()
    policy = Retry(attempts=3, clock=fake.clock, sleep=fake.sleep)
    op, calls = failing([ConnectionResetError(), StatusError(503)], result="done")
    assert await policy.call(op) == "done" and len(calls) == 3 and len(fake.slept) == 2
    fake.slept.clear()
    op, calls = failing([], result="first")
    assert await policy.call(op) == "first" and len(calls) == 1 and fake.slept == []


async def test_the_deadline_ends_retrying_before_a_retry_would_start_after_it():
    fake = FakeTime()
    policy = Retry(attempts=1000, base_s=1.0, max_s=1.0, deadline_s=5.0, rng=random.Random(3),
                   clock=fake.clock, sleep=fake.sleep)
    op, calls = failing([TimeoutError()] * 1000)
    with pytest.raises(TimeoutError):
        await policy.call(op)
    assert sum(fake.slept) < 5.0                     # no retry began at or past the deadline
    assert sum(fake.slept) > 3.0 and len(calls) > 5   # and it kept trying until close to it


async def test_the_deadline_counts_the_attempts_own_time():
    fake = FakeTime()
    policy = Retry(attempts=1000, base_s=0.01, max_s=0.01, deadline_s=2.0, clock=fake.clock, sleep=fake.sleep)
    calls = []

    async def slow() -> None:
        calls.append(1)
        fake.now += 0.9                              # each attempt takes 0.9 s before failing
        raise ConnectionRefusedError()
    with pytest.raises(ConnectionRefusedError):
        await policy.call(slow)
    assert len(calls) == 3                           # at 0.9 s and 1.8 s there was still time, at 2.7 s none


async def test_on_retry_hears_each_retry_with_its_delay_and_error():
    fake = FakeTime()
    errors = [StatusError(502), TimeoutError(), StatusError(503)]
    hooked: list[tuple[int, float, BaseException]] = []
    policy = Retry(attempts=2, clock=fake.clock, sleep=fake.sleep, on_retry=lambda *a: hooked.append(a))
    op, calls = failing(errors)
    with pytest.raises(StatusError):
        await policy.call(op)
    assert [(a, e) for a, _, e in hooked] == [(1, errors[0]), (2, errors[1])]   # not the third: cap reached
    assert [d for _, d, _ in hooked] == fake.slept


async def test_a_caller_predicate_decides_and_unknown_errors_are_not_retried_by_default():
    fake = FakeTime()
    op, calls = failing([ValueError("a bug, not an outage")])
    with pytest.raises(ValueError):
        await Retry(clock=fake.clock, sleep=fake.sleep).call(op)
    assert len(calls) == 1
    op, calls = failing([ValueError("retry me")], result="ok")
    policy = Retry(retryable=lambda exc: isinstance(exc, ValueError), clock=fake.clock, sleep=fake.sleep)
    assert await policy.call(op) == "ok" and len(calls) == 2


def test_default_predicate():
    assert retryable_error(ConnectionRefusedError()) and retryable_error(TimeoutError())
    assert not retryable_error(RuntimeError())

    class WithStatus(Exception):
        status = 404
    assert not retryable_error(WithStatus())
    WithStatus.status = 503
    assert retryable_error(WithStatus())


def test_next_delay_for_loops_that_do_their_own_step_between_attempts():
    hooked = []
    policy = Retry(attempts=2, base_s=0.5, max_s=30.0, rng=random.Random(1), on_retry=lambda *a: hooked.append(a))
    first = policy.next_delay(StatusError(502), 1)
    assert first is not None and 0.0 <= first <= 0.5
    assert policy.next_delay(StatusError(400), 1) is None
    assert policy.next_delay(StatusError(502), 3) is None        # past the cap
    assert len(hooked) == 1

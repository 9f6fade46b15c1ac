"""The ingress's deadline and the answers for failed or lost units, without Ray or Serve running."""

from __future__ import annotations

import asyncio

import pytest

from cluster.serving.failures import Deadline, deadline_s, unit_failed, unit_lost


def test_the_ingress_answers_before_the_proxy():
    assert deadline_s(300.0) == 299.0  # 1 s margin
    assert deadline_s(0.5) == pytest.approx(0.45)  # at most 10% of a short limit


async def _events(gaps):
    for i, gap in enumerate(gaps):
        await asyncio.sleep(gap)
        yield i


def test_deadline_passes_events_through_then_times_out():
    async def collect(gaps, seconds):
        seen = []
        async for event in Deadline(seconds).timed(_events(gaps)):
            seen.append(event)
        return seen

    assert asyncio.run(collect([0, 0.01, 0], 5.0)) == [0, 1, 2]
    seen = []

    async def late():
        async for event in Deadline(0.1).timed(_events([0, 0, 1.0])):
            seen.append(event)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(late())
    assert seen == [0, 1]
    error = Deadline(12.0).error()
    assert error.status == 408 and error.body()["error"]["code"] == "request_timeout" and "12 s" in error.message


def test_failed_and_lost_units_are_retryable_503s():
    cases = ((unit_failed("a shard died"), "unit_failed"), (unit_lost(RuntimeError("gone")), "unit_unavailable"))
    for error, code in cases:
        body = error.body()["error"]
        assert error.status == 503 and error.headers["Retry-After"] == "1"
        assert body["code"] == code and body["type"] == "server_error"
        assert set(body) == {"message", "type", "param", "code"}

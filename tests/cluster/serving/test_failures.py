"""The ingress's deadline and the answers for failed or lost units, without Ray or Serve running."""

from __future__ import annotations

import asyncio

import pytest

from cluster.serving.failures import ClosingStreamingResponse, Deadline, deadline_s, unit_failed, unit_lost


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


def test_a_client_gone_during_a_send_still_runs_the_streams_cleanup():
    """The disconnect's cancellation lands in `send`, outside the body generator: its `finally` runs at once."""
    cleaned = []

    async def body():
        try:
            for i in range(10):
                yield f"data: {i}\n\n"
        finally:
            cleaned.append(True)

    async def run():
        sent, stalled = [], asyncio.Event()

        async def send(message):
            sent.append(message)
            if len(sent) == 3:  # start, first chunk, then the client stops reading
                stalled.set()
                await asyncio.Event().wait()

        async def receive():
            await asyncio.Event().wait()

        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        task = asyncio.ensure_future(ClosingStreamingResponse(body())(scope, receive, send))
        await stalled.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return cleaned[:]  # before the loop ends (which would finalize a forgotten generator anyway)

    assert asyncio.run(run()) == [True]

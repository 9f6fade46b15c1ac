"""Stream batching (`cluster.serving.decoder.coalesced`): merged deltas keep the stream's content and order, the first
delta and a held one are never kept waiting for the next round, and closing the stream closes the unit's."""

from __future__ import annotations

import asyncio

import pytest

from actors.requests import TokenLogprob
from cluster.serving.decoder import Finished, TextDelta, coalesced, merge


def delta(i: int, logprobs: bool = False) -> TextDelta:
    return TextDelta(f"t{i} ", (i,), (TokenLogprob(i, -0.5),) if logprobs else None)


FINISHED = Finished("length", (0, 1, 2), "", None, None, "u")


async def rounds(n: int, gap_s: float, logprobs: bool = False):
    for i in range(n):
        await asyncio.sleep(gap_s)
        yield delta(i, logprobs)
    yield FINISHED


async def collect(events):
    return [event async for event in events]


def test_interval_zero_passes_every_event_through():
    out = asyncio.run(collect(coalesced(rounds(5, 0.0), 0.0)))
    assert out == [delta(i) for i in range(5)] + [FINISHED]


@pytest.mark.parametrize("logprobs", [False, True])
def test_merged_deltas_keep_text_tokens_and_logprobs_in_order_and_end_with_finished(logprobs):
    out = asyncio.run(collect(coalesced(rounds(40, 0.002, logprobs), 0.05)))
    deltas = out[:-1]
    assert out[-1] == FINISHED and all(isinstance(d, TextDelta) for d in deltas)
    assert deltas[0] == delta(0, logprobs)  # the first token goes out alone, at once
    assert len(deltas) < 40  # rounds 2 ms apart under a 50 ms interval: merged
    assert "".join(d.text for d in deltas) == "".join(f"t{i} " for i in range(40))
    assert sum((d.token_ids for d in deltas), ()) == tuple(range(40))
    if logprobs:
        assert [e.token_id for d in deltas for e in d.logprobs] == list(range(40))
    else:
        assert all(d.logprobs is None for d in deltas)


def test_a_held_delta_is_sent_without_waiting_for_the_next_round():
    """The source produces its third delta only once the consumer has the second: a delta held for the interval
    must go out when the interval ends, or this would wait forever."""
    received = asyncio.Event()

    async def source():
        yield delta(0)
        yield delta(1)  # held: the interval since the first has not passed
        await received.wait()
        yield delta(2)
        yield FINISHED

    async def run():
        out = []
        async for event in coalesced(source(), 0.02):
            out.append(event)
            if len(out) == 2:
                received.set()
        return out

    out = asyncio.run(asyncio.wait_for(run(), 10))
    assert out == [delta(0), delta(1), delta(2), FINISHED]


def test_closing_the_stream_closes_the_units_while_a_round_is_pending():
    closed = asyncio.Event()

    async def source():
        try:
            yield delta(0)
            await asyncio.sleep(60)  # the next round never comes
            yield delta(1)
        finally:
            closed.set()

    async def run():
        stream = coalesced(source(), 0.02)
        assert await anext(stream) == delta(0)
        consumer = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        consumer.cancel()  # the client goes away while the unit computes
        with pytest.raises(asyncio.CancelledError):
            await consumer
        await stream.aclose()
        return closed.is_set()

    assert asyncio.run(asyncio.wait_for(run(), 10))


def test_an_error_in_the_units_stream_reaches_the_consumer():
    async def source():
        yield delta(0)
        raise RuntimeError("engine gone")

    async def run():
        return [event async for event in coalesced(source(), 0.02)]

    with pytest.raises(RuntimeError, match="engine gone"):
        asyncio.run(run())


def test_deltas_with_and_without_logprobs_do_not_merge():
    with pytest.raises(ValueError, match="logprobs"):
        merge(delta(0, True), delta(1, False))

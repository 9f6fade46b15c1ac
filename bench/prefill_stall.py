"""Latency under a long prefill: what a long prompt does to the streams decoding beside it.

`streams` target-only requests (γ = 0: one token per stream per round) decode on an in-process unit; once each
has emitted `warmup` tokens a `long_tokens`-token prompt arrives. The **inter-token latency** (ITL) is the gap
between consecutive tokens of one stream; the ratio compared with `GOAL_RATIO` is the p95 of the gaps that
overlap the long prompt's prefill (its arrival to its first token) over the p95 of the gaps before it arrived.
`compare` runs each `target.prefill_chunk_tokens` setting on one engine, in order and then in reverse.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from bench.harness import percentile

GOAL_RATIO = 2.0


@dataclass(frozen=True)
class StallRun:
    chunk: int | None  # prefill_chunk_tokens; None = whole prompts
    steady_p95_s: float
    during_p95_s: float
    max_gap_s: float  # the longest gap in the window (the stall itself without chunking)
    long_ttft_s: float  # the long prompt's time to first token

    @property
    def ratio(self) -> float:
        return self.during_p95_s / self.steady_p95_s

    def summary(self) -> dict:
        return {"chunk": self.chunk, "steady_p95_itl_s": self.steady_p95_s, "during_p95_itl_s": self.during_p95_s,
                "ratio": self.ratio, "max_gap_s": self.max_gap_s, "long_ttft_s": self.long_ttft_s,
                "within_goal": self.ratio <= GOAL_RATIO}


def long_prompt(vocab_size: int, tokens: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab_size) for _ in range(tokens)]


def measure(coordinator, *, streams: int, long_tokens: int, vocab_size: int, warmup: int = 12,
            stream_tokens: int = 400, seed: int = 0) -> StallRun:
    """One run on `coordinator` (its scheduler's chunk setting is the one measured)."""
    from actors.requests import GenerationRequest, SamplingParams

    rng = random.Random(seed)
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    short = [[rng.randrange(100, vocab_size) for _ in range(16)] for _ in range(streams)]
    params = SamplingParams(max_tokens=stream_tokens, ignore_eos=True)

    async def stream(i: int, stop: asyncio.Event):
        request = GenerationRequest(f"stall-{seed}-{i}", short[i], params, speculate=False)
        async for chunk in coordinator.generate(request):
            arrivals[i].extend([time.perf_counter()] * len(chunk.token_ids))
            if stop.is_set():
                await coordinator.abort(request.request_id)

    async def scenario():
        stop = asyncio.Event()
        tasks = [asyncio.ensure_future(stream(i, stop)) for i in range(streams)]
        while min(len(a) for a in arrivals) < warmup:
            await asyncio.sleep(0.005)
        arrived = time.perf_counter()
        request = GenerationRequest(f"stall-{seed}-long", long_prompt(vocab_size, long_tokens, seed),
                                    SamplingParams(max_tokens=4, ignore_eos=True), speculate=False)
        first = None
        async for chunk in coordinator.generate(request):
            if chunk.token_ids and first is None:
                first = time.perf_counter()
        closes = time.perf_counter() + 60.0  # every stream's next token closes its gap over the prefill
        while any(times[-1] <= first for times in arrivals) and time.perf_counter() < closes:
            await asyncio.sleep(0.005)
        stop.set()
        await asyncio.gather(*tasks)
        await coordinator.stop()
        return arrived, first

    arrived, first = asyncio.run(scenario())
    gaps = [(a, b) for times in arrivals for a, b in zip(times, times[1:])]
    steady = sorted(b - a for a, b in gaps if b <= arrived)  # every gap before the long prompt arrived
    during = sorted(b - a for a, b in gaps if b > arrived and a < first)  # gaps overlapping its prefill
    if not steady or not during:
        raise RuntimeError("prefill stall: no tokens in a window; the streams ended too early")
    return StallRun(coordinator.scheduler.prefill_chunk_tokens, percentile(steady, 95), percentile(during, 95),
                    during[-1], first - arrived)


def compare(coordinator, chunks: list[int | None], *, streams: int = 8, long_tokens: int = 1500,
            vocab_size: int, repeats: int = 2, stream_tokens: int = 400) -> list[dict]:
    """Each chunk setting measured `repeats` times, interleaved (forward order, then reversed)."""
    runs: dict[int | None, list[StallRun]] = {c: [] for c in chunks}
    order = []
    for r in range(repeats):
        order += chunks if r % 2 == 0 else list(reversed(chunks))
    for n, chunk in enumerate(order):
        coordinator.scheduler.prefill_chunk_tokens = chunk
        runs[chunk].append(measure(coordinator, streams=streams, long_tokens=long_tokens, vocab_size=vocab_size,
                                   stream_tokens=stream_tokens, seed=n))
    out = []
    for chunk, results in runs.items():
        best = sorted(results, key=lambda r: r.ratio)[len(results) // 2]  # the median run by ratio
        out.append({**best.summary(), "ratios": [r.ratio for r in results]})
    return out

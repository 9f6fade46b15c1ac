"""HTTP load for the reliability section: greedy requests over `/v1/completions`, each classified by how it
ended (`bench.reliability` defines the outcomes).

`run_load` sends them at a bounded concurrency through one `httpx.AsyncClient`; `send` never raises: a
dropped connection is a "lost" outcome and a request past `request_timeout_s` + `HANG_SLACK_S` a "hung" one.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

from cluster.serving.ab import ARM_HEADER

HANG_SLACK_S = 15.0


@dataclass(frozen=True)
class LoadRequest:
    index: int
    prompt: tuple[int, ...] | str
    max_tokens: int
    stream: bool
    arm: str | None  # None: the app's weights choose


@dataclass
class Outcome:
    index: int
    arm: str
    stream: bool
    end: str  # "completed" | "errored" | "lost" | "hung"
    status: int | None = None
    code: str | None = None  # the error's code
    latency_s: float = 0.0
    text: str = ""
    degraded: bool = False
    regret_spent: float | None = None
    regret_budget: float | None = None
    ttft_s: float | None = None  # streamed: seconds to the first chunk with text


def plan_load(prompts: list[tuple[int, ...]], n: int, lengths: tuple[int, ...], arms: tuple[str, ...],
              seed: int = 0) -> list[LoadRequest]:
    """n requests over every (prompt, max_tokens, stream, arm) mix, in a seeded order."""
    rng = random.Random(seed)
    return [LoadRequest(i, rng.choice(prompts), rng.choice(lengths), rng.random() < 0.5, rng.choice(arms))
            for i in range(n)]


async def send(client, url: str, model: str, req: LoadRequest, *, timeout_s: float,
               headers: dict[str, str] | None = None, speculate: bool = True) -> Outcome:
    """One request, classified; never raises."""
    prompt = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
    body = {"model": model, "prompt": prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "stream": req.stream, "speculate": speculate}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    out = Outcome(req.index, req.arm, req.stream, "lost")
    start = time.monotonic()
    try:
        arm = {} if req.arm is None else {ARM_HEADER: req.arm}
        await asyncio.wait_for(_exchange(client, url, body, {**(headers or {}), **arm}, out), timeout_s + HANG_SLACK_S)
    except asyncio.TimeoutError:
        out.end = "hung"
    except Exception as err:  # connection dropped, unreadable answer
        out.end, out.code = "lost", type(err).__name__
    out.latency_s = time.monotonic() - start
    return out


async def _exchange(client, url: str, body: dict, headers: dict, out: Outcome) -> None:
    start = time.monotonic()
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=None) as r:
        out.status = r.status_code
        if r.status_code != 200 or not body["stream"]:
            answer = json.loads(await r.aread())
            if r.status_code != 200:
                out.end, out.code = ("errored", answer["error"]["code"]) if "error" in answer else ("lost", None)
                return
            out.text = answer["choices"][0]["text"]
            _usage(out, answer.get("usage"))
            out.end = "completed"
            return
        text, finished, done, error = [], False, False, None
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]["code"]
                continue
            for choice in chunk["choices"]:
                if out.ttft_s is None and choice["text"]:
                    out.ttft_s = time.monotonic() - start
                text.append(choice["text"])
                finished = finished or choice["finish_reason"] is not None
            _usage(out, chunk.get("usage"))
        out.text = "".join(text)
        if done and error is not None:
            out.end, out.code = "errored", error
        elif done and finished:
            out.end = "completed"


def _usage(out: Outcome, usage: dict | None) -> None:
    spec = (usage or {}).get("speculative") or {}
    out.degraded = bool(spec.get("degraded"))
    out.regret_spent, out.regret_budget = spec.get("regret_spent"), spec.get("regret_budget")


async def run_load(url: str, model: str, requests: list[LoadRequest], *, concurrency: int, timeout_s: float,
                   headers: dict[str, str] | None = None, speculate: bool = True, on_done=None) -> list[Outcome]:
    """Every request, at most `concurrency` at once; `on_done(outcome)` after each."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(limits=limits) as client:

        async def one(req):
            async with gate:
                outcome = await send(client, url, model, req, timeout_s=timeout_s, headers=headers,
                                     speculate=speculate)
            if on_done is not None:
                on_done(outcome)
            return outcome

        return await asyncio.gather(*(one(r) for r in requests))

"""The choices of one HTTP request: one `DecodeJob` each, their event streams merged, and each one's answer.

A request has `n` choices per prompt, numbered prompt-major (`cluster.serving.bodies`). Each is its own job, so
each runs, streams and ends on its own; a unit on vLLM shares their prompt's prefill through its prefix cache.
A seeded request's choice j draws with seed + j (vLLM's rule), so each choice reproduces alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.timing import add, hops
from cluster.serving.bodies import TokenText, chat_logprobs, completion_logprobs, merge_speculative, usage_body
from cluster.serving.decoder import DecodeJob, Finished, TextDelta
from cluster.serving.errors import APIError
from cluster.serving.protocol import INT64_MIN

UNIT_FIELDS = {"structured": "response_format"}  # a unit's name of a field (`SamplingParams`) -> the request's


def choice_seed(seed: int | None, j: int) -> int | None:
    """The seed of a request's j-th choice of a prompt: seed + j, wrapped into the int64 range."""
    if seed is None:
        return None
    return (seed + j - INT64_MIN) % 2**64 + INT64_MIN


def check_room(total: int, room: int, n: int) -> None:
    """A request's `total` choices run at once, each a sequence of the unit: more than the `room` it runs at once
    (`serving.max_ongoing_requests`) would wait behind each other in the queue other requests need, and no retry
    helps, so they are a 400 naming `n` (or `prompt`, for a list of prompts with n = 1)."""
    if total > room:
        param = "n" if n > 1 else "prompt"
        raise APIError(f"{param}: {total} choices exceed the {room} a unit runs at once", param=param,
                       code="invalid_value")


def refusal(message: str) -> APIError:
    """The 400 for a job a unit refused: its ValueError's message names the field first ("field: why")."""
    field, _, why = message.partition(":")
    if not why or not field.isidentifier():
        return APIError(message, code="invalid_value")
    param = UNIT_FIELDS.get(field, field)
    return APIError(f"{param}:{why}", param=param, code="invalid_value")


async def read_ahead(streams: Sequence[AsyncIterator]) -> list[AsyncIterator]:
    """Each stream's first event read now, so a job its unit refuses is a 400 before a response starts; the
    streams again, each first event put back in front."""
    firsts = await asyncio.gather(*(s.__anext__() for s in streams))
    refused = next((f for f in firsts if isinstance(f, Finished) and f.refused), None)
    if refused is not None:
        raise refusal(refused.error)
    return [_replayed(first, stream) for first, stream in zip(firsts, streams)]


async def _replayed(first, events: AsyncIterator) -> AsyncIterator:
    yield first
    async for event in events:
        yield event


@dataclass
class Choice:
    """One choice's answer as it is built: its text so far (an echoed prompt first) and its logprobs."""

    index: int
    job: DecodeJob
    chat: bool
    echo: str = ""  # the prompt's text, sent before the output (completions' `echo`)
    text: list[str] = field(default_factory=list)
    chars: int = 0  # characters of text sent so far, echo included (completions' text_offset)
    logprobs: list = field(default_factory=list)
    finished: Finished | None = None

    def __post_init__(self):
        self.chars = len(self.echo)

    def render_logprobs(self, entries, token_text: TokenText) -> dict[str, Any] | None:
        """`entries`' logprobs in the route's shape (None when the job did not ask for them); advances the
        character offset past `entries`' tokens."""
        if entries is None:
            return None
        if self.chat:
            return chat_logprobs(entries, token_text)
        body = completion_logprobs(entries, token_text, self.chars)
        self.chars += sum(len(t) for t in body["tokens"])
        return body

    def add(self, event: TextDelta | Finished) -> None:
        """A non-streaming choice: keep the event's text and logprobs."""
        self.text.append(event.text)
        if event.logprobs is not None:
            self.logprobs.extend(event.logprobs)
        if isinstance(event, Finished):
            self.finished = event

    @property
    def full_text(self) -> str:
        return self.echo + "".join(self.text)


async def merged(streams: Sequence[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """(i, event) from every stream i as events arrive; the first stream to raise ends the merge with its error,
    and every stream's reader is cancelled when the merge ends, however it ends."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for event in stream:
                await queue.put((i, event, None))
            await queue.put((i, end, None))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which re-raises it
            await queue.put((i, end, err))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            i, event, err = await queue.get()
            if err is not None:
                raise err
            if event is end:
                open_streams -= 1
                continue
            yield i, event
    finally:
        for task in tasks:
            task.cancel()


def usage(choices: list[Choice], timing: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
    """`usage` over every choice: each prompt counted once, every choice's output tokens; `speculative`
    (`bodies.merge_speculative`) with each choice's `timing_s` completed by the ingress's hops (`actors.timing`)."""
    per_choice = []
    for choice in choices:
        speculative = choice.finished.speculative
        if speculative is not None:
            hop = {**(speculative.get("timing_s") or {}), "tokenize": timing["tokenize"],
                   "ingress_to_unit": timing["ingress_to_unit"][choice.index]}
            speculative = {**speculative, "timing_s": hops(add(hop, "detokenize_sse", timing["sse"]))}
        per_choice.append(speculative)
    return usage_body(prompt_tokens, sum(len(c.finished.token_ids) for c in choices), merge_speculative(per_choice))


def openai_reason(finished: Finished) -> str:
    """OpenAI knows "stop" and "length"; an aborted sequence (unit shutting down) reads as "stop"."""
    return "length" if finished.finish_reason == "length" else "stop"

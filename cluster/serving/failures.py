"""How the ingress answers when the unit side fails or a request runs out of time.

- **Unit failed** (a target shard died: the unit ends its in-flight requests with finish_reason "error" and
  rebuilds) and **unit unavailable** (the decoder replica's process died under the request; Serve starts
  another): the request was not at fault and may be sent again, so the answer is 503 with Retry-After, or an
  SSE error event once a stream has begun. A request whose replica died has its ledger closed here, since
  the unit that held it is gone.
- **Deadline**: `serving.request_timeout_s` bounds a request end to end, queueing included. The ingress ends
  it a little before Serve's proxy would (`deadline_s`), so the client gets a 408 with OpenAI's error body
  (or an SSE error event and `[DONE]`), never a cut connection, and the unit frees the sequence. The proxy's
  own timeout stays as the backstop; a client cannot lift this one with Serve's `x-request-timeout-seconds`.
- **Client gone**: `ClosingStreamingResponse` closes its body generator however the response ends, so the
  generator's cleanup (cancelling the unit's stream: KV and ledger freed) never waits for garbage collection;
  `AfterJSONResponse` runs its follow-up (the quality audit) once the body is sent or the client is gone.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from cluster.serving.errors import APIError

UNIT_LOST = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)  # the replica died or is gone
RETRY_AFTER_S = 1
PROXY_MARGIN_S = 1.0  # the ingress's deadline comes this much before the proxy's (at most 10% of it)


def deadline_s(request_timeout_s: float) -> float:
    """Seconds the ingress gives a request: `request_timeout_s` less a margin, so it answers first."""
    return request_timeout_s - min(PROXY_MARGIN_S, 0.1 * request_timeout_s)


class Deadline:
    """A request's deadline on the monotonic clock."""

    def __init__(self, seconds: float, clock=time.monotonic):
        self.seconds, self.clock = seconds, clock
        self.at = clock() + seconds

    def left(self) -> float:
        return max(0.0, self.at - self.clock())

    async def next(self, events):
        """The stream's next event; `asyncio.TimeoutError` past the deadline, StopAsyncIteration at its end."""
        return await asyncio.wait_for(events.__anext__(), self.left())

    async def timed(self, events):
        """The stream's events, raising `asyncio.TimeoutError` once the deadline passes."""
        while True:
            try:
                event = await self.next(events)
            except StopAsyncIteration:
                return
            yield event

    def error(self) -> APIError:
        return APIError(f"the request did not finish within the server's limit of {self.seconds:.0f} s",
                        status=408, type="timeout_error", code="request_timeout")


def unit_failed(message: str) -> APIError:
    return APIError(f"generation failed: {message}", status=503, type="server_error", code="unit_failed",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def unit_lost(err: BaseException) -> APIError:
    return APIError(f"the decoder unit serving this request went away ({type(err).__name__}); send it again",
                    status=503, type="server_error", code="unit_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


class ClosingStreamingResponse(StreamingResponse):
    """A `StreamingResponse` whose body generator is closed when the response ends, however it ends.

    A client that disconnects cancels the response's task. Where the cancellation lands in `send`, the body
    generator is left suspended at a `yield` and its `finally` would run only when the generator is collected.
    Closing it here runs that cleanup at once.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)  # an async generator's; Starlette's own wrappers
            if close is not None:
                await close()


class AfterJSONResponse(JSONResponse):
    """A `JSONResponse` that calls `after()` once its body is sent, or the sending failed (client gone)."""

    def __init__(self, content: Any, after, **kwargs):
        super().__init__(content, **kwargs)
        self.after = after

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.after()

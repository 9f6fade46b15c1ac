"""The OpenAI-compatible HTTP front end (a Serve ingress deployment with FastAPI).

Per request: validate the body (`cluster.serving.protocol`; omitted sampling fields take `serving.defaults`, else
OpenAI's), tokenize, check the context limit, pick the arm (`cluster.serving.ab`) and stream a `DecodeJob` to
a decoder unit through a Serve handle; answers are OpenAI bodies, or SSE chunks ending with `data: [DONE]`.
Client mistakes get a 4xx with OpenAI's error body, a full queue or a failed unit a 503 with Retry-After
(`cluster.serving.failures`), a request past `serving.request_timeout_s` a 408; a client that disconnects aborts
its sequence in the unit. Greedy ASD requests the `AuditSampler` draws are replayed on the exact reference arm in
the background, submitted once the last byte is sent (or the client is gone). `usage.speculative.timing_s` gets
the ingress's hops (`actors.timing`): `tokenize`, `ingress_to_unit` and the OpenAI encoding after the unit's final
message (an earlier chunk's is encoded while the unit works on). Every status: docs/reliability.md; the request path: docs/architecture.md.
"""


import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.requests import SamplingParams
from actors.timing import add, hops
from cluster.config import parse_config
from cluster.serving import openapi
from cluster.serving.ab import ARM_HEADER, ARM_RESPONSE_HEADER, ArmRouter, UnknownArmError
from cluster.serving.audit import AuditRunner, AuditSampler
from cluster.serving.decoder import DecodeJob, Finished, TextDelta, UnitStarted, policy_actor_name, policy_kwargs
from cluster.serving.failures import (
    UNIT_LOST,
    ClosingStreamingResponse,
    Deadline,
    deadline_s,
    unit_failed,
    unit_lost,
)
from cluster.serving.guard import GuardPolicy, RequestGuard
from cluster.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chunk_body,
    completion_body,
    error_body,
    models_body,
    resolve_max_tokens,
    usage_body,
    validation_error,
)

logger = logging.getLogger(__name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_RETRY_AFTER_S = 1

app = FastAPI(title="specserve", description="OpenAI-compatible speculative decoding on Ray Serve.")
app.add_middleware(RequestGuard)  # enforces app.state.guard, set from the config by OpenAIIngress.__init__


@app.exception_handler(APIError)
async def _api_error(request: Request, err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


@app.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
    api_error = validation_error(list(err.errors()))
    return JSONResponse(api_error.body(), status_code=api_error.status)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    return JSONResponse(
        error_body(str(err.detail), type=kind, code=str(err.status_code)),
        status_code=err.status_code,
        headers=getattr(err, "headers", None),
    )


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


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


def _usage(job: DecodeJob, finished: Finished, ingress: dict[str, float]) -> dict[str, Any]:
    """`usage`, its `speculative.timing_s` completed with the ingress's hops (`actors.timing.hops`)."""
    speculative = finished.speculative
    if speculative is not None:
        timing = speculative.get("timing_s") or {}
        timing = add({**timing, "tokenize": ingress["tokenize"], "ingress_to_unit": ingress["ingress_to_unit"]},
                     "detokenize_sse", ingress["sse"])
        speculative = {**speculative, "timing_s": hops(timing)}
    return usage_body(len(job.prompt_ids), len(finished.token_ids), speculative)


def _openai_reason(finished: Finished) -> str:
    """OpenAI knows "stop" and "length"; an aborted sequence (unit shutting down) reads as "stop"."""
    return "length" if finished.finish_reason == "length" else "stop"


# Everything the ingress class uses is defined above it: serve.ingress captures the class when it decorates it.
@serve.ingress(app)
class OpenAIIngress:
    """Serve ingress body (wrapped by `cluster.serving.app.build_app`). `decoder` is the decoder deployment's handle;
    `config` the dumped `SpecServeConfig`."""

    def __init__(self, decoder, config: dict[str, Any]):
        from actors.sources import context_length, load_tokenizer, model_info

        self.config = parse_config(config)
        self.decoder = decoder.options(stream=True)
        self.app_name = serve.get_replica_context().app_name
        self.tokenizer = load_tokenizer(self.config.target.source)
        info = model_info(self.config.target.source)
        self.max_seq_len = context_length(self.config.target.max_seq_len, info)
        self.vocab_size = info["vocab_size"]
        self.router = ArmRouter(self.config.arms)
        self.sampler = AuditSampler(self.config.audit.fraction)
        self.auditor = AuditRunner(
            self.config.audit.reference_arm, self._send_audit, max_pending=self.config.audit.max_pending
        )
        self._hub = None
        self.created = int(time.time())
        serving = self.config.serving
        self.timeout_s = deadline_s(serving.request_timeout_s)
        app.state.guard = GuardPolicy.from_settings(serving)
        app.openapi_schema = None  # FastAPI's document, completed with what this config knows
        app.openapi_schema = openapi.specserve_openapi(
            app.openapi(), served_name=self.config.target.served_name, arms=[a.name for a in self.config.arms],
            max_tokens_limit=serving.max_tokens_limit, auth=app.state.guard.auth,
            protect_metrics=serving.protect_metrics, protect_export=serving.protect_export)

    # --- routes ------------------------------------------------------------------------------------------
    @app.get("/healthz", response_model=openapi.Health)
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models", response_model=openapi.ModelList, responses=openapi.MODELS)
    async def models(self) -> dict[str, Any]:
        return models_body(self.config.target.served_name, created=self.created)

    @app.get("/metrics", response_class=PlainTextResponse, responses=openapi.METRICS)
    async def metrics(self) -> Response:
        text = await self.hub().prometheus_text.remote()
        return Response(text, media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/specserve/export", response_model=openapi.Export, responses=openapi.EXPORT)
    async def export(self) -> JSONResponse:
        return JSONResponse(await self.hub().export.remote())

    @app.post("/v1/completions", response_model=openapi.Completion, responses=openapi.GENERATE)
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        start = time.perf_counter()
        prompt = self._completion_prompt(body)
        return await self._serve(body, prompt, request, chat=False, tokenize_s=time.perf_counter() - start)

    @app.post("/v1/chat/completions", response_model=openapi.ChatCompletion, responses=openapi.GENERATE)
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        start = time.perf_counter()
        prompt = self._chat_prompt(body)
        return await self._serve(body, prompt, request, chat=True, tokenize_s=time.perf_counter() - start)

    # --- request handling --------------------------------------------------------------------------------
    def hub(self):
        if self._hub is None:
            from cluster.observability.telemetry import get_or_create_hub

            self._hub = get_or_create_hub(self.app_name, self.config.telemetry, [a.name for a in self.config.arms])
        return self._hub

    def _completion_prompt(self, body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, str):
            return list(self.tokenizer.encode(body.prompt))
        if max(body.prompt) >= self.vocab_size:
            raise APIError(f"prompt token ids must be < {self.vocab_size}", param="prompt", code="invalid_value")
        return list(body.prompt)

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError("this model has no chat template; use /v1/completions", param="messages",
                           code="no_chat_template")
        try:
            text = self.tokenizer.apply_chat_template(
                body.template_messages(), tokenize=False, add_generation_prompt=True
            )
        except APIError:
            raise
        except Exception as err:  # a template may reject a conversation (e.g. roles out of order)
            raise APIError(f"messages: the chat template rejected them: {err}", param="messages") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _check_model(self, model: str) -> None:
        if model != self.config.target.served_name:
            raise APIError(
                f"model {model!r} does not exist; this server serves {self.config.target.served_name!r}",
                status=404, param="model", code="model_not_found",
            )

    def _job(self, body, prompt_ids: list[int], request: Request):
        serving = self.config.serving
        max_tokens = resolve_max_tokens(
            body.requested_max_tokens, prompt_len=len(prompt_ids), default=serving.default_max_tokens,
            limit=serving.max_tokens_limit, max_seq_len=self.max_seq_len,
        )
        try:
            arm = self.router.assign(body.user, request.headers.get(ARM_HEADER))
        except UnknownArmError as err:
            raise APIError(str(err), param=ARM_HEADER, code="unknown_arm") from None
        try:
            params = SamplingParams(max_tokens=max_tokens, seed=body.seed,
                                    **body.sampling(serving.defaults, self.vocab_size),
                                    **body.stop_rules(self.vocab_size))
        except ValueError as err:
            raise APIError(str(err), code="invalid_value") from None
        request_id = f"{'chatcmpl' if isinstance(body, ChatCompletionRequest) else 'cmpl'}-{uuid.uuid4().hex}"
        job = DecodeJob(request_id, tuple(prompt_ids), params, arm.to_arm_spec(), body.stop_strings, body.speculate,
                        stream=bool(body.stream))
        return job, arm

    async def _serve(self, body, prompt_ids: list[int], request: Request, *, chat: bool,
                     tokenize_s: float) -> Response:
        deadline = Deadline(self.timeout_s)
        job, arm = self._job(body, prompt_ids, request)
        events, to_unit = await self._start(job, deadline)
        timing = {"tokenize": tokenize_s, "ingress_to_unit": to_unit, "sse": 0.0}
        headers = {ARM_RESPONSE_HEADER: arm.name}
        if body.stream:
            stream = self._stream(job, events, body, deadline, timing, chat=chat)
            return ClosingStreamingResponse(stream, media_type="text/event-stream", headers=headers)
        text, finished = [], None
        try:
            async for event in deadline.timed(events):
                if isinstance(event, TextDelta):
                    text.append(event.text)
                elif isinstance(event, Finished):
                    finished = event
        except asyncio.TimeoutError:
            raise deadline.error() from None
        except UNIT_LOST as err:
            await self._forget(job)
            raise unit_lost(err) from None
        finally:
            events.cancel()  # a no-op once finished; frees the sequence if this handler is cancelled or late
        if finished is None or finished.finish_reason == "error":
            raise unit_failed(finished.error if finished else "the unit ended the stream")
        start = time.perf_counter()
        text.append(finished.text)
        text = "".join(text)
        timing["sse"] = time.perf_counter() - start  # the body's own JSON encoding follows its usage: not in it
        result = completion_body(job.request_id, body.model, text, _openai_reason(finished),
                                 _usage(job, finished, timing), chat=chat, created=int(time.time()))
        return AfterJSONResponse(result, lambda: self._maybe_audit(job, finished), headers=headers)

    async def _start(self, job: DecodeJob, deadline: Deadline):
        """Send the job to a unit and wait until one accepted it: (the unit's events, seconds from the call to
        the unit taking the job). 503 + Retry-After when every queue is full or the unit went away, 408 when
        none accepted it in time."""
        sent = time.time()
        events = self.decoder.generate.remote(job)
        try:
            first = await deadline.next(events)
        except asyncio.TimeoutError:
            events.cancel()
            raise deadline.error() from None
        except UNIT_LOST as err:
            await self._forget(job)
            raise unit_lost(err) from None
        except BackPressureError as err:
            retry = err.retry_after_s or DEFAULT_RETRY_AFTER_S
            raise APIError(
                f"server overloaded: {err}", status=503, type="server_overloaded", code="queue_full",
                headers={"Retry-After": str(max(1, round(retry)))},
            ) from None
        if not isinstance(first, UnitStarted):
            raise RuntimeError(f"unit protocol: expected UnitStarted, got {type(first).__name__}")
        return events, first.started_s - sent

    async def _stream(self, job: DecodeJob, events, body, deadline: Deadline, timing: dict[str, float], *,
                      chat: bool) -> AsyncIterator[str]:
        created = int(time.time())
        model = body.model
        finished = None

        def chunk(**fields) -> str:  # one SSE event; after the final message, its encoding is `detokenize_sse`'s
            start = time.perf_counter()
            event = _sse(chunk_body(job.request_id, model, created, chat=chat, **fields))
            if finished is not None:
                timing["sse"] += time.perf_counter() - start
            return event

        try:
            if chat:
                yield chunk(role=True)
            async for event in deadline.timed(events):
                if isinstance(event, TextDelta) and event.text:
                    yield chunk(text=event.text)
                elif isinstance(event, Finished):
                    finished = event
            if finished is None or finished.finish_reason == "error":
                message = finished.error if finished else "the unit ended the stream"
                yield _sse(error_body(f"generation failed: {message}", type="server_error", code="unit_failed"))
            else:
                if finished.text:
                    yield chunk(text=finished.text)
                yield chunk(finish_reason=_openai_reason(finished))
                if body.include_usage:
                    yield chunk(usage=_usage(job, finished, timing), no_choices=True)
            yield SSE_DONE
        except asyncio.TimeoutError:
            yield _sse(deadline.error().body())
            yield SSE_DONE
        except UNIT_LOST as err:
            await self._forget(job)
            yield _sse(unit_lost(err).body())
            yield SSE_DONE
        except Exception as err:  # the status line is sent already: report in-band, then end the stream
            logger.exception("request %s: stream failed", job.request_id)
            yield _sse(error_body(f"generation failed: {err}", type="server_error", code="stream_failed"))
            yield SSE_DONE
        finally:
            events.cancel()  # client gone (or done): the unit aborts the sequence and frees its caches
            if finished is not None and finished.finish_reason != "error":
                self._maybe_audit(job, finished)  # after the last byte, or once the client is gone

    # --- quality audit -----------------------------------------------------------------------------------
    def _maybe_audit(self, job: DecodeJob, finished: Finished) -> None:
        if not self.sampler.should_audit(job.request_id, job.arm.verification, job.params.temperature):
            return
        if finished.finish_reason not in ("stop", "length"):
            return
        reference = self.config.arm(self.config.audit.reference_arm).to_arm_spec()
        replay_job = DecodeJob(
            f"{job.request_id}-audit", job.prompt_ids, job.params, reference, job.stop, job.speculate, stream=False
        )

        async def replay() -> list[int]:
            events = self.decoder.generate.remote(replay_job)
            tokens: list[int] = []
            async for event in events:
                if isinstance(event, Finished):
                    tokens = list(event.token_ids)
            return tokens

        self.auditor.submit(
            job.request_id, job.arm.name, finished.token_ids, finished.regret_spent or 0.0, replay, finished.unit
        )

    def _send_audit(self, record) -> None:
        self.hub().record.remote([record])

    async def _forget(self, job: DecodeJob) -> None:
        """The unit that held `job` died: drop the ledger the app's policy actor still mirrors for it."""
        from actors.remote.policy import forget_ledger

        try:
            await forget_ledger(policy_actor_name(self.app_name), policy_kwargs(self.config), job.request_id)
        except Exception as err:  # the policy restarting loses the mirror anyway
            logger.warning("request %s: dropping the ledger of a lost unit failed: %s", job.request_id, err)

"""The OpenAI-compatible HTTP front end (a Serve ingress deployment with FastAPI).

Per request: validate the body (`cluster.serving.protocol`; omitted sampling fields take `serving.defaults`, else
OpenAI's), tokenize, check the context limit, pick the arm (`cluster.serving.ab`) and stream a `DecodeJob` to
a decoder unit through a Serve handle; answers are OpenAI bodies, or SSE chunks ending with `data: [DONE]`.
Client mistakes get a 4xx with OpenAI's error body, a full queue or a failed unit a 503 with Retry-After
(`cluster.serving.failures`), a request past `serving.request_timeout_s` a 408; a client that disconnects aborts
its sequence in the unit. Greedy ASD requests the `AuditSampler` draws are replayed on the exact reference arm in
the background, submitted once the last byte is sent (or the client is gone). `usage.speculative.timing_s` gets
the ingress's hops (`actors.timing`): `tokenize`, `ingress_to_unit` and the OpenAI encoding after the unit's final
message (an earlier chunk's is encoded while the unit works on). The arms and the audit are the deployment's
`user_config`: `reconfigure` swaps them in place, restarting no unit. Every status and the upgrades:
docs/reliability.md; the request path: docs/architecture.md.
"""


import asyncio
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
from cluster.config import parse_config
from cluster.serving import openapi
from cluster.serving.ab import ARM_HEADER, ARM_RESPONSE_HEADER, ArmRouter, UnknownArmError, with_ingress_settings
from cluster.serving.audit import AuditRunner, AuditSampler
from cluster.serving.bodies import (SSE_DONE, TokenText, choice_body, chunk_body, completion_body, models_body,
                                    sse)
from cluster.serving.choices import Choice, check_room, choice_seed, merged, openai_reason, read_ahead, refusal, usage
from cluster.serving.decoder import DecodeJob, Finished, TextDelta, UnitStarted, policy_actor_name, policy_kwargs
from cluster.serving.failures import (
    UNIT_LOST,
    AfterJSONResponse,
    ClosingStreamingResponse,
    Deadline,
    deadline_s,
    unit_failed,
    unit_lost,
)
from cluster.serving.guard import GuardPolicy, RequestGuard
from cluster.serving.errors import APIError, error_body, validation_error
from cluster.serving.protocol import ChatCompletionRequest, CompletionRequest, resolve_max_tokens

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


# Everything the ingress class uses is defined above it: serve.ingress captures the class when it decorates it.
@serve.ingress(app)
class OpenAIIngress:
    """Serve ingress body (wrapped by `cluster.serving.app.build_app`). `decoder` is the decoder deployment's handle;
    `config` the dumped `SpecServeConfig`; the deployment's `user_config` (`cluster.serving.ab.ingress_user_config`)
    sets the arms and the audit, at start and on every in-place update (`reconfigure`)."""

    def __init__(self, decoder, config: dict[str, Any]):
        from actors.sources import context_length, load_tokenizer, model_info

        config = parse_config(config)
        self.decoder = decoder.options(stream=True)
        self.app_name = serve.get_replica_context().app_name
        self.tokenizer = load_tokenizer(config.target.source)
        info = model_info(config.target.source)
        self.max_seq_len = context_length(config.target.max_seq_len, info)
        self.vocab_size = info["vocab_size"]
        self.token_text = TokenText(self.tokenizer)
        self._hub = None
        self.created = int(time.time())
        self.timeout_s = deadline_s(config.serving.request_timeout_s)
        app.state.guard = GuardPolicy.from_settings(config.serving)
        self.auditor = AuditRunner(config.audit.reference_arm, self._send_audit, max_pending=config.audit.max_pending)
        self._apply(config, report=False)  # the arms are reported by `reconfigure`, which Serve calls next

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's in-place update of this deployment's `user_config`: new arms and audit settings for the requests
        that arrive from now on (those in flight keep their arm). A ValueError names the bad field."""
        self._apply(with_ingress_settings(self.config, user_config))

    def _apply(self, config, report: bool = True) -> None:
        self.config = config
        self.router = ArmRouter(config.arms)
        self.sampler = AuditSampler(config.audit.fraction)
        self.auditor.reference_arm, self.auditor.max_pending = config.audit.reference_arm, config.audit.max_pending
        if report:  # the arms now served, in config order, with their weights (the export's `deployments`)
            self.hub().set_arms.remote([a.name for a in config.arms], [a.weight for a in config.arms])
        serving = config.serving
        app.openapi_schema = None  # FastAPI's document, completed with what this config knows
        app.openapi_schema = openapi.specserve_openapi(
            app.openapi(), served_name=config.target.served_name, arms=[a.name for a in config.arms],
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
        body.check_choices()
        start = time.perf_counter()
        prompts = [self._completion_prompt(prompt) for prompt in body.prompts]
        return await self._serve(body, prompts, request, chat=False, tokenize_s=time.perf_counter() - start)

    @app.post("/v1/chat/completions", response_model=openapi.ChatCompletion, responses=openapi.GENERATE)
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        body.check_choices()
        start = time.perf_counter()
        prompt = self._chat_prompt(body)
        return await self._serve(body, [prompt], request, chat=True, tokenize_s=time.perf_counter() - start)

    # --- request handling --------------------------------------------------------------------------------
    def hub(self):
        if self._hub is None:
            from cluster.observability.telemetry import get_or_create_hub
            self._hub = get_or_create_hub(self.app_name, self.config.telemetry, [a.name for a in self.config.arms])
        return self._hub

    def _completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        if max(prompt) >= self.vocab_size:
            raise APIError(f"prompt token ids must be < {self.vocab_size}", param="prompt", code="invalid_value")
        return list(prompt)

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

    def _choices(self, body, prompts: list[list[int]], request: Request, *, chat: bool):
        """The request's choices (one `DecodeJob` each, prompt-major) and its arm; a 4xx naming the field."""
        serving = self.config.serving
        try:
            arm = self.router.assign(body.user, request.headers.get(ARM_HEADER))
        except UnknownArmError as err:
            raise APIError(str(err), param=ARM_HEADER, code="unknown_arm") from None
        structured = body.structured() if chat else None
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        total = len(prompts) * body.n
        check_room(total, serving.max_ongoing_requests, body.n)
        choices = []
        for p, prompt_ids in enumerate(prompts):
            max_tokens = resolve_max_tokens(
                body.requested_max_tokens, prompt_len=len(prompt_ids), default=serving.default_max_tokens,
                limit=serving.max_tokens_limit, max_seq_len=self.max_seq_len,
            )
            rules = {**body.sampling(serving.defaults, self.vocab_size), **body.stop_rules(self.vocab_size),
                     **body.logit_rules(self.vocab_size, max_tokens)}
            echo = self.tokenizer.decode(prompt_ids, skip_special_tokens=True) if getattr(body, "echo", False) else ""
            for j in range(body.n):
                try:
                    params = SamplingParams(max_tokens=max_tokens, seed=choice_seed(body.seed, j),
                                            logprobs=body.top_logprobs_n, structured=structured, **rules)
                except ValueError as err:
                    raise APIError(str(err), code="invalid_value") from None
                index = p * body.n + j
                job = DecodeJob(request_id if total == 1 else f"{request_id}-{index}", tuple(prompt_ids), params,
                                arm.to_arm_spec(), body.stop_strings, body.speculate, stream=bool(body.stream))
                choices.append(Choice(index, job, chat, echo))
        return request_id, choices, arm

    async def _serve(self, body, prompts: list[list[int]], request: Request, *, chat: bool,
                     tokenize_s: float) -> Response:
        deadline = Deadline(self.timeout_s)
        request_id, choices, arm = self._choices(body, prompts, request, chat=chat)
        started = await self._start_all([c.job for c in choices], deadline)
        timing = {"tokenize": tokenize_s, "ingress_to_unit": [to_unit for _, to_unit in started], "sse": 0.0}
        prompt_tokens = sum(len(p) for p in prompts)
        headers = {ARM_RESPONSE_HEADER: arm.name}
        events = [e for e, _ in started]
        sources, streaming = [deadline.timed(e) for e in events], False
        try:
            if body.stream and any(c.job.params.structured is not None for c in choices):
                sources = await read_ahead(sources)  # the unit compiles the grammar: a refusal is still a 400
            if body.stream:
                streaming = True
                stream = self._stream(request_id, choices, events, sources, body, deadline, timing, prompt_tokens)
                return ClosingStreamingResponse(stream, media_type="text/event-stream", headers=headers)
            async for i, event in merged(sources):
                choices[i].add(event)
        except asyncio.TimeoutError:
            raise deadline.error() from None
        except UNIT_LOST as err:
            await asyncio.gather(*(self._forget(c.job) for c in choices))
            raise unit_lost(err) from None
        finally:
            for e in events if not streaming else ():  # a no-op once finished; frees the sequences otherwise
                e.cancel()
        for c in choices:
            if c.finished is not None and c.finished.refused:
                raise refusal(c.finished.error)
            if c.finished is None or c.finished.finish_reason == "error":
                raise unit_failed(c.finished.error if c.finished else "the unit ended the stream")
        start = time.perf_counter()
        bodies = [choice_body(c.index, c.full_text, openai_reason(c.finished), chat=chat,
                              logprobs=c.render_logprobs(c.logprobs if c.job.params.logprobs is not None else None,
                                                         self.token_text)) for c in choices]
        timing["sse"] = time.perf_counter() - start  # the body's own JSON encoding follows its usage: not in it
        result = completion_body(request_id, body.model, bodies, usage(choices, timing, prompt_tokens), chat=chat,
                                 created=int(time.time()))
        return AfterJSONResponse(result, lambda: self._audit_all(choices), headers=headers)

    async def _start_all(self, jobs: list[DecodeJob], deadline: Deadline):
        """`_start` for every job, concurrently; if one fails, the others' streams are cancelled and its error
        raised."""
        if len(jobs) == 1:
            return [await self._start(jobs[0], deadline)]
        results = await asyncio.gather(*(self._start(job, deadline) for job in jobs), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            for r in results:
                if not isinstance(r, BaseException):
                    r[0].cancel()
            raise failed
        return results

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

    async def _stream(self, request_id: str, choices: list[Choice], events, sources, body, deadline: Deadline,
                      timing: dict[str, Any], prompt_tokens: int) -> AsyncIterator[str]:
        created = int(time.time())
        model, chat = body.model, choices[0].chat
        done = 0  # choices whose final message came: the encoding after the last one is `detokenize_sse`'s

        def chunk(index: int, **fields) -> str:
            start = time.perf_counter()
            event = sse(chunk_body(request_id, model, created, chat=chat, index=index, **fields))
            if done == len(choices):
                timing["sse"] += time.perf_counter() - start
            return event

        try:
            for c in choices:
                if chat:
                    yield chunk(c.index, role=True)
                elif c.echo:
                    yield chunk(c.index, text=c.echo)
            async for i, event in merged(sources):
                c = choices[i]
                if isinstance(event, TextDelta) and (event.text or event.logprobs):
                    yield chunk(c.index, text=event.text, logprobs=c.render_logprobs(event.logprobs, self.token_text))
                elif isinstance(event, Finished):
                    c.finished = event
                    if event.finish_reason == "error":
                        break
                    done += 1
                    if event.text:
                        yield chunk(c.index, text=event.text)
                    yield chunk(c.index, finish_reason=openai_reason(event))
            failed = next((c.finished for c in choices if c.finished is None or c.finished.finish_reason == "error"),
                          False)
            if failed is not False:
                message = failed.error if failed else "the unit ended the stream"
                yield sse(error_body(f"generation failed: {message}", type="server_error", code="unit_failed"))
            elif body.include_usage:
                yield chunk(0, usage=usage(choices, timing, prompt_tokens), no_choices=True)
            yield SSE_DONE
        except asyncio.TimeoutError:
            yield sse(deadline.error().body())
            yield SSE_DONE
        except UNIT_LOST as err:
            await asyncio.gather(*(self._forget(c.job) for c in choices))
            yield sse(unit_lost(err).body())
            yield SSE_DONE
        except Exception as err:  # the status line is sent already: report in-band, then end the stream
            logger.exception("request %s: stream failed", request_id)
            yield sse(error_body(f"generation failed: {err}", type="server_error", code="stream_failed"))
            yield SSE_DONE
        finally:
            for e in events:  # client gone (or done): the unit aborts each sequence and frees its caches
                e.cancel()
            self._audit_all(choices)  # after the last byte, or once the client is gone

    # --- quality audit -----------------------------------------------------------------------------------
    def _audit_all(self, choices: list[Choice]) -> None:
        for c in (c for c in choices if c.finished is not None and c.finished.finish_reason != "error"):
            self._maybe_audit(c.job, c.finished)

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

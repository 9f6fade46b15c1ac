"""Request traces: one span tree per finished request, built from the loop's records after the fact.

The speculative loop never holds a span open: `RequestTracer` keeps each request's `RoundRecord`s (bounded)
until its `RequestRecord` arrives, then writes a `specserve.request` span, a `specserve.round` child per round
and `draft` / `score` / `verify` children of each, with explicit start and end times (the tree:
docs/architecture.md, "cluster/"). A request whose clock is not wall time is shifted to end when the observer
receives it. `make_tracer_provider(settings)` turns `TelemetrySettings.tracing` into a provider ("off" → None,
"on" → every request, "sampled" → `ParentBased(TraceIdRatioBased(trace_sample_rate))`) exporting to OTLP/HTTP
at `{otlp_endpoint}/v1/traces`, or to an injected exporter.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased

from actors.stats import RequestRecord, RoundRecord, RowRecord
from cluster.config import TelemetrySettings

logger = logging.getLogger(__name__)

TRACER_NAME = "specserve"
REQUEST_SPAN = "specserve.request"
ROUND_SPAN = "specserve.round"
PHASE_SPANS = ("draft", "score", "verify")
WALL_CLOCK_TOLERANCE_S = 60.0

RoundOfRequest = tuple[RoundRecord, RowRecord]  # a round and this request's row in it


def make_tracer_provider(
    settings: TelemetrySettings, span_exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """The TracerProvider `settings` ask for, or None when tracing is off."""
    if settings.tracing == "off":
        return None
    sampler = ALWAYS_ON if settings.tracing == "on" else ParentBased(TraceIdRatioBased(settings.trace_sample_rate))
    provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name}), sampler=sampler)
    if span_exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    elif settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = settings.otlp_endpoint.rstrip("/") + "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    else:
        logger.warning("tracing is %r but telemetry.otlp_endpoint is not set: spans are dropped", settings.tracing)
    return provider


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTracer:
    """Holds each active request's rounds until it finishes, then writes its span tree.

    Bounded: at most `max_requests` requests are held (the oldest is forgotten first) and at most
    `max_rounds` rounds per request (later rounds are counted on the request span, not drawn).
    """

    def __init__(
        self,
        tracer_provider: TracerProvider,
        unit: str,
        max_requests: int = 4096,
        max_rounds: int = 1024,
    ):
        self._tracer = tracer_provider.get_tracer(TRACER_NAME)
        self.unit = unit
        self.max_requests = max_requests
        self.max_rounds = max_rounds
        self._rounds: OrderedDict[str, list[RoundOfRequest]] = OrderedDict()
        self._dropped_rounds: dict[str, int] = {}
        self.forgotten_requests = 0

    def add_round(self, record: RoundRecord) -> None:
        """Remember `record` for every request that took part in it."""
        for row in record.rows:
            rounds = self._rounds.get(row.request_id)
            if rounds is None:
                if len(self._rounds) >= self.max_requests:
                    old, _ = self._rounds.popitem(last=False)
                    self._dropped_rounds.pop(old, None)
                    self.forgotten_requests += 1
                rounds = self._rounds[row.request_id] = []
            if len(rounds) < self.max_rounds:
                rounds.append((record, row))
            else:
                self._dropped_rounds[row.request_id] = self._dropped_rounds.get(row.request_id, 0) + 1

    def pop(self, request_id: str) -> tuple[list[RoundOfRequest], int]:
        """Forget a request: its held rounds and how many were not held."""
        return self._rounds.pop(request_id, []), self._dropped_rounds.pop(request_id, 0)

    def emit(
        self,
        request: RequestRecord,
        rounds: Sequence[RoundOfRequest],
        dropped_rounds: int = 0,
        now: float | None = None,
    ) -> None:
        """Write the span tree of one finished request (see the module docstring)."""
        now = time.time() if now is None else now
        shift = 0.0 if abs(now - request.finished_s) < WALL_CLOCK_TOLERANCE_S else now - request.finished_s
        attributes = {
            "specserve.request_id": request.request_id,
            "specserve.arm": request.arm,
            "specserve.unit": request.unit or self.unit,
            "specserve.verification": request.verification,
            "specserve.finish_reason": request.finish_reason,
            "specserve.prompt_tokens": request.prompt_tokens,
            "specserve.output_tokens": request.output_tokens,
            "specserve.rounds": request.rounds,
            "specserve.draft_tokens": request.draft_tokens,
            "specserve.accepted_tokens": request.accepted_tokens,
            "specserve.acceptance_rate": (
                request.accepted_tokens / request.draft_tokens if request.draft_tokens else 0.0
            ),
            "specserve.degraded": request.degraded,
            "specserve.rounds_not_traced": dropped_rounds,
        }
        if request.verification == "asd":
            attributes["specserve.regret_spent"] = request.regret_spent or 0.0
            attributes["specserve.relaxed_tokens"] = request.relaxed_tokens or 0
            attributes["specserve.ledger_exhausted"] = request.ledger_exhausted
        root = self._tracer.start_span(
            REQUEST_SPAN, start_time=_ns(request.started_s + shift), attributes=attributes
        )
        if request.finish_reason == "error":
            root.set_status(trace.Status(trace.StatusCode.ERROR))
        parent = trace.set_span_in_context(root)
        for record, row in rounds:
            self._emit_round(record, row, parent)
        root.end(end_time=_ns(request.finished_s + shift))

    def _emit_round(self, record: RoundRecord, row: RowRecord, parent) -> None:
        start = record.started_s
        span = self._tracer.start_span(
            ROUND_SPAN,
            context=parent,
            start_time=_ns(start),
            attributes={
                "specserve.unit": record.unit,
                "specserve.batch_size": record.batch_size,
                "specserve.gamma": row.gamma,
                "specserve.accepted": row.accepted,
                "specserve.relaxed": row.relaxed,
                "specserve.regret": row.regret,
                "specserve.orchestration_s": record.orchestration_s,
            },
        )
        inner = trace.set_span_in_context(span)
        t = start
        for name, duration in zip(PHASE_SPANS, (record.draft_s, record.score_s, record.verify_s)):
            self._tracer.start_span(name, context=inner, start_time=_ns(t)).end(end_time=_ns(t + duration))
            t += duration
        span.end(end_time=_ns(start + max(record.total_s, t - start)))

"""Metrics: what the records of a unit's rounds and requests mean as counters and histograms, and their Prometheus
text from many units at once.

`MetricsRecorder` turns `RoundRecord` / `RequestRecord` / `AuditRecord`s into OpenTelemetry instruments (`METRICS`)
in the process that holds the records: each unit's observer records its own, so the telemetry hub receives one
cumulative snapshot per unit per flush instead of every round (why: docs/architecture.md, "Metrics are aggregated
in the unit"). `merged_text(snapshots)` renders the union of snapshots as one exposition. vLLM's metrics keep
vLLM's names (`vllm:*`), ours are `specserve_*`; every metric has `arm` and `unit` labels, and rates are derived
from the counters, never stored. Names, labels and what counts as a draft: docs/architecture.md, "cluster/".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import View
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from actors.stats import RequestRecord, RoundRecord
from cluster.config import TelemetrySettings
from cluster.records import AuditRecord

MIXED_ARM = "mixed"
NO_ARM = "none"

_SECONDS_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
         80.0, 160.0, 640.0)
_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0)
_GAMMA = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)  # le=0 counts plain-decoding rounds
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_TOKENS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric. `name` is the exposed name (may contain ':'); `unit` is UCUM ("s" → _seconds)."""

    key: str
    name: str
    kind: Literal["counter", "histogram"]
    description: str
    unit: str = ""
    buckets: tuple[float, ...] | None = None

    @property
    def instrument_name(self) -> str:
        return self.name.replace(":", ".")


METRICS: tuple[MetricSpec, ...] = (
    # vLLM-compatible (labels: arm, unit; per_pos adds position)
    MetricSpec("drafts", "vllm:spec_decode_num_drafts", "counter", "Drafting rounds (γ > 0)."),
    MetricSpec("draft_tokens", "vllm:spec_decode_num_draft_tokens", "counter", "Draft tokens proposed."),
    MetricSpec("accepted_tokens", "vllm:spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted."),
    MetricSpec("accepted_per_pos", "vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
               "Drafts that kept the draft token at `position` (0-based)."),
    MetricSpec("prompt_tokens", "vllm:prompt_tokens", "counter", "Prompt tokens of finished requests."),
    MetricSpec("generation_tokens", "vllm:generation_tokens", "counter", "Output tokens of finished requests."),
    MetricSpec("ttft", "vllm:time_to_first_token_seconds", "histogram", "Time to first token.", "s", _TTFT),
    MetricSpec("e2e", "vllm:e2e_request_latency_seconds", "histogram", "Request latency, end to end.", "s", _E2E),
    MetricSpec("tpot", "vllm:request_time_per_output_token_seconds", "histogram",
               "Per request: (finish - first token) / (output tokens - 1).", "s", _TPOT),
    # specserve's own
    MetricSpec("requests", "specserve_requests", "counter",
               "Finished requests by finish_reason and the verification that ran."),
    MetricSpec("fallbacks", "specserve_asd_fallbacks", "counter",
               "Requests an ASD arm verified exactly, by reason (sampled: temperature > 0 and asd.sampled exact)."),
    MetricSpec("degraded", "specserve_degraded_requests", "counter", "Requests that ran without the drafter."),
    MetricSpec("gamma", "specserve_gamma", "histogram", "γ chosen per sequence per round (0 = plain).", "",
               _GAMMA),
    MetricSpec("regret", "specserve_regret_spent", "counter", "ASD regret charged to ledgers (target logits)."),
    MetricSpec("relaxed", "specserve_relaxed_tokens", "counter", "Mismatched draft tokens accepted by ASD."),
    MetricSpec("exhaustions", "specserve_ledger_exhaustions", "counter",
               "Requests whose ASD regret budget ran out."),
    MetricSpec("phase", "specserve_round_phase_seconds", "histogram",
               "Round time by phase (draft, score, verify, orchestration).", "s", _SECONDS_FAST),
    MetricSpec("round", "specserve_round_seconds", "histogram", "Whole round time.", "s", _SECONDS_FAST),
    MetricSpec("batch", "specserve_round_batch_size", "histogram", "Sequences batched in a round.", "", _BATCH),
    MetricSpec("audits", "specserve_audit_requests", "counter",
               "Audited ASD requests by reference_arm and exact_match."),
    MetricSpec("audit_prefix", "specserve_audit_common_prefix_tokens", "histogram",
               "Tokens agreeing with the exact replay before the first divergence.", "", _TOKENS),
    MetricSpec("audit_edit", "specserve_audit_edit_distance_tokens", "histogram",
               "Token edit distance to the exact replay.", "", _TOKENS),
)

def round_arm(record: RoundRecord) -> str:
    """The `arm` label of a whole-round metric: the rows' shared arm, "mixed", or "none"."""
    arms = {row.arm for row in record.rows}
    if not arms:
        return NO_ARM
    return arms.pop() if len(arms) == 1 else MIXED_ARM


def latencies(record: RequestRecord) -> tuple[float, float | None, float | None]:
    """(latency, ttft, tpot) of a finished request: finished - started; first token - started (None without
    tokens); (finished - first token) / (output_tokens - 1) (None below 2 tokens)."""
    latency = record.finished_s - record.started_s
    if record.first_token_s is None:
        return latency, None, None
    tpot = (record.finished_s - record.first_token_s) / (record.output_tokens - 1) if record.output_tokens > 1 else None
    return latency, record.first_token_s - record.started_s, tpot


class MetricsRecorder:
    """The instruments of `METRICS`, fed with records; read as Prometheus text or as a snapshot of metric families.

    `settings.metrics` gives a Prometheus reader on a private registry (no global registry, no HTTP server);
    `settings.otlp_endpoint` adds a periodic OTLP exporter. Not thread-safe: the caller serialises `record`.
    """

    def __init__(self, settings: TelemetrySettings):
        self.settings = settings
        self._registry = CollectorRegistry()
        readers = []
        if settings.metrics:
            readers.append(PrometheusMetricReader(disable_target_info=True, scope_info_enabled=False,
                                                  registry=self._registry))
        if settings.otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            endpoint = settings.otlp_endpoint.rstrip("/") + "/v1/metrics"
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint)))
        views = [View(instrument_name=s.instrument_name, name=s.name) for s in METRICS if ":" in s.name]
        self._provider: MeterProvider | None = MeterProvider(
            metric_readers=readers, views=views, resource=Resource.create({"service.name": settings.service_name}))
        meter = self._provider.get_meter("specserve")
        self._sums: dict[tuple[str, tuple], float] = {}  # a batch's counter increments, per series
        self._m: dict[str, Any] = {}
        for spec in METRICS:
            if spec.kind == "counter":
                self._m[spec.key] = meter.create_counter(spec.instrument_name, spec.unit, spec.description)
            else:
                self._m[spec.key] = meter.create_histogram(
                    spec.instrument_name, spec.unit, spec.description,
                    explicit_bucket_boundaries_advisory=tuple(map(float, spec.buckets)))

    def record(self, items: Iterable[RoundRecord | RequestRecord | AuditRecord]) -> None:
        """Count a batch of records (other types are the caller's to refuse). A counter's increments are summed
        over the batch first, so it costs one add per series, not one per row."""
        self._sums = {}
        for item in items:
            if isinstance(item, RoundRecord):
                self._on_round(item)
            elif isinstance(item, RequestRecord):
                self._on_request(item)
            elif isinstance(item, AuditRecord):
                self._on_audit(item)
        for (key, labels), amount in self._sums.items():
            self._m[key].add(amount, dict(labels))

    def _add(self, key: str, amount: float, labels: dict[str, str]) -> None:
        series = (key, tuple(labels.items()))
        self._sums[series] = self._sums.get(series, 0) + amount

    def _on_round(self, r: RoundRecord) -> None:
        labels = {"arm": round_arm(r), "unit": r.unit}
        for phase, seconds in (("draft", r.draft_s), ("score", r.score_s), ("verify", r.verify_s),
                               ("orchestration", r.orchestration_s)):
            self._m["phase"].record(seconds, {**labels, "phase": phase})
        self._m["round"].record(r.total_s, labels)
        self._m["batch"].record(r.batch_size, labels)
        for row in r.rows:
            row_labels = {"arm": row.arm, "unit": r.unit}
            self._m["gamma"].record(row.gamma, row_labels)
            if row.gamma > 0:
                self._add("drafts", 1, row_labels)
                self._add("draft_tokens", row.gamma, row_labels)
                self._add("accepted_tokens", row.accepted, row_labels)
                for position in range(row.accepted):
                    self._add("accepted_per_pos", 1, {**row_labels, "position": str(position)})
            self._add("relaxed", row.relaxed, row_labels)  # zeros too: every arm has the series (0 on exact)
            self._add("regret", row.regret, row_labels)

    def _on_request(self, r: RequestRecord) -> None:
        labels = {"arm": r.arm, "unit": r.unit}
        latency, ttft, tpot = latencies(r)
        self._add("requests", 1, {**labels, "finish_reason": r.finish_reason, "verification": r.verification})
        self._add("prompt_tokens", r.prompt_tokens, labels)
        self._add("generation_tokens", r.output_tokens, labels)
        self._m["e2e"].record(latency, labels)
        if ttft is not None:
            self._m["ttft"].record(ttft, labels)
        if tpot is not None:
            self._m["tpot"].record(tpot, labels)
        # counted as 0 too, so dashboards and alerts see the series (and rate() works) before the first event
        self._add("degraded", int(r.degraded), labels)
        if r.verification == "asd":
            self._add("exhaustions", int(r.ledger_exhausted), labels)
        if r.asd_fallback is not None:
            self._add("fallbacks", 1, {**labels, "reason": r.asd_fallback})

    def _on_audit(self, a: AuditRecord) -> None:
        labels = {"arm": a.arm, "unit": a.unit}
        self._add("audits", 1, {**labels, "reference_arm": a.reference_arm,
                                  "exact_match": "true" if a.exact_match else "false"})
        self._m["audit_prefix"].record(a.common_prefix, labels)
        self._m["audit_edit"].record(a.edit_distance, labels)

    def snapshot(self) -> list[Metric]:
        """Every metric's cumulative value now, as Prometheus metric families (picklable); [] without a
        Prometheus reader."""
        return list(self._registry.collect()) if self.settings.metrics and self._provider is not None else []

    def shutdown(self) -> None:
        """Flush OTLP and release the meter provider."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None


def metrics_recorder(settings: TelemetrySettings) -> MetricsRecorder | None:
    """A recorder when the settings export metrics (Prometheus or OTLP), else None."""
    return MetricsRecorder(settings) if settings.metrics or settings.otlp_endpoint else None


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merged_text(snapshots: Iterable[Sequence[Metric]]) -> str:
    """One Prometheus text exposition (format 0.0.4) of several snapshots: a family's samples from every
    snapshot under one HELP and TYPE. Snapshots of different units never share a series (the `unit` label)."""
    merged: dict[str, Metric] = {}
    for families in snapshots:
        for family in families:
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            into.samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry).decode()

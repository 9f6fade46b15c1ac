"""Telemetry: metrics (OpenTelemetry SDK → Prometheus text and OTLP), request rows for the A/B report, traces.

`TelemetryHub`, one per app (a named, detached Ray actor made by `get_or_create_hub`, or a plain object
in-process), owns the OpenTelemetry `MeterProvider`: it turns `RoundRecord` / `RequestRecord` / `AuditRecord`
batches into counters and histograms, renders Prometheus text for `GET /metrics`, and keeps bounded request and
audit rows for `GET /v1/specserve/export`; `request_row(record)` is one request's export row. vLLM's metrics keep
vLLM's names (`vllm:*`), ours are `specserve_*` (`METRICS`); every metric has `arm` and `unit` labels, and rates
are derived from the counters, never stored. Names, labels and what counts as a draft: docs/architecture.md,
"cluster/".
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import View
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest

from actors.stats import RequestRecord, RoundRecord
from cluster.config import TelemetrySettings
from cluster.records import AuditRecord

logger = logging.getLogger(__name__)

EXPORT_SCHEMA = "specserve.export/v1"
HUB_NAMESPACE = "specserve"
MAX_ROWS = 100_000
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


def request_row(record: RequestRecord) -> dict[str, Any]:
    """The export row of one finished request; the report's input (keys are a public contract).

    verification = the verification that ran, arm_verification = the arm's own, asd_fallback = why an ASD arm
    verified the request exactly (None when it did not), sampled = temperature > 0.

    latency_s = finished - started; ttft_s = first token - started (None without tokens);
    tpot_s = (finished - first token) / (output_tokens - 1) (None below 2 tokens);
    tokens_per_s = output_tokens / latency_s (None when latency is 0); timing_s = the request's seconds per hop
    (`actors.timing`), with `end_deferred`, the end's work after its answer.
    """
    latency = record.finished_s - record.started_s
    ttft = record.first_token_s - record.started_s if record.first_token_s is not None else None
    tpot = (
        (record.finished_s - record.first_token_s) / (record.output_tokens - 1)
        if record.first_token_s is not None and record.output_tokens > 1
        else None
    )
    return {
        "request_id": record.request_id,
        "arm": record.arm,
        "unit": record.unit,
        "verification": record.verification,
        "arm_verification": record.arm_verification,
        "asd_fallback": record.asd_fallback,
        "sampled": record.sampled,
        "finish_reason": record.finish_reason,
        "degraded": record.degraded,
        "prompt_tokens": record.prompt_tokens,
        "output_tokens": record.output_tokens,
        "rounds": record.rounds,
        "draft_tokens": record.draft_tokens,
        "accepted_tokens": record.accepted_tokens,
        "gamma_mean": sum(record.gammas) / len(record.gammas) if record.gammas else 0.0,
        "latency_s": latency,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "tokens_per_s": record.output_tokens / latency if latency > 0 else None,
        "regret_spent": record.regret_spent,
        "regret_budget": record.regret_budget,
        "relaxed_tokens": record.relaxed_tokens,
        "ledger_exhausted": record.ledger_exhausted,
        "finished_s": record.finished_s,
        "timing_s": dict(record.timing_s),
    }


def round_arm(record: RoundRecord) -> str:
    """The `arm` label of a whole-round metric: the rows' shared arm, "mixed", or "none"."""
    arms = {row.arm for row in record.rows}
    if not arms:
        return NO_ARM
    return arms.pop() if len(arms) == 1 else MIXED_ARM


class TelemetryHub:
    """Aggregates every unit's records: metrics, request rows and audit rows of one app.

    Works as a plain object (tests, benchmarks) or as a Ray actor via `get_or_create_hub`.
    `arms` lists the configured arm names in config order (the report's reference arm is the first).
    """

    def __init__(self, settings: TelemetrySettings | None = None, arms: Sequence[str] = (), max_rows: int = MAX_ROWS):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.settings = settings or TelemetrySettings()
        self._lock = threading.Lock()
        self._arms: list[str] = list(dict.fromkeys(arms))
        self._requests: deque[dict] = deque(maxlen=max_rows)
        self._audits: deque[dict] = deque(maxlen=max_rows)
        self._seen = {"requests": 0, "audits": 0}
        self._load = {"batches": 0, "rounds": 0, "requests": 0, "audits": 0, "busy_s": 0.0}
        self._registry = CollectorRegistry()
        self._provider: MeterProvider | None = None
        self._m: dict[str, Any] = {}
        if self.settings.metrics or self.settings.otlp_endpoint:
            self._provider = self._make_meter_provider()
            meter = self._provider.get_meter("specserve")
            for spec in METRICS:
                if spec.kind == "counter":
                    self._m[spec.key] = meter.create_counter(spec.instrument_name, spec.unit, spec.description)
                else:
                    self._m[spec.key] = meter.create_histogram(
                        spec.instrument_name, spec.unit, spec.description,
                        explicit_bucket_boundaries_advisory=tuple(map(float, spec.buckets)),
                    )

    def _make_meter_provider(self) -> MeterProvider:
        readers = []
        if self.settings.metrics:
            # A private registry: no global REGISTRY, no HTTP server; the ingress serves prometheus_text().
            readers.append(PrometheusMetricReader(
                disable_target_info=True, scope_info_enabled=False, registry=self._registry
            ))
        if self.settings.otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            endpoint = self.settings.otlp_endpoint.rstrip("/") + "/v1/metrics"
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint)))
        views = [View(instrument_name=s.instrument_name, name=s.name) for s in METRICS if ":" in s.name]
        return MeterProvider(
            metric_readers=readers,
            views=views,
            resource=Resource.create({"service.name": self.settings.service_name}),
        )

    # ------------------------------------------------------------------ intake

    def record(self, batch: Iterable[RoundRecord | RequestRecord | AuditRecord]) -> None:
        """Take a batch of records from a unit (or the audit runner); unknown types are logged and skipped."""
        with self._lock:
            start = time.perf_counter()
            for item in batch:
                if isinstance(item, RoundRecord):
                    self._on_round(item)
                    self._load["rounds"] += 1
                elif isinstance(item, RequestRecord):
                    self._on_request(item)
                    self._load["requests"] += 1
                elif isinstance(item, AuditRecord):
                    self._on_audit(item)
                    self._load["audits"] += 1
                else:
                    logger.warning("telemetry hub: ignoring record of type %s", type(item).__name__)
            self._load["batches"] += 1
            self._load["busy_s"] += time.perf_counter() - start

    def load(self) -> dict[str, float]:
        """What the hub has taken so far: batches, the rounds, requests and audits in them, and the seconds it spent
        taking them."""
        with self._lock:
            return dict(self._load)

    def _note_arm(self, arm: str) -> None:
        if arm not in self._arms:
            self._arms.append(arm)

    def _on_round(self, r: RoundRecord) -> None:
        if not self._m:
            return
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
                self._m["drafts"].add(1, row_labels)
                self._m["draft_tokens"].add(row.gamma, row_labels)
                self._m["accepted_tokens"].add(row.accepted, row_labels)
                for position in range(row.accepted):
                    self._m["accepted_per_pos"].add(1, {**row_labels, "position": str(position)})
            self._m["relaxed"].add(row.relaxed, row_labels)  # zeros too: every arm has the series (0 on exact)
            self._m["regret"].add(row.regret, row_labels)

    def _on_request(self, r: RequestRecord) -> None:
        self._note_arm(r.arm)
        row = request_row(r)
        self._requests.append(row)
        self._seen["requests"] += 1
        if not self._m:
            return
        labels = {"arm": r.arm, "unit": r.unit}
        self._m["requests"].add(1, {**labels, "finish_reason": r.finish_reason, "verification": r.verification})
        self._m["prompt_tokens"].add(r.prompt_tokens, labels)
        self._m["generation_tokens"].add(r.output_tokens, labels)
        self._m["e2e"].record(row["latency_s"], labels)
        if row["ttft_s"] is not None:
            self._m["ttft"].record(row["ttft_s"], labels)
        if row["tpot_s"] is not None:
            self._m["tpot"].record(row["tpot_s"], labels)
        # counted as 0 too, so dashboards and alerts see the series (and rate() works) before the first event
        self._m["degraded"].add(int(r.degraded), labels)
        if r.verification == "asd":
            self._m["exhaustions"].add(int(r.ledger_exhausted), labels)
        if r.asd_fallback is not None:
            self._m["fallbacks"].add(1, {**labels, "reason": r.asd_fallback})

    def _on_audit(self, a: AuditRecord) -> None:
        self._note_arm(a.arm)
        self._audits.append(a.to_dict())
        self._seen["audits"] += 1
        if not self._m:
            return
        labels = {"arm": a.arm, "unit": a.unit}
        self._m["audits"].add(1, {**labels, "reference_arm": a.reference_arm,
                                  "exact_match": "true" if a.exact_match else "false"})
        self._m["audit_prefix"].record(a.common_prefix, labels)
        self._m["audit_edit"].record(a.edit_distance, labels)

    # ------------------------------------------------------------------ output

    def prometheus_text(self) -> str:
        """Prometheus text exposition (format 0.0.4) of every metric; "" when metrics are off."""
        if not self.settings.metrics:
            return ""
        with self._lock:
            return generate_latest(self._registry).decode()

    def export(self) -> dict[str, Any]:
        """The JSON export the A/B report reads (`GET /v1/specserve/export`):

        {"schema": "specserve.export/v1", "service": str, "generated_s": float (time.time()),
         "arms": [arm names, config order first],
         "requests": [request_row(...), ...] (newest MAX_ROWS), "audits": [AuditRecord.to_dict(), ...],
         "dropped": {"requests": int, "audits": int}  (rows that fell out of the ring buffers)}
        """
        with self._lock:
            return {
                "schema": EXPORT_SCHEMA,
                "service": self.settings.service_name,
                "generated_s": time.time(),
                "arms": list(self._arms),
                "requests": list(self._requests),
                "audits": list(self._audits),
                "dropped": {
                    "requests": self._seen["requests"] - len(self._requests),
                    "audits": self._seen["audits"] - len(self._audits),
                },
            }

    def shutdown(self) -> None:
        """Flush OTLP and release the meter provider."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self._m = {}


def hub_name(app_name: str) -> str:
    return f"specserve-telemetry-{app_name}"


def get_or_create_hub(app_name: str, settings: TelemetrySettings, arms: Sequence[str] = ()):
    """The app's hub actor, created on first call: named `specserve-telemetry-<app>` in namespace
    `specserve`, detached (outlives the driver; `kill_hub` removes it), num_cpus=0, on the head node."""
    import ray

    from actors.remote.placement import on_head

    return (
        ray.remote(TelemetryHub)
        .options(name=hub_name(app_name), namespace=HUB_NAMESPACE, get_if_exists=True, lifetime="detached",
                 num_cpus=0, resources=on_head())
        .remote(settings, list(arms))
    )


def kill_hub(app_name: str) -> bool:
    """Kill the app's hub actor; False when there is none."""
    import ray

    try:
        ray.kill(ray.get_actor(hub_name(app_name), namespace=HUB_NAMESPACE))
    except ValueError:
        return False
    return True

"""Telemetry: the app's hub of request rows for the A/B report and of `/metrics` over every unit.

`TelemetryHub`, one per app (a named, detached Ray actor made by `get_or_create_hub`, or a plain object
in-process), keeps bounded request and audit rows for `GET /v1/specserve/export` (`request_row(record)` is one
request's export row) and each unit's latest metrics snapshot, which it renders with its own metrics as the
Prometheus text of `GET /metrics`. The metrics themselves (names, labels, OTLP) are
`cluster.observability.metrics`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from actors.stats import RequestRecord, RoundRecord
from cluster.config import TelemetrySettings
from cluster.observability.metrics import latencies, merged_text, metrics_recorder
from cluster.records import AuditRecord

logger = logging.getLogger(__name__)

EXPORT_SCHEMA = "specserve.export/v1"
HUB_NAMESPACE = "specserve"
MAX_ROWS = 100_000
UNIT_TTL_S = 600.0

def request_row(record: RequestRecord) -> dict[str, Any]:
    """The export row of one finished request; the report's input (keys are a public contract).

    verification = the verification that ran, arm_verification = the arm's own, asd_fallback = why an ASD arm
    verified the request exactly (None when it did not), sampled = temperature > 0.

    latency_s = finished - started; ttft_s = first token - started (None without tokens);
    tpot_s = (finished - first token) / (output_tokens - 1) (None below 2 tokens);
    tokens_per_s = output_tokens / latency_s (None when latency is 0); timing_s = the request's seconds per hop
    (`actors.timing`), with `end_deferred`, the end's work after its answer.
    """
    latency, ttft, tpot = latencies(record)
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


class TelemetryHub:
    """The app's telemetry: request and audit rows for the export, and `/metrics` over every unit.

    Units call `report(unit, rows, snapshot)`: their finished requests' rows and the cumulative snapshot of their
    own metrics (`MetricsRecorder.snapshot`), which replaces the unit's previous one; the hub counts nothing per
    round. `record(batch)` takes records whose metrics the hub counts itself (the ingress's audits, in-process
    use). A unit's snapshot is dropped `UNIT_TTL_S` after its last report (a replica gone for good). Works as a
    plain object (tests, benchmarks) or as a Ray actor via `get_or_create_hub`. `arms` lists the configured arm
    names in config order (the report's reference arm is the first).
    """

    def __init__(self, settings: TelemetrySettings | None = None, arms: Sequence[str] = (), max_rows: int = MAX_ROWS):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.settings = settings or TelemetrySettings()
        self._lock = threading.Lock()
        self._arms: list[str] = list(dict.fromkeys(arms))
        self._requests: deque[dict] = deque(maxlen=max_rows)
        self._audits: deque[dict] = deque(maxlen=max_rows)
        self._load = {"batches": 0, "rounds": 0, "requests": 0, "audits": 0, "snapshots": 0, "busy_s": 0.0}
        self._deployments: list[dict[str, Any]] = []  # each change of the configured arms, with its time
        self._units: dict[str, tuple[float, list]] = {}  # unit -> (monotonic time of its report, its snapshot)
        self._metrics = metrics_recorder(self.settings)

    # ------------------------------------------------------------------ intake

    def record(self, batch: Iterable[RoundRecord | RequestRecord | AuditRecord]) -> None:
        """Take a batch of records and count their metrics here (export rows too); unknown types are logged and
        skipped."""
        with self._lock:
            start = time.perf_counter()
            taken = []
            for item in batch:
                if not isinstance(item, (RoundRecord, RequestRecord, AuditRecord)):
                    logger.warning("telemetry hub: ignoring record of type %s", type(item).__name__)
                elif isinstance(item, RoundRecord):
                    taken.append(item)
                    self._load["rounds"] += 1
                else:
                    taken.append(item)
                    self._add_row(item)
            if self._metrics is not None:
                self._metrics.record(taken)
            self._took(start)

    def report(self, unit: str, rows: Sequence[RequestRecord | AuditRecord], snapshot: list | None = None) -> None:
        """A unit's flush: export rows of its finished requests (their metrics are in the snapshot), and its
        metrics' cumulative snapshot (None: unchanged since its last report)."""
        with self._lock:
            start = time.perf_counter()
            for item in rows:
                if isinstance(item, (RequestRecord, AuditRecord)):
                    self._add_row(item)
                else:
                    logger.warning("telemetry hub: ignoring row of type %s", type(item).__name__)
            now = time.monotonic()
            if snapshot is not None:
                self._units[unit] = (now, snapshot)
                self._load["snapshots"] += 1
            elif unit in self._units:
                self._units[unit] = (now, self._units[unit][1])
            self._took(start)

    def _add_row(self, item: RequestRecord | AuditRecord) -> None:
        self._note_arm(item.arm)
        if isinstance(item, RequestRecord):
            self._requests.append(request_row(item))
            self._load["requests"] += 1
        else:
            self._audits.append(item.to_dict())
            self._load["audits"] += 1

    def _took(self, start: float) -> None:
        self._load["batches"] += 1
        self._load["busy_s"] += time.perf_counter() - start

    def set_arms(self, arms: Sequence[str], weights: Sequence[float] | None = None) -> None:
        """The configured arms of a deployed version, in config order, with their weights (each ingress replica
        calls it as it starts and on each in-place update): the export lists them first, then any other arm its
        rows name, and notes when they or their weights changed."""
        entry = {"arms": list(arms), "weights": None if weights is None else dict(zip(arms, map(float, weights)))}
        with self._lock:
            self._arms = list(dict.fromkeys([*arms, *self._arms]))
            last = self._deployments[-1] if self._deployments else None
            if last is None or (last["arms"], last["weights"]) != (entry["arms"], entry["weights"]):
                self._deployments.append({**entry, "at_s": time.time()})

    def _note_arm(self, arm: str) -> None:
        if arm not in self._arms:
            self._arms.append(arm)

    def load(self) -> dict[str, float]:
        """What the hub has taken so far: batches (`record` and `report` calls), the rounds it counted itself,
        request and audit rows, unit snapshots, and the seconds it spent taking them."""
        with self._lock:
            return dict(self._load)

    # ------------------------------------------------------------------ output

    def prometheus_text(self) -> str:
        """Prometheus text exposition (format 0.0.4) of every metric, every unit's and the hub's own; "" when
        metrics are off."""
        if not self.settings.metrics:
            return ""
        with self._lock:
            cutoff = time.monotonic() - UNIT_TTL_S
            self._units = {unit: entry for unit, entry in self._units.items() if entry[0] >= cutoff}
            snapshots = [self._metrics.snapshot(), *(snapshot for _, snapshot in self._units.values())]
        return merged_text(snapshots)

    def export(self) -> dict[str, Any]:
        """The JSON export the A/B report reads (`GET /v1/specserve/export`):

        {"schema": "specserve.export/v1", "service": str, "generated_s": float (time.time()),
         "arms": [arm names, config order first],
         "requests": [request_row(...), ...] (newest MAX_ROWS), "audits": [AuditRecord.to_dict(), ...],
         "dropped": {"requests": int, "audits": int}  (rows that fell out of the ring buffers),
         "deployments": [{"arms": [names], "weights": {name: weight} | None, "at_s": float (time.time())}, ...]
                        (each change of the arms or their weights, in order)}
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
                    "requests": self._load["requests"] - len(self._requests),
                    "audits": self._load["audits"] - len(self._audits),
                },
                "deployments": [dict(d) for d in self._deployments],
            }

    def shutdown(self) -> None:
        """Flush OTLP and release the meter provider."""
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics = None


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

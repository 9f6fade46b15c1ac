"""The `actors.stats.LoopObserver` of a unit: its metrics, its reports to the telemetry hub, and request traces.

It buffers records and, from a background thread, counts them into the unit's own metrics
(`cluster.observability.metrics`) and sends the hub a report: the finished requests' rows and the metrics'
cumulative snapshot, fire-and-forget, so the loop never waits on telemetry and the hub's work does not grow with
the step rate. It also writes request span trees (`cluster.observability.tracing`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from opentelemetry.sdk.trace import TracerProvider

from actors.stats import RequestRecord, RoundRecord
from cluster.config import TelemetrySettings
from cluster.observability.metrics import metrics_recorder
from cluster.observability.tracing import RequestTracer, make_tracer_provider

logger = logging.getLogger(__name__)

FINISH_GRACE_S = 2.0  # a finished request's span tree waits this long at most for its last round record
KEEPALIVE_S = 60.0  # an idle unit re-sends its snapshot this often, so the hub keeps its series (UNIT_TTL_S)


def remote_sender(hub) -> Callable[[str, list, list | None], object]:
    """`send` for a hub actor handle: fire-and-forget, so the loop never waits on telemetry."""
    return lambda unit, rows, snapshot: hub.report.remote(unit, rows, snapshot)


class UnitObserver:
    """The `LoopObserver` of one unit: counts its metrics, reports to the hub and writes request traces.

    `send(unit, rows, snapshot)` delivers a report to the hub (`TelemetryHub.report`): `remote_sender(hub)` for
    the app's hub actor (fire-and-forget), or an in-process hub's `report`. Buffered records are counted and a
    report sent when `max_batch` are buffered, and every `flush_interval_s` by a daemon thread (None: no thread;
    call `flush()`), so `on_round` / `on_request` only append to a list. The snapshot is sent when something was
    counted since the last report, and at least every `KEEPALIVE_S`. Traces follow `settings.tracing`;
    `tracer_provider` overrides the provider the settings would build (tests inject one with an in-memory
    exporter). `close()` flushes and stops.
    """

    def __init__(
        self,
        send: Callable[[list], object],
        unit: str,
        settings: TelemetrySettings | None = None,
        tracer_provider: TracerProvider | None = None,
        *,
        max_batch: int = 256,
        flush_interval_s: float | None = 0.5,
    ):
        self.settings = settings or TelemetrySettings()
        self.unit = unit
        self.max_batch = max_batch
        self._send_report = send
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one report at a time: the metrics are counted in order, sent once
        self._buffer: list = []
        self._metrics = metrics_recorder(self.settings)
        self._snapshot_s = -KEEPALIVE_S  # monotonic time of the last snapshot sent
        self._finishing: list[tuple] = []  # (RequestRecord, monotonic time) awaiting their last round record
        self._finished: list[tuple] = []  # (RequestRecord, rounds, dropped) ready for span emission
        self._owns_provider = tracer_provider is None
        provider = None
        if self.settings.tracing != "off":
            provider = tracer_provider or make_tracer_provider(self.settings)
        self._provider = provider
        self._tracer = RequestTracer(provider, unit) if provider is not None else None
        self._stop = threading.Event()
        self._wake = threading.Event()  # a full buffer asks the thread to flush now
        self._thread = None
        if flush_interval_s is not None:
            self._thread = threading.Thread(
                target=self._run, args=(flush_interval_s,), name=f"specserve-telemetry-{unit}", daemon=True
            )
            self._thread.start()

    def on_round(self, record: RoundRecord) -> None:
        if self._tracer is not None:
            with self._lock:
                self._tracer.add_round(record)
                self._release_finishing(min_age_s=0.0)
        self._append(record)

    def on_request(self, record: RequestRecord) -> None:
        if self._tracer is not None:
            with self._lock:
                self._finishing.append((record, time.monotonic()))
        self._append(record)

    def _release_finishing(self, min_age_s: float) -> None:
        """Queue for tracing the finished requests waiting at least `min_age_s` (caller holds the lock).

        The loop reports a request when its last round commits, before that round's `RoundRecord`; so a
        finished request waits for the next round record (or `FINISH_GRACE_S` when the unit goes idle).
        """
        now, waiting = time.monotonic(), []
        for record, since in self._finishing:
            if now - since >= min_age_s:
                rounds, dropped = self._tracer.pop(record.request_id)
                self._finished.append((record, rounds, dropped))
            else:
                waiting.append((record, since))
        self._finishing = waiting

    def _append(self, record) -> None:
        with self._lock:
            self._buffer.append(record)
            full = len(self._buffer) >= self.max_batch
        if full and self._thread is not None:
            self._wake.set()  # counting is the thread's work, never the loop's
        elif full:
            self._send()

    def _send(self) -> None:
        with self._send_lock:
            with self._lock:
                batch, self._buffer = self._buffer, []
            now = time.monotonic()
            if not batch and now - self._snapshot_s < KEEPALIVE_S:
                return
            self._snapshot_s = now  # new records, or the keepalive is due: the snapshot goes out
            try:
                snapshot = None
                if self._metrics is not None:
                    self._metrics.record(batch)
                    snapshot = self._metrics.snapshot()
                rows = [item for item in batch if isinstance(item, RequestRecord)]
                if rows or snapshot:
                    self._send_report(self.unit, rows, snapshot)
            except Exception:  # telemetry must never break serving
                logger.exception("unit %s: dropped %d telemetry records", self.unit, len(batch))

    def flush(self, grace_s: float = FINISH_GRACE_S) -> None:
        """Send buffered records and write the span trees of finished requests whose last round has been
        seen (or that finished more than `grace_s` ago)."""
        self._send()
        with self._lock:
            if self._tracer is not None:
                self._release_finishing(grace_s)
            finished, self._finished = self._finished, []
        for record, rounds, dropped in finished:
            try:
                self._tracer.emit(record, rounds, dropped)
            except Exception:
                logger.exception("unit %s: could not trace request %s", self.unit, record.request_id)

    def _run(self, interval_s: float) -> None:
        while True:
            self._wake.wait(interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return  # close() flushes
            self.flush()

    def close(self) -> None:
        """Stop the flush thread, flush, and flush the tracer provider's exporters."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush(grace_s=0.0)
        if self._provider is not None:
            self._provider.force_flush()
            if self._owns_provider:
                self._provider.shutdown()
        if self._metrics is not None:
            self._metrics.shutdown()

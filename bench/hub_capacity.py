"""The telemetry hub's capacity: simulated units report at a GPU step rate, from 1 to 256 units.

Each simulated unit sends one real hub actor what a Serve replica's `UnitObserver` sends it: every `FLUSH_S`, a
report of the `RequestRecord`s its rows finished since the last (`REQUEST_TOKENS` tokens at `TOKENS_PER_ROUND` a
round, `rows` rows stepping at `step_hz`) and its metrics' snapshot, made once per unit from a `MetricsRecorder`
that counted a representative run (the hub's work does not depend on the snapshot's values). What a unit spends
counting its own rounds is measured apart: `unit_us_per_round`, one real recorder counting `rows`-row rounds,
and `unit_ms_per_snapshot`. Per unit count: the requests the units sent per second, the reports and requests
the hub took per second, its busy share, each report's latency (sent to taken), and how long the hub took after
the load stopped to take what was still queued (`drain_s`: a backlog that grows without bound is a saturated
hub), and one scrape of `/metrics` after it (`scrape_ms`, `scrape_kib`). The simulators share this machine's
cores with the hub, so the figures are lower bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from prometheus_client.metrics_core import Metric

from actors.stats import RequestRecord, RoundRecord, RowRecord
from cluster.config import TelemetrySettings
from cluster.observability.metrics import MetricsRecorder
from cluster.observability.telemetry import get_or_create_hub, kill_hub

UNITS = (1, 4, 16, 64, 256)
STEP_HZ = 50.0  # a GPU unit's steps per second
ROWS = 8  # rows per step
REQUEST_TOKENS = 128
TOKENS_PER_ROUND = 3.0
FLUSH_S = 0.5  # the observer's flush interval in a replica
ARMS = ("exact", "asd")


def round_record(unit: str, step: int, rows: int) -> RoundRecord:
    """One step of `rows` rows, both arms, γ = 4 and 0..4 drafts kept (the hub's cost grows with the kept)."""
    return RoundRecord(unit=unit, batch_size=rows, started_s=time.time(), draft_s=0.001, score_s=0.012,
                       verify_s=0.001, total_s=0.016, forward_s=0.011,
                       rows=tuple(RowRecord(f"{unit}-r{i}", ARMS[i % 2], 4, (step + i) % 5,
                                            int(i % 2 and step % 3 == 0), 0.5 if i % 2 else 0.0)
                                  for i in range(rows)))


def request_record(unit: str, n: int) -> RequestRecord:
    now = time.time()
    arm = ARMS[n % 2]
    rounds = int(REQUEST_TOKENS / TOKENS_PER_ROUND)
    return RequestRecord(f"{unit}-q{n}", arm, unit, prompt_tokens=200, output_tokens=REQUEST_TOKENS, rounds=rounds,
                         draft_tokens=4 * rounds, accepted_tokens=2 * rounds, gammas=(4,) * rounds, started_s=now - 2.0,
                         first_token_s=now - 1.9, finished_s=now, finish_reason="length", verification=arm,
                         regret_spent=1.0 if arm == "asd" else None, regret_budget=8.0 if arm == "asd" else None,
                         relaxed_tokens=2 if arm == "asd" else None, accepted_per_position=(rounds, rounds // 2))


class TimedSender:
    """Sends reports to the hub as `remote_sender` does, each report's latency recorded."""

    def __init__(self, hub, latencies: list[float], pending: set):
        self.hub, self.latencies, self.pending = hub, latencies, pending

    def __call__(self, unit: str, rows: list, snapshot: list | None) -> None:
        start = time.perf_counter()
        future = self.hub.report.remote(unit, rows, snapshot).future()
        self.pending.add(future)

        def done(f) -> None:
            self.latencies.append(time.perf_counter() - start)
            self.pending.discard(f)

        future.add_done_callback(done)


def unit_costs(rows: int, rounds: int = 200) -> tuple[float, float, list]:
    """What one unit spends on its own metrics: µs to count a `rows`-row round (requests included at their rate;
    counted a flush's worth at a time, as the observer does), ms per snapshot, and the snapshot after `rounds`
    rounds (the representative one the units send)."""
    recorder = MetricsRecorder(TelemetrySettings())
    per_step = rows * TOKENS_PER_ROUND / REQUEST_TOKENS
    records, finished = [], 0.0
    for step in range(rounds):
        records.append(round_record("sim", step, rows))
        finished += per_step
        while finished >= 1:
            finished -= 1
            records.append(request_record("sim", len(records)))
    per_flush = max(1, round(STEP_HZ * FLUSH_S))  # a flush's rounds (and the requests among them) at a time
    start = time.perf_counter()
    for i in range(0, len(records), per_flush):
        recorder.record(records[i:i + per_flush])
    per_round = (time.perf_counter() - start) / rounds
    start = time.perf_counter()
    snapshot = recorder.snapshot()
    per_snapshot = time.perf_counter() - start
    recorder.shutdown()
    return 1e6 * per_round, 1e3 * per_snapshot, snapshot


def relabel(snapshot: list, unit: str) -> list:
    """`snapshot` as unit `unit`'s (its series carry their unit's label)."""
    out = []
    for family in snapshot:
        copy = Metric(family.name, family.documentation, family.type, family.unit)
        copy.samples = [s._replace(labels={**s.labels, "unit": unit}) for s in family.samples]
        out.append(copy)
    return out


async def one_point(units: int, *, seconds: float, step_hz: float = STEP_HZ, rows: int = ROWS) -> dict:
    """Drive `units` simulated units for `seconds` against a fresh hub; the point's figures (module docstring)."""
    name = f"capacity-hub-{units}-{time.monotonic_ns()}"
    hub = get_or_create_hub(name, TelemetrySettings(metrics=True), ARMS)
    first = await hub.load.remote()
    unit_us, snapshot_ms, snapshot = unit_costs(rows)
    latencies: list[float] = []
    pending: set = set()
    send = TimedSender(hub, latencies, pending)
    names = [f"sim{u}" for u in range(units)]
    snapshots = [relabel(snapshot, unit) for unit in names]
    per_flush = rows * TOKENS_PER_ROUND / REQUEST_TOKENS * step_hz * FLUSH_S  # requests a unit finishes per flush
    flush_hz = 1.0 / FLUSH_S
    t0 = time.perf_counter()
    tick = requests = 0
    finished = [0.0] * units
    ticks_per_flush = max(1, round(step_hz * FLUSH_S))  # flushes are spread over the steps of a flush interval
    while time.perf_counter() - t0 < seconds:
        for u in range(tick % ticks_per_flush, units, ticks_per_flush):
            finished[u] += per_flush
            rows_out = []
            while finished[u] >= 1:
                finished[u] -= 1
                rows_out.append(request_record(names[u], requests))
                requests += 1
            send(names[u], rows_out, snapshots[u])
        tick += 1
        await asyncio.sleep(max(0.0, t0 + tick / step_hz - time.perf_counter()))
    wall = time.perf_counter() - t0
    sent_at = time.perf_counter()
    while pending:
        await asyncio.sleep(0.01)
    drain = time.perf_counter() - sent_at
    last = await hub.load.remote()
    start = time.perf_counter()
    text = await hub.prometheus_text.remote()  # one scrape of every unit's series
    scrape = time.perf_counter() - start
    kill_hub(name)
    latencies.sort()
    window = wall + drain
    return {
        "units": units, "offered_rounds_per_s": units * step_hz, "reports_per_s_offered": units * flush_hz,
        "requests_per_s_sent": requests / wall,
        "batches_per_s": (last["batches"] - first["batches"]) / window,
        "requests_per_s": (last["requests"] - first["requests"]) / window,
        "hub_busy": (last["busy_s"] - first["busy_s"]) / window,
        "busy_us_per_batch": 1e6 * (last["busy_s"] - first["busy_s"]) / max(1, last["batches"] - first["batches"]),
        "latency_ms_p50": 1e3 * latencies[len(latencies) // 2] if latencies else None,
        "latency_ms_p95": 1e3 * latencies[int(0.95 * (len(latencies) - 1))] if latencies else None,
        "drain_s": drain, "scrape_ms": 1e3 * scrape, "scrape_kib": len(text) / 1024,
        "unit_us_per_round": unit_us, "unit_ms_per_snapshot": snapshot_ms,
    }


def main_section(args: argparse.Namespace, command: str) -> int:
    """`specserve bench --section hub [--quick] [--out DIR]`: the capacity curve, the simulated units on a worker
    node and the hub on the head (`bench.multinode.across_nodes`), in DIR/hub_capacity.json and one line per point
    on stderr (the config is not used)."""
    from bench.multinode import across_nodes

    units = (1, 16, 64) if args.quick else UNITS
    seconds = 3.0 if args.quick else 6.0
    points = across_nodes(one_point, units, seconds=seconds, step_hz=STEP_HZ, rows=ROWS)
    out = Path(args.out or "bench-out/hub")
    out.mkdir(parents=True, exist_ok=True)
    (out / "hub_capacity.json").write_text(json.dumps({
        "command": command, "step_hz": STEP_HZ, "rows": ROWS, "request_tokens": REQUEST_TOKENS,
        "tokens_per_round": TOKENS_PER_ROUND, "nodes": "units on a worker node, the hub on the head",
        "points": points}, indent=1))
    return 0

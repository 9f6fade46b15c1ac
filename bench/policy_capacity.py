"""The policy actor's capacity: simulated units report at a GPU step rate, from 1 to 256 units.

Each simulated unit is a real `RemotePolicy` (the unit's side of the protocol) stepping at `step_hz`: per step it
observes `rows` rows, charges its ASD leases, and calls `flush()` (one report in flight, never awaited), as a
unit's round does. Per unit count: the reports the actor merged per second, the rows per second they carried,
the report latency (submit to merged reply), and the step time a unit spends in the policy (observe + charge +
flush). The simulators and the actor share this machine's cores, so the figures are lower bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import ray

from actors.policy import UnitPolicy
from actors.remote.policy import ActorLink, get_or_create_policy_actor

SETTINGS = dict(gamma_max=8, gamma_min=0, prior_alpha=0.6, draft_cost=0.05, fixed_gamma=None)
UNITS = (1, 4, 16, 64, 256)
STEP_HZ = 50.0  # a GPU unit's steps per second
ROWS = 8  # rows per step


class TimedLink(ActorLink):
    """An `ActorLink` that records each report's latency (submit to reply)."""

    def __init__(self, name, settings, latencies: list[float]):
        super().__init__(name, settings)
        self.latencies = latencies

    def submit(self, report):
        start = time.perf_counter()
        future = super().submit(report)
        future.add_done_callback(lambda _: self.latencies.append(time.perf_counter() - start))
        return future


async def simulate(unit: int, name: str, *, seconds: float, step_hz: float, rows: int, latencies: list[float],
                   step_costs: list[float]) -> int:
    policy = UnitPolicy(TimedLink(name, SETTINGS, latencies), unit=f"sim{unit}", **SETTINGS)

    rids = [f"u{unit}-r{i}" for i in range(rows)]
    for rid in rids:
        policy.open_request(rid, "asd", 8.0)
    period, steps = 1.0 / step_hz, 0
    next_t = time.perf_counter() + (unit % 50) * period / 50  # spread the units' phases
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        await asyncio.sleep(max(0.0, next_t - time.perf_counter()))
        next_t += period
        start = time.perf_counter()
        for rid in rids:
            policy.observe(rid, "asd", 4, steps % 5)
        policy.observe_costs(rows, 0.0005, {5: 0.02})
        policy.charged(rids[:2])
        policy.plan([], rows)
        policy.flush()
        step_costs.append(time.perf_counter() - start)
        steps += 1
    for rid in rids:
        policy.close_request(rid)
    await policy.synced()
    return steps


async def one_point(units: int, *, seconds: float, step_hz: float, rows: int) -> dict:
    name = f"capacity-policy-{units}-{time.monotonic_ns()}"
    actor = get_or_create_policy_actor(name, **SETTINGS)
    await actor.summary.remote()
    latencies: list[float] = []
    step_costs: list[float] = []
    first = await actor.summary.remote()
    t0 = time.perf_counter()
    steps = await asyncio.gather(*(simulate(u, name, seconds=seconds, step_hz=step_hz, rows=rows,
                                            latencies=latencies, step_costs=step_costs) for u in range(units)))
    wall = time.perf_counter() - t0
    last = await actor.summary.remote()
    before, after = first["reports"], last["reports"]
    ray.kill(actor, no_restart=True)
    latencies.sort()
    step_costs.sort()
    return {
        "units": units, "offered_steps_per_s": units * step_hz, "steps_per_s": sum(steps) / wall,
        "reports_per_s": (after - before) / wall, "rows_per_s": sum(steps) * rows / wall,
        "steps_per_report": sum(steps) / max(1, after - before),
        "actor_busy": (last["busy_s"] - first["busy_s"]) / wall,  # share of the window the actor spent merging
        "merge_us_per_report": 1e6 * (last["busy_s"] - first["busy_s"]) / max(1, after - before),
        "latency_ms_p50": 1e3 * latencies[len(latencies) // 2] if latencies else None,
        "latency_ms_p95": 1e3 * latencies[int(0.95 * (len(latencies) - 1))] if latencies else None,
        "step_cost_us_mean": 1e6 * statistics.fmean(step_costs) if step_costs else None,
        "step_cost_us_p95": 1e6 * step_costs[int(0.95 * (len(step_costs) - 1))] if step_costs else None,
    }


def main_section(args: argparse.Namespace, command: str) -> int:
    """`specserve bench --section policy [--quick] [--out DIR]`: the capacity curve, the simulated units on a worker
    node and the actor on the head (`bench.multinode.across_nodes`), in DIR/policy_capacity.json and one line per
    point on stderr (the γ settings are the defaults; the config is not used)."""
    from bench.multinode import across_nodes

    units = (1, 16, 64) if args.quick else UNITS
    seconds = 3.0 if args.quick else 6.0
    points = across_nodes(one_point, units, seconds=seconds, step_hz=STEP_HZ, rows=ROWS)
    out = Path(args.out or "bench-out/policy")
    out.mkdir(parents=True, exist_ok=True)
    (out / "policy_capacity.json").write_text(json.dumps({"command": command, "step_hz": STEP_HZ, "rows": ROWS,
                                                          "nodes": "units on a worker node, the actor on the head",
                                                          "points": points}, indent=1))
    return 0

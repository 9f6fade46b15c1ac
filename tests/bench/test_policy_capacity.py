"""The policy-capacity section runs: simulated units report to a real policy actor, and every report merges."""

import asyncio

from bench.policy_capacity import one_point


def test_one_point_measures_reports_latency_and_step_cost(ray_cluster):
    point = asyncio.run(one_point(2, seconds=1.0, step_hz=50.0, rows=4))
    assert point["units"] == 2 and point["reports_per_s"] > 0 and point["steps_per_s"] > 20
    assert point["latency_ms_p50"] is not None and point["step_cost_us_mean"] > 0
    assert 0 <= point["actor_busy"] < 1

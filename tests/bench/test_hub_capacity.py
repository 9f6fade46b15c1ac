"""The hub-capacity section runs: simulated units report to a real hub actor, every report is taken, and the
units' own counting is measured."""

import asyncio

from bench.hub_capacity import one_point


def test_one_point_measures_what_the_hub_took_its_busy_share_and_latency(ray_cluster):
    point = asyncio.run(one_point(2, seconds=1.0, step_hz=50.0, rows=4))
    assert point["units"] == 2 and point["requests_per_s_sent"] > 0
    assert point["batches_per_s"] > 0 and point["requests_per_s"] > 0
    assert point["latency_ms_p50"] is not None and 0 < point["hub_busy"] < 1 and point["drain_s"] >= 0
    assert point["unit_us_per_round"] > 0 and point["unit_ms_per_snapshot"] > 0 and point["scrape_kib"] > 0

"""The features section's accounting (no server): cost against plain, speculation's speedup, the goals, the report."""

import pytest

from bench import features
from bench.run import parse_args


def _cells(plain: float, target_only: float, **variants: tuple[float, float]) -> dict:
    rates = {"plain": (plain, target_only), **variants}
    out = {}
    for variant in features.VARIANTS:
        spec, alone = rates.get(variant, (plain, target_only))
        out[f"{variant}/speculative"] = {"tokens": 100, "wall_s": 100 / spec, "tokens_per_s": spec, "acceptance": 0.5}
        out[f"{variant}/target_only"] = {"tokens": 100, "wall_s": 100 / alone, "tokens_per_s": alone}
    return out


def test_cost_speedup_and_goals():
    summary = features.summarize({"1": _cells(20.0, 10.0, logprobs=(19.5, 9.9), penalties=(17.0, 10.0),
                                              json_schema=(19.8, 11.0))})["1"]
    assert summary["plain"]["cost"] == 0.0 and summary["plain"]["speedup"] == 2.0
    assert abs(summary["logprobs"]["cost"] - 0.025) < 1e-9 and summary["logprobs"]["cost_met"]
    assert not summary["penalties"]["cost_met"]  # 15% slower
    assert summary["logprobs"]["speedup_held"] and not summary["json_schema"]["speedup_held"]  # 1.8 < 0.95 × 2
    results = {"meta": {"command": "specserve bench --section features --quick", "started": "now", "elapsed_s": 1},
               "engines": [{"engine": "native", "config": "configs/local.yaml", "summary": {"1": summary}}],
               "notes": []}
    text = features.report_markdown(results)
    assert "| 1 | penalties | 17.0 | 50% | +15.0% | +0.0% | 1.70 | missed: cost, speedup |" in text
    assert "| 1 | logprobs | 19.5 | 50% | +2.5% | +1.0% | 1.97 | met |" in text
    assert abs(summary["json_schema"]["work_cost"] + 0.1) < 1e-9  # target-only 11 against plain's 10


def _blocks(walls: list[dict[str, float]]) -> dict:
    """Blocks of 10 tokens per cell (4 drafted, 2 accepted) with the given wall times (default 1 s), totals beside
    them as `measure` gives."""
    blocks = [{f"{v}/{m}": [10, wall.get(f"{v}/{m}", 1.0), 4, 2] for v in features.VARIANTS
               for m in ("speculative", "target_only")} for wall in walls]
    return {**features._totals(blocks), "blocks": blocks}


def test_the_cost_ci_resamples_interleaved_blocks():
    # logprobs steadily 2% slower than plain in every block: the CI is narrow and within the goal
    steady = features.summarize({"1": _blocks([{"plain/speculative": w, "logprobs/speculative": w / 0.98}
                                               for w in (0.8, 1.0, 1.3, 0.9, 1.1, 1.2)])})["1"]
    low, high = steady["logprobs"]["cost_ci"]
    assert abs(steady["logprobs"]["cost"] - 0.02) < 1e-9 and abs(low - 0.02) < 1e-9 and abs(high - 0.02) < 1e-9
    assert steady["logprobs"]["cost_shown"] and steady["plain"]["cost_ci"] is None
    assert steady["logprobs"]["acceptance"] == 0.5
    # penalties 10% faster in half the blocks and 12% slower in the others: a 0% point estimate the CI cannot show
    noisy = features.summarize({"1": _blocks([{"penalties/speculative": w} for w in (0.9, 1.12) * 4])})["1"]
    low, high = noisy["penalties"]["cost_ci"]
    assert noisy["penalties"]["cost_met"] and not noisy["penalties"]["cost_shown"] and low < 0 < 0.05 < high
    results = {"meta": {"command": "c", "started": "now", "elapsed_s": 1}, "notes": [],
               "engines": [{"engine": "native", "config": "configs/local.yaml", "summary": {"1": noisy}}]}
    assert f"met; the CI reaches {high:+.1%}" in features.report_markdown(results)
    assert features.summarize({"1": _blocks([{}, {}])})["1"]["logprobs"]["cost_ci"] is None  # too few blocks


def test_the_cli_knows_the_section():
    assert parse_args(["--section", "features", "--quick"]).section == "features"


def test_the_section_measures_the_exact_arm_and_refuses_a_config_without_one():
    from bench.http_bench import exact_arm
    from cluster.config import load_config

    config = load_config("configs/local.yaml")
    assert exact_arm(config) == "exact"
    asd_only = config.model_copy(update={"arms": [a for a in config.arms if a.verification != "exact"]})
    with pytest.raises(ValueError, match="arms"):
        exact_arm(asd_only)

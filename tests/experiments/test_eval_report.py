"""The eval report: per-arm figures, paired differences, the A/B quality section, the bench's quality delta,
and the files written (results.json, report.md, frontier.png)."""

from __future__ import annotations

import json

import pytest

from experiments.eval.report import (
    asd_quality_delta,
    build_eval_report,
    quality_section,
    read_eval_report,
    write_outputs,
)
from experiments.eval.stats import mcnemar_p_value

# exact passes problems 0-7 of 10; asd passes 0-5 and 8 (b = 2: 6 and 7; c = 1: 8); asd answers twice as fast.
EXACT_PASS = [True] * 8 + [False] * 2
ASD_PASS = [True] * 6 + [False, False, True, False]


def _row(arm: str, i: int, passed: bool, seconds: float, spec: dict | None = None, **extra) -> dict:
    return {"suite": "toy", "problem": f"toy/{i}", "arm": arm, "score": float(passed), "passed": passed,
            "output_tokens": 40, "seconds": seconds, "tokens_per_s": 40 / seconds, "error": None,
            "speculative": spec, **extra}


def toy_rows() -> list[dict]:
    rows = []
    for i in range(10):
        rows.append(_row("exact", i, EXACT_PASS[i], 2.0, {"rounds": 10, "draft_tokens": 30, "accepted_tokens": 15}))
        rows.append(_row("asd", i, ASD_PASS[i], 1.0, {"rounds": 10, "draft_tokens": 30, "accepted_tokens": 24,
                                                      "regret_spent": 1.5, "regret_budget": 8.0,
                                                      "relaxed_tokens": 2}))
    rows.append({"suite": "toy", "problem": "toy/3", "arm": "asd", "score": None, "passed": None, "error": "HTTP 500"})
    return rows


def test_per_arm_figures_and_paired_differences():
    report = build_eval_report(toy_rows(), suite="toy", binary=True, resamples=2000, seed=1)
    assert report["schema"] == "specserve.eval/v1" and report["reference"] == "exact" and report["problems"] == 10
    exact, asd = report["arms"]["exact"], report["arms"]["asd"]
    assert (exact["n"], exact["score"], exact["passed"], exact["tokens_per_s"]) == (10, 0.8, 8, 20.0)
    assert exact["acceptance_rate"] == pytest.approx(0.5) and exact["mean_accepted_length"] == pytest.approx(1.5)
    assert exact["verification"] == "exact" and exact["relaxed_tokens"] is None
    assert (asd["score"], asd["tokens_per_s"], asd["verification"]) == (0.7, 40.0, "asd")  # inferred from usage
    assert asd["errors"] == 0  # the failed request was answered by an earlier row
    assert asd["regret_spent_mean"] == 1.5 and asd["relaxed_tokens"] == 20
    pair = report["paired"]["asd"]
    assert pair["n_pairs"] == 10
    assert pair["score"]["diff"] == pytest.approx(-0.1)
    low, high = pair["score"]["ci95"]
    assert -0.4 <= low < -0.1 < high <= 0.2  # d has two −1s and one +1 in ten: the interval straddles 0
    assert pair["mcnemar"] == {"b": 2, "c": 1, "p_value": mcnemar_p_value(2, 1)}
    assert pair["speed"]["ratio"] == pytest.approx(2.0) and pair["speed"]["ci95"] == pytest.approx([2.0, 2.0])


def test_reference_choice_and_errors():
    report = build_eval_report(toy_rows(), suite="toy", binary=True, reference="asd", resamples=200)
    assert report["reference"] == "asd" and set(report["paired"]) == {"exact"}
    assert report["paired"]["exact"]["score"]["diff"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="reference"):
        build_eval_report(toy_rows(), suite="toy", binary=True, reference="nope")
    with pytest.raises(ValueError, match="rows"):
        build_eval_report([], suite="toy", binary=True)


def test_quality_section_for_the_ab_report():
    report = build_eval_report(toy_rows(), suite="toy", binary=True, resamples=500)
    section = quality_section(report)
    rows = {r["arm"]: r for r in section["rows"]}
    assert rows["exact"]["score_diff"] is None and rows["asd"]["score_diff"] == pytest.approx(-0.1)
    assert rows["asd"]["speed_ratio"] == pytest.approx(2.0) and rows["asd"]["mcnemar_p"] == pytest.approx(1.0)
    assert "| asd | 10 | 70.0 | -10.0 |" in section["markdown"]
    assert "| exact (ref) |" in section["markdown"]


def test_asd_quality_delta_for_the_bench():
    settings = {"asd": {"verification": "asd", "asd": {"g": 2.0, "max_relaxed_per_block": 2, "budget": 8.0}}}
    report = build_eval_report(toy_rows(), suite="toy", binary=True, arm_settings=settings, resamples=500)
    delta = asd_quality_delta(report)
    assert set(delta) == {"asd"}
    entry = delta["asd"]
    assert entry["delta"] == pytest.approx(-0.1) and entry["n"] == 10 and entry["reference"] == "exact"
    assert entry["settings"] == {"g": 2.0, "max_relaxed_per_block": 2, "budget": 8.0}
    assert entry["ci95"][0] <= entry["delta"] <= entry["ci95"][1]
    json.dumps(delta)


def test_graded_suites_have_no_mcnemar():
    rows = [_row(arm, i, True, 1.0) | {"score": s, "passed": None}
            for i, (a, b) in enumerate([(0.5, 0.7), (0.2, 0.2), (0.9, 1.0)]) for arm, s in (("exact", a), ("asd", b))]
    report = build_eval_report(rows, suite="toy", binary=False, resamples=500)
    assert report["paired"]["asd"]["mcnemar"] is None
    assert report["paired"]["asd"]["score"]["diff"] == pytest.approx(0.1)
    assert report["arms"]["asd"]["verification"] is None  # no usage.speculative, no settings: unknown


def test_write_outputs(tmp_path):
    report = build_eval_report(toy_rows(), suite="toy", binary=True, resamples=500)
    paths = write_outputs(tmp_path, report)
    assert [p.name for p in paths] == ["results.json", "report.md", "frontier.png"]
    assert json.loads((tmp_path / "results.json").read_text())["paired"]["asd"]["n_pairs"] == 10
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (tmp_path / "report.md").read_text()
    assert "# specserve eval: toy" in markdown and "![speed–quality frontier](frontier.png)" in markdown
    assert read_eval_report(tmp_path) == read_eval_report(tmp_path / "results.json") == json.loads(json.dumps(report))
    with pytest.raises(ValueError, match="not an eval result"):
        read_eval_report(_write(tmp_path / "other.json", {"schema": "specserve.report/v1"}))


def _write(path, data):
    path.write_text(json.dumps(data))
    return path

"""`specserve ab report --eval`: the task-quality section of an eval result beside the A/B speed figures (text
and --json), alone when no export is given, and a clear error for something that is not an eval result."""

from __future__ import annotations

import json

import pytest

from actors.stats import RequestRecord
from cluster.config import TelemetrySettings
from cluster.observability.telemetry import TelemetryHub
from experiments.ab_report import main
from experiments.eval.report import build_eval_report, write_outputs

# exact passes problems 0-7 of 10, asd passes 0-5 and 8 (McNemar: b = 2, c = 1); asd answers twice as fast.
EXACT_PASS = [True] * 8 + [False] * 2
ASD_PASS = [True] * 6 + [False, False, True, False]


def toy_rows() -> list[dict]:
    rows = []
    for i in range(10):
        for arm, passed, seconds in (("exact", EXACT_PASS[i], 2.0), ("asd", ASD_PASS[i], 1.0)):
            rows.append({"suite": "toy", "problem": f"toy/{i}", "arm": arm, "score": float(passed), "passed": passed,
                         "output_tokens": 40, "seconds": seconds, "tokens_per_s": 40 / seconds, "error": None,
                         "speculative": {"rounds": 10, "draft_tokens": 30, "accepted_tokens": 15 if seconds > 1 else 24,
                                         **({"regret_budget": 8.0, "regret_spent": 1.5} if arm == "asd" else {})}})
    # a failed request, superseded by the answer above: it pairs nothing away
    rows.append({"suite": "toy", "problem": "toy/3", "arm": "asd", "score": None, "passed": None, "error": "HTTP 500"})
    return rows


def synthetic_export(n: int) -> dict:
    """The hub's export of n requests per arm: exact at 20 tokens/s, asd at 25."""
    hub = TelemetryHub(TelemetrySettings(metrics=False), arms=["exact", "asd"])
    hub.record([RequestRecord(f"{arm}-{i}", arm, "u0", prompt_tokens=10, output_tokens=64, rounds=20, draft_tokens=80,
                              accepted_tokens=40, gammas=(4,) * 20, started_s=1000.0 + i, first_token_s=1000.1 + i,
                              finished_s=1000.0 + i + 64 / (rate + i % 3), finish_reason="stop", verification=arm,
                              regret_spent=1.0 if arm == "asd" else None, regret_budget=8.0 if arm == "asd" else None,
                              relaxed_tokens=2 if arm == "asd" else None)
                for i in range(n) for arm, rate in (("exact", 20.0), ("asd", 25.0))])
    return hub.export()


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    report = build_eval_report(toy_rows(), suite="toy", binary=True, reference="exact", resamples=500, seed=0)
    (out / "results.json").write_text(json.dumps(report))  # the file alone is what --eval reads
    return out


@pytest.fixture(scope="module")
def export_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "export.json"
    path.write_text(json.dumps(synthetic_export(n=40)))
    return path


def test_json_has_the_speed_report_and_the_quality_rows(eval_dir, export_file, capsys):
    assert main(["--file", str(export_file), "--eval", str(eval_dir), "--json", "--resamples", "100"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "specserve.report/v1" and "tokens_per_s_mean" in report["differences"]["asd"]
    quality = report["quality"]
    assert quality["reference"] == "exact" and quality["suite"] == "toy"
    rows = {r["arm"]: r for r in quality["rows"]}
    asd = rows["asd"]
    n = 10  # asd's failed request on toy/3 is superseded by its answer: all 10 problems are paired
    diff = (sum(ASD_PASS) - sum(EXACT_PASS)) / n
    assert asd["n_pairs"] == n and asd["score_diff"] == pytest.approx(diff)
    low, high = asd["score_diff_ci95"]
    assert low <= diff <= high
    assert asd["speed_ratio"] == pytest.approx(2.0) and asd["mcnemar_p"] == pytest.approx(1.0)
    assert rows["exact"]["score_diff"] is None


def test_text_shows_quality_after_the_speed_figures(eval_dir, export_file, capsys):
    assert main(["--file", str(export_file), "--eval", str(eval_dir / "results.json"), "--resamples", "100"]) == 0
    text = capsys.readouterr().out
    speed, _, quality = text.partition("task quality (specserve eval)")
    assert "asd − exact" in speed and "tokens_per_s_mean" in speed
    assert "| asd | 10 |" in quality and "| exact (ref) |" in quality and "Δ score (pts)" in quality


def test_eval_alone_needs_no_service(eval_dir, capsys):
    # no --url or --file: nothing is fetched, the report is the quality section
    assert main(["--eval", str(eval_dir), "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == {"quality"}
    assert main(["--eval", str(eval_dir)]) == 0
    assert "| asd |" in capsys.readouterr().out


def test_a_file_that_is_not_an_eval_result_is_a_clear_error(export_file, tmp_path, capsys):
    assert main(["--eval", str(export_file)]) == 2
    assert "not an eval result" in capsys.readouterr().err
    assert main(["--eval", str(tmp_path / "missing")]) == 2
    assert "could not read the eval result" in capsys.readouterr().err


def test_the_eval_dir_written_by_specserve_eval_is_read(tmp_path, capsys):
    report = build_eval_report(toy_rows(), suite="toy", binary=True, resamples=200, seed=0)
    write_outputs(tmp_path, report)
    assert main(["--eval", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quality"]["rows"][1]["arm"] == "asd"

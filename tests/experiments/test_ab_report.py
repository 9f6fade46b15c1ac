"""A/B report on a synthetic export built by the real hub: figures, bootstrap CIs, JSON shape, CLI hooks."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
import pytest

from actors.stats import RequestRecord
from cluster.config import TelemetrySettings
from cluster.observability.telemetry import TelemetryHub
from cluster.serving.audit import compare
from experiments.ab_report import COMPARED, EXPORT_PATH, build_report, main, render_text


def synthetic_export(n=200, seed=0):
    """Arm "exact": ~20 tokens/s; arm "asd": ~25 tokens/s, more accepted tokens, some regret; plus audits."""
    rng = np.random.default_rng(seed)
    hub = TelemetryHub(TelemetrySettings(metrics=False), arms=["exact", "asd"])
    records = []
    for i in range(n):
        for arm, rate in (("exact", 20.0), ("asd", 25.0)):
            tokens = 64
            latency = tokens / rng.normal(rate, 2.0)
            asd = arm == "asd"
            records.append(RequestRecord(
                f"{arm}-{i}", arm, "u0", prompt_tokens=10, output_tokens=tokens, rounds=20, draft_tokens=80,
                accepted_tokens=int(rng.integers(40, 50) if asd else rng.integers(30, 40)), gammas=(4,) * 20,
                started_s=1000.0 + i, first_token_s=1000.0 + i + 0.1, finished_s=1000.0 + i + latency,
                finish_reason="stop", verification=arm, regret_spent=float(rng.uniform(0, 4)) if asd else None,
                regret_budget=8.0 if asd else None, relaxed_tokens=3 if asd else None,
                ledger_exhausted=bool(asd and i % 10 == 0),
            ))
    records.append(RequestRecord("exact-aborted", "exact", "u0", 10, 3, 1, 4, 2, (4,), 0.0, 0.1, 9.0, "abort"))
    audits = [compare(f"asd-{i}", "asd", "exact", [1, 2, 3, 4], [1, 2, 3, 4] if i % 2 else [1, 2, 9, 4],
                      regret_spent=float(i % 4), unit="u0") for i in range(20)]
    hub.record([*records, *audits])
    return hub.export()


@pytest.fixture(scope="module")
def export():
    return synthetic_export()


def test_per_arm_figures(export):
    report = build_report(export, resamples=500, seed=1)
    assert report["reference"] == "exact" and list(report["arms"]) == ["exact", "asd"]
    exact, asd = report["arms"]["exact"], report["arms"]["asd"]
    assert exact["requests"] == 201 and exact["completed"] == 200 and exact["aborted"] == 1
    assert exact["tokens_per_s"]["mean"] == pytest.approx(20.0, rel=0.05)
    assert exact["tokens_per_s"]["p50"] <= exact["tokens_per_s"]["p95"]
    assert exact["ttft_s"]["mean"] == pytest.approx(0.1)
    assert asd["acceptance_rate"] == pytest.approx(44.5 / 80, rel=0.05)
    assert asd["mean_accepted_length"] == pytest.approx(44.5 / 20, rel=0.05)
    assert exact["regret_spent"]["total"] == 0.0 and asd["regret_spent"]["mean"] == pytest.approx(2.0, rel=0.15)
    assert asd["ledger_exhaustions"] == 20 and exact["ledger_exhaustions"] == 0
    assert exact["audit"] is None
    assert asd["audit"]["n"] == 20 and asd["audit"]["exact_match_rate"] == pytest.approx(0.5)


def test_differences_have_bootstrap_cis(export):
    report = build_report(export, resamples=1000, seed=3)
    diffs = report["differences"]["asd"]
    assert set(diffs) == set(COMPARED)
    tps = diffs["tokens_per_s_mean"]
    lo, hi = tps["ci95"]
    assert lo < tps["diff"] < hi
    assert 0 < lo and lo < 5.0 < hi + 1.0  # true difference ≈ +5 tokens/s; the CI excludes 0
    assert diffs["acceptance_rate"]["ci95"][0] > 0
    assert diffs["ttft_s_mean"]["diff"] == pytest.approx(0.0, abs=1e-9)
    assert report == build_report(export, resamples=1000, seed=3)  # fixed seed: reproducible


def test_identical_arms_ci_covers_zero():
    rows = synthetic_export(n=100, seed=5)
    twin = {**rows, "arms": ["a", "b"],
            "requests": [{**r, "arm": a} for r in rows["requests"] if r["arm"] == "exact" for a in ("a", "b")],
            "audits": []}
    diffs = build_report(twin, resamples=500)["differences"]["b"]
    for stat, d in diffs.items():
        assert d["diff"] == pytest.approx(0.0, abs=1e-12), stat
        if d["ci95"]:
            assert d["ci95"][0] <= 0 <= d["ci95"][1], stat


def test_json_output_shape(export, tmp_path, capsys):
    path = tmp_path / "export.json"
    path.write_text(json.dumps(export))
    assert main(["--file", str(path), "--json", "--seed", "7", "--resamples", "200"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"schema", "service", "reference", "resamples", "seed", "dropped", "changes", "warnings",
                           "arms", "differences"}
    assert report["warnings"] == []  # the asd arm ran ASD on all its requests
    assert report["seed"] == 7 and report["resamples"] == 200
    arm = report["arms"]["asd"]
    for key in ("requests", "tokens_per_s", "ttft_s", "tpot_s", "acceptance_rate", "mean_accepted_length",
                "regret_spent", "ledger_exhaustions", "audit"):
        assert key in arm
    assert set(arm["tokens_per_s"]) == {"mean", "p50", "p95"}
    entry = report["differences"]["asd"]["tokens_per_s_mean"]
    assert set(entry) == {"reference", "arm", "diff", "ci95", "relative"} and len(entry["ci95"]) == 2


def test_text_output(export):
    text = render_text(build_report(export, resamples=200))
    assert "reference arm exact" in text and "asd − exact" in text
    assert "tokens_per_s_mean" in text and "audit of asd: 20 requests, exact match 50.0%" in text


def test_reference_override_and_errors(export, tmp_path, capsys):
    assert build_report(export, reference="asd", resamples=100)["differences"].keys() == {"exact"}
    with pytest.raises(ValueError, match="reference arm 'nope'"):
        build_report(export, reference="nope")
    path = tmp_path / "export.json"
    path.write_text(json.dumps(export))
    assert main(["--file", str(path), "--reference", "nope"]) == 2
    assert main(["--file", str(tmp_path / "missing.json")]) == 2
    assert "could not read" in capsys.readouterr().err


def test_empty_export():
    report = build_report({"requests": [], "audits": []})
    assert report["arms"] == {} and report["differences"] == {} and report["reference"] is None
    assert "no requests" in render_text(report)


def test_specserve_ab_report_runs_through_the_cli(export, tmp_path, capsys):
    from cluster.cli import main as specserve

    path = tmp_path / "export.json"
    path.write_text(json.dumps(export))
    assert specserve(["-v", "ab", "report", "--file", str(path), "--json", "--resamples", "50"]) == 0
    assert json.loads(capsys.readouterr().out)["reference"] == "exact"


def test_fetches_export_over_http(export, capsys):
    body = json.dumps(export).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server API)
            status = 200 if self.path == EXPORT_PATH else 404
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body if status == 200 else b"{}")

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["--url", url, "--json", "--resamples", "50"]) == 0
        assert json.loads(capsys.readouterr().out)["arms"]["asd"]["requests"] == 200
    finally:
        server.shutdown()


def test_the_report_shows_when_the_arms_changed():
    """An upgrade that changes the arms is in the export (`deployments`) and the report: its time, the arms before
    and after, and the requests that finished on each side of it."""
    hub = TelemetryHub(TelemetrySettings(metrics=False))
    hub.set_arms(["exact", "asd"])
    hub.set_arms(["exact", "asd"])  # another ingress replica of the same version: no change
    first = RequestRecord("a", "exact", "u0", 10, 8, 4, 8, 6, (2,), 1.0, 1.1, 2.0, "stop")
    hub.record([first])
    hub.set_arms(["exact", "asd", "asd-wide"])
    later = RequestRecord("b", "asd-wide", "u0", 10, 8, 4, 8, 6, (2,), 9e9, 9e9, 9e9 + 1, "stop",
                          verification="asd", regret_spent=0.0, regret_budget=8.0, relaxed_tokens=0)
    hub.record([later])
    export = hub.export()
    assert [d["arms"] for d in export["deployments"]] == [["exact", "asd"], ["exact", "asd", "asd-wide"]]
    report = build_report(export, resamples=10)
    (change,) = report["changes"]
    assert change["arms_after"] == ["exact", "asd", "asd-wide"]
    assert (change["requests_before"], change["requests_after"]) == (1, 1)
    assert "arms changed at " in render_text(report) and "exact, asd -> exact, asd, asd-wide" in render_text(report)


def test_the_report_shows_a_change_of_weights_alone():
    """New weights for the same arms (an in-place update of the ingress's user_config) are a change too; the
    same weights again (another ingress replica) are not."""
    hub = TelemetryHub(TelemetrySettings(metrics=False))
    hub.set_arms(["exact", "asd"], [1, 1])
    hub.set_arms(["exact", "asd"], [1.0, 1.0])
    hub.record([RequestRecord("a", "exact", "u0", 10, 8, 4, 8, 6, (2,), 1.0, 1.1, 2.0, "stop")])
    hub.set_arms(["exact", "asd"], [1, 3])
    export = hub.export()
    assert [d["weights"] for d in export["deployments"]] == [{"exact": 1.0, "asd": 1.0}, {"exact": 1.0, "asd": 3.0}]
    report = build_report(export, resamples=10)
    (change,) = report["changes"]
    assert (change["weights_before"], change["weights_after"]) == ({"exact": 1.0, "asd": 1.0},
                                                                    {"exact": 1.0, "asd": 3.0})
    assert "exact ×1, asd ×1 -> exact ×1, asd ×3" in render_text(report)

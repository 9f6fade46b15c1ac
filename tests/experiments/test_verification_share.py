"""The A/B report says what ran: per-arm own-verification share, a warning at the top when an ASD arm ran
exact verification on most of its requests, the same in --json, and the sampled ASD spend in the audit part."""

import json

import pytest

from actors.stats import RequestRecord
from cluster.config import TelemetrySettings
from cluster.observability.telemetry import TelemetryHub
from experiments.ab_report import build_report, main, render_text
from experiments.verification_share import MOST, share_that_ran, warnings


def request(i, arm, *, ran, own, fallback=None, sampled=False, regret=None, budget=None):
    rate = 20.0 + (i % 5)
    return RequestRecord(f"{arm}-{i}", arm, "u0", 10, 40, 10, 40, 20, (4,) * 10, 100.0 + i, 100.1 + i,
                         100.0 + i + 40 / rate, "stop", verification=ran, arm_verification=own,
                         asd_fallback=fallback, sampled=sampled, regret_spent=regret, regret_budget=budget,
                         relaxed_tokens=0 if own == "asd" else None)


def export(asd_rows):
    """24 requests per arm on a hub; the asd arm's rows are given as (ran, fallback, sampled, regret)."""
    hub = TelemetryHub(TelemetrySettings(metrics=False), arms=["exact", "asd"])
    hub.record([request(i, "exact", ran="exact", own="exact", sampled=True) for i in range(24)])
    hub.record([request(i, "asd", ran=ran, own="asd", fallback=fb, sampled=s, regret=r, budget=8.0)
                for i, (ran, fb, s, r) in enumerate(asd_rows)])
    return hub.export()


ALL_SAMPLED = [("exact", "sampled", True, None)] * 24  # the run: OpenAI default temperature 1.0


def test_all_sampled_asd_arm_is_warned_about_in_text_and_json(tmp_path, capsys):
    report = build_report(export(ALL_SAMPLED), resamples=100)
    (warning,) = report["warnings"]
    assert warning["arm"] == "asd" and warning["reference"] == "exact" and warning["verification"] == "exact"
    assert warning["ran_reference"] == 24 and warning["share"] == 1.0
    assert "measure noise" in warning["message"] and "asd.sampled: relaxed" in warning["message"]
    asd = report["arms"]["asd"]
    assert asd["own_verification_share"] == 0.0 and asd["asd_fallbacks"] == {"sampled": 24}
    assert report["arms"]["exact"]["own_verification_share"] == 1.0
    text = render_text(report)
    assert text.startswith("WARNING: arm 'asd' ran exact verification")

    path = tmp_path / "export.json"
    path.write_text(json.dumps(export(ALL_SAMPLED)))
    assert main(["--file", str(path), "--json", "--resamples", "50"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["warnings"][0]["arm"] == "asd"
    assert printed["arms"]["asd"]["own_verification_share"] == 0.0


@pytest.mark.parametrize("fallbacks, warned", [(12, False), (13, True), (0, False)])
def test_warning_only_when_most_requests_fell_back(fallbacks, warned):
    rows = [("exact", "sampled", True, None)] * fallbacks + [("asd", None, False, 0.5)] * (24 - fallbacks)
    report = build_report(export(rows), resamples=50)
    assert bool(report["warnings"]) == warned  # 12 of 24 is half, not most (> MOST = 0.5)
    assert report["arms"]["asd"]["own_verification_share"] == pytest.approx((24 - fallbacks) / 24)
    assert MOST == 0.5


def test_relaxed_sampled_requests_show_their_spend_and_point_to_eval():
    rows = [("asd", None, True, 0.25 * (i % 4)) for i in range(24)]
    report = build_report(export(rows), resamples=50)
    assert report["warnings"] == []
    spend = report["arms"]["asd"]["sampled_asd"]
    assert spend["n"] == 24 and spend["regret_spent_max"] == 0.75 and spend["regret_budget"] == 8.0
    assert spend["regret_spent_mean"] == pytest.approx(0.375)
    text = render_text(report)
    assert "sampled requests of asd verified by ASD" in text and "specserve eval" in text


def test_older_exports_cannot_say_and_are_not_warned():
    rows = [{"arm": "asd", "verification": "asd", "finish_reason": "stop"}]
    assert share_that_ran(rows, "asd") is None
    assert warnings({"exact": [{"arm": "exact", "verification": "exact"}], "asd": rows}, "exact") == []

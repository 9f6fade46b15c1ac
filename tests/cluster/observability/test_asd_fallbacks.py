"""What ran, in the metrics and the export: `specserve_asd_fallbacks_total{arm, unit, reason}` and the export
row's verification fields."""

from prometheus_client.parser import text_string_to_metric_families

from actors.stats import RequestRecord
from cluster.config import TelemetrySettings
from cluster.observability.telemetry import TelemetryHub, request_row


def record(rid, arm, verification, arm_verification, fallback=None, sampled=False):
    return RequestRecord(rid, arm, "u0", 5, 4, 2, 4, 2, (2, 2), 0.0, 0.1, 1.0, "stop", verification=verification,
                         arm_verification=arm_verification, asd_fallback=fallback, sampled=sampled,
                         regret_spent=0.0 if arm_verification == "asd" else None)


def test_fallback_counter_moves_by_arm_unit_and_reason():
    hub = TelemetryHub(TelemetrySettings(), arms=["exact", "asd"])
    hub.record([record("a", "asd", "exact", "asd", "sampled", True), record("b", "asd", "exact", "asd", "sampled", True),
                record("c", "asd", "asd", "asd"), record("d", "exact", "exact", "exact", sampled=True)])
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(hub.prometheus_text()) for s in family.samples}
    key = frozenset({"arm": "asd", "unit": "u0", "reason": "sampled"}.items())
    assert samples[("specserve_asd_fallbacks_total", key)] == 2
    assert not any(name == "specserve_asd_fallbacks_total" and dict(labels)["arm"] == "exact"
                   for name, labels in samples)
    # specserve_requests counts by the verification that ran
    ran_exact = frozenset({"arm": "asd", "unit": "u0", "finish_reason": "stop", "verification": "exact"}.items())
    assert samples[("specserve_requests_total", ran_exact)] == 2


def test_export_row_says_what_ran():
    row = request_row(record("a", "asd", "exact", "asd", "sampled", True))
    assert (row["verification"], row["arm_verification"], row["asd_fallback"], row["sampled"]) == (
        "exact", "asd", "sampled", True)
    row = request_row(record("c", "asd", "asd", "asd"))
    assert (row["verification"], row["arm_verification"], row["asd_fallback"], row["sampled"]) == (
        "asd", "asd", None, False)

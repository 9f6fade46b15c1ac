"""Telemetry: metrics move after records (parsed Prometheus text), labels, export rows, request span trees."""

import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from actors.stats import RequestRecord, RoundRecord, RowRecord
from cluster.config import TelemetrySettings
from cluster.observability.metrics import METRICS, round_arm
from cluster.observability.observer import UnitObserver, remote_sender
from cluster.observability.telemetry import EXPORT_SCHEMA, TelemetryHub, get_or_create_hub, kill_hub
from cluster.observability.tracing import make_tracer_provider
from cluster.serving.audit import compare

T0 = time.time()


@pytest.fixture(autouse=True)
def fresh_clock():
    """Stamp each test's records 'now': the tracer takes times far from the wall clock for another clock's
    and shifts them, which a long test session would otherwise trigger."""
    global T0
    T0 = time.time()


def rounds_and_request(request_id="r1", arm="asd", unit="u0", other=None):
    """Two rounds of one request (γ=4 accepting 3 with one relaxed, then γ=2 accepting 2); the first round
    also batches `other` (request id, arm) when given."""
    first_rows = (RowRecord(request_id, arm, gamma=4, accepted=3, relaxed=1, regret=0.5),)
    if other:
        first_rows += (RowRecord(other[0], other[1], gamma=0, accepted=0),)
    rounds = [
        RoundRecord(unit, len(first_rows), T0, draft_s=0.001, score_s=0.010, verify_s=0.0005, total_s=0.0130,
                    rows=first_rows),
        RoundRecord(unit, 1, T0 + 0.02, draft_s=0.002, score_s=0.008, verify_s=0.0005, total_s=0.0120,
                    rows=(RowRecord(request_id, arm, gamma=2, accepted=2),)),
    ]
    request = RequestRecord(
        request_id, arm, unit, prompt_tokens=7, output_tokens=7, rounds=2, draft_tokens=6, accepted_tokens=5,
        gammas=(4, 2), started_s=T0 - 0.05, first_token_s=T0 - 0.01, finished_s=T0 + 0.04, finish_reason="stop",
        degraded=True, verification="asd", regret_spent=0.5, regret_budget=8.0, relaxed_tokens=1,
        ledger_exhausted=True, accepted_per_position=(2, 2, 1),
    )
    return rounds, request


def samples(text):
    """{(sample name, frozenset(labels)): value} of a Prometheus text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(parsed, name, **labels):
    return parsed[(name, frozenset(labels.items()))]


def test_counters_move_with_vllm_names_and_labels():
    hub = TelemetryHub(TelemetrySettings(), arms=["exact", "asd"])
    rounds, request = rounds_and_request(other=("r2", "exact"))
    hub.record([*rounds, request])
    parsed = samples(hub.prometheus_text())
    asd = dict(arm="asd", unit="u0")
    assert value(parsed, "vllm:spec_decode_num_drafts_total", **asd) == 2
    assert value(parsed, "vllm:spec_decode_num_draft_tokens_total", **asd) == 6
    assert value(parsed, "vllm:spec_decode_num_accepted_tokens_total", **asd) == 5
    assert value(parsed, "vllm:spec_decode_num_accepted_tokens_per_pos_total", **asd, position="0") == 2
    assert value(parsed, "vllm:spec_decode_num_accepted_tokens_per_pos_total", **asd, position="2") == 1
    assert value(parsed, "vllm:generation_tokens_total", **asd) == 7
    assert value(parsed, "vllm:time_to_first_token_seconds_count", **asd) == 1
    assert value(parsed, "vllm:e2e_request_latency_seconds_sum", **asd) == pytest.approx(0.09)
    assert value(parsed, "vllm:request_time_per_output_token_seconds_sum", **asd) == pytest.approx(0.05 / 6)
    assert value(parsed, "specserve_requests_total", **asd, finish_reason="stop", verification="asd") == 1
    assert value(parsed, "specserve_regret_spent_total", **asd) == pytest.approx(0.5)
    assert value(parsed, "specserve_relaxed_tokens_total", **asd) == 1
    assert value(parsed, "specserve_ledger_exhaustions_total", **asd) == 1
    assert value(parsed, "specserve_degraded_requests_total", **asd) == 1
    # γ histogram per row: the plain-decoding row of the exact arm lands in le=0, no vLLM draft counted
    assert value(parsed, "specserve_gamma_bucket", arm="exact", unit="u0", le="0.0") == 1
    assert ("vllm:spec_decode_num_drafts_total", frozenset({"arm": "exact", "unit": "u0"}.items())) not in parsed
    assert value(parsed, "specserve_gamma_count", **asd) == 2
    # the first round batched two arms: whole-round metrics say arm="mixed"
    assert value(parsed, "specserve_round_phase_seconds_count", arm="mixed", unit="u0", phase="score") == 1
    assert value(parsed, "specserve_round_phase_seconds_count", **asd, phase="orchestration") == 1
    assert value(parsed, "specserve_round_seconds_sum", **asd) == pytest.approx(0.012)

    hub.record(rounds_and_request(request_id="r3")[0])  # counters keep moving
    parsed = samples(hub.prometheus_text())
    assert value(parsed, "vllm:spec_decode_num_drafts_total", **asd) == 4


def test_every_metric_carries_arm_and_unit():
    hub = TelemetryHub(TelemetrySettings())
    rounds, request = rounds_and_request()
    audit = compare("r1", "asd", "exact", [1, 2, 3], [1, 2, 4], regret_spent=0.5, unit="u0")
    fallback = RequestRecord("r9", "asd", "u0", 7, 3, 1, 2, 1, (2,), T0 - 0.05, T0 - 0.01, T0, "stop",
                             verification="exact", arm_verification="asd", asd_fallback="sampled", sampled=True)
    hub.record([*rounds, request, audit, fallback])
    families = list(text_string_to_metric_families(hub.prometheus_text()))
    exposed = {f.name for f in families}
    for spec in METRICS:
        assert spec.name in exposed or spec.name.removesuffix("_seconds") in exposed, spec.name
    for family in families:
        for s in family.samples:
            assert {"arm", "unit"} <= set(s.labels), (s.name, s.labels)
    parsed = samples(hub.prometheus_text())
    assert value(parsed, "specserve_audit_requests_total", arm="asd", unit="u0", reference_arm="exact",
                 exact_match="false") == 1


def test_round_arm_label():
    rounds, _ = rounds_and_request(other=("r2", "exact"))
    assert round_arm(rounds[0]) == "mixed" and round_arm(rounds[1]) == "asd"
    assert round_arm(RoundRecord("u", 0, T0, 0, 0, 0, 0)) == "none"


def test_export_rows_and_ring_buffer():
    hub = TelemetryHub(TelemetrySettings(metrics=False), arms=["exact", "asd"], max_rows=2)
    assert hub.prometheus_text() == ""
    for i in range(3):
        hub.record([rounds_and_request(request_id=f"r{i}")[1]])
    hub.record([compare("r0", "asd", "exact", [1], [1], 0.0)])
    out = hub.export()
    assert out["schema"] == EXPORT_SCHEMA and out["arms"] == ["exact", "asd"]
    assert [r["request_id"] for r in out["requests"]] == ["r1", "r2"]
    assert out["dropped"] == {"requests": 1, "audits": 0}
    row = out["requests"][0]
    assert row["ttft_s"] == pytest.approx(0.04) and row["latency_s"] == pytest.approx(0.09)
    assert row["tokens_per_s"] == pytest.approx(7 / 0.09) and row["tpot_s"] == pytest.approx(0.05 / 6)
    assert out["audits"][0]["exact_match"] is True


def test_observer_batches_to_in_process_hub():
    hub = TelemetryHub(TelemetrySettings())
    observer = UnitObserver(hub.report, "u0", TelemetrySettings(), max_batch=100, flush_interval_s=None)
    rounds, request = rounds_and_request()
    for r in rounds:
        observer.on_round(r)
    assert hub.export()["requests"] == []  # buffered, not sent
    observer.on_request(request)
    observer.flush()
    assert [r["request_id"] for r in hub.export()["requests"]] == ["r1"]
    observer.close()


def test_units_count_their_own_metrics_and_the_hub_renders_them_together():
    """The same records give the same exposition whether the hub counts them or two units' observers do (each
    its own rounds), and the hub counts no round of theirs: its work does not grow with the step rate."""
    counted = TelemetryHub(TelemetrySettings(), arms=["exact", "asd"])
    reported = TelemetryHub(TelemetrySettings(), arms=["exact", "asd"])
    observers = {unit: UnitObserver(reported.report, unit, TelemetrySettings(), flush_interval_s=None)
                 for unit in ("u0", "u1")}
    for unit, request_id in (("u0", "r1"), ("u1", "r2"), ("u0", "r3")):
        rounds, request = rounds_and_request(request_id=request_id, unit=unit, other=("x", "exact"))
        counted.record([*rounds, request])
        for r in rounds:
            observers[unit].on_round(r)
        observers[unit].on_request(request)
        observers[unit].flush()
    assert samples(reported.prometheus_text()) == samples(counted.prometheus_text())
    assert value(samples(reported.prometheus_text()), "vllm:spec_decode_num_drafts_total", arm="asd", unit="u1") == 2
    assert text_string_to_metric_families(reported.prometheus_text())  # one family per name: parses
    load = reported.load()
    assert load["rounds"] == 0 and load["requests"] == 3 and load["snapshots"] == 3
    assert [r["request_id"] for r in reported.export()["requests"]] == ["r1", "r2", "r3"]
    for observer in observers.values():
        observer.close()


def test_an_idle_unit_keeps_its_series_and_a_gone_one_expires(monkeypatch):
    from cluster.observability import observer as observer_module
    from cluster.observability import telemetry

    hub = TelemetryHub(TelemetrySettings())
    observer = UnitObserver(hub.report, "u0", TelemetrySettings(), flush_interval_s=None)
    rounds, request = rounds_and_request()
    for r in rounds:
        observer.on_round(r)
    observer.flush()
    assert hub.load()["snapshots"] == 1
    observer.flush()  # nothing new: no report
    assert hub.load()["batches"] == 1
    monkeypatch.setattr(observer_module, "KEEPALIVE_S", 0.0)
    observer.flush()  # the keepalive re-sends the snapshot
    assert hub.load()["snapshots"] == 2
    monkeypatch.setattr(telemetry, "UNIT_TTL_S", 0.0)
    time.sleep(0.01)
    assert "unit=\"u0\"" not in hub.prometheus_text()
    observer.close()


def test_observer_background_flush():
    hub = TelemetryHub(TelemetrySettings(metrics=False))
    observer = UnitObserver(hub.report, "u0", TelemetrySettings(), flush_interval_s=0.05)
    observer.on_request(rounds_and_request()[1])
    deadline = time.time() + 5
    while not hub.export()["requests"] and time.time() < deadline:
        time.sleep(0.02)
    observer.close()
    assert len(hub.export()["requests"]) == 1


def traced(settings, request_ids=("r1",)):
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider(settings, span_exporter=exporter)
    hub = TelemetryHub(TelemetrySettings(metrics=False))
    observer = UnitObserver(hub.report, "u0", settings, tracer_provider=provider, flush_interval_s=None)
    for request_id in request_ids:
        rounds, request = rounds_and_request(request_id=request_id, other=("other", "exact"))
        for r in rounds:
            observer.on_round(r)
        observer.on_request(request)
    observer.close()
    return exporter.get_finished_spans()


def test_request_span_tree():
    spans = traced(TelemetrySettings(tracing="on"))
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    (root,) = by_name["specserve.request"]
    assert root.parent is None
    assert root.attributes["specserve.request_id"] == "r1" and root.attributes["specserve.arm"] == "asd"
    assert root.attributes["specserve.unit"] == "u0" and root.attributes["specserve.output_tokens"] == 7
    assert root.attributes["specserve.acceptance_rate"] == pytest.approx(5 / 6)
    assert root.start_time == int((T0 - 0.05) * 1e9) and root.end_time == int((T0 + 0.04) * 1e9)
    rounds = sorted(by_name["specserve.round"], key=lambda s: s.start_time)
    assert len(rounds) == 2  # the other request's rows are not in r1's tree
    assert all(r.parent.span_id == root.context.span_id for r in rounds)
    assert [r.attributes["specserve.gamma"] for r in rounds] == [4, 2]
    assert rounds[0].attributes["specserve.batch_size"] == 2
    for rnd in rounds:
        phases = sorted((s for s in spans if s.parent and s.parent.span_id == rnd.context.span_id),
                        key=lambda s: s.start_time)
        assert [p.name for p in phases] == ["draft", "score", "verify"]
        assert phases[0].start_time == rnd.start_time
        assert phases[0].end_time == phases[1].start_time and phases[1].end_time == phases[2].start_time
        assert phases[2].end_time <= rnd.end_time
    assert rounds[0].end_time - rounds[0].start_time == pytest.approx(0.013e9, abs=1e3)  # float seconds: sub-µs precision
    assert len(spans) == 1 + 2 * 4


def test_last_round_reported_after_its_request():
    # The loop reports a request when its last round commits, then that round's RoundRecord.
    exporter = InMemorySpanExporter()
    settings = TelemetrySettings(tracing="on")
    observer = UnitObserver(TelemetryHub(TelemetrySettings(metrics=False)).report, "u0", settings,
                            tracer_provider=make_tracer_provider(settings, exporter), flush_interval_s=None)
    (first, last), request = rounds_and_request()
    observer.on_round(first)
    observer.on_request(request)
    observer.flush()
    assert exporter.get_finished_spans() == ()  # waits for the last round record
    observer.on_round(last)
    observer.flush()
    assert sum(s.name == "specserve.round" for s in exporter.get_finished_spans()) == 2
    observer.close()


def test_real_loop_records():
    """The coordinator's own records (tiny random model, n-gram drafter, one exact and one ASD request)."""
    torch = pytest.importorskip("torch")
    from actors.coordinator import ArmSpec, Coordinator, GenerationRequest, SamplingParams
    from actors.drafting import NgramDrafter
    from actors.engines.native.engine import Engine
    from actors.engines.native.model import CausalLM, ModelArgs
    from actors.policy import PolicyCore
    from policies.asd import ASDConfig

    torch.manual_seed(0)
    args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                     num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=256)
    model = CausalLM(args, 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)).eval()
    settings = TelemetrySettings(tracing="on")
    exporter = InMemorySpanExporter()
    hub = TelemetryHub(settings, arms=["exact", "asd"])
    observer = UnitObserver(hub.report, "u0", settings, tracer_provider=make_tracer_provider(settings, exporter),
                            flush_interval_s=None)
    coordinator = Coordinator.local(Engine(model, max_slots=4, max_seq_len=256), NgramDrafter(), PolicyCore(),
                                    unit="u0", observer=observer)
    asd = ArmSpec("asd", "asd", ASDConfig(g=5.0, max_relaxed_per_block=2, budget=8.0))
    prompt = [1, 2, 3, 4, 5] * 3
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    results = coordinator.generate_many_sync(
        [GenerationRequest("e", prompt, params, ArmSpec("exact")), GenerationRequest("a", prompt, params, asd)]
    )
    observer.close()
    records = {r.record.request_id: r.record for r in results}

    spans = exporter.get_finished_spans()
    roots = {s.context.span_id: s.attributes["specserve.request_id"] for s in spans
             if s.name == "specserve.request"}
    assert sorted(roots.values()) == ["a", "e"]
    for request_id, record in records.items():
        rounds = [s for s in spans if s.name == "specserve.round" and roots[s.parent.span_id] == request_id]
        assert len(rounds) == record.rounds
        assert sorted(s.attributes["specserve.gamma"] for s in rounds) == sorted(record.gammas)
    parsed = samples(hub.prometheus_text())

    def counter(name, **labels):  # a counter never added to is absent: 0
        return parsed.get((name, frozenset(labels.items())), 0.0)

    for arm, record in (("exact", records["e"]), ("asd", records["a"])):
        labels = dict(arm=arm, unit="u0")
        assert counter("vllm:spec_decode_num_accepted_tokens_total", **labels) == record.accepted_tokens
        assert counter("vllm:spec_decode_num_draft_tokens_total", **labels) == record.draft_tokens
        for k, kept in enumerate(record.accepted_per_position):
            assert counter("vllm:spec_decode_num_accepted_tokens_per_pos_total", **labels, position=str(k)) == kept
        assert counter("vllm:generation_tokens_total", **labels) == record.output_tokens


def test_tracing_off_and_sampled():
    assert make_tracer_provider(TelemetrySettings(tracing="off")) is None
    assert traced(TelemetrySettings(tracing="off")) == ()
    assert traced(TelemetrySettings(tracing="sampled", trace_sample_rate=0.0)) == ()
    spans = traced(TelemetrySettings(tracing="sampled", trace_sample_rate=1.0), request_ids=("a", "b"))
    assert sum(s.name == "specserve.request" for s in spans) == 2


def test_request_clock_not_wall_time_is_shifted():
    from cluster.observability.tracing import RequestTracer

    exporter = InMemorySpanExporter()
    provider = make_tracer_provider(TelemetrySettings(tracing="on"), span_exporter=exporter)
    _, request = rounds_and_request()
    monotonic = type(request)(**{**request.__dict__, "started_s": 100.0, "first_token_s": 100.1,
                                 "finished_s": 101.0})
    RequestTracer(provider, "u0").emit(monotonic, [], now=T0)
    (root,) = exporter.get_finished_spans()
    assert root.end_time == int(T0 * 1e9) and root.end_time - root.start_time == pytest.approx(1e9, abs=1e3)


@pytest.mark.slow
def test_hub_as_ray_actor(ray_cluster):
    ray = ray_cluster
    hub = get_or_create_hub("test-telemetry", TelemetrySettings(), arms=["exact", "asd"])
    try:
        again = get_or_create_hub("test-telemetry", TelemetrySettings())
        assert again._actor_id == hub._actor_id
        observer = UnitObserver(remote_sender(hub), "u0", TelemetrySettings(), flush_interval_s=None)
        rounds, request = rounds_and_request()
        for r in rounds:
            observer.on_round(r)
        observer.on_request(request)
        observer.close()
        out = ray.get(hub.export.remote())
        assert [r["request_id"] for r in out["requests"]] == ["r1"]
        parsed = samples(ray.get(hub.prometheus_text.remote()))
        assert value(parsed, "vllm:spec_decode_num_drafts_total", arm="asd", unit="u0") == 2
    finally:
        assert kill_hub("test-telemetry")

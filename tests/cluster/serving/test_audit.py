"""Quality audit: token comparison, sampling, background runner, summaries."""

import asyncio
import json
import random

import pytest

from cluster.serving.audit import (
    AuditRecord,
    AuditRunner,
    AuditSampler,
    common_prefix_length,
    compare,
    divergence_by_regret,
    edit_distance,
    rank_correlation,
    summarize,
)


def reference_levenshtein(a, b):
    """Textbook O(n·m) DP, the oracle for the vectorised one."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        row = [i]
        for j, y in enumerate(b, 1):
            row.append(min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = row
    return prev[-1]


def test_edit_distance_known_cases():
    assert edit_distance([], []) == 0
    assert edit_distance([1, 2, 3], []) == 3
    assert edit_distance([], [4]) == 1
    assert edit_distance([1, 2, 3], [1, 2, 3]) == 0
    assert edit_distance([1, 2, 3], [1, 9, 3]) == 1  # substitution
    assert edit_distance([1, 2, 3], [1, 3]) == 1  # deletion
    assert edit_distance([1, 3], [1, 2, 3]) == 1  # insertion
    assert edit_distance([5, 1, 2, 3], [1, 2, 3, 5]) == 2  # move = delete + insert


def test_edit_distance_matches_reference_on_random_sequences():
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(4) for _ in range(rng.randrange(0, 15))]
        b = [rng.randrange(4) for _ in range(rng.randrange(0, 15))]
        assert edit_distance(a, b) == reference_levenshtein(a, b), (a, b)


def test_compare_fields():
    rec = compare("r1", "asd", "exact", [1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6], regret_spent=1.5, unit="u0")
    assert rec == AuditRecord("r1", "asd", "exact", exact_match=False, common_prefix=2, edit_distance=2,
                              asd_tokens=5, ref_tokens=6, regret_spent=1.5, unit="u0")
    assert rec.prefix_agreement == pytest.approx(2 / 6)
    assert rec.normalized_edit_distance == pytest.approx(2 / 6)
    assert AuditRecord.from_dict({**rec.to_dict(), "future_field": 1}) == rec
    same = compare("r2", "asd", "exact", [7, 8], [7, 8], regret_spent=0.0)
    assert same.exact_match and same.common_prefix == 2 and same.edit_distance == 0
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2


def test_sampler_only_greedy_asd_and_fraction():
    sampler = AuditSampler(0.3, seed=7)
    ids = [f"req-{i}" for i in range(10_000)]
    assert not any(sampler.should_audit(i, "exact", 0.0) for i in ids[:100])
    assert not any(sampler.should_audit(i, "asd", 0.7) for i in ids[:100])
    drawn = [sampler.should_audit(i, "asd", 0.0) for i in ids]
    # Binomial(10000, 0.3): sd = 0.0046; a 5-sigma bound.
    assert abs(sum(drawn) / len(ids) - 0.3) < 0.023
    assert drawn == [AuditSampler(0.3, seed=7).should_audit(i, "asd", 0.0) for i in ids]  # reproducible
    assert not any(AuditSampler(0.0).should_audit(i, "asd", 0.0) for i in ids[:100])
    assert all(AuditSampler(1.0).should_audit(i, "asd", 0.0) for i in ids[:100])
    with pytest.raises(ValueError, match="fraction"):
        AuditSampler(1.5)


def test_runner_records_and_bounds_pending():
    async def scenario():
        got = []
        gate = asyncio.Event()
        runner = AuditRunner("exact", got.append, max_pending=2)

        async def replay():
            await gate.wait()
            return [1, 2, 3]

        async def broken():
            raise RuntimeError("target died")

        assert runner.submit("a", "asd", [1, 2, 3], 0.0, replay)
        assert runner.submit("b", "asd", [1, 5, 3], 2.0, replay)
        assert not runner.submit("c", "asd", [1], 1.0, replay)  # over max_pending
        gate.set()
        await runner.drain()
        assert runner.submit("d", "asd", [1], 1.0, broken)
        await runner.drain()
        return runner, got

    runner, got = asyncio.run(scenario())
    assert sorted(r.request_id for r in got) == ["a", "b"]
    assert {r.request_id: r.exact_match for r in got} == {"a": True, "b": False}
    assert runner.skipped == 1 and runner.failed == 1 and runner.pending == 0


def _rec(i, regret, prefix, length=10):
    return AuditRecord(f"r{i}", "asd", "exact", exact_match=prefix == length, common_prefix=prefix,
                       edit_distance=length - prefix, asd_tokens=length, ref_tokens=length, regret_spent=regret)


def test_summary_and_regret_bins():
    records = [_rec(i, 0.0, 10) for i in range(4)] + [_rec(10 + i, 1.0 + i, 9 - i) for i in range(8)]
    summary = summarize(records)
    assert summary["n"] == 12
    assert summary["exact_match_rate"] == pytest.approx(4 / 12)
    assert summary["mean_common_prefix"] == pytest.approx((40 + sum(9 - i for i in range(8))) / 12)
    assert summary["regret_divergence_spearman"] == pytest.approx(1.0)  # divergence grows with regret here
    bins = divergence_by_regret(records, bins=4)
    assert [b["n"] for b in bins] == [4, 2, 2, 2, 2]
    assert bins[0]["regret_hi"] == 0.0 and bins[0]["exact_match_rate"] == 1.0
    assert bins[1]["regret_lo"] == 1.0 and bins[-1]["regret_hi"] == 8.0
    empty = summarize([])
    assert empty["n"] == 0 and empty["exact_match_rate"] is None and empty["by_regret"] == []


def test_rank_correlation_edge_cases():
    assert rank_correlation([1, 2], [1, 2]) is None
    assert rank_correlation([1, 1, 1], [1, 2, 3]) is None
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="lengths"):
        rank_correlation([1, 2, 3], [1, 2])


# --- the audit runs after the last byte (issue 23), and is not lost when the client leaves -----------------------
def _ingress_parts():
    from types import SimpleNamespace

    from actors.requests import EXACT, SamplingParams
    from cluster.serving.choices import Choice
    from cluster.serving.decoder import DecodeJob, Finished, TextDelta
    from cluster.serving.failures import Deadline
    from cluster.serving.ingress import OpenAIIngress

    job = DecodeJob("chatcmpl-1", (1, 2, 3), SamplingParams(max_tokens=4), EXACT)
    finished = Finished("length", (5, 6), "", {"arm": "exact", "timing_s": {"queue": 0.0}}, None, "u")

    class Events:
        def __init__(self):
            self.items = iter([TextDelta("hi", (5, 6)), finished])

        def __aiter__(self):
            return self

        async def __anext__(self):
            try:
                return next(self.items)
            except StopIteration:
                raise StopAsyncIteration from None

        def cancel(self):
            pass

    audited = []
    ingress = SimpleNamespace(_maybe_audit=lambda j, f: audited.append(j.request_id), token_text=None)
    ingress._audit_all = lambda choices: OpenAIIngress._audit_all(ingress, choices)
    body = SimpleNamespace(model="m", include_usage=True)

    def stream():
        timing = {"tokenize": 0.001, "ingress_to_unit": [0.002], "sse": 0.0}
        events = Events()
        return OpenAIIngress._stream(ingress, "chatcmpl-1", [Choice(0, job, chat=True)], [events], [events], body,
                                     Deadline(10), timing, prompt_tokens=3)

    return stream, audited


def test_stream_audits_after_the_last_byte_and_when_the_client_leaves_after_the_answer():
    stream, audited = _ingress_parts()

    async def whole():
        events = []
        async for event in stream():
            events.append(event)
            if event.startswith("data: [DONE]"):
                assert audited == []  # not before the last byte
        return events

    events = asyncio.run(whole())
    assert audited == ["chatcmpl-1"]
    usage = json.loads(events[-2][len("data: "):])["usage"]
    timing = usage["speculative"]["timing_s"]
    assert list(timing)[:3] == ["tokenize", "ingress_to_unit", "queue"] and timing["prefill"] is None
    assert timing["detokenize_sse"] > 0

    stream, audited = _ingress_parts()

    async def leaves():  # the client is gone once it has the finish reason, before usage and [DONE]
        gen = stream()
        async for event in gen:
            if '"finish_reason":"length"' in event:
                break
        await gen.aclose()

    asyncio.run(leaves())
    assert audited == ["chatcmpl-1"]


def test_a_json_answer_runs_its_after_work_also_when_sending_fails():
    from cluster.serving.failures import AfterJSONResponse

    done = []

    async def send_fails(message):
        raise OSError("client gone")

    async def receive():
        return {"type": "http.disconnect"}

    response = AfterJSONResponse({"ok": True}, lambda: done.append(True))
    with pytest.raises(OSError):
        asyncio.run(response({"type": "http"}, receive, send_fails))
    assert done == [True]

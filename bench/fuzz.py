"""The served app under schemathesis: every route of its OpenAPI document, with schema-valid and schema-invalid
data, every answer checked against what the document declares.

Checks: no 5xx, a declared status code, content type, headers and body schema, each SSE event's `data` as the
declared chunk (or `[DONE]` last), invalid data rejected with a 4xx, API keys not ignored. Hypothesis draws
`examples` cases per operation and mode, derandomized, so a run repeats. `fuzz(url, ...)` returns a
`FuzzReport`; nothing here knows Ray (leak checks are the caller's). What is left unchecked: docs/reliability.md.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import TypeAdapter, ValidationError

from cluster.serving.openapi import STREAM_DONE, StreamChunk

_CHUNK = TypeAdapter(StreamChunk)
MAX_STREAM_EVENTS = 1000  # read whole streams (schemathesis stops at 20 events by default)


@dataclass
class FuzzReport:
    cases: int = 0
    seconds: float = 0.0
    statuses: Counter = field(default_factory=Counter)  # "POST /v1/completions 400" -> count
    failures: list[dict] = field(default_factory=list)  # {"operation", "mode", "failure"}, distinct messages

    @property
    def server_errors(self) -> int:
        return sum(n for key, n in self.statuses.items() if int(key.rsplit(" ", 1)[1]) >= 500)

    def summary(self) -> dict:
        return {"cases": self.cases, "seconds": self.seconds, "server_errors": self.server_errors,
                "failures": len(self.failures), "statuses": dict(sorted(self.statuses.items())),
                "failure_samples": self.failures[:10]}


def stream_chunks(ctx, response, case) -> bool | None:
    """A schemathesis check: each SSE event's data is a declared chunk or error, and the stream ends `[DONE]`
    (unless the client stopped reading it, `MAX_STREAM_EVENTS`)."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return None
    events = response.content.decode(errors="replace").split("\n\n")
    complete, cut = events[:-1], response.stream_cut_short  # the piece after the last blank line is unfinished
    data = [line[5:].strip() for event in complete for line in event.splitlines() if line.startswith("data:")]
    if not cut and (not data or data[-1] != STREAM_DONE or events[-1].strip()):
        raise AssertionError(f"the stream does not end with `data: {STREAM_DONE}`: ...{response.text[-300:]!r}")
    for item in data:
        if item == STREAM_DONE:
            continue
        try:
            _CHUNK.validate_json(item, strict=True)
        except ValidationError as err:
            raise AssertionError(f"SSE data is not a declared chunk: {item[:200]}: {err}") from None
    return True


def fuzz(url: str, *, examples: int, headers: dict[str, str] | None = None, timeout_s: float = 60.0,
         settle: Callable[[], object] | None = None) -> FuzzReport:
    """Fuzz every operation of `url`/openapi.json with `examples` positive and `examples` negative cases.

    `settle`, when given, runs before each case: it waits until the server has finished the previous case's work
    (a stream the fuzzer stopped reading may still hold the unit's slots), so each case is judged alone and a
    503 `queue_full` from that leftover load is not counted against the case that follows."""
    import hypothesis
    import schemathesis
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    config = schemathesis.Config.from_dict({"max-stream-events": MAX_STREAM_EVENTS})
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)
    report, seen = FuzzReport(), set()
    start = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @hypothesis.settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                                 suppress_health_check=list(hypothesis.HealthCheck),
                                 phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                if settle is not None:
                    settle()
                report.cases += 1
                try:
                    response = case.call(base_url=url, headers=headers, timeout=timeout_s)
                    report.statuses[f"{operation.label} {response.status_code}"] += 1
                    case.validate_response(response, headers=headers, additional_checks=[stream_chunks],
                                           excluded_checks=[positive_data_acceptance],
                                           transport_kwargs={"base_url": url, "headers": headers,
                                                             "timeout": timeout_s})
                except (Exception, FailureGroup) as err:  # a failed check, or no answer: one sample per message
                    message = f"{type(err).__name__}: {err}"
                    if message[:300] not in seen:
                        seen.add(message[:300])
                        report.failures.append({"operation": operation.label, "mode": mode.value,
                                                "failure": message[:3000]})

            try:
                run()
            except hypothesis.errors.Unsatisfiable:  # nothing to make invalid (a route without parameters)
                pass
    report.seconds = time.monotonic() - start
    return report


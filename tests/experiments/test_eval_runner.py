"""The eval runner: interleaved arms, code that hangs or crashes scored as failures, failed requests, resume.

The backend here is scripted (answers chosen per arm and problem) so each behaviour is exact; the real
backends are exercised in test_eval_cli.py (an in-process unit) and against a served app.
"""

from __future__ import annotations

import json

import pytest

from experiments.eval.backends import BackendError, BackendUnavailable, Completion
from experiments.eval.humaneval import HumanEvalSuite
from experiments.eval.report import build_eval_report
from experiments.eval.runner import ROWS_FILE, read_rows, run_suite

SUITE = HumanEvalSuite(timeout_s=1.0)
PROBLEMS = SUITE.problems()[:4]

HANG = "    while True:\n        pass\n"
SEGFAULT = "    import ctypes\n    ctypes.string_at(0)\n"
EXIT = "    import sys\n    sys.exit(3)\n"
MEMORY = "    x = bytearray(50 * 1024**3)\n"


class ScriptedBackend:
    """Answers each (arm, problem index) with a scripted completion; records the order of requests."""

    description = "scripted"

    def __init__(self, answers: dict[str, list[str | Exception]], arms=("exact", "asd"), fail_after: int | None = None):
        self.answers = answers
        self.arms = arms
        self.calls: list[tuple[str, str]] = []
        self.fail_after = fail_after
        self.closed = False

    def arm_settings(self):
        return {"exact": {"verification": "exact", "asd": None},
                "asd": {"verification": "asd", "asd": {"g": 2.0, "max_relaxed_per_block": 2, "budget": 8.0}}}

    def check_arms(self, arms):
        unknown = [a for a in arms if a not in self.arms]
        if unknown:
            raise ValueError(f"arm: unknown {unknown}")

    def complete(self, request):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt  # the run is killed mid-way
        index = next(i for i, p in enumerate(PROBLEMS) if p.data["prompt"] == request.prompt.prompt)
        self.calls.append((request.arm, PROBLEMS[index].id))
        answer = self.answers[request.arm][index]
        if isinstance(answer, Exception):
            raise answer
        accepted = 15 if request.arm == "asd" else 10
        spec = {"arm": request.arm, "rounds": 10, "draft_tokens": 20, "accepted_tokens": accepted}
        return Completion(answer, output_tokens=30, seconds=1.0 if request.arm == "exact" else 0.5,
                          speculative=spec, finish_reason="stop", served_arm=request.arm)

    def close(self):
        self.closed = True


def canonical(i: int) -> str:
    return PROBLEMS[i].data["canonical_solution"]


def test_hanging_and_crashing_code_scores_as_failure_and_the_run_goes_on(tmp_path):
    backend = ScriptedBackend({"exact": [canonical(i) for i in range(4)], "asd": [HANG, SEGFAULT, EXIT, MEMORY]})
    lines = []
    info = run_suite(SUITE, backend, ["exact", "asd"], tmp_path, limit=4, progress=lines.append)
    rows = read_rows(tmp_path)
    assert (info.written, info.resumed, info.errors) == (8, 0, 0)
    assert len(rows) == 8 and all(r["error"] is None for r in rows)
    assert all(r["passed"] for r in rows if r["arm"] == "exact")
    asd = {r["problem"]: r for r in rows if r["arm"] == "asd"}
    assert not any(r["passed"] for r in asd.values())
    assert "timed out" in asd[PROBLEMS[0].id]["detail"]
    assert "SystemExit" in asd[PROBLEMS[2].id]["detail"] and "MemoryError" in asd[PROBLEMS[3].id]["detail"]
    assert rows[0]["tokens_per_s"] == 30.0 and rows[0]["speculative"]["draft_tokens"] == 20
    assert "4 problems × 2 arms" in lines[0] and lines[-1].startswith("[8/8]")


def test_arms_are_interleaved_problem_by_problem_with_rotating_order(tmp_path):
    backend = ScriptedBackend({"exact": [canonical(i) for i in range(4)], "asd": [canonical(i) for i in range(4)]})
    run_suite(SUITE, backend, ["exact", "asd"], tmp_path, limit=4)
    ids = [p.id for p in PROBLEMS]
    assert backend.calls == [("exact", ids[0]), ("asd", ids[0]), ("asd", ids[1]), ("exact", ids[1]),
                             ("exact", ids[2]), ("asd", ids[2]), ("asd", ids[3]), ("exact", ids[3])]


def test_a_killed_run_resumes_where_it_stopped(tmp_path):
    answers = {"exact": [canonical(i) for i in range(4)], "asd": [canonical(i) for i in range(4)]}
    with pytest.raises(KeyboardInterrupt):
        run_suite(SUITE, ScriptedBackend(answers, fail_after=3), ["exact", "asd"], tmp_path, limit=4)
    with open(tmp_path / ROWS_FILE, "a") as f:
        f.write('{"suite": "humaneval", "problem": "HumanEval/1", "ar')  # a torn last line
    assert len(read_rows(tmp_path)) == 3
    again = ScriptedBackend(answers)
    lines = []
    info = run_suite(SUITE, again, ["exact", "asd"], tmp_path, limit=4, progress=lines.append)
    assert (info.written, info.resumed) == (5, 3)
    assert len(again.calls) == 5 and "resuming, 3 of 8 rows done" in lines[0]
    keys = [(r["arm"], r["problem"]) for r in read_rows(tmp_path)]
    assert len(keys) == len(set(keys)) == 8
    assert run_suite(SUITE, ScriptedBackend(answers), ["exact", "asd"], tmp_path, limit=4).written == 0


def test_a_failed_request_is_recorded_retried_on_rerun_and_left_out_of_the_pairs(tmp_path):
    answers = {"exact": [canonical(i) for i in range(4)],
               "asd": [canonical(0), BackendError("HTTP 500: boom"), canonical(2), canonical(3)]}
    info = run_suite(SUITE, ScriptedBackend(answers), ["exact", "asd"], tmp_path, limit=4)
    assert info.errors == 1
    rows = read_rows(tmp_path)
    failed = [r for r in rows if r["error"]]
    assert len(failed) == 1 and failed[0]["score"] is None and "boom" in failed[0]["error"]
    report = build_eval_report(rows, suite=SUITE.name, binary=True, resamples=200)
    assert report["arms"]["asd"]["errors"] == 1 and report["paired"]["asd"]["n_pairs"] == 3
    answers["asd"][1] = canonical(1)
    assert run_suite(SUITE, ScriptedBackend(answers), ["exact", "asd"], tmp_path, limit=4).written == 1
    report = build_eval_report(read_rows(tmp_path), suite=SUITE.name, binary=True, resamples=200)
    assert report["arms"]["asd"]["errors"] == 0 and report["paired"]["asd"]["n_pairs"] == 4


def test_consecutive_failures_stop_the_run_and_an_unreachable_service_stops_it_at_once(tmp_path):
    down = [BackendError("HTTP 503")] * 4
    with pytest.raises(BackendError, match="3 requests in a row failed"):
        run_suite(SUITE, ScriptedBackend({"exact": down, "asd": down}), ["exact", "asd"], tmp_path / "a", limit=4)
    assert len(read_rows(tmp_path / "a")) == 3
    gone = [BackendUnavailable("cannot reach")] * 4
    with pytest.raises(BackendUnavailable):
        run_suite(SUITE, ScriptedBackend({"exact": gone, "asd": gone}), ["exact", "asd"], tmp_path / "b", limit=4)


def test_bad_arguments_are_value_errors(tmp_path):
    backend = ScriptedBackend({"exact": [], "asd": []})
    with pytest.raises(ValueError, match="unknown"):
        run_suite(SUITE, backend, ["exact", "nope"], tmp_path)
    with pytest.raises(ValueError, match="arms"):
        run_suite(SUITE, backend, ["exact", "exact"], tmp_path)
    with pytest.raises(ValueError, match="limit"):
        run_suite(SUITE, backend, ["exact"], tmp_path, limit=0)


def test_an_output_directory_of_another_suite_is_refused(tmp_path):
    answers = {"exact": [canonical(i) for i in range(4)], "asd": [canonical(i) for i in range(4)]}
    run_suite(SUITE, ScriptedBackend(answers), ["exact"], tmp_path, limit=1)
    other = HumanEvalSuite(name="humaneval-other", timeout_s=1.0)
    with pytest.raises(ValueError, match="holds a run of suite 'humaneval'"):
        run_suite(other, ScriptedBackend(answers), ["exact"], tmp_path, limit=1)
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["suite"] == "humaneval" and info["arm_settings"]["exact"]["verification"] == "exact"


def test_sampled_runs_pair_the_arms_seeds_and_keep_one_temperature_per_directory(tmp_path):
    answers = {"exact": [canonical(i) for i in range(4)], "asd": [canonical(i) for i in range(4)]}
    backend = ScriptedBackend(answers)
    seen = []
    complete = backend.complete
    backend.complete = lambda request: seen.append(request.prompt) or complete(request)
    run_suite(SUITE, backend, ["exact", "asd"], tmp_path, limit=2, temperature=0.7)
    assert all(p.temperature == 0.7 for p in seen)
    seeds = {}
    for prompt in seen:  # one seed per problem, the same on both arms; problems get different seeds
        seeds.setdefault(prompt.prompt, set()).add(prompt.seed)
    assert all(len(s) == 1 and None not in s for s in seeds.values()) and len(seeds) == 2
    assert len({next(iter(s)) for s in seeds.values()}) == 2
    assert json.loads((tmp_path / "run.json").read_text())["temperature"] == 0.7
    with pytest.raises(ValueError, match="temperature"):
        run_suite(SUITE, ScriptedBackend(answers), ["exact"], tmp_path, limit=2)
    with pytest.raises(ValueError, match="temperature"):
        run_suite(SUITE, ScriptedBackend(answers), ["exact"], tmp_path / "other", temperature=3.0)

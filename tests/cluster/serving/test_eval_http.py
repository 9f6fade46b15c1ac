"""`specserve eval --url` against the served app: a real Serve app on a local Ray cluster (tiny random Llama, an
exact and an ASD arm), the real `openai` client, a small `module:object` suite. Checks per-arm rows, that the
forced arm served every request, the resume, bad input, and `ab report --eval` against the same service."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from served_app import served_app

pytestmark = pytest.mark.slow

pytest.importorskip("openai")

APP = "tiny-eval-http"

SUITE = '''
from experiments.eval.suites import EvalPrompt, Problem, Score


class Echo:
    """Short completions of repetitive text; passes when the answer is non-empty (the model is random)."""

    name = "echo"
    binary = True

    def problems(self):
        texts = ["a b c a b c a b", "x y x y x y x", "one two one two one", "red green red green"]
        return [Problem(f"echo/{i}", {"text": t}) for i, t in enumerate(texts)]

    def prompt(self, problem):
        return EvalPrompt(prompt=problem.data["text"], max_tokens=8)

    def score(self, problem, completion):
        return Score.of_pass(bool(completion.strip()))


SUITE = Echo()
'''


def config(model_dir) -> dict:
    return {
        "name": APP,
        "target": {"source": str(model_dir), "served_name": "tiny", "max_seq_len": 256, "max_batch_size": 4,
                   "resources": {"num_cpus": 0.25}, "placement_strategy": "PACK"},
        "drafter": {"kind": "ngram", "resources": {"num_cpus": 0}},
        "arms": [{"name": "exact", "verification": "exact"},
                 {"name": "asd", "verification": "asd", "asd": {"g": 2.0, "max_relaxed_per_block": 2, "budget": 8.0}}],
        "serving": {"max_tokens_limit": 64, "default_max_tokens": 8},
        "unit": {"num_cpus": 0.25, "torch_threads": 1},
        "autoscaling": {"enabled": False, "min_replicas": 1, "max_replicas": 1},
    }


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_llama_dir):
    with served_app(config(tiny_llama_dir), APP) as url:
        yield url


@pytest.fixture
def suite(tmp_path, monkeypatch) -> str:
    (tmp_path / "eval_http_suite.py").write_text(SUITE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "eval_http_suite:SUITE"


def test_eval_over_http_scores_both_arms_and_resumes(server, suite, tmp_path, capsys):
    from experiments.eval.cli import main

    out = tmp_path / "out"
    args = ["--url", server, "--suite", suite, "--arms", "exact,asd", "--out", str(out), "--resamples", "200"]
    assert main([*args, "--limit", "3"]) == 0
    captured = capsys.readouterr()
    assert "[6/6]" in captured.err and "| asd |" in captured.out
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert sorted((r["arm"], r["problem"]) for r in rows) == sorted(
        (a, f"echo/{i}") for a in ("exact", "asd") for i in range(3))
    for row in rows:
        # the x-specserve-arm request header forced the arm: the response header and usage.speculative agree
        assert row["error"] is None and row["served_arm"] == row["arm"] == row["speculative"]["arm"]
        assert 0 < row["output_tokens"] <= 8 and row["seconds"] > 0
    assert all(r["speculative"]["regret_budget"] == 8.0 for r in rows if r["arm"] == "asd")
    assert all("regret_budget" not in r["speculative"] for r in rows if r["arm"] == "exact")
    results = json.loads((out / "results.json").read_text())
    assert results["reference"] == "exact" and results["paired"]["asd"]["n_pairs"] == 3
    assert results["arms"]["asd"]["verification"] == "asd"  # told from usage.speculative: HTTP has no settings

    assert main([*args, "--limit", "4"]) == 0  # one problem more: only its two rows are requested
    err = capsys.readouterr().err
    assert "resuming, 6 of 8 rows done" in err and "2 answers now, 6 from earlier runs" in err
    assert len((out / "rows.jsonl").read_text().splitlines()) == 8

    from experiments.ab_report import main as ab_report

    # a request's record reaches the export a moment after its response: wait until each arm's 6 have (4 rows,
    # and the one-token probe of each of the two runs)
    deadline = time.monotonic() + 30
    while True:
        rows = httpx.get(f"{server}/v1/specserve/export", timeout=10).json()["requests"]
        if all(sum(r["arm"] == arm for r in rows) >= 6 for arm in ("exact", "asd")):
            break
        assert time.monotonic() < deadline, "the export never held every request"
        time.sleep(0.2)
    assert ab_report(["--url", server, "--eval", str(out), "--json", "--resamples", "100"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"exact", "asd"} <= set(report["arms"]) and report["arms"]["asd"]["completed"] >= 4
    assert [r["arm"] for r in report["quality"]["rows"]] == ["exact", "asd"]


def test_arms_default_to_the_services(server, suite, tmp_path, capsys):
    from experiments.eval.cli import main

    assert main(["--url", server, "--suite", suite, "--limit", "1", "--out", str(tmp_path), "--resamples", "50"]) == 0
    assert "2 arms (exact, asd)" in capsys.readouterr().err


def test_an_unknown_arm_is_refused_before_any_row(server, suite, tmp_path, capsys):
    from experiments.eval.cli import main

    out = tmp_path / "bad"
    assert main(["--url", server, "--suite", suite, "--arms", "exact,nope", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "exact" in err
    assert not (out / "rows.jsonl").exists() or not (out / "rows.jsonl").read_text()

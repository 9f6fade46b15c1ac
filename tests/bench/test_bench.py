"""bench: the whole in-process suite on a tiny random Llama (seconds): results.json shape, summary keys,
goals, report and plots; plus the pure parts (α fit, predicted speedup, percentiles, workloads)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from actors.stats import RoundRecord, RowRecord
from bench import speedup
from bench.harness import percentile
from bench.summary import GOALS, SUMMARY_KEYS

ROOT = Path(__file__).resolve().parents[2]


def run_bench(argv: list[str]) -> int:
    """`specserve bench` in this process; it sets torch to the bench's threads, so put the test's 1 back."""
    import torch

    from bench.run import main

    try:
        return main(argv)
    finally:
        torch.set_num_threads(1)


def _round(k: int, accepted: int, score_s: float, total_s: float | None = None) -> RoundRecord:
    return RoundRecord("u", 1, 0.0, 0.001 if k else 0.0, score_s, 0.0, total_s or score_s + 0.001,
                       (RowRecord("r", "exact", k, accepted),))


def test_fit_recovers_alpha_costs_and_the_speedup_formula():
    plain = [_round(0, 0, 0.10) for _ in range(5)]
    # every block of 4 fully accepted except one rejection at position 2: α = 14 / (14 + 1)
    run = [_round(4, 4, 0.15), _round(4, 4, 0.15), _round(4, 4, 0.15), _round(4, 2, 0.15)]
    fit = speedup.fit(run, plain)
    assert fit["t1_s"] == pytest.approx(0.10)
    assert fit["alpha"] == pytest.approx(14 / 15)
    assert fit["v"]["4"] == pytest.approx(1.5)
    assert fit["c"] == pytest.approx(0.001 / 4 / 0.10)
    e = (1 - fit["alpha"] ** 5) / (1 - fit["alpha"])
    assert fit["predicted"] == pytest.approx(e / (4 * fit["c"] + 1.5))


def test_fit_uses_the_policys_cost_rule():
    """v(k) is the policy's CostModel curve: relative to t1, never below 1, non-decreasing in k."""
    from policies.estimators import CostModel

    plain = [_round(0, 0, 0.10) for _ in range(3)]
    run = [_round(2, 1, 0.08), _round(2, 2, 0.08), _round(6, 3, 0.18)]  # k = 2 measured faster than t1: noise
    fit = speedup.fit(run, plain)
    reference = CostModel(default_draft_cost=0.0, decay=0.0)
    reference.observe(1, 0.003 / 10, {1: 0.10, 3: 0.08, 7: 0.18})
    curve = reference.verify_cost(1, 6)
    assert fit["v"] == {"0": 1.0, "2": pytest.approx(curve[2]), "6": pytest.approx(curve[6])}
    assert fit["v"]["2"] == 1.0 and fit["v"]["6"] == pytest.approx(1.8)
    assert fit["c"] == pytest.approx(reference.draft_cost(1))


def test_nothing_drafted_predicts_plain_decoding():
    plain = [_round(0, 0, 0.1) for _ in range(3)]
    assert speedup.fit(plain, plain)["predicted"] == 1.0


def test_exact_kept_stops_at_the_first_draft_that_is_not_greedy():
    from bench.decompose import exact_kept

    output = [5, 1, 2, 3, 9, 4, 4, 7]  # the prefill's token, then a round keeps 3, then one keeps 2
    greedy = [5, 1, 8, 3, 9, 4, 4, 7]  # position 2 was a relaxed token
    rows = [RowRecord("r", "asd", 3, 3, relaxed=1), RowRecord("r", "asd", 2, 2), RowRecord("r", "asd", 0, 0)]
    assert exact_kept(rows, output, greedy) == [1, 2, 0]
    assert exact_kept(rows, output, output) == [3, 2, 0]  # an exact arm's rounds replay to what they kept


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 95) == 5.0 and percentile([], 50) is None


def test_workloads_are_seeded_and_chat_templated(smollm2_tokenizer):
    from bench.workloads import WORKLOADS, load_workload

    for w in WORKLOADS:
        a, b = load_workload(w, smollm2_tokenizer, 3, seed=1), load_workload(w, smollm2_tokenizer, 3, seed=1)
        assert a == b and len(a) == 3 and all(p.ids for p in a)
    edit = smollm2_tokenizer.decode(load_workload("edit", smollm2_tokenizer, 1)[0].ids)
    assert "<|im_start|>user" in edit and "def " in edit
    with pytest.raises(ValueError, match="workload"):
        load_workload("poetry", smollm2_tokenizer, 1)


@pytest.fixture
def tiny_config(tmp_path, tiny_llama_dir):
    data = yaml.safe_load((ROOT / "configs/local.yaml").read_text())
    data["target"].update(source=str(tiny_llama_dir), served_name="tiny", max_seq_len=512, max_batch_size=4)
    data["serving"].update(max_tokens_limit=256, default_max_tokens=16)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_suite_writes_results_report_and_plots(tiny_config, tmp_path):
    out = tmp_path / "bench"
    argv = ["--quick", "--out", str(out), "--skip", "http,quality", "--workloads", "code,edit", "--prompts", "1",
            "--max-tokens", "6", str(tiny_config)]
    assert run_bench(argv) == 0
    results = json.loads((out / "results.json").read_text())
    summary = results["summary"]
    assert set(summary) == set(SUMMARY_KEYS) - {"http_vs_inprocess", "concurrency8_vs_1", "asd_quality_delta"}
    for key, value in summary.items():
        values = value.values() if isinstance(value, dict) else [value]
        assert values and all(isinstance(v, (int, float)) and math.isfinite(v) for v in values), key
        if isinstance(value, dict):
            assert set(value) <= {"code", "edit"}
    assert [g["key"] for g in results["goals"]] == [g.key for g in GOALS]
    assert results["meta"]["skipped"] == ["http", "quality", "sampled"]  # quick leaves out sampled and quality
    for single in results["sections"]["single"].values():
        assert all(single["identical"].values())  # exact greedy speculation == target-only decoding
    for asd in results["sections"]["asd"].values():  # the replay sees the engine's own greedy tokens
        assert all(r["decomposition"]["replay_agreement"] == 1.0 for r in asd["settings"])
    report = (out / "report.md").read_text()
    assert "## Goals" in report and "spec_vs_target_only" in report
    assert {"gamma_sweep.png", "asd_frontier.png", "peer.png", "predicted_vs_realized.png"} <= {
        p.name for p in out.iterdir()}
    # a resumed run reuses every stored section
    assert run_bench(argv + ["--resume"]) == 0


def test_quality_section_runs_the_selection_protocol(tiny_config, tmp_path):
    out = tmp_path / "bench"
    # quick leaves the quality section out unless --sections names it
    argv = ["--quick", "--out", str(out), "--sections", "single,quality", "--workloads", "code",
            "--prompts", "1", "--max-tokens", "6", "--quality-problems", "2", str(tiny_config)]
    assert run_bench(argv) == 0
    results = json.loads((out / "results.json").read_text())
    quality = results["sections"]["quality"]
    report, protocol = quality["report"], quality["protocol"]
    assert quality["suite"] == "humaneval" and report["reference"] == "exact"
    # one problem chooses, one is held out; the split is written
    assert len(protocol["split"]["selection"]) == 1 and len(protocol["split"]["held_out"]) == 1
    assert list(report["arms"]) == ["exact", "asd"] and all(a["n"] == 1 for a in report["arms"].values())
    # a random model never ends within 6 tokens: the protocol stops before the held-out split, says why, and
    # the summary quotes nothing (selection figures are never quoted)
    assert protocol["stopped"] == "max_tokens" and "max-tokens" in quality["stopped"]
    assert report["arms"]["exact"]["measures"]["truncated"] == 1
    assert results["summary"].get("asd_quality_delta", {}) == {}
    shipped = yaml.safe_load((ROOT / "configs/local.yaml").read_text())["arms"][1]["asd"]
    assert report["arms"]["asd"]["settings"]["asd"] == shipped
    text = (out / "report.md").read_text()
    assert "## Task quality per arm" in text and "Not judged on held-out problems" in text
    assert (out / "quality" / "protocol.json").is_file() and (out / "quality" / "selection" / "rows.jsonl").is_file()
    assert not (out / "quality" / "held-out").exists()
    # without --resume the eval's rows start afresh; with it, the stored section is reused as is
    assert run_bench(argv) == 0 and len((out / "quality" / "selection" / "rows.jsonl").read_text().splitlines()) == 2
    again = json.loads((out / "results.json").read_text())["sections"]["quality"]
    assert again["report"]["created"] > report["created"]
    assert run_bench(argv + ["--resume"]) == 0
    assert json.loads((out / "results.json").read_text())["sections"]["quality"] == again


@pytest.mark.slow
def test_http_section_measures_the_served_app(tiny_config, tmp_path):
    out = tmp_path / "bench"
    argv = ["--quick", "--out", str(out), "--skip", "batched,asd,sampled,hf,quality", "--workloads", "code",
            "--prompts", "2", "--max-tokens", "6", "--port", "8791", str(tiny_config)]
    assert run_bench(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert {"http_vs_inprocess", "concurrency8_vs_1"} <= set(results["summary"])
    rows = results["sections"]["http"]["rows"]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [("adaptive", 1), ("adaptive", 8)]
    assert all(r["tokens_per_s"] > 0 and r["latency_p95_s"] >= r["latency_p50_s"] for r in rows)
    assert (out / "concurrency.png").is_file()

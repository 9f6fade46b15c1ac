"""The benchmark's estimators: each wave's fastest repeat, the bench's drafter, and comparing two runs."""

from __future__ import annotations

import json

import pytest

from bench.compare import main as compare_main, rows, spread
from bench.harness import best_of


def test_best_of_takes_each_items_least_time():
    # a load spike in repeat 0 of item 1 and in repeat 1 of item 0 leaves no trace
    assert best_of([10, 20], [[1.0, 9.0], [5.0, 2.0]]) == pytest.approx(30 / 3.0)
    assert best_of([10], [[2.0]]) == pytest.approx(5.0)
    assert best_of([], [[]]) == 0.0


def test_bench_turns_the_output_cache_off():
    from bench.drafter import bench_drafter_setup, bench_drafter_spec, drafter_label
    from cluster.config import load_config

    config = load_config("configs/local.yaml")
    config = config.model_copy(update={"drafter": config.drafter.model_copy(update={"kind": "suffix"})})
    assert config.drafter.suffix_cache_tokens > 0
    assert bench_drafter_spec(config).suffix_cache_tokens == 0
    setup = bench_drafter_setup(config)
    assert setup.kind == "suffix" and setup.suffix_cache_tokens == 0
    assert "cache off" in drafter_label(config.drafter)


def test_compare_lists_every_ratio_with_its_spread(tmp_path, capsys):
    quality = lambda delta: {"asd": {"suite": "humaneval", "delta": delta, "ci95": [0.0, 0.0]}}  # noqa: E731
    a = {"summary": {"spec_vs_target_only": {"code": 1.30, "edit": 2.0}, "http_vs_inprocess": 0.95,
                     "asd_quality_delta": quality(0.0)}}
    b = {"summary": {"spec_vs_target_only": {"code": 1.33, "edit": 1.6}, "concurrency8_vs_1": 2.5,
                     "asd_quality_delta": quality(0.0)}}
    for name, data in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(data))
    got = dict(rows([a["summary"], b["summary"]]))
    assert got["spec_vs_target_only/edit"] == [2.0, 1.6] and got["concurrency8_vs_1"] == [None, 2.5]
    assert got["asd_quality_delta/asd"] == [0.0, 0.0]  # nested figures compare by their delta
    assert spread([1.30, 1.33]) == pytest.approx(0.03 / 1.315) and spread([None, 2.5]) is None
    assert compare_main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "1 ratio(s) outside ±5%" in out and "spec_vs_target_only/edit" in out


def test_sections_and_skip_name_known_sections_only():
    from bench.plan import FULL, QUICK
    from bench.run import make_plan, parse_args

    assert QUICK.sections == ("single", "batched", "asd", "hf", "http") and set(FULL.sections) >= set(QUICK.sections)
    plan = make_plan(parse_args(["--quick", "--sections", "single,sampled"]))
    assert plan.sections == ("single", "sampled") and plan.name == "quick"
    with pytest.raises(ValueError, match="--sections: unknown sections"):
        make_plan(parse_args(["--sections", "single,speed"]))


def test_results_record_the_command_as_given():
    from bench.run import command_line, parse_args
    from cluster.cli import build_parser

    assert command_line(parse_args(["--quick", "--out", "a b"])) == "specserve bench --quick --out 'a b'"
    args = build_parser().parse_args(["-v", "bench", "--quick"])
    args.argv = ["-v", "bench", "--quick"]  # cluster.cli.main sets it
    assert command_line(args) == "specserve -v bench --quick"

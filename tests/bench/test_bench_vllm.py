"""The vLLM peer section's pure parts: the peer servers' command lines, specserve's server variants, how each
ratio is chosen (the best vLLM configuration per workload and load, after the fact, each ratio within one
group) and the report. The section itself starts servers: a benchmark."""

from __future__ import annotations

import json

import pytest
import yaml

from bench.vllm_peer import (BENCH_KV_CACHE_BYTES, GROUPS, SPECSERVE, VLLM_PEERS, MemoryWatch, _vllm_command,
                             specserve_variants, vllm_section)
from bench.vllm_report import report_markdown
from bench.vllm_report import results as _results
from cluster.config import load_config, parse_config


def test_peer_servers_get_the_configs_engine_settings():
    config = load_config("configs/local-vllm.yaml", check_engines=False)
    plain = _vllm_command(config, "/models/x", 9000, None)
    assert plain[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--speculative-config" not in plain
    assert plain[plain.index("--dtype") + 1] == "float32" and plain[plain.index("--max-model-len") + 1] == "2048"
    assert plain[plain.index("--kv-cache-memory-bytes") + 1] == str(2 << 30)
    assert plain[plain.index("--served-model-name") + 1] == config.target.served_name
    ngram = _vllm_command(config, "/models/x", 9000, VLLM_PEERS["vllm_ngram4"])
    assert json.loads(ngram[ngram.index("--speculative-config") + 1]) == {"method": "ngram", "num_speculative_tokens": 4}
    suffix = _vllm_command(config, "/models/x", 9000, VLLM_PEERS["vllm_suffix"])
    # the same prompts come back every repeat: a cache of earlier outputs would replay them
    assert json.loads(suffix[suffix.index("--speculative-config") + 1]) == {
        "method": "suffix", "suffix_decoding_max_cached_requests": 0}
    draft = _vllm_command(config, "/models/x", 9000, VLLM_PEERS["vllm_draft8"])  # the target drafts for itself
    assert json.loads(draft[draft.index("--speculative-config") + 1]) == {
        "method": "draft_model", "num_speculative_tokens": 8, "model": "/models/x"}


def test_every_specserve_variant_is_a_valid_one_replica_config_with_the_benchs_kv_cache():
    data = yaml.safe_load(open("configs/local-vllm.yaml"))
    variants = specserve_variants(data, yaml.safe_load(open("configs/local.yaml")))
    assert set(variants) == set(SPECSERVE)
    assert {n for group in GROUPS.values() for n in group["specserve"]} <= set(SPECSERVE)
    assert {n for group in GROUPS.values() for n in group["vllm"]} == set(VLLM_PEERS)
    for name, variant in variants.items():
        config = parse_config(variant, name)
        assert config.autoscaling.max_replicas == 1 and not config.autoscaling.enabled
        if config.target.engine == "vllm":
            assert config.target.engine_kwargs["kv_cache_memory_bytes"] == BENCH_KV_CACHE_BYTES
    kinds = {name: parse_config(v, name).drafter for name, v in variants.items()}
    assert (kinds["specserve_draft"].kind, kinds["specserve_draft"].method) == ("vllm", "draft_model")
    assert kinds["specserve_actor"].kind == "model" and kinds["specserve_native"].kind == "ngram"
    assert parse_config(variants["specserve_native"], "native").target.engine == "native"
    assert data["target"]["engine_kwargs"]["kv_cache_memory_bytes"] == 2 << 30  # the config itself is untouched


def test_unknown_groups_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="groups: unknown \\['nope'\\]"):
        vllm_section("configs/local-vllm.yaml", {"workloads": ("chat",), "prompts": 1}, tmp_path, ("ngram", "nope"))


def _cells(groups: dict, workloads=("code", "edit")) -> dict:
    """{group: cells} from {group: {workload: {label: tokens/s}}}; load 8 runs 8x as fast, the second repeat slower."""
    return {group: {(w, load, label): {"runs": [v * load, v * load * 0.9], "texts": ["a", "b"],
                                       "acceptance": 0.5 if label != "vllm_plain" else None, "step_s": [0.1 / v]}
                    for w in workloads for load in (1, 8) for label, v in speeds[w].items()}
            for group, speeds in groups.items()}


def test_each_ratio_divides_by_the_best_vllm_configuration_of_its_kind_within_a_group():
    ngram = ["specserve_exact", "specserve_asd", "specserve_native_exact", "vllm_plain", "vllm_ngram2"]
    long = ["specserve_exact", "specserve_native_exact", "vllm_ngram4", "vllm_ngram8"]
    suffix = ["specserve_exact", "specserve_native_exact", "specserve_suffix_exact", "vllm_suffix"]
    draft = ["specserve_draft_exact", "specserve_actor_exact", "vllm_draft2", "vllm_draft4"]
    cells = _cells({
        "ngram": {"code": dict(zip(ngram, [30, 45, 40, 20, 25])), "edit": dict(zip(ngram, [60, 90, 50, 30, 40]))},
        "ngram_long": {"code": dict(zip(long, [30, 40, 33, 28])), "edit": dict(zip(long, [60, 50, 50, 55]))},
        # the suffix group drifted: specserve exact ran 10% slower there, so its ratios use its own figure
        "suffix": {"code": dict(zip(suffix, [27, 36, 29, 32])), "edit": dict(zip(suffix, [54, 45, 70, 35]))},
        "draft": {"code": dict(zip(draft, [20, 10, 16, 25])), "edit": dict(zip(draft, [30, 15, 20, 24]))},
    })
    out = _results(cells, {"workloads": ("code", "edit"), "loads": (1, 8)})
    summary = out["summary"]
    # code: ngram4 gives 30/33 = 0.91, suffix 27/32 = 0.84: the suffix method is the best vLLM configuration
    assert summary["vs_vllm"] == {"code@1": 27 / 32, "code@8": 27 / 32, "edit@1": 60 / 55, "edit@8": 60 / 55}
    assert summary["vs_vllm_native"]["code@1"] == 36 / 32 and summary["vs_vllm_native"]["edit@1"] == 50 / 55
    assert summary["vs_vllm_draft"] == {"code@1": 0.8, "code@8": 0.8, "edit@1": 1.25, "edit@8": 1.25}
    assert summary["vllm_asd_vs_exact"]["edit@1"] == 1.5
    assert summary["vs_vllm_suffix"]["edit@1"] == 2.0
    assert summary["drafter_placement"]["code@1"]["in_worker_vs_actor"] == 2.0
    assert summary["drafter_placement"]["code@1"]["actor_step_s"] == 0.1 / 10
    rows = out["rows"]
    assert [r["best_vs_vllm"] for r in rows] == ["vllm_suffix", "vllm_suffix", "vllm_ngram8", "vllm_ngram8"]
    assert [r["best_vs_vllm_draft"] for r in rows] == ["vllm_draft4", "vllm_draft4", "vllm_draft4", "vllm_draft4"]
    assert rows[0]["greedy_text_agreement"] == {
        "ngram/specserve_exact": 1.0, "ngram/specserve_native_exact": 1.0, "ngram_long/specserve_exact": 1.0,
        "ngram_long/specserve_native_exact": 1.0, "suffix/specserve_exact": 1.0,
        "suffix/specserve_native_exact": 1.0, "suffix/specserve_suffix_exact": 1.0,
        "draft/specserve_draft_exact": 1.0, "draft/specserve_actor_exact": 1.0}
    out["meta"] = {"command": "specserve bench --section vllm", "started": "now", "elapsed_s": 1.0, "preset": {}}
    report = report_markdown(out)
    assert "| code | 1 | 30.0 (50%) | 45.0 (50%) | 40.0 (50%) | 20.0 | 25.0 (50%) |" in report
    assert ("| code | 1 | **0.84** (vllm_suffix) | **1.12** (vllm_suffix) | **0.91** | **0.80** (vllm_draft4) | "
            "1.50 | 2.00 (0.005 / 0.010) |") in report


def test_a_partial_run_reports_what_it_measured_only():
    labels = ["specserve_draft_exact", "specserve_actor_exact", "vllm_draft2"]
    out = _results(_cells({"draft": {"chat": dict(zip(labels, [10, 12, 10]))}}, ("chat",)),
                   {"workloads": ("chat",), "loads": (1,)})
    assert set(out["summary"]) == {"vs_vllm_draft", "drafter_placement"}
    # without vLLM plain, texts are compared with the group's first vLLM server, which the key names
    assert out["rows"][0]["greedy_text_agreement"] == {"draft/specserve_draft_exact vs vllm_draft2": 1.0,
                                                       "draft/specserve_actor_exact vs vllm_draft2": 1.0}
    out["meta"] = {"command": "c", "started": "now", "elapsed_s": 1.0, "preset": {}, "min_available_gib": 1.25}
    report = report_markdown(out)
    assert "| workload | N | vs_vllm_draft | draft in worker / actor (s per step) | greedy texts agree |" in report
    assert "- lowest available memory during the run: 1.2 GiB" in report


def test_the_memory_watch_records_the_runs_lowest_available_memory():
    import time

    watch = MemoryWatch()
    time.sleep(1.2)
    watch.stop()
    assert 0 < watch.min_available_gib <= MemoryWatch.available_gib() + 1.0  # sampled at least once, in GiB

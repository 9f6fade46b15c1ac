"""The vLLM peer section's pure parts: the peer servers' command lines and how `vs_vllm` is chosen (the best
vLLM configuration per workload and load, after the fact), `vs_vllm_suffix` (suffix drafter against vLLM's
suffix method) and the report. The section itself starts servers: a benchmark."""

from __future__ import annotations

import json

from bench.vllm_peer import GROUPS, VLLM_PEERS, _results, _vllm_command, report_markdown
from cluster.config import load_config


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


def _cells(groups: dict, workloads=("code", "edit")) -> dict:
    """{group: cells} from {group: {workload: {label: tokens/s}}}; load 8 runs 8x as fast, the second repeat slower."""
    return {group: {(w, load, label): {"runs": [v * load, v * load * 0.9], "texts": ["a", "b"]}
                    for w in workloads for load in (1, 8) for label, v in speeds[w].items()}
            for group, speeds in groups.items()}


def test_vs_vllm_divides_by_the_best_vllm_configuration_per_workload_and_load():
    ngram = ["specserve_exact", "specserve_asd", *GROUPS["ngram"]]
    suffix = ["specserve_exact", "specserve_suffix_exact", "vllm_suffix"]
    cells = _cells({
        "ngram": {"code": dict(zip(ngram, [30, 45, 20, 25, 33, 28])),
                  "edit": dict(zip(ngram, [60, 90, 30, 40, 50, 55]))},
        # the suffix group drifted: specserve exact ran 10% slower there, so its ratios use its own figure
        "suffix": {"code": dict(zip(suffix, [27, 29, 32])), "edit": dict(zip(suffix, [54, 70, 35]))},
    })
    out = _results(cells, {"workloads": ("code", "edit"), "loads": (1, 8)})
    # code: ngram4 gives 30/33 = 0.91, suffix 27/32 = 0.84: the suffix method is the best vLLM configuration
    assert out["summary"]["vs_vllm"] == {"code@1": 27 / 32, "code@8": 27 / 32, "edit@1": 60 / 55, "edit@8": 60 / 55}
    assert out["summary"]["vllm_asd_vs_exact"]["edit@1"] == 1.5
    assert [r["best_vllm"] for r in out["rows"]] == ["vllm_suffix", "vllm_suffix", "vllm_ngram8", "vllm_ngram8"]
    assert out["summary"]["vs_vllm_suffix"] == {"code@1": 29 / 32, "code@8": 29 / 32, "edit@1": 2.0, "edit@8": 2.0}
    assert all(r["greedy_text_agreement"] == {"ngram/specserve_exact": 1.0, "suffix/specserve_exact": 1.0,
                                              "suffix/specserve_suffix_exact": 1.0} for r in out["rows"])
    out["meta"] = {"command": "specserve bench --section vllm", "started": "now", "elapsed_s": 1.0, "preset": {}}
    assert ("| code | 1 | 30.0 | 45.0 | 20.0 | 25.0 | 33.0 | 28.0 | 27.0 | 29.0 | 32.0 | vllm_suffix | **0.84** | "
            "**0.91** | 1.50 | 100%, 100%, 100% |") in report_markdown(out)


def test_without_vllms_suffix_method_the_report_says_so():
    labels = ["specserve_exact", "specserve_asd", "vllm_plain"]
    out = _results(_cells({"ngram": {"chat": dict(zip(labels, [10, 12, 10]))}}, ("chat",)),
                   {"workloads": ("chat",), "loads": (1,)})
    assert "vs_vllm_suffix" not in out["summary"] and out["summary"]["vs_vllm"] == {"chat@1": 1.0}
    out["meta"] = {"command": "c", "started": "now", "elapsed_s": 1.0, "preset": {}}
    assert "suffix method was not measured" in report_markdown(out)

"""The vLLM peer section's pure parts: the peer servers' command lines and how `vs_vllm` is chosen (the best
vLLM configuration per workload and load, after the fact). The section itself starts servers: a benchmark."""

from __future__ import annotations

import json

from cluster.bench.vllm_peer import VLLM_PEERS, _results, _vllm_command
from cluster.config import load_config


def test_peer_servers_get_the_configs_engine_settings():
    config = load_config("configs/local-vllm.yaml", check_engines=False)
    plain = _vllm_command(config, "/models/x", 9000, None)
    assert plain[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--speculative-config" not in plain
    assert plain[plain.index("--dtype") + 1] == "float32" and plain[plain.index("--max-model-len") + 1] == "2048"
    assert plain[plain.index("--kv-cache-memory-bytes") + 1] == str(2 << 30)
    assert plain[plain.index("--served-model-name") + 1] == config.target.served_name
    ngram = _vllm_command(config, "/models/x", 9000, 4)
    assert json.loads(ngram[ngram.index("--speculative-config") + 1]) == {"method": "ngram", "num_speculative_tokens": 4}


def test_vs_vllm_divides_by_the_best_vllm_configuration_per_workload_and_load():
    labels = ["specserve_exact", "specserve_asd", *VLLM_PEERS]
    speeds = {"code": dict(zip(labels, [30, 45, 20, 25, 33, 28])), "edit": dict(zip(labels, [60, 90, 30, 40, 50, 55]))}
    cells = {(w, load, label): {"runs": [v * load, v * load * 0.9], "texts": ["a", "b"]}
             for w, row in speeds.items() for load in (1, 8) for label, v in row.items()}
    out = _results(cells, {"workloads": ("code", "edit"), "loads": (1, 8)})
    assert out["summary"]["vs_vllm"] == {"code@1": 30 / 33, "code@8": 30 / 33, "edit@1": 60 / 55, "edit@8": 60 / 55}
    assert out["summary"]["vllm_asd_vs_exact"]["edit@1"] == 1.5
    assert [r["best_vllm"] for r in out["rows"]] == ["vllm_ngram4", "vllm_ngram4", "vllm_ngram8", "vllm_ngram8"]
    assert all(r["greedy_text_agreement"] == 1.0 for r in out["rows"])

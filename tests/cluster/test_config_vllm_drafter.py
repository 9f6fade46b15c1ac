"""`drafter.kind: vllm` (vLLM's own proposer inside the target's vLLM engine): its fields, the checks that name
them, and how they reach `DrafterSetup` and vLLM's `speculative_config`."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.config import ConfigError, parse_config

BASE = yaml.safe_load(Path("configs/local-vllm.yaml").read_text())
DRAFT_MODEL = {"kind": "vllm", "method": "draft_model", "source": "embedded:smollm2"}


def test_kind_vllm_flows_typed_into_the_unit_and_vllms_speculative_config():
    from actors.engines.vllm.unit import engine_args
    from cluster.serving.decoder import policy_kwargs, unit_setup

    cfg = parse_config({**BASE, "drafter": {**DRAFT_MODEL, "engine_kwargs": {"draft_tensor_parallel_size": 1}}})
    setup = unit_setup(cfg)
    drafter = setup["drafter"]
    assert (drafter.kind, drafter.method, drafter.source) == ("vllm", "draft_model", "embedded:smollm2")
    args = engine_args(setup["target"], drafter, policy_kwargs(cfg), model_dir="/m", max_seq_len=1024)
    spec = args["speculative_config"]
    assert spec["method"] == "draft_model" and spec["num_speculative_tokens"] == cfg.gamma.gamma_max
    assert spec["model"] and spec["draft_tensor_parallel_size"] == 1
    assert args["additional_config"]["specserve"]["vllm_proposer"] is True and args["async_scheduling"] is False
    for method in ("eagle", "eagle3"):
        assert parse_config({**BASE, "drafter": {**DRAFT_MODEL, "method": method}}).drafter.method == method
    mtp = unit_setup(parse_config({**BASE, "drafter": {"kind": "vllm", "method": "mtp"}}))["drafter"]
    spec = mtp.speculative_config(2)
    assert (spec["method"], spec["model"], spec["num_speculative_tokens"]) == ("mtp", None, 2)


@pytest.mark.parametrize("drafter, target, message", [
    ({**DRAFT_MODEL, "method": "lookahead"}, {}, r"drafter.method: Input should be 'draft_model'"),
    ({"kind": "vllm", "method": "mtp", "source": "embedded:smollm2"}, {}, r"drafter.source must be left out for "
     r"drafter.method 'mtp'"),
    ({"kind": "vllm", "source": "embedded:smollm2"}, {}, r"drafter.method is required"),
    ({"kind": "vllm", "method": "eagle3"}, {}, r"drafter.source .* is required for drafter.method 'eagle3'"),
    ({"kind": "ngram", "method": "draft_model"}, {}, r"drafter.method is only used when drafter.kind is 'vllm'"),
    ({**DRAFT_MODEL, "engine_kwargs": {"num_speculative_tokens": 3}}, {}, r"drafter.engine_kwargs may not set"),
    (DRAFT_MODEL, {"engine": "native", "engine_kwargs": {}}, r"needs target.engine 'vllm'"),
    (DRAFT_MODEL, {"tensor_parallel_size": 2}, r"target.tensor_parallel_size > 1 is not available yet"),
    (DRAFT_MODEL, {"engine_kwargs": {"async_scheduling": True}}, r"target.engine_kwargs.async_scheduling"),
])
def test_kind_vllm_bad_input_fails_at_load_naming_the_field(drafter, target, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({**BASE, "drafter": drafter, "target": {**BASE["target"], **target}})


def test_a_native_unit_refuses_kind_vllm():
    from actors.drafting import DrafterSetup, make_drafter

    with pytest.raises(ValueError, match="target.engine 'vllm'"):
        make_drafter(DrafterSetup(kind="vllm", method="draft_model", source="/m"), max_slots=1, max_seq_len=64)


def test_a_draft_model_or_eagle_head_that_does_not_fit_the_target_fails_at_load_naming_drafter_source():
    from cluster.config import validate_models

    target = {"vocab_size": 1000, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    models = {"embedded:smollm2": target, "/small-vocab": {**target, "vocab_size": 999},
              "/narrow": {**target, "hidden_size": 32}}
    target_spec = {**BASE["target"], "source": "embedded:smollm2", "max_seq_len": None}
    for method, source, message in [("draft_model", "/small-vocab", r"drafter.source vocab_size \(999\)"),
                                    ("eagle", "/narrow", r"drafter.source hidden_size \(32\)")]:
        drafter = {"kind": "vllm", "method": method, "source": source}
        cfg = parse_config({**BASE, "target": target_spec, "drafter": drafter})
        with pytest.raises(ValueError, match=message):
            validate_models(cfg, model_info=models.__getitem__)
    validate_models(parse_config({**BASE, "target": target_spec, "drafter": {**DRAFT_MODEL, "method": "eagle"}}),
                    model_info=models.__getitem__)


def test_a_medusa_head_must_fit_the_target_and_have_gamma_max_heads():
    from cluster.config import validate_models

    target = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2}
    head = {"model_type": "medusa", "vocab_size": 1000, "hidden_size": 64, "num_heads": 8}
    models = {"/t": target, "/heads": head, "/narrow": {**head, "hidden_size": 32}, "/few": {**head, "num_heads": 2},
              "/llama": target}
    base = {**BASE, "target": {**BASE["target"], "source": "/t", "max_seq_len": None}, "gamma": {"gamma_max": 4}}
    for source, message in [("/narrow", r"drafter.source hidden_size \(32\) must equal the target's \(64\)"),
                            ("/few", r"drafter.source has 2 Medusa heads, fewer than gamma.gamma_max \(4\)"),
                            ("/llama", r"drafter.source \(/llama\) is not a Medusa head")]:
        cfg = parse_config({**base, "drafter": {"kind": "vllm", "method": "medusa", "source": source}})
        with pytest.raises(ValueError, match=message):
            validate_models(cfg, model_info=models.__getitem__)
    validate_models(parse_config({**base, "drafter": {"kind": "vllm", "method": "medusa", "source": "/heads"}}),
                    model_info=models.__getitem__)


def test_model_info_reads_a_medusa_heads_config(tmp_path):
    import json

    from actors.sources import model_info

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "medusa", "hidden_size": 64, "vocab_size": 1000,
                                                      "medusa_num_heads": 5, "medusa_num_layers": 1}))
    assert model_info(tmp_path) == {"model_type": "medusa", "vocab_size": 1000, "hidden_size": 64, "num_heads": 5}


def test_mtp_needs_a_target_that_declares_mtp_layers():
    from cluster.config import validate_models

    plain = {"vocab_size": 1000, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "mtp_layers": 0}
    models = {"/plain": plain, "/mimo": {**plain, "mtp_layers": 1}}
    mtp = {"kind": "vllm", "method": "mtp"}
    with pytest.raises(ValueError, match=r"drafter.method 'mtp' .* target.source \(/plain\) declares none"):
        validate_models(parse_config({**BASE, "target": {**BASE["target"], "source": "/plain", "max_seq_len": None},
                                      "drafter": mtp}), model_info=models.__getitem__)
    validate_models(parse_config({**BASE, "target": {**BASE["target"], "source": "/mimo", "max_seq_len": None},
                                  "drafter": mtp}), model_info=models.__getitem__)

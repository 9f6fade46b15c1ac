"""Bench section `sampled` on a tiny random Llama: its modes, figures and report table (seconds)."""

from __future__ import annotations

import pytest
import torch

from bench.plan import ASDSetting
from bench.sampled import LOOSE, markdown, modes, sampled_section


@pytest.fixture(scope="module")
def bench(tiny_llama_dir):
    from actors.drafting import NgramDrafter
    from actors.engines.native import Engine, load_model
    from bench.harness import InProcessBench

    torch.set_num_threads(1)
    model, _ = load_model(str(tiny_llama_dir))
    return InProcessBench(Engine(model, max_slots=4, max_seq_len=256), NgramDrafter(1, 3), eos_token_ids=[2],
                          policy=dict(gamma_max=4), max_tokens=8, repeats=1)


def test_modes_compare_exact_fallback_and_relaxed():
    arm = ("asd:g2_M2_B8", ASDSetting(g=2, max_relaxed_per_block=2, budget=8))
    names = [(m.name, m.arm.verification, m.arm.sampled) for m in modes(arm)]
    assert names == [("exact", "exact", "exact"), ("fallback", "asd", "exact"),
                     ("relaxed_asd:g2_M2_B8", "asd", "relaxed"), (f"relaxed_{LOOSE.label}", "asd", "relaxed")]
    assert [m.name for m in modes(None)] == ["exact", f"relaxed_{LOOSE.label}"]


def test_a_setting_carries_its_gate_form_into_labels_and_arms():
    from bench.quality import parse_setting

    old = ASDSetting(g=2, max_relaxed_per_block=2, budget=8, gate="fraction")
    assert old.label == "g2_M2_B8_fraction" and parse_setting(old.label) == old
    assert parse_setting("g2_M2_B8").gate == "remaining"
    assert {m.arm.asd.gate for m in modes((f"asd:{old.label}", old))[1:3]} == {"fraction"}


def test_section_measures_every_mode_and_renders(bench):
    from bench.workloads import Prompt

    prompts = [Prompt("code", f"p{i}", tuple(range(10 + i, 30 + i)) * 2) for i in range(2)]
    arm = ("asd:g2_M2_B8", ASDSetting(g=2, max_relaxed_per_block=2, budget=8))
    section = sampled_section(bench, prompts, arm)
    assert section["temperature"] == 1.0 and list(section["modes"]) == [m.name for m in modes(arm)]
    for name, m in section["modes"].items():
        assert m["tokens_per_s"] > 0 and m["output_tokens"] > 0, name
    assert section["modes"]["exact"]["vs_exact"] == 1.0
    assert "regret_spent_mean" in section["modes"]["relaxed_asd:g2_M2_B8"]  # relaxed requests have ledgers
    assert "regret_spent_mean" not in section["modes"]["fallback"]  # exact-verified ones do not
    text = "\n".join(markdown({"code": section}))
    assert "relaxed rule vs exact speculative sampling" in text and "| code | fallback |" in text

"""Bench section `sampled`: the relaxed rule for sampled requests (`asd.sampled: relaxed`) against exact
speculative sampling, in-process, on the same prompts, interleaved.

Requests sample at `TEMPERATURE`, unseeded, so γ is adaptive as in serving. Modes (`modes`), each with its own
policy over the bench's engine and drafter: `exact` (the reference), `fallback` (the config's first ASD arm as
configured: verified exactly, so it shows the comparison's noise), `relaxed_<label>` (that arm with the relaxed
rule) and `LOOSE` (a budget that never binds). Per mode: tokens/s (median over repeats), acceptance, mean
accepted length, regret spent per request (nats, docs/asd-sampled.md) and relaxed tokens; per relaxed mode its
ratio to `exact`. Speed only: quality is `specserve eval`'s.
"""

from __future__ import annotations

import logging

import torch

from actors.requests import EXACT, ArmSpec, GenerationRequest, SamplingParams
from bench.harness import InProcessBench, Mode
from bench.plan import ASDSetting
from bench.workloads import Prompt

log = logging.getLogger("specserve.bench")

TEMPERATURE = 1.0
LOOSE = ASDSetting(g=8, max_relaxed_per_block=8, budget=1000)
SEED = 0  # of the global generator the unseeded requests draw from


class SampledBench(InProcessBench):
    """An `InProcessBench` whose requests sample at `temperature` (unseeded)."""

    def __init__(self, base: InProcessBench, temperature: float = TEMPERATURE):
        super().__init__(base.engine, base.drafter, eos_token_ids=base.eos, policy=base.policy,
                         max_tokens=base.max_tokens, repeats=base.repeats, warmup=base.warmup)
        self.temperature = temperature

    def request(self, prompt: Prompt, mode: Mode) -> GenerationRequest:
        self._ids += 1
        params = SamplingParams(self.max_tokens, temperature=self.temperature)
        return GenerationRequest(f"{prompt.name}#{self._ids}", list(prompt.ids), params, mode.arm,
                                 speculate=mode.speculate)


def modes(arm: tuple[str, ASDSetting] | None) -> list[Mode]:
    """exact, then (with an ASD arm) its fallback and relaxed modes, then the loose relaxed mode."""
    out = [Mode("exact", arm=EXACT)]
    settings = [] if arm is None else [arm]
    if arm is not None:
        out.append(Mode("fallback", arm=_arm(arm[0], arm[1], "exact")))
    if arm is None or arm[1] != LOOSE:
        settings.append((LOOSE.label, LOOSE))
    out += [Mode(f"relaxed_{label}", arm=_arm(label, s, "relaxed")) for label, s in settings]
    return out


def _arm(label: str, s: ASDSetting, sampled: str) -> ArmSpec:
    return ArmSpec(f"{sampled}-{label}", "asd", s.to_asd_config(), sampled=sampled)


def sampled_section(bench: InProcessBench, prompts: list[Prompt], arm: tuple[str, ASDSetting] | None,
                    temperature: float = TEMPERATURE) -> dict:
    """The section's JSON: {"workload", "temperature", "modes": {name: run summary + "vs_exact"}}."""
    torch.manual_seed(SEED)
    runs = SampledBench(bench, temperature).sweep(prompts, modes(arm), 1)
    exact = runs["exact"].tokens_per_s
    out = {}
    for name, run in runs.items():
        summary = {k: v for k, v in run.summary().items() if k not in ("workload", "concurrency")}
        summary["vs_exact"] = run.tokens_per_s / exact if exact else None
        out[name] = summary
    log.info("  %s sampled (T=%g): %s tok/s", prompts[0].workload, temperature,
             ", ".join(f"{name} {run.tokens_per_s:.2f}" for name, run in runs.items()))
    return {"workload": prompts[0].workload, "temperature": temperature, "modes": out}


def markdown(section: dict) -> list[str]:
    """The report's table for the section (empty when the section did not run)."""
    if not section:
        return []
    lines = ["", f"## Sampled requests: relaxed rule vs exact speculative sampling (T = "
                 f"{next(iter(section.values()))['temperature']:g}, adaptive γ)", "",
             "| workload | mode | tokens/s | × exact | acceptance | accepted len | regret/request (nats) | relaxed |",
             "|---|---|---|---|---|---|---|---|"]
    for workload, s in section.items():
        for name, m in s["modes"].items():
            cells = [m["tokens_per_s"], m["vs_exact"], m["acceptance_rate"], m["mean_accepted_length"],
                     m.get("regret_spent_mean")]
            lines.append(f"| {workload} | {name} | " + " | ".join("–" if c is None else f"{c:.2f}" for c in cells)
                         + f" | {m.get('relaxed_tokens', '–')} |")
    lines += ["", "`fallback` is the ASD arm as configured (`asd.sampled: exact`): it verifies sampled requests "
              "exactly, so its ratio to `exact` is the noise of the comparison. Quality of the relaxed rule is "
              "measured by `specserve eval`, not here."]
    return lines

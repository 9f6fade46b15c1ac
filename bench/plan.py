"""What a benchmark run measures and how much of it: `BenchPlan`, and the `quick` and `full` presets (`PRESETS`).

`quick` measures the summary's speed ratios only: it leaves out the `sampled` and `quality` sections
(`--sections` adds them back), HF's plain `generate` (no ratio divides by it) and the ASD sweep beyond the
config's arm; `full` runs every section. Every measurement runs at least twice, since one repeat cannot tell a
disturbed wave from a slow mode. The presets' sizes and running times: docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from bench.workloads import WORKLOADS


Section = Literal["single", "batched", "asd", "sampled", "hf", "http", "quality"]
SECTIONS: tuple[str, ...] = get_args(Section)


class ASDSetting(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    g: float = Field(ge=0, description="Gate: regret r_i (logits) ≤ g · (K − i), or g · (K − i) / K ('fraction').")
    max_relaxed_per_block: int = Field(ge=0, description="M: most relaxed tokens per block.")
    budget: float = Field(ge=0, description="B: regret budget per request.")
    gate: Literal["remaining", "fraction"] = Field("remaining", description="The gate's form (asd.gate).")

    @property
    def label(self) -> str:
        suffix = "" if self.gate == "remaining" else f"_{self.gate}"
        return f"g{self.g:g}_M{self.max_relaxed_per_block}_B{self.budget:g}{suffix}"

    def to_asd_config(self):
        """This setting as `policies.asd.ASDConfig`."""
        from policies.asd import ASDConfig

        return ASDConfig(g=self.g, max_relaxed_per_block=self.max_relaxed_per_block, budget=self.budget,
                         gate=self.gate)


class BenchPlan(BaseModel):
    """One benchmark run. Every field is a size or a list of settings; nothing here is tuned per result."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Preset name, recorded in results.json.")
    sections: tuple[Section, ...] = Field(SECTIONS, description="The sections it runs (`--sections`, `--skip`).")
    workloads: tuple[str, ...] = Field(WORKLOADS, description="Workloads, by name (bench.workloads).")
    prompts: int = Field(ge=1, description="Prompts per workload (sampled by seed).")
    max_tokens: int = Field(ge=1, description="max_tokens of every request (greedy; EOS may end it earlier).")
    repeats: int = Field(ge=1, description="Repeats per measurement (each wave counts its fastest, harness.best_of).")
    seed: int = Field(0, description="Seed of the prompt sample.")
    gammas: tuple[int, ...] = Field(description="Fixed γ sweep (0 is target-only decoding).")
    batched_concurrency: int = Field(16, ge=2, description="In-process concurrency of the γ-under-load sweep.")
    batched_workloads: tuple[str, ...] = Field(description="Workloads of the γ-under-load sweep.")
    batched_gammas: tuple[int, ...] = Field(description="Fixed γ sweep under load.")
    asd_settings: tuple[ASDSetting, ...] = Field(description="ASD (g, M, B) settings besides the config's default arm.")
    asd_workloads: tuple[str, ...] = Field(description="Workloads of the ASD sweep beyond the default arm.")
    hf_modes: tuple[str, ...] = Field(description="Hugging Face peer modes (bench.hf_peer.HF_MODES).")
    hf_assistant_workloads: tuple[str, ...] = Field(
        (), description="Workloads that also run HF `assistant_model` (the target as its own assistant: slow).")
    http_workload: str = Field("code", description="Workload of the HTTP concurrency sweep.")
    http_concurrency: tuple[int, ...] = Field(description="Concurrency levels through the HTTP app.")
    http_modes: tuple[str, ...] = Field(description="'adaptive', 'best_fixed', 'target_only'.")
    quality_suite: str = Field("humaneval", description="`specserve eval` suite of the quality section.")
    quality_problems: int = Field(ge=1, description="The quality suite's first N problems.")
    quality_max_tokens: int | None = Field(None, ge=1, description="max_tokens per answer (None: the suite's).")
    quality_asd_settings: tuple[ASDSetting, ...] = Field(
        (), description="ASD settings the quality section runs besides the config's arms.")


QUICK = BenchPlan(
    name="quick", sections=("single", "batched", "asd", "hf", "http"),
    prompts=3, max_tokens=32, repeats=2, gammas=(0, 2, 4, 8),
    batched_workloads=("code",), batched_gammas=(0, 4),
    asd_settings=(), asd_workloads=WORKLOADS,
    hf_modes=("prompt_lookup_3", "prompt_lookup_10"),
    http_concurrency=(1, 8), http_modes=("adaptive",),
    quality_problems=2, quality_max_tokens=96,
)

# Full, estimated on a quiet 2-core CPU: single ≈ 12 min, batched ≈ 4, ASD ≈ 6, HF ≈ 8, HTTP ≈ 5, quality ≈ 10.
FULL = BenchPlan(
    name="full", prompts=4, max_tokens=64, repeats=3, gammas=(0, 1, 2, 4, 6, 8, 16),
    batched_workloads=("code",), batched_gammas=(0, 1, 2, 4, 6, 8),
    asd_settings=(ASDSetting(g=1, max_relaxed_per_block=1, budget=4), ASDSetting(g=4, max_relaxed_per_block=4, budget=32),
                  ASDSetting(g=8, max_relaxed_per_block=8, budget=1000)),
    asd_workloads=WORKLOADS,
    hf_modes=("plain", "prompt_lookup_3", "prompt_lookup_10"), hf_assistant_workloads=("code",),
    http_concurrency=(1, 2, 4, 8, 16), http_modes=("adaptive", "best_fixed", "target_only"),
    quality_suite="humaneval-rewrite", quality_problems=8,
    quality_asd_settings=(ASDSetting(g=1, max_relaxed_per_block=2, budget=8),
                          ASDSetting(g=2, max_relaxed_per_block=2, budget=8)),
)

PRESETS = {"quick": QUICK, "full": FULL}

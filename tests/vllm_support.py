"""For test modules that need vLLM (`target.engine: vllm`): skip them where vLLM is not installed, unless
SPECSERVE_REQUIRE_VLLM=1 (the README's test command sets it, so CI fails rather than skips)."""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor

import pytest


def require_vllm_or_skip() -> None:
    from actors.engines.vllm import require_vllm

    try:
        require_vllm()
    except ImportError as err:
        if os.environ.get("SPECSERVE_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(str(err), allow_module_level=True)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def shared_memory() -> set[str]:
    """The machine's POSIX shared-memory segments (vLLM's queues between its processes live there); not the named
    semaphores ("sem."), which multiprocessing unlinks when their lock is collected, later."""
    from actors.engines.vllm import SHARED_MEMORY

    return {name for name in os.listdir(SHARED_MEMORY) if not name.startswith("sem.")}


def assert_nothing_left(unit) -> None:
    """A `VllmUnit` with no request left holds nothing: no book or ledger in its worker, no active request, and
    every KV block free again (waiting for the engine core, which frees a finished request's blocks on its next
    step)."""
    for _ in range(50):
        kv = unit.run_sync(unit.kv_stats())
        if kv["free_blocks"] >= kv["total_blocks"] - 1 and not kv["running"]:
            break
        time.sleep(0.1)
    live = unit.run_sync(unit.worker_state())
    assert live["requests"] == [] and live["ledgers"] == [] and unit.active_requests() == []
    assert kv["free_blocks"] >= kv["total_blocks"] - 1 and kv["running"] == kv["waiting"] == 0


def replay_asd_entry(entry: dict):
    """Replay one entry of the worker's ASD log (`specserve_asd_log`) with `verify_asd_scores`, from the ledgers'
    spend before the step; asserts the worker's verdict is the replay's, and returns the replay's `Verdict`."""
    import torch

    from policies.asd import ASDConfig, RegretLedger, verify_asd_scores
    from policies.scores import TargetScores

    ledgers = [RegretLedger.restored(entry["config"][2], spent, request_id=rid)
               for rid, spent in zip(entry["rids"], entry["spent_before"])]
    scores = TargetScores(argmax_ids=torch.tensor(entry["argmax_ids"]),
                          argmax_logits=torch.tensor(entry["argmax_logits"], dtype=torch.float32),
                          draft_logits=torch.tensor(entry["draft_logits"], dtype=torch.float32))
    replay = verify_asd_scores(torch.tensor(entry["draft_ids"]), scores, ledgers, ASDConfig(*entry["config"]),
                               draft_lens=torch.tensor(entry["draft_lens"]))
    assert replay.tokens.tolist() == entry["tokens"] and replay.num_accepted.tolist() == entry["num_accepted"]
    return replay


def vllm_greedy(model: str, prompts: list[list[int]], max_tokens: int, stop_ids: list[int],
                **engine) -> list[list[int]]:
    """vLLM's own greedy output of `model` (a plain `LLM`: no speculation, no specserve settings, fp32), each
    output without its stop token (specserve's outputs end before it)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", seed=0, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=stop_ids), use_tqdm=False)
    tokens = []
    for out in outs:
        ids = list(out.outputs[0].token_ids)
        if out.outputs[0].finish_reason == "stop" and ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        tokens.append(ids)
    llm.llm_engine.engine_core.shutdown()
    return tokens


def vllm_greedy_in_background(*args, **kwargs) -> Future:
    """`vllm_greedy` in a spawned process, so that a module's own engine starts meanwhile (a start is mostly one
    core's imports); the future's result is its output."""
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    future = pool.submit(vllm_greedy, *args, **kwargs)
    pool.shutdown(wait=False)
    return future

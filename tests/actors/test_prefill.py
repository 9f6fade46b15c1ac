"""Chunked prefill: aligned chunks within the budget, identical output to whole prefill, decode rounds between
a long prompt's chunks, and an abort mid-prefill that frees the sequence."""

import asyncio
import random
from dataclasses import dataclass

import pytest
import torch

from actors.coordinator import ArmSpec, Coordinator, GenerationRequest, SamplingParams
from actors.drafting import NgramDrafter
from actors.engines.native import load_model
from actors.engines.native.engine import Engine
from actors.policy import PolicyCore
from actors.prefill import plan_chunks, prefill_batch
from actors.requests import GenerationRequest as Request
from policies.asd import ASDConfig


@dataclass
class Seq:
    request: Request
    tokens: list
    prefilled: int = 0
    output: tuple = ()

    @property
    def rid(self):
        return self.request.request_id

    @property
    def prefill_end(self):
        return len(self.request.prompt_ids)

    def rules(self, drafts=()):
        return None


def seq(rid, n, prefilled=0):
    return Seq(Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4)), list(range(1, n + 1)), prefilled)


def test_chunks_are_aligned_and_within_the_budget_per_sequence():
    a, b, c = seq("a", 100, prefilled=32), seq("b", 10), seq("c", 40)
    chunks = plan_chunks([a, b, c], 32)  # every prefilling sequence advances by its own next chunk
    assert [(ch.seq.rid, ch.start, ch.end, ch.last) for ch in chunks] == [
        ("a", 32, 64, False), ("b", 0, 10, True), ("c", 0, 32, False)]
    a.prefilled, c.prefilled = 96, 32
    chunks = plan_chunks([a, c], 32)  # aligned: a's last 4 tokens, c's last 8, whatever else prefills
    assert [(ch.seq.rid, ch.start, ch.end, ch.last) for ch in chunks] == [("a", 96, 100, True), ("c", 32, 40, True)]
    assert all(ch.end - ch.start <= 32 for ch in chunks)
    whole = plan_chunks([seq("x", 100), seq("y", 7)], None)
    assert [(ch.start, ch.end, ch.last) for ch in whole] == [(0, 100, True), (0, 7, True)]
    with pytest.raises(ValueError, match="budget"):
        plan_chunks([a], 0)


def test_only_the_last_chunk_samples():
    sampled = Request("s", list(range(50)), SamplingParams(max_tokens=4, temperature=0.9, seed=3))
    s = Seq(sampled, list(range(50)))
    first, = plan_chunks([s], 32)
    assert prefill_batch([first]).sampling[0].greedy  # no random draws for a prompt's inner chunks
    s.prefilled = 32
    last, = plan_chunks([s], 32)
    batch = prefill_batch([last])
    assert last.last and batch.sampling[0].seed == 3 and batch.prompt_rows == 1
    assert batch.tokens == [list(range(32, 50))]


@pytest.fixture(scope="module")
def tiny(tiny_llama_pair):
    torch.set_num_threads(1)
    return load_model(tiny_llama_pair[0])[0]


def unit(model, chunk, target=None, **kw):
    coord = Coordinator.local(Engine(model, max_slots=8, max_seq_len=512), NgramDrafter(1, 3),
                              PolicyCore(gamma_max=4, fixed_gamma=3), prefill_chunk_tokens=chunk, **kw)
    if target is not None:
        coord.target = target(coord.target)
    return coord


def prompts(seed=0):
    rng = random.Random(seed)
    lengths = [200, 37, 131, 64, 5]
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def requests(tag):
    asd0 = ArmSpec("asd0", "asd", ASDConfig(g=5.0, max_relaxed_per_block=2, budget=0.0))
    out = []
    for i, p in enumerate(prompts()):
        params = SamplingParams(max_tokens=20, temperature=0.8, seed=i) if i == 2 else SamplingParams(max_tokens=20)
        out.append(GenerationRequest(f"{tag}{i}", p, params, arm=asd0 if i == 3 else ArmSpec("exact")))
    return out


async def collect(coord, request) -> list[int]:
    out = []
    async for chunk in coord.generate(request):
        out.extend(chunk.token_ids)
    return out


async def beside_a_stream(coord, requests_: list, started: int = 3) -> list[list[int]]:
    """The requests' tokens, submitted once a running stream has emitted `started` tokens (chunking binds only
    while some stream decodes), then the stream is awaited too."""
    streamed = []

    async def stream():
        async for chunk in coord.generate(GenerationRequest("runner", [7, 8, 9], SamplingParams(max_tokens=120),
                                                            speculate=False)):
            streamed.extend(chunk.token_ids)

    runner = asyncio.ensure_future(stream())
    while len(streamed) < started:
        await asyncio.sleep(0)
    outs = await asyncio.gather(*(collect(coord, r) for r in requests_))
    await runner
    await coord.stop()
    return list(outs)


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_prefill_gives_the_same_tokens_as_whole_prefill(tiny, chunk):
    whole = [o.token_ids for o in unit(tiny, None).generate_many_sync(requests("w"))]
    coord = unit(tiny, chunk, target=Recording)
    chunked = asyncio.run(beside_a_stream(coord, requests("c")))
    assert chunked == whole  # greedy, ASD with B = 0 and a seeded sampled row
    assert max(e[1] for e in coord.target.log if e[0] == "prefill" and "runner" not in e[2]) <= chunk
    assert coord.target.engine.active_ids() == [] and coord.policy.core.open_ledgers() == []


def test_an_idle_unit_prefills_whole_prompts(tiny):
    """With no stream decoding there is nothing to protect: a burst of requests enters whole, in one step."""
    coord = unit(tiny, 16, target=Recording)
    outs = coord.generate_many_sync(requests("i"))
    prefills = [e for e in coord.target.log if e[0] == "prefill"]
    assert len(prefills) == 1 and prefills[0][1] == max(len(p) for p in prompts()) > 16
    assert [o.token_ids for o in outs] == [o.token_ids for o in unit(tiny, None).generate_many_sync(requests("w"))]


class Recording:
    """A TargetBackend that logs each step's parts: ("round", decode rows, step) and ("prefill", most tokens fed
    for one sequence, ids, step); a step that feeds prompt chunks beside decode rows logs both, round first."""

    def __init__(self, inner):
        self.inner, self.log, self.steps = inner, [], 0

    async def step(self, batch):
        decode = len(batch.seq_ids) - batch.prompt_rows
        if decode:
            self.log.append(("round", decode, self.steps))
        if batch.prompt_rows:
            fed = max(len(t) for t in batch.tokens[decode:])
            self.log.append(("prefill", fed, tuple(batch.seq_ids[decode:]), self.steps))
        self.steps += 1
        return await self.inner.step(batch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_decode_rounds_run_between_a_long_prompts_chunks(tiny):
    coord = unit(tiny, 32, target=Recording)
    long_prompt = prompts(1)[0] * 2  # 400 tokens: 13 chunks

    long_request = GenerationRequest("long", long_prompt, SamplingParams(max_tokens=4))
    (out,) = asyncio.run(beside_a_stream(coord, [long_request]))
    log = coord.target.log
    long_steps = [i for i, e in enumerate(log) if e[0] == "prefill" and "long" in e[2]]
    assert len(long_steps) == 13 and all(log[i][1] <= 32 for i in long_steps)
    # every gap between two of the long prompt's chunks holds a decode round of the running stream
    assert all(any(log[j][0] == "round" for j in range(a + 1, b)) for a, b in zip(long_steps, long_steps[1:]))
    # and each chunk rides in the same forward as a decode round (one forward per unit step)
    assert all(log[i - 1][0] == "round" and log[i - 1][2] == log[i][3] for i in long_steps)
    reference = unit(tiny, None).generate_sync(GenerationRequest("ref", long_prompt, SamplingParams(max_tokens=4)))
    assert out == reference.token_ids


def test_abort_mid_prefill_frees_the_sequence(tiny):
    coord = unit(tiny, 16, target=Recording)
    asd = ArmSpec("asd", "asd", ASDConfig(g=2.0, max_relaxed_per_block=2, budget=4.0))

    async def scenario():
        runner = asyncio.ensure_future(collect(coord, GenerationRequest("runner", [7, 8, 9],
                                                                        SamplingParams(max_tokens=60))))
        while not coord.scheduler.active:  # a decoding stream, so the prompt is chunked
            await asyncio.sleep(0)
        gen = coord.generate(GenerationRequest("a", prompts(2)[0], SamplingParams(max_tokens=8), arm=asd))
        consumer = asyncio.ensure_future(gen.__anext__())
        while sum(e[0] == "prefill" and "a" in e[2] for e in coord.target.log) < 2:
            await asyncio.sleep(0)
        assert coord.scheduler.prefilling and coord.policy.core.open_ledgers() == ["a"]
        await coord.abort("a")
        last = await consumer
        await runner
        await coord.stop()
        return last

    last = asyncio.run(scenario())
    assert last.finish_reason == "abort"
    assert coord.target.engine.active_ids() == [] and coord.policy.core.open_ledgers() == []

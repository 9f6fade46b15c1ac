"""Issue 24's rules on a pretend accelerator (tests/fake_device.py): penalties, logit_bias, a grammar mask and
logprobs run where the logits are, mix no devices, wait for the device once per target step (twice when a row
asks for logprobs), and give what the host gives; a unit with them on the device emits what the host unit does."""

from __future__ import annotations

import json

import pytest
import torch

from actors.contracts import NO_CROP, DraftRequest, RowRules, TargetBatch
from actors.coordinator import Coordinator, GenerationRequest, SamplingParams
from actors.drafting import ModelDrafter
from actors.engines.native import Engine, load_model
from actors.policy import PolicyCore
from actors.requests import StructuredOutput
from actors.sampling import SamplingSpec
from actors.target import TargetStep
from policies.penalties import Penalties
from tests.fake_device import fake_device, module_on_device

PROMPTS = [[5, 17, 300, 42, 9, 5, 17], [7, 8, 9], [100, 200, 300, 400, 100, 200]]
RULES = dict(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.4, logit_bias={17: -100.0, 77: 3.0},
             min_tokens=4)


@pytest.fixture(scope="module")
def models(tiny_llama_dir):
    torch.set_num_threads(1)
    host = load_model(tiny_llama_dir)[0]
    device = module_on_device(load_model(tiny_llama_dir)[0].fuse_projections())
    return host, device


def _engines(models):
    host, device = models
    engine = Engine(device, max_slots=4, max_seq_len=64, graphs=True)
    engine.static.capture = False
    return Engine(host, max_slots=4, max_seq_len=64), engine


def _round(vocab: int) -> TargetBatch:
    """A greedy row with rules, a seeded sampled row with rules and a grammar-like mask, a plain row; logprobs on
    the first two."""
    rules = Penalties.of(frequency=0.7, presence=0.3, repetition=1.4, logit_bias={17: -100.0, 77: 3.0},
                         min_tokens=4, stop_ids=[2])
    mask = torch.full((3, -(-vocab // 32)), -1, dtype=torch.int32)  # [k+1, W]: position 1 refuses tokens 0..31
    mask[1, 0] = 0
    draft = torch.tensor([[11, 12, 13], [21, 22, -1], [-1, -1, -1]])
    return TargetBatch(["g", "s", "t"], [NO_CROP] * 3, [[1, 11, 12, 13], [2, 21, 22], [3]], draft,
                       torch.tensor([3, 2, 0]),
                       [SamplingSpec(), SamplingSpec(temperature=0.8, top_k=20, seed=7), SamplingSpec()],
                       rules={0: RowRules(rules, PROMPTS[0], (40, 11)), 1: RowRules(rules, PROMPTS[1], (), mask)},
                       logprobs={0: 3, 1: 0})


def test_rules_and_logprobs_on_the_device_equal_the_hosts(models):
    with fake_device() as device:
        host_engine, engine = _engines(models)
        for seq, prompt in zip("gst", PROMPTS):  # cache each row's prompt first
            host_engine.forward([seq], [prompt])
            engine.forward([seq], [prompt])
        want = TargetStep(host_engine)(_round(host_engine.vocab_size))
        before = device.syncs
        got = TargetStep(engine)(_round(engine.vocab_size))
        assert device.syncs - before == 2  # the round's results, then the logprobs of what the rows emit
    assert torch.equal(got.scores.argmax_ids, want.scores.argmax_ids)
    assert got.sampled_tokens == want.sampled_tokens
    for b in (0, 1):
        mine, theirs = got.logprobs[b], want.logprobs[b]
        assert torch.equal(mine.candidates, theirs.candidates) and torch.equal(mine.top_ids, theirs.top_ids)
        assert torch.allclose(mine.candidate_logprobs, theirs.candidate_logprobs, atol=1e-5)
    assert got.scores.argmax_ids[0, 0] != 17  # banned


def test_a_biased_model_drafter_on_the_device_waits_once(models):
    rules = Penalties.of(frequency=0.8, presence=0.5, repetition=1.3, logit_bias={77: 4.0, 5: -100.0})
    requests = [DraftRequest("a", PROMPTS[0], 3, rules=rules, prompt_len=4), DraftRequest("b", PROMPTS[1], 2)]
    with fake_device() as device:
        host_engine, engine = _engines(models)
        expected = ModelDrafter(host_engine).propose(requests)
        drafted = ModelDrafter(engine).propose(requests)
        assert device.syncs == 1
    assert torch.equal(drafted.draft_ids, expected.draft_ids)


def test_a_unit_with_rules_on_the_device_emits_what_the_host_unit_emits(models, tiny_llama_dir):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]})
    requests = lambda: [  # noqa: E731
        GenerationRequest("r", PROMPTS[0], SamplingParams(max_tokens=10, logprobs=2, **RULES)),
        GenerationRequest("s", PROMPTS[1], SamplingParams(max_tokens=10, temperature=0.8, seed=5, logprobs=0, **RULES)),
        GenerationRequest("j", PROMPTS[2], SamplingParams(max_tokens=10, structured=StructuredOutput("json_schema",
                                                                                                     schema))),
    ]
    host_drafter, drafter_model = (load_model(tiny_llama_dir)[0].fuse_projections() for _ in range(2))

    def run(target, drafter):
        unit = Coordinator.local(target, ModelDrafter(drafter), PolicyCore(fixed_gamma=3), eos_token_ids=[2],
                                 tokenizer_source=str(tiny_llama_dir))
        return [(r.token_ids, [round(lp.logprob, 4) for lp in r.logprobs or []])
                for r in unit.generate_many_sync(requests())]

    with fake_device():
        host_target, target = _engines(models)
        expected = run(host_target, Engine(host_drafter, max_slots=4, max_seq_len=64))
        drafter = Engine(module_on_device(drafter_model), max_slots=4, max_seq_len=64, graphs=True)
        drafter.static.capture = False
        got = run(target, drafter)
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, mine), (_, theirs) in zip(got, expected):
        assert all(abs(a - b) <= 1e-3 for a, b in zip(mine, theirs))

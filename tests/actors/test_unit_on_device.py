"""The native engine, the target step, the model drafter and a whole unit on an accelerator, checked on the CPU
with a pretend device (tests/fake_device.py): no op mixes devices, generators live where they draw, the
host waits for the device once per target step and once per drafter call, and every output equals the
host's run.
"""

from __future__ import annotations

import pytest
import torch

from actors.contracts import NO_CROP, DraftRequest, TargetBatch
from actors.coordinator import ArmSpec, Coordinator, GenerationRequest, SamplingParams
from actors.drafting import ModelDrafter
from actors.engines.native import Engine, load_model
from actors.policy import PolicyCore
from actors.sampling import SamplingSpec
from actors.target import TargetStep
from policies import PAD_TOKEN_ID
from policies.asd import ASDConfig
from tests.fake_device import FAKE, fake_device, module_on_device

PROMPTS = [[5, 17, 300, 42, 9, 5, 17], [7, 8, 9], [100, 200, 300, 400, 100, 200]]


@pytest.fixture(scope="module")
def models(tiny_llama_dir):
    torch.set_num_threads(1)
    host = load_model(tiny_llama_dir)[0]
    device = module_on_device(load_model(tiny_llama_dir)[0].fuse_projections())  # fused on the host, as tagged
    return host, device


def _engines(models, **options):
    """(host engine, device engine); call inside `fake_device()`, where the model says it is on cuda:0."""
    host, device = models
    engine = Engine(device, max_slots=4, max_seq_len=64, **options)
    if engine.static is not None:
        engine.static.capture = False  # no CUDA to capture on: run the fixed-shape forward as it is
    return Engine(host, max_slots=4, max_seq_len=64), engine


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "fixed-shape"])
def test_engine_forward_runs_on_the_device_without_waiting_for_it(models, graphs):
    with fake_device() as device:
        host, engine = _engines(models, graphs=graphs)
        assert engine.device == FAKE and engine.cache.k[0].device == FAKE
        ids = ["a", "b", "c"]
        expected = host.forward(ids, PROMPTS, [1, 1, 1])
        got = engine.forward(ids, PROMPTS, [1, 1, 1])
        assert got.device == FAKE and torch.allclose(got.as_subclass(torch.Tensor), expected, atol=1e-5)
        fed = got[:, 0].argmax(-1)[:, None]  # [B, 1] tokens that stay on the device
        got = engine.forward(["c", "a"], fed[[2, 0]], [1, 1])
        expected = host.forward(["c", "a"], fed[[2, 0]].as_subclass(torch.Tensor).tolist(), [1, 1])
        assert torch.allclose(got.as_subclass(torch.Tensor), expected, atol=1e-5)
        assert device.syncs == 0


def _round(step: TargetStep, prefill: bool):
    greedy, seeded = SamplingSpec(), SamplingSpec(temperature=0.8, top_k=20, seed=7)
    if prefill:
        return TargetBatch(["g", "s", "t"], [NO_CROP] * 3, [p[:] for p in PROMPTS],
                           torch.full((3, 1), PAD_TOKEN_ID), torch.zeros(3, dtype=torch.long),
                           [greedy, seeded, SamplingSpec(temperature=1.0, top_p=0.9, seed=3)], prompt_rows=3)
    draft = torch.tensor([[11, 12, 13], [21, 22, PAD_TOKEN_ID], [PAD_TOKEN_ID] * 3])
    q = torch.softmax(torch.randn(3, 3, step.engine.vocab_size, generator=torch.Generator().manual_seed(0)), -1)
    return TargetBatch(["g", "s", "t"], [NO_CROP] * 3, [[1, 11, 12, 13], [2, 21, 22], [3]], draft,
                       torch.tensor([3, 2, 0]), [greedy, seeded, SamplingSpec(temperature=1.0, top_p=0.9, seed=3)],
                       draft_probs=q)


def test_target_step_verifies_on_the_device_and_syncs_once_per_round(models):
    with fake_device() as device:
        host_engine, engine = _engines(models)
        host = TargetStep(host_engine)
        expected = [host(_round(host, prefill)) for prefill in (True, False)]
        step = TargetStep(engine)
        for prefill, want in zip((True, False), expected):
            before = device.syncs
            result = step(_round(step, prefill))
            assert device.syncs - before == 1  # the results' one trip to the host
            assert result.scores.argmax_ids.device.type == "cpu"
            assert torch.equal(result.scores.argmax_ids, want.scores.argmax_ids)
            assert torch.allclose(result.scores.argmax_logits, want.scores.argmax_logits, atol=1e-5)
            assert result.sampled_tokens == want.sampled_tokens and result.sampled_accepted == want.sampled_accepted


def test_model_drafter_drafts_on_the_device_and_waits_once(models):
    requests = [DraftRequest("a", PROMPTS[0], 3), DraftRequest("b", PROMPTS[1], 0),
                DraftRequest("c", PROMPTS[2], 2, SamplingSpec(temperature=0.9, top_p=0.95, seed=11))]
    with fake_device() as device:
        host_engine, engine = _engines(models, graphs=True)
        expected = ModelDrafter(host_engine).propose(requests)
        drafted = ModelDrafter(engine).propose(requests)
        assert device.syncs == 2  # the draft ids, then the q rows of a sampling batch
    assert torch.equal(drafted.draft_ids, expected.draft_ids)
    assert torch.equal(drafted.draft_lens, expected.draft_lens)
    assert torch.allclose(drafted.draft_probs, expected.draft_probs, atol=1e-6)


def test_a_unit_on_the_device_emits_what_the_host_unit_emits(models, tiny_llama_dir):
    asd = ArmSpec("asd", "asd", ASDConfig(g=3.0, max_relaxed_per_block=1, budget=4.0))
    requests = lambda: [  # noqa: E731
        GenerationRequest("e", PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True)),
        GenerationRequest("a", PROMPTS[2], SamplingParams(max_tokens=12, ignore_eos=True), asd),
        GenerationRequest("s", PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)),
    ]
    # a model for each side: a host Engine prepacks its model's CPU linears, which do not move to a device
    host_drafter, drafter_model = (load_model(tiny_llama_dir)[0].fuse_projections() for _ in range(2))

    def run(target, drafter):
        unit = Coordinator.local(target, ModelDrafter(drafter), PolicyCore(fixed_gamma=3))
        return [r.token_ids for r in unit.generate_many_sync(requests())]

    with fake_device():
        host_target, target = _engines(models, graphs=True)
        expected = run(host_target, Engine(host_drafter, max_slots=4, max_seq_len=64))
        drafter = Engine(module_on_device(drafter_model), max_slots=4, max_seq_len=64)
        drafter.static.capture = False
        assert run(target, drafter) == expected

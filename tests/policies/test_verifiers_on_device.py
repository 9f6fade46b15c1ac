"""The verifiers on an accelerator, checked on the CPU with a pretend device (tests/fake_device.py).

Each verifier must work on tensors that all live on one device, return its tensors there, refuse mixed
devices with a ValueError naming the argument, and (with validate=False) never read a device value on the
host. Results must equal the host's, bit for bit: the pretend device computes on the host.
"""

from __future__ import annotations

import pytest
import torch

from policies import PAD_TOKEN_ID
from policies.asd import ASDConfig, verify_asd_scores
from policies.exact import draw_uniforms, process_logits, verify_greedy, verify_greedy_scores, verify_sampled
from policies.scores import compact_scores
from tests.fake_device import FAKE, fake_device, on_device

V = 32


def _block(seed: int = 0, batch: int = 4, k: int = 3):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, V, generator=gen) * 3  # [B, K+1, V]
    draft = torch.where(torch.rand(batch, k, generator=gen) < 0.6, logits[:, :k].argmax(-1),
                        torch.randint(0, V, (batch, k), generator=gen))  # [B, K]
    lens = torch.tensor([k, 0, 2, 1][:batch])  # [B], ragged
    draft = torch.where(torch.arange(k) < lens[:, None], draft, PAD_TOKEN_ID)
    return draft, logits, lens


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(torch.Tensor)


def test_greedy_and_scores_stay_on_the_device_and_equal_the_host():
    draft, logits, lens = _block()
    host = verify_greedy(draft, logits, lens)
    with fake_device() as device:
        d_draft, d_logits, d_lens = map(on_device, (draft, logits, lens))
        scores = compact_scores(d_draft, d_logits, validate=False)
        assert device.syncs == 0
        assert scores.argmax_ids.device == FAKE and scores.draft_logits.device == FAKE
        verdict = verify_greedy_scores(d_draft, scores, d_lens)
        assert verdict.tokens.device == FAKE and verdict.num_accepted.device == FAKE
        assert torch.equal(_on_host(verdict.tokens), host.tokens)


def test_mixed_devices_are_a_value_error_naming_the_argument():
    draft, logits, lens = _block()
    with fake_device():
        with pytest.raises(ValueError, match="draft_ids is on cpu"):
            compact_scores(draft, on_device(logits))
        with pytest.raises(ValueError, match="draft_lens"):
            verify_greedy(on_device(draft), on_device(logits), lens)
        scores = compact_scores(on_device(draft), on_device(logits))
        with pytest.raises(ValueError, match="scores.argmax_ids"):
            verify_greedy_scores(draft, scores, lens)
        with pytest.raises(ValueError, match="target_probs"):
            verify_sampled(on_device(draft), None, logits.softmax(-1), draft_lens=on_device(lens))


def test_process_logits_with_device_parameters_reads_nothing_back():
    _, logits, _ = _block()
    temperature, top_k, top_p = torch.tensor([0.0, 0.7, 1.3, 1.0]), torch.tensor([V, 5, 3, V]), torch.tensor(
        [1.0, 0.9, 1.0, 0.5])
    host = process_logits(logits, temperature, top_k, top_p)
    with fake_device() as device:
        probs = process_logits(*map(on_device, (logits, temperature, top_k, top_p)), validate=False)
        assert device.syncs == 0 and probs.device == FAKE
        assert torch.equal(_on_host(probs), host)
        with pytest.raises(ValueError, match="top_p"):  # Python parameters are checked on the host, always
            process_logits(on_device(logits), 1.0, None, 1.5, validate=False)


def test_sampled_verification_draws_on_the_device_with_row_generators():
    draft, logits, lens = _block(seed=3)
    p = process_logits(logits, 0.8)  # [B, K+1, V]
    q = process_logits(logits[:, :-1] + 0.3 * torch.randn(logits[:, :-1].shape), 0.8)  # [B, K, V]
    host = verify_sampled(draft, q, p, [torch.Generator().manual_seed(s) for s in (1, 2, 3, 4)], lens)
    with fake_device() as device:
        generators = [torch.Generator(device="cuda").manual_seed(s) for s in (1, 2, 3, 4)]
        uniforms = draw_uniforms(generators, lens.tolist(), draft.shape[1], FAKE)
        verdict = verify_sampled(*map(on_device, (draft, q, p)), draft_lens=on_device(lens), uniforms=uniforms,
                                 validate=False)
        assert device.syncs == 0 and verdict.tokens.device == FAKE
        assert torch.equal(_on_host(verdict.tokens), host.tokens)
        with pytest.raises(RuntimeError, match="device type for generator"):  # as CUDA says it
            draw_uniforms([torch.Generator()] * 4, lens.tolist(), draft.shape[1], FAKE)


def test_asd_on_device_scores_equals_the_host():
    draft, logits, lens = _block(seed=5)
    config = ASDConfig(g=4.0, max_relaxed_per_block=2, budget=6.0)
    host = verify_asd_scores(draft, compact_scores(draft, logits), [config.new_ledger() for _ in lens], config, lens)
    with fake_device():
        d_draft = on_device(draft)
        scores = compact_scores(d_draft, on_device(logits))
        verdict = verify_asd_scores(d_draft, scores, [config.new_ledger() for _ in lens], config, on_device(lens))
        assert verdict.tokens.device == FAKE and verdict.regret.device == FAKE
        assert torch.equal(_on_host(verdict.tokens), host.tokens)

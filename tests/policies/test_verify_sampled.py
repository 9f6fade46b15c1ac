"""Speculative sampling: emitted tokens follow the target distribution p, proven statistically.

Why the chi-square bound is not flaky: every draw comes from generators with fixed seeds, so each test is
deterministic; it passes or fails the same way on every run. Had the seed been chosen at random, a correct
verifier would still fail with probability 1e-6 (the p-value threshold). A wrong one is caught with
certainty: with N = 100k draws on V ≤ 8 the chi-square statistic grows like N·(χ² distance), so a 1%
total-variation error gives a statistic in the hundreds, p-value ≈ 0. Bins where p = 0 must stay empty.
"""

from __future__ import annotations

import pytest
import torch

from policies import PAD_TOKEN_ID
from policies.exact import process_logits, verify_greedy, verify_sampled

N = 100_000
P_VALUE_FLOOR = 1e-6


def chi_square_p_value(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """p-value of observed token counts against distribution p [V]; asserts that zero-mass bins are empty."""
    counts = torch.bincount(tokens, minlength=p.numel()).double()  # [V]
    support = p > 0
    assert counts[~support].sum() == 0, f"tokens sampled outside the support of p: {counts.tolist()}"
    expected = p[support].double() * counts.sum()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2))


def run_block(p_rows, q_rows, seed, one_hot_from=None):
    """Draw N blocks: x_i ~ q_i (or ~ one_hot_from with q = None), verify against p; return the Verdict."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.stack(p_rows)  # [K+1, V]
    k = p.shape[0] - 1
    draw_from = torch.stack(q_rows) if one_hot_from is None else torch.stack(one_hot_from)  # [K, V]
    draft = torch.multinomial(draw_from, N, replacement=True, generator=gen).T.contiguous()  # [N, K]
    q = draw_from.expand(N, k, -1) if one_hot_from is None else None  # [N, K, V]
    return verify_sampled(draft, q, p.expand(N, k + 1, -1), generator=gen)


def assert_follows_target(verdict, p_rows):
    first = verdict.tokens[:, 0]
    assert chi_square_p_value(first, p_rows[0]) > P_VALUE_FLOOR
    # Given that x_0 was kept, the second emitted token is the target's token at position 1.
    kept = verdict.num_accepted >= 1
    if not bool(kept.any()):  # disjoint supports: nothing is ever kept, the second token is the next round's
        return
    assert int(kept.sum()) > 10_000
    assert chi_square_p_value(verdict.tokens[kept, 1], p_rows[1]) > P_VALUE_FLOOR


def dist(*weights):
    t = torch.tensor(weights, dtype=torch.float32)
    return t / t.sum()


CASES = {
    "disjoint_supports": (
        [dist(5, 3, 2, 0, 0, 0), dist(1, 1, 1, 0, 0, 0), dist(0, 0, 1, 1, 0, 0)],
        [dist(0, 0, 0, 1, 1, 1), dist(0, 0, 0, 2, 1, 1)],
    ),
    "p_equals_q": (
        [dist(1, 2, 3, 4, 5, 6), dist(6, 5, 4, 3, 2, 1), dist(1, 1, 1, 1, 1, 1)],
        [dist(1, 2, 3, 4, 5, 6), dist(6, 5, 4, 3, 2, 1)],
    ),
    "peaked_q_over_flat_p": (
        [dist(1, 1, 1, 1, 1, 1), dist(1, 1, 1, 1, 1, 1), dist(1, 1, 1, 1, 1, 1)],
        [dist(50, 1, 1, 1, 1, 1), dist(1, 1, 1, 1, 1, 50)],
    ),
    "overlapping": (
        [dist(4, 0, 3, 2, 1, 0), dist(0, 1, 1, 5, 2, 1), dist(1, 1, 1, 1, 1, 1)],
        [dist(1, 3, 1, 0, 3, 2), dist(2, 2, 2, 2, 1, 1)],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_emitted_tokens_follow_target(case):
    p_rows, q_rows = CASES[case]
    verdict = run_block(p_rows, q_rows, seed=sorted(CASES).index(case))
    assert_follows_target(verdict, p_rows)
    if case == "disjoint_supports":
        assert bool((verdict.num_accepted == 0).all())


def test_p_equals_q_accepts_everything_without_nan():
    p_rows, q_rows = CASES["p_equals_q"]
    verdict = run_block(p_rows, q_rows, seed=11)
    assert bool((verdict.num_accepted == 2).all())


def test_one_hot_draft_without_distribution_follows_target():
    """draft_probs=None (n-gram drafter): x is kept with probability p(x), else resampled from p minus x."""
    p_rows = [dist(4, 0, 3, 2, 1, 0), dist(0, 1, 1, 5, 2, 1), dist(1, 1, 1, 1, 1, 1)]
    drafts_from = [dist(1, 1, 1, 1, 1, 1), dist(0, 0, 0, 1, 0, 0)]  # incl. p(x) = 0 and a deterministic draft
    verdict = run_block(p_rows, None, seed=5, one_hot_from=drafts_from)
    assert_follows_target(verdict, p_rows)


def test_top_k_and_top_p_processed_distributions_are_followed():
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.randn(3, 8, generator=gen) * 2  # [K+1, V]
    draft_logits = target_logits[:2] + torch.randn(2, 8, generator=gen)  # [K, V], a drafter that mostly agrees
    p = process_logits(target_logits, temperature=0.8, top_k=4)  # [K+1, V]
    q = process_logits(draft_logits, temperature=0.8, top_p=0.7)  # [K, V]
    assert bool(((p > 0).sum(-1) == 4).all())
    p_rows, q_rows = list(p), list(q)
    assert_follows_target(run_block(p_rows, q_rows, seed=2), p_rows)


def test_process_logits_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    torch.testing.assert_close(process_logits(logits, 1.0), torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    torch.testing.assert_close(process_logits(logits, 1.0, top_k=2), torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    # top_p = 0.7: 0.5 alone is short of 0.7, 0.5 + 0.25 reaches it.
    torch.testing.assert_close(process_logits(logits, 1.0, top_p=0.7), torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    torch.testing.assert_close(process_logits(logits, 1.0, top_p=0.1), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    sharp = process_logits(logits, 0.5)
    torch.testing.assert_close(sharp, torch.softmax(logits / 0.5, -1))
    torch.testing.assert_close(process_logits(logits, 0.0), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_process_logits_per_row_parameters():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1], [0.1, 0.15, 0.25, 0.5]]))
    probs = process_logits(logits, torch.tensor([1.0, 0.0]), top_k=torch.tensor([2, 4]))
    torch.testing.assert_close(probs, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]))


@pytest.mark.parametrize(
    "kwargs, argument",
    [({"temperature": -1.0}, "temperature"), ({"temperature": 1.0, "top_k": 0}, "top_k"),
     ({"temperature": 1.0, "top_p": 0.0}, "top_p"), ({"temperature": 1.0, "top_p": 1.5}, "top_p")],
)
def test_process_logits_bad_input(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        process_logits(torch.zeros(2, 4), **kwargs)


def test_zero_q_of_draft_token():
    """q(x) = 0: kept when p(x) > 0 (no division), never kept when p(x) = 0 too."""
    p = torch.tensor([[[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]]])  # [1, 2, 3]
    q = torch.tensor([[[0.0, 0.0, 1.0]]])  # [1, 1, 3]
    kept = verify_sampled(torch.tensor([[0]]), q, p, generator=torch.Generator().manual_seed(0))
    assert kept.num_accepted.tolist() == [1]
    dropped = verify_sampled(torch.tensor([[2]]), q, p, generator=torch.Generator().manual_seed(0))
    assert dropped.num_accepted.tolist() == [0] and dropped.tokens[0, 0].item() in (0, 1)


def test_per_row_generators_reproduce_a_request_whatever_its_batch():
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, 4, 10, generator=gen), -1)  # [B, K+1, V]
    q = torch.softmax(torch.randn(4, 3, 10, generator=gen), -1)  # [B, K, V]
    draft = torch.multinomial(q.reshape(-1, 10), 1, generator=gen).reshape(4, 3)
    lens = torch.tensor([3, 0, 2, 3])
    draft[torch.arange(3)[None, :] >= lens[:, None]] = PAD_TOKEN_ID
    batched = verify_sampled(draft, q, p, [torch.Generator().manual_seed(100 + b) for b in range(4)], lens)
    for b, k_b in enumerate(lens.tolist()):
        k_row = max(k_b, 1)
        alone = verify_sampled(
            draft[b : b + 1, :k_row], q[b : b + 1, :k_row], p[b : b + 1, : k_row + 1],
            [torch.Generator().manual_seed(100 + b)], lens[b : b + 1],
        )
        assert alone.emitted() == [batched.emitted()[b]]


def test_rows_without_a_block_draw_only_their_final_token():
    gen = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(1, 3, 10), -1)
    verify_sampled(torch.tensor([[PAD_TOKEN_ID, PAD_TOKEN_ID]]), None, p, [gen], torch.tensor([0]))
    reference = torch.Generator().manual_seed(7)
    torch.rand(1, generator=reference)
    assert torch.equal(gen.get_state(), reference.get_state())


@pytest.mark.parametrize(
    "target, draft_probs, argument",
    [
        (torch.full((1, 3, 4), 0.25), torch.full((1, 2, 5), 0.2), "draft_probs"),
        (torch.full((1, 2, 4), 0.25), None, "target_probs"),
        (torch.full((1, 3, 4), float("nan")), None, "target_probs"),
        (torch.full((1, 3, 4), 0.5), None, "target_probs"),
    ],
)
def test_sampled_bad_input(target, draft_probs, argument):
    with pytest.raises(ValueError, match=argument):
        verify_sampled(torch.tensor([[1, 2]]), draft_probs, target)


def test_top_k_keeps_ties_with_the_kth_value():
    probs = process_logits(torch.tensor([[3.0, 1.0, 1.0, 0.0]]), 1.0, top_k=2)
    assert (probs > 0).tolist() == [[True, True, True, False]]


def test_temperature_zero_sampling_is_greedy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 4, 12, generator=gen)  # [B, K+1, V]
    draft = torch.where(torch.rand(16, 3, generator=gen) < 0.7, logits[:, :3].argmax(-1), 5)
    p = process_logits(logits, 0.0)
    sampled = verify_sampled(draft, None, p, generator=gen)
    greedy = verify_greedy(draft, logits)
    assert torch.equal(sampled.tokens, greedy.tokens)


def test_generator_list_must_have_one_per_row():
    p = torch.full((2, 2, 4), 0.25)
    with pytest.raises(ValueError, match="generator"):
        verify_sampled(torch.tensor([[1], [2]]), None, p, [torch.Generator()])

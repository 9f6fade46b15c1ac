"""Greedy verification: hand-built blocks, ragged batches, the compact-scores path, bad input."""

from __future__ import annotations

import pytest
import torch

from policies import PAD_TOKEN_ID, Verdict
from policies.exact import verify_greedy, verify_greedy_scores
from policies.scores import TargetScores, compact_scores

P = PAD_TOKEN_ID


def test_perfect_match_emits_bonus(make_logits):
    logits = make_logits([[5, 6, 7, 8]])
    verdict = verify_greedy(torch.tensor([[5, 6, 7]]), logits)
    assert verdict.num_accepted.tolist() == [3]
    assert verdict.tokens.tolist() == [[5, 6, 7, 8]]
    assert verdict.emitted() == [[5, 6, 7, 8]]


def test_early_mismatch_emits_recovered_token(make_logits):
    logits = make_logits([[5, 6, 7, 8]])
    verdict = verify_greedy(torch.tensor([[9, 6, 7]]), logits)
    assert verdict.num_accepted.tolist() == [0]
    assert verdict.tokens.tolist() == [[5, P, P, P]]


def test_rows_of_one_batch_have_their_own_outcome(make_logits):
    logits = make_logits([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    draft = torch.tensor([[1, 2, 3], [1, 9, 3], [1, 2, 9]])
    verdict = verify_greedy(draft, logits)
    assert isinstance(verdict, Verdict)
    assert verdict.num_accepted.tolist() == [3, 1, 2]
    assert verdict.tokens.tolist() == [[1, 2, 3, 4], [1, 2, P, P], [1, 2, 3, P]]
    assert verdict.num_relaxed is None and verdict.regret is None


def test_later_matches_after_a_mismatch_are_not_kept(make_logits):
    logits = make_logits([[1, 2, 3, 4]])
    verdict = verify_greedy(torch.tensor([[1, 9, 3]]), logits)
    assert verdict.emitted() == [[1, 2]]


def test_ragged_batch_equals_per_row_calls(make_logits):
    gen = torch.Generator().manual_seed(3)
    targets = torch.randint(0, 16, (4, 5), generator=gen)  # [B, K+1]
    logits = make_logits(targets.tolist())
    lens = torch.tensor([4, 2, 0, 3])
    draft = targets[:, :4].clone()
    draft[3, 1] = (draft[3, 1] + 1) % 16  # row 3 mismatches at position 1
    draft[torch.arange(4)[None, :] >= lens[:, None]] = P
    batched = verify_greedy(draft, logits, draft_lens=lens)
    for b, k_b in enumerate(lens.tolist()):
        if k_b == 0:
            expected = [int(logits[b, 0].argmax())]  # plain decoding: the argmax of row 0
        else:
            expected = verify_greedy(draft[b : b + 1, :k_b], logits[b : b + 1, : k_b + 1]).emitted()[0]
        assert batched.emitted()[b] == expected
    assert batched.num_accepted.tolist() == [4, 2, 0, 1]
    assert batched.emitted()[0] == targets[0].tolist()  # bonus from row K_b = 4


def test_ragged_bonus_comes_from_row_k_b(make_logits):
    logits = make_logits([[1, 2, 3, 4]])
    verdict = verify_greedy(torch.tensor([[1, P, P]]), logits, draft_lens=torch.tensor([1]))
    assert verdict.emitted() == [[1, 2]]


def test_scores_path_is_identical(make_logits):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, 32, generator=gen)  # [B, K+1, V]
    draft = logits[:, :4].argmax(-1)
    draft[torch.rand(6, 4, generator=gen) < 0.3] = 7
    scores = compact_scores(draft, logits)
    assert isinstance(scores, TargetScores)
    assert scores.argmax_ids.shape == (6, 5) and scores.draft_logits.shape == (6, 4)
    torch.testing.assert_close(scores.argmax_ids, logits.argmax(-1))
    torch.testing.assert_close(scores.argmax_logits, logits.amax(-1))
    torch.testing.assert_close(scores.draft_logits, logits[:, :4].gather(-1, draft[..., None]).squeeze(-1))
    full, compact = verify_greedy(draft, logits), verify_greedy_scores(draft, scores)
    assert torch.equal(full.tokens, compact.tokens) and torch.equal(full.num_accepted, compact.num_accepted)


def test_ties_resolve_to_the_first_index():
    logits = torch.zeros(1, 2, 8)
    logits[0, 0, [2, 5]] = 1.0
    logits[0, 1, 3] = 1.0
    assert verify_greedy(torch.tensor([[2]]), logits).emitted() == [[2, 3]]
    assert verify_greedy(torch.tensor([[5]]), logits).emitted() == [[2]]


@pytest.mark.parametrize(
    "draft, logits, lens, argument",
    [
        (torch.tensor([[1, 2]]), torch.zeros(1, 2, 8), None, "target_logits"),  # K+1 mismatch
        (torch.tensor([[1, 2]]), torch.zeros(2, 3, 8), None, "target_logits"),  # B mismatch
        (torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 1, 8), None, "K = 0"),
        (torch.tensor([[1, 8]]), torch.zeros(1, 3, 8), None, "vocabulary"),  # id ≥ V
        (torch.tensor([[1, -2]]), torch.zeros(1, 3, 8), None, "negative"),
        (torch.tensor([[1, P]]), torch.zeros(1, 3, 8), None, "negative"),  # PAD without draft_lens
        (torch.tensor([[1, 2]]), torch.zeros(1, 3, 8), torch.tensor([1]), "PAD_TOKEN_ID"),
        (torch.tensor([[1, 2]]), torch.zeros(1, 3, 8), torch.tensor([3]), "draft_lens"),
        (torch.tensor([[1.0, 2.0]]), torch.zeros(1, 3, 8), None, "draft_ids"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(draft, logits, lens, argument):
    with pytest.raises(ValueError, match=argument):
        verify_greedy(draft, logits, draft_lens=lens)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_logits_raise(bad):
    logits = torch.zeros(2, 3, 8)
    logits[1, 2, 5] = bad
    with pytest.raises(ValueError, match="target_logits"):
        verify_greedy(torch.tensor([[1, 2], [1, 2]]), logits)

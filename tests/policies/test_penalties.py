"""policies.penalties against a brute-force reference written from vLLM's definitions (min_tokens and
logit_bias processors, then `apply_penalties`: repetition, frequency, presence), position by position."""

import math

import pytest
import torch

from policies import PAD_TOKEN_ID
from policies.penalties import (BlockLogprobs, Penalties, allowed_drafts, gather_candidates, penalise_block,
                                raw_logprobs)

V = 12


def reference(z, rules, prompt, output):
    """One position's logits (a list) after the rules, token by token, as vLLM defines them."""
    z = list(z)
    for t, b in rules.logit_bias:
        z[t] += b
    if len(output) < rules.min_tokens:
        for t in rules.stop_ids:
            z[t] = -math.inf
    for v in range(V):
        if v in prompt or v in output:
            z[v] = z[v] / rules.repetition if z[v] > 0 else z[v] * rules.repetition
        count = output.count(v)
        z[v] -= rules.frequency * count + rules.presence * (count > 0)
    return z


CASES = [
    Penalties.of(frequency=0.7),
    Penalties.of(presence=-1.3),
    Penalties.of(repetition=1.8),
    Penalties.of(repetition=0.6, frequency=0.4, presence=0.3),
    Penalties.of(logit_bias={3: 5.0, 7: -100.0}),
    Penalties.of(min_tokens=5, stop_ids=[2, 9]),
    Penalties.of(frequency=1.1, presence=0.5, repetition=1.3, logit_bias={0: 2.0, 4: -3.5}, min_tokens=4,
                 stop_ids=[2]),
]


@pytest.mark.parametrize("rules", CASES)
@pytest.mark.parametrize("k", [0, 1, 4])
def test_penalise_block_equals_the_reference_at_every_position(rules, k):
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(k + 2, V, generator=gen) * 3  # one padded position past the bonus
    prompt = [1, 4, 4, 8]
    output = [3, 5, 3]
    drafts = [5, 6, 3, 11][:k]
    got = penalise_block(logits, rules, torch.tensor(prompt), torch.tensor(output, dtype=torch.long),
                         torch.tensor(drafts, dtype=torch.long))
    for i in range(k + 2):
        want = torch.tensor(reference(logits[i].tolist(), rules, prompt, output + drafts[:i]))
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)


def test_neutral_rules_change_nothing_and_are_inactive():
    rules = Penalties.of(min_tokens=3)  # no stop ids (EOS ignored, none given): nothing to mask
    assert not rules.active and not Penalties().active
    logits = torch.randn(3, V)
    torch.testing.assert_close(penalise_block(logits, rules, torch.tensor([1]), torch.tensor([2]),
                                              torch.tensor([4])), logits)


def test_allowed_drafts_stops_at_the_first_banned_token():
    rules = Penalties.of(logit_bias={7: -100.0, 8: -99.0}, min_tokens=3, stop_ids=[2])
    assert allowed_drafts([1, 8, 7, 4], rules, output_len=5) == 2  # -100 bans, -99 does not
    assert allowed_drafts([1, 2, 4], rules, output_len=1) == 1  # EOS at output length 2 < min_tokens 3
    assert allowed_drafts([1, 4, 2], rules, output_len=1) == 3  # EOS at output length 3: allowed
    assert rules.banned(2) == {7, 2} and rules.banned(3) == {7}


def test_raw_logprobs_and_candidates():
    logits = torch.randn(2, 3, V)
    logprobs, top_ids, top_lp = raw_logprobs(logits, 4)
    torch.testing.assert_close(logprobs.exp().sum(-1), torch.ones(2, 3))
    assert top_ids.shape == (2, 3, 4) and bool((top_lp[..., :-1] >= top_lp[..., 1:]).all())
    torch.testing.assert_close(top_lp[..., 0], logprobs.amax(-1))
    assert raw_logprobs(logits, 0)[1].shape == (2, 3, 0)
    candidates = torch.tensor([[5, PAD_TOKEN_ID], [2, 3]])  # [T=2, C=2]
    chosen = gather_candidates(logprobs[0, :2], candidates)
    assert chosen[0, 1] == float("-inf") and chosen[1, 1] == logprobs[0, 1, 3]
    block = BlockLogprobs(candidates, chosen, top_ids[0, :2], top_lp[0, :2])
    lp, top = block.lookup(1, 3, 2)
    assert lp == pytest.approx(float(logprobs[0, 1, 3])) and len(top) == 2 and top[0][0] == int(top_ids[0, 1, 0])
    with pytest.raises(ValueError, match="candidate"):
        block.lookup(0, 7, 1)


def test_too_few_positions_for_the_drafts_is_a_value_error():
    with pytest.raises(ValueError, match="draft_ids"):
        penalise_block(torch.randn(2, V), Penalties.of(frequency=1.0), torch.tensor([1]), torch.tensor([1]),
                       torch.tensor([1, 2]))


def test_speculative_sampling_on_penalised_blocks_follows_the_penalised_target():
    """The chi-square test of test_verify_sampled, with a frequency penalty and a logit_bias: each position's
    p is the penalised target's with the block's earlier drafts in the output (`penalise_block`), so the
    first emitted token follows p_0 and, where x_0 was kept, the second follows p_1 given x_0. N = 100k fixed-seed
    draws on V = 6: the statistic is deterministic (not flaky); a correct verifier would fail the 1e-6 floor
    with probability 1e-6 at a random seed, while the law without the penalty at position 1 (the raw p_1 or
    one blind to x_0) is off by several percent in total variation, a statistic in the hundreds (checked)."""
    from tests.policies.test_verify_sampled import P_VALUE_FLOOR, chi_square_p_value
    from policies.exact import verify_sampled

    n, k, vocab = 100_000, 2, 6
    gen = torch.Generator().manual_seed(7)
    z = torch.randn(k + 1, vocab, generator=gen)  # the target's raw logits at each position
    rules = Penalties.of(frequency=1.0, logit_bias={1: -2.0, 4: 1.5})
    output = torch.tensor([3, 3])
    q = torch.softmax(torch.randn(k, vocab, generator=gen), -1)  # [K, V] the drafter's
    draft = torch.multinomial(q, n, replacement=True, generator=gen).T.contiguous()  # [N, K]
    # p for every distinct prefix: [V, V, K+1, V], position i penalised with the drafts before it
    by_prefix = torch.stack([torch.stack([
        torch.softmax(penalise_block(z, rules, torch.tensor([0]), output, torch.tensor([a, b])), -1)
        for b in range(vocab)]) for a in range(vocab)])
    p = by_prefix[draft[:, 0], draft[:, 1]]  # [N, K+1, V]
    verdict = verify_sampled(draft, q.expand(n, k, vocab), p, generator=gen)
    assert chi_square_p_value(verdict.tokens[:, 0], by_prefix[0, 0, 0]) > P_VALUE_FLOOR
    for x0 in range(vocab):
        kept = (verdict.num_accepted >= 1) & (draft[:, 0] == x0)
        assert chi_square_p_value(verdict.tokens[kept, 1], by_prefix[x0, 0, 1]) > P_VALUE_FLOOR
    x0 = int(torch.bincount(draft[verdict.num_accepted >= 1, 0]).argmax())  # the most kept draft token
    kept = (verdict.num_accepted >= 1) & (draft[:, 0] == x0)
    blind = torch.softmax(penalise_block(z[1:2], rules, torch.tensor([0]), output, torch.zeros(0).long()), -1)[0]
    assert chi_square_p_value(verdict.tokens[kept, 1], blind) < P_VALUE_FLOOR  # the test tells them apart
    assert chi_square_p_value(verdict.tokens[:, 0], torch.softmax(z[0], -1)) < P_VALUE_FLOOR


def test_min_tokens_keeps_the_stop_when_nothing_else_is_left():
    """As vLLM's min_tokens with structured output: a position where only stop ids are finite (a finished
    grammar) keeps them; other positions lose them."""
    logits = torch.randn(2, V)
    logits[0, :] = float("-inf")
    logits[0, 2] = 1.0  # only EOS allowed here
    got = penalise_block(logits, Penalties.of(min_tokens=5, stop_ids=[2, 9]), torch.tensor([1]),
                         torch.tensor([3], dtype=torch.long), torch.tensor([4]))
    assert got[0, 2] == 1.0 and torch.isneginf(got[0]).sum() == V - 1
    assert torch.isneginf(got[1, [2, 9]]).all() and torch.isfinite(got[1, [0, 1, 3]]).all()

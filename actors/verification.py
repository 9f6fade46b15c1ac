"""The verify step of a round: which rule verifies each row, where it runs, and what the row emits.

The rule is the one that actually runs for the row (`SequenceState.asd`), not only its arm's setting:
- exact greedy rows are verified here, vectorised (`policies.exact.verify_greedy_scores`);
- exact sampled rows were settled in the target (`verify_sampled`); their tokens are in the `TargetResult`;
- ASD rows are verified in the policy, where the ledgers are, in one `ASDBatch` per arm and rule: greedy rows
  with their compact `TargetScores` (`policies.asd`), and the sampled rows of an arm whose `sampled` rule is
  "relaxed" with the `SampledScores` the target drew for them (`policies.asd_sampled`).

A row that asked for logprobs gets one `TokenLogprob` per emitted token (`attach_logprobs`), read from the
raw logprobs the target gathered for it (`policies.penalties.BlockLogprobs`).

A sampled request on an ASD arm whose `sampled` rule is "exact" falls back to exact speculative sampling;
its record says so (`RequestRecord.asd_fallback`).
"""

from __future__ import annotations

import torch

from actors.contracts import ASDBatch, TargetBatch, TargetResult
from actors.requests import TokenLogprob
from actors.scheduler import RowOutcome, SequenceState
from policies import Verdict
from policies.asd import ASDConfig
from policies.asd_sampled import SampledScores
from policies.exact import verify_greedy_scores
from policies.penalties import BlockLogprobs
from policies.scores import TargetScores


def relaxed_sampled(rows: list[SequenceState]) -> dict[int, ASDConfig]:
    """`TargetBatch.relaxed_sampled` of a round: its sampled rows verified by ASD, with their arm's config."""
    return {b: s.request.arm.asd for b, s in enumerate(rows) if s.asd and not s.greedy}


def exact_outcomes(rows: list[SequenceState], batch: TargetBatch, result: TargetResult) -> list[RowOutcome | None]:
    """Outcomes of the exact rows: greedy ones verified here (vectorised), sampled ones settled in the target.
    ASD rows are None until the policy settles them."""
    outcomes: list[RowOutcome | None] = [None] * len(rows)
    greedy = [b for b, s in enumerate(rows) if not s.asd and b not in result.sampled_tokens]
    if greedy:
        idx = torch.tensor(greedy)
        verdict = verify_greedy_scores(batch.draft_ids[idx], take_scores(result.scores, idx),
                                       draft_lens=batch.draft_lens[idx])
        for j, (b, tokens) in enumerate(zip(greedy, verdict.emitted())):
            outcomes[b] = RowOutcome(tokens, int(verdict.num_accepted[j]))
    for b, tokens in result.sampled_tokens.items():
        outcomes[b] = RowOutcome(tokens, result.sampled_accepted[b])
    return outcomes


def asd_batches(rows: list[SequenceState], batch: TargetBatch,
                result: TargetResult) -> list[tuple[list[int], ASDBatch]]:
    """The round's ASD rows grouped by (arm, greedy or sampled), in order of first appearance: per group the
    row indices and the `ASDBatch` the policy verifies them in."""
    groups: dict[tuple[str, bool], list[int]] = {}
    for b, seq in enumerate(rows):
        if seq.asd:
            groups.setdefault((seq.request.arm.name, seq.greedy), []).append(b)
    out = []
    for (arm, greedy), members in groups.items():
        idx = torch.tensor(members)
        if greedy:
            scores = take_scores(result.scores, idx)
        else:
            scores = concat_sampled([result.sampled_scores[b] for b in members])
        out.append((members, ASDBatch(tuple(rows[b].rid for b in members), batch.draft_ids[idx],
                                      batch.draft_lens[idx], scores, rows[members[0]].request.arm.asd, arm)))
    return out


def asd_outcomes(verdict: Verdict) -> list[RowOutcome]:
    """One outcome per row of a settled `ASDBatch`, with its relaxed tokens and the regret charged."""
    out = []
    for j, k in enumerate(verdict.num_accepted.tolist()):
        out.append(RowOutcome(verdict.tokens[j, : k + 1].tolist(), k, int(verdict.num_relaxed[j]),
                              float(verdict.regret[j])))
    return out


def attach_logprobs(rows: list[SequenceState], outcomes: list[RowOutcome], result: TargetResult) -> None:
    """Give each row that asked for logprobs one `TokenLogprob` per token it emits this round."""
    for b, block in result.logprobs.items():
        outcomes[b].logprobs = token_logprobs(block, outcomes[b].tokens, rows[b].request.params.logprobs)


def first_token(seq: SequenceState, result: TargetResult, b: int) -> RowOutcome:
    """What a prompt's last chunk (row b of `result`) emits: the token the target sampled, or its argmax."""
    token = result.sampled_tokens[b][0] if b in result.sampled_tokens else int(result.scores.argmax_ids[b, 0])
    block = result.logprobs.get(b)
    logprobs = None if block is None else token_logprobs(block, [token], seq.request.params.logprobs)
    return RowOutcome([token], 0, logprobs=logprobs)


def token_logprobs(block: BlockLogprobs, tokens: list[int], n: int) -> list[TokenLogprob]:
    """The `TokenLogprob` of tokens[j], emitted at position j of a block, with its position's top n."""
    return [TokenLogprob(t, *block.lookup(j, t, n)) for j, t in enumerate(tokens)]


def take_scores(scores: TargetScores, idx: torch.Tensor) -> TargetScores:
    """The rows `idx` [A] of compact scores."""
    return TargetScores(scores.argmax_ids[idx], scores.argmax_logits[idx], scores.draft_logits[idx])


def concat_sampled(parts: list[SampledScores]) -> SampledScores:
    """Rows' `SampledScores` (each [1, K], one K for the round) stacked into one [A, K]."""
    return SampledScores(**{name: torch.cat([getattr(p, name) for p in parts])
                            for name in SampledScores.__dataclass_fields__})

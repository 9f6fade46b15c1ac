"""A decode round's `TargetBatch`: its rows' pending tokens and drafts, and what the target needs besides
logits to verify them: each row's sampling, its rules and grammar masks (`TargetBatch.rules`), the logprobs it
asks for, and the relaxed ASD rows.

Drafts are cut first (`trim_drafts`) before the first token a row's rules ban at its position or its grammar
refuses: the target would reject it and every draft after it, and a grammar has no mask past a refused token.
Rows without rules, grammar or logprobs add nothing to the batch.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from actors.contracts import DraftBatch, TargetBatch
from actors.scheduler import SequenceState
from actors.verification import relaxed_sampled
from policies import PAD_TOKEN_ID


def decode_batch(rows: list[SequenceState], draft: DraftBatch) -> tuple[TargetBatch, DraftBatch]:
    """The round's batch for `rows` and their drafts, and the drafts as verified (trimmed)."""
    ruled = [b for b, s in enumerate(rows) if s.penalties is not None or s.grammar is not None]
    if ruled:
        draft = trim_drafts(draft, rows, ruled)
    lens = draft.draft_lens.tolist()
    drafts = [draft.draft_ids[b, : lens[b]].tolist() for b in range(len(rows))]
    rules = {b: rows[b].rules(drafts[b]) for b in ruled}
    logprobs = {b: s.request.params.logprobs for b, s in enumerate(rows) if s.request.params.logprobs is not None}
    batch = TargetBatch(
        seq_ids=[s.rid for s in rows], crops=[s.crop for s in rows],
        tokens=[[s.tokens[-1]] + drafts[b] for b, s in enumerate(rows)],
        draft_ids=draft.draft_ids, draft_lens=draft.draft_lens,
        sampling=[s.request.params.spec() for s in rows], draft_probs=draft.draft_probs,
        relaxed_sampled=relaxed_sampled(rows), rules=rules, logprobs=logprobs,
    )
    return batch, draft


def trim_drafts(draft: DraftBatch, rows: list[SequenceState], ruled: list[int]) -> DraftBatch:
    """The `ruled` rows' drafts cut before the first one each may not emit (`SequenceState.allowed_drafts`)."""
    lens = draft.draft_lens.tolist()
    cuts = {}
    for b in ruled:
        if lens[b]:
            keep = rows[b].allowed_drafts(draft.draft_ids[b, : lens[b]].tolist())
            if keep < lens[b]:
                cuts[b] = keep
    if not cuts:
        return draft
    ids, new_lens = draft.draft_ids.clone(), draft.draft_lens.clone()  # [B, Kmax], [B]
    for b, keep in cuts.items():
        ids[b, keep:] = PAD_TOKEN_ID
        new_lens[b] = keep
    confidence = None if draft.confidence is None else draft.confidence * (
        torch.arange(ids.shape[1]) < new_lens[:, None])  # [B, Kmax], 0 past a row's drafts
    return replace(draft, draft_ids=ids, draft_lens=new_lens, confidence=confidence)

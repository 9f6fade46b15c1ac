"""Chunked prefill: a long prompt enters the target's KV cache a bounded chunk per unit step.

With a prefill budget of C tokens (`target.prefill_chunk_tokens`), while some stream decodes
(`Scheduler.prefill_chunks`) every prefilling sequence feeds its next chunk of at most C prompt tokens per step:
the budget is per sequence, not per step. The chunks ride in the decode round's forward, as rows after the decode
rows (`prefill_batch(chunks, decode)`); a unit with no decoding stream feeds whole prompts in a step of their
own. Chunks are aligned, prompt positions [kC, min((k+1)C, len)), so how a prompt is split depends on the prompt
and C only. Only a prompt's last chunk is sampled (it yields the first token); earlier ones are fed as greedy
rows, so a seeded request draws the same numbers chunked or not. Why per sequence: docs/benchmarks.md, "The
per-sequence budget"; the promise it holds: docs/reliability.md, promise 8.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from actors.contracts import NO_CROP, RowRules, TargetBatch
from actors.requests import GenerationRequest
from actors.sampling import GREEDY
from policies import PAD_TOKEN_ID


class Prefilling(Protocol):
    """What chunking reads of a sequence (`actors.scheduler.SequenceState`)."""

    request: GenerationRequest
    tokens: list[int]  # the prompt, then what the request emitted
    prefilled: int  # tokens already in the target's KV cache

    @property
    def prefill_end(self) -> int: ...  # tokens the prefill feeds: the prompt, or all but the pending one

    @property
    def rid(self) -> str: ...

    def rules(self) -> RowRules | None: ...  # the rules and grammar on the target's logits for the next token


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt positions [start, end) of one sequence, fed in one step."""

    seq: Prefilling
    start: int
    end: int

    @property
    def last(self) -> bool:
        """The chunk completes the prefill: its logits give the first token (of a request not resumed)."""
        return self.end == self.seq.prefill_end


def plan_chunks(prefilling: list[Prefilling], budget: int | None) -> list[PrefillChunk]:
    """The chunks of one step: each prefilling sequence's next aligned chunk of at most `budget` tokens
    (a per-sequence budget, see the module docstring); `budget` None feeds every remaining prompt whole."""
    if budget is not None and budget < 1:
        raise ValueError(f"budget: must be >= 1 or None, got {budget}")
    chunks = []
    for seq in prefilling:
        start, length = seq.prefilled, seq.prefill_end
        end = length if budget is None else min(length, (start // budget + 1) * budget)
        chunks.append(PrefillChunk(seq, start, end))
    return chunks


def prefill_batch(chunks: list[PrefillChunk], decode: TargetBatch | None = None) -> TargetBatch:
    """The target step that feeds `chunks`: no crop, no drafts, the last position scored per chunk; with
    `decode`, that round's rows first and the chunks after them (`TargetBatch.prompt_rows`)."""
    n = len(chunks)
    first = [c.last and not c.seq.output for c in chunks]  # chunks whose logits give the first token
    sampling = [c.seq.request.params.spec() if f else GREEDY for c, f in zip(chunks, first)]
    tokens = [c.seq.tokens[c.start : c.end] for c in chunks]
    at = 0 if decode is None else len(decode.seq_ids)  # row of the first chunk
    rules = {at + j: r for j, (c, f) in enumerate(zip(chunks, first)) if f and (r := c.seq.rules()) is not None}
    logprobs = {at + j: c.seq.request.params.logprobs for j, (c, f) in enumerate(zip(chunks, first))
                if f and c.seq.request.params.logprobs is not None}
    if decode is None:
        return TargetBatch(
            seq_ids=[c.seq.rid for c in chunks], crops=[NO_CROP] * n, tokens=tokens,
            draft_ids=torch.full((n, 1), PAD_TOKEN_ID, dtype=torch.long),  # [n, 1]
            draft_lens=torch.zeros(n, dtype=torch.long),  # [n]
            sampling=sampling, prompt_rows=n, rules=rules, logprobs=logprobs,
        )
    width = decode.draft_ids.shape[1]
    probs = decode.draft_probs
    if probs is not None:  # chunk rows draft nothing: zero q rows
        probs = torch.cat([probs, probs.new_zeros(n, *probs.shape[1:])])  # [B + n, Kmax, V]
    return replace(
        decode, seq_ids=decode.seq_ids + [c.seq.rid for c in chunks], crops=decode.crops + [NO_CROP] * n,
        tokens=decode.tokens + tokens,
        draft_ids=torch.cat([decode.draft_ids, torch.full((n, width), PAD_TOKEN_ID, dtype=torch.long)]),
        draft_lens=torch.cat([decode.draft_lens, torch.zeros(n, dtype=torch.long)]),  # [B + n]
        sampling=decode.sampling + sampling, draft_probs=probs, prompt_rows=n,
        rules={**decode.rules, **rules}, logprobs={**decode.logprobs, **logprobs},
    )

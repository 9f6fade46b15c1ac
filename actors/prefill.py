"""Chunked prefill: a long prompt enters the target's KV cache a bounded chunk per unit step, between rounds.

Without chunking, a unit prefills a newly admitted prompt whole before its next round, so a 1,500-token
prompt stalls every stream decoding beside it for the length of that forward. With a **prefill budget** of
C tokens (`target.prefill_chunk_tokens`), each step of the unit's loop feeds at most C prompt tokens, then
runs the decode round: running streams keep emitting, and the long prompt's first token comes a few rounds
later. vLLM's chunked prefill does the same with its own `max_num_batched_tokens`. The budget binds only
while some stream decodes (`Scheduler.prefill_chunks`): a unit with no running stream feeds whole prompts,
so a burst of requests to an idle unit is not slowed down to C tokens a step.

Chunk boundaries are **aligned**: a sequence's chunks are prompt positions [kC, min((k+1)C, len)), whatever
else is prefilling, so how a prompt is split depends on the prompt and C only, never on other traffic.
Sequences prefill first come first served: the first one always gets its next chunk, later ones join the
same forward while their next chunk still fits the step's budget. Only a prompt's **last** chunk is sampled
(it yields the first token); earlier chunks are fed as greedy rows, so a seeded sampled request draws no
random numbers for them and reproduces whether or not its prompt was chunked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from actors.contracts import NO_CROP, TargetBatch
from actors.requests import GenerationRequest
from actors.sampling import GREEDY
from policies import PAD_TOKEN_ID


class Prefilling(Protocol):
    """What chunking reads of a sequence (`actors.scheduler.SequenceState`)."""

    request: GenerationRequest
    tokens: list[int]  # the prompt (nothing is emitted before the prefill ends)
    prefilled: int  # prompt tokens already in the target's KV cache

    @property
    def rid(self) -> str: ...


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt positions [start, end) of one sequence, fed in one step."""

    seq: Prefilling
    start: int
    end: int

    @property
    def last(self) -> bool:
        """The chunk completes the prompt: its logits give the first token."""
        return self.end == len(self.seq.request.prompt_ids)


def plan_chunks(prefilling: list[Prefilling], budget: int | None) -> list[PrefillChunk]:
    """The chunks of one step: aligned chunks of at most `budget` tokens in all, first come first served
    (the first sequence always gets its chunk); `budget` None feeds every remaining prompt whole."""
    if budget is not None and budget < 1:
        raise ValueError(f"budget: must be >= 1 or None, got {budget}")
    chunks, used = [], 0
    for seq in prefilling:
        start, length = seq.prefilled, len(seq.request.prompt_ids)
        end = length if budget is None else min(length, (start // budget + 1) * budget)
        if chunks and budget is not None and used + end - start > budget:
            continue  # a later, shorter chunk may still fit this step
        chunks.append(PrefillChunk(seq, start, end))
        used += end - start
    return chunks


def prefill_batch(chunks: list[PrefillChunk]) -> TargetBatch:
    """The target step that feeds `chunks`: no crop, no drafts, the last position scored per row."""
    n = len(chunks)
    return TargetBatch(
        seq_ids=[c.seq.rid for c in chunks], crops=[NO_CROP] * n,
        tokens=[c.seq.tokens[c.start : c.end] for c in chunks],
        draft_ids=torch.full((n, 1), PAD_TOKEN_ID, dtype=torch.long),  # [B, 1]
        draft_lens=torch.zeros(n, dtype=torch.long),  # [B]
        sampling=[c.seq.request.params.spec() if c.last else GREEDY for c in chunks], prefill=True,
    )

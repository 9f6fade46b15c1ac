"""Scheduling for one unit: which sequences run, and with how many drafts.

The `Scheduler` owns the waiting queue, the sequences prefilling (a KV slot each, their prompt entering the
cache a chunk per step, `actors.prefill`), the active batch (prefilling + active ≤ `max_batch_size`), the
aborts asked for since the last round, and the γ plan (the policy's γ per request, applied next round).
It checks a request against the engine at enqueue (vocabulary, context, grammar), and holds each sequence's
rules (`policies.penalties.Penalties`) and grammar matcher (`actors.grammar`), None when it has none.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.bookkeeping import RequestBook
from actors.contracts import NO_CROP, RowKey, RowRules
from actors.grammar import Grammars, advance, block_masks, valid_drafts
from actors.prefill import PrefillChunk, plan_chunks
from actors.requests import GenerationRequest, SamplingParams, TokenLogprob
from actors.stats import RequestRecord
from policies.penalties import Penalties, allowed_drafts


@dataclass
class RowOutcome:
    """What a row emits in one round."""

    tokens: list[int]  # accepted drafts + the recovered or bonus token
    accepted: int  # draft tokens kept
    relaxed: int = 0  # kept mismatches (ASD)
    regret: float = 0.0  # regret charged (ASD)
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them


@dataclass
class SequenceState:
    """One request in the unit: `tokens` = prompt + emitted output; the target's KV holds `tokens[:-1]`, and
    the last emitted token is *pending* (fed first next round). Its accounting is its `book`."""

    request: GenerationRequest
    queue: asyncio.Queue  # GenerationChunks for the request's consumer
    tokens: list[int]
    book: RequestBook
    crop: int = NO_CROP  # target KV length to keep before the next feed
    output: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the target's KV cache (chunked prefill)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    penalties: Penalties | None = None  # the request's rules on the target's logits, None without any
    grammar: Any = None  # its grammar's matcher at the committed output (`actors.grammar`), None without one
    vocab_size: int = 0  # the target's (the grammar's masks cover it)

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def greedy(self) -> bool:
        return self.book.greedy

    @property
    def prefill_end(self) -> int:
        """Tokens the prefill puts in the KV cache: the prompt, or after a resume every token but the pending one."""
        return len(self.tokens) - 1 if self.output else len(self.request.prompt_ids)

    @property
    def asd(self) -> bool:
        return self.book.asd

    def key(self) -> RowKey:
        return RowKey(self.rid, self.request.arm.name, self.book.seeded)

    def allowed_drafts(self, drafts: Sequence[int]) -> int:
        """How many of `drafts` to verify: up to the first its rules ban or its grammar refuses (the target
        would reject it, and every draft after it)."""
        keep = len(drafts)
        if self.penalties is not None:
            keep = allowed_drafts(drafts, self.penalties, len(self.output))
        if self.grammar is not None and keep:
            keep = valid_drafts(self.grammar, drafts[:keep])
        return keep

    def rules(self, drafts: Sequence[int] = ()) -> RowRules | None:
        """What the target applies to this row's block with `drafts` (allowed ones): its rules, and its
        grammar's masks; None without either. The output is copied: it crosses actors."""
        if self.penalties is None and self.grammar is None:
            return None
        masks = None if self.grammar is None else block_masks(self.grammar, drafts, self.vocab_size)
        return RowRules(self.penalties, self.request.prompt_ids, tuple(self.output), masks)

    def draft_limit(self, max_seq_len: int) -> int:
        return self.book.draft_limit(output_len=len(self.output), context_len=len(self.tokens),
                                     max_seq_len=max_seq_len)

    def commit(self, outcome: RowOutcome, *, drafted: int, eos: frozenset[int], max_seq_len: int,
               is_round: bool = True) -> tuple[list[int], str | None]:
        """Append a round's emitted tokens up to EOS / stop ids / max_tokens / the context; returns the tokens
        appended and the finish reason ("stop" | "length"), if the request ends here."""
        params = self.request.params
        base = len(self.tokens)
        out, reason = [], None
        for tok in outcome.tokens:
            if tok in params.stop_token_ids or (tok in eos and not params.ignore_eos):
                reason = "stop"
                break
            out.append(tok)
            if len(self.output) + len(out) >= params.max_tokens or base + len(out) >= max_seq_len:
                reason = "length"
                break
        if self.grammar is not None:
            advance(self.grammar, out, self.rid)
        self.tokens.extend(out)
        self.output.extend(out)
        self.crop = base + outcome.accepted  # KV keeps the old pending token and the accepted drafts
        if is_round:
            self.book.account(drafted, outcome.accepted)
        return out, reason

    def record(self, unit: str, reason: str, finished_s: float) -> RequestRecord:
        return self.book.record(unit=unit, finish_reason=reason, output_tokens=len(self.output),
                                finished_s=finished_s, timing_s=self.book.timing(time.perf_counter()))


class Scheduler:
    """Waiting queue, active batch, aborts and the γ plan of one unit."""

    def __init__(self, *, max_batch_size: int, max_seq_len: int, vocab_size: int | None, clock,
                 prefill_chunk_tokens: int | None = None, eos: Collection[int] = (), grammars: Grammars | None = None):
        if prefill_chunk_tokens is not None and prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens: must be >= 1 or None, got {prefill_chunk_tokens}")
        self.max_batch_size = max_batch_size
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.clock = clock
        self.eos = frozenset(eos)
        self.grammars = grammars
        self.waiting: list[SequenceState] = []
        self.prefilling: list[SequenceState] = []
        self.active: list[SequenceState] = []
        self.aborts: set[str] = set()
        self.plan: dict[str, int] = {}

    # --- requests ----------------------------------------------------------------------------------------
    def enqueue(self, request: GenerationRequest) -> SequenceState:
        """Validate and queue a request; ValueError naming the problem."""
        prompt = request.prompt_ids
        if not prompt:
            raise ValueError("prompt_ids must not be empty")
        if self.vocab_size is not None and (min(prompt) < 0 or max(prompt) >= self.vocab_size):
            raise ValueError(f"prompt_ids must lie in [0, {self.vocab_size})")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in max_seq_len {self.max_seq_len}")
        if self.find(request.request_id) is not None:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        self._check_params(request.params)
        structured = request.params.structured
        seq = SequenceState(request, asyncio.Queue(), list(prompt), RequestBook(request, self.clock()),
                            penalties=penalties_for(request.params, self.eos),
                            grammar=None if structured is None else self.grammars.matcher(structured),
                            vocab_size=self.vocab_size or 0)
        self.waiting.append(seq)
        return seq

    def _check_params(self, params: SamplingParams) -> None:
        """What only the engine can check: token ids within its vocabulary; ValueError naming the field."""
        if params.structured is not None and (self.grammars is None or not self.vocab_size):
            raise ValueError("structured: this unit has no tokenizer to compile a grammar with")
        vocab = self.vocab_size
        if vocab is not None:
            for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
                if any(t >= vocab for t in ids):
                    raise ValueError(f"{name}: token ids must lie in [0, {vocab}), got {max(ids)}")

    def find(self, request_id: str) -> SequenceState | None:
        return next((s for s in self.waiting + self.running() if s.rid == request_id), None)

    def request_ids(self) -> list[str]:
        return [s.rid for s in self.waiting + self.running()]

    def running(self) -> list[SequenceState]:
        """Sequences holding a KV slot: prefilling, then active."""
        return self.prefilling + self.active

    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.active or self.aborts)

    def take_aborted(self) -> tuple[list[SequenceState], list[SequenceState]]:
        """(waiting, running) sequences whose abort was asked for; the waiting ones leave the queue here."""
        waiting = [s for s in self.waiting if s.rid in self.aborts]
        active = [s for s in self.running() if s.rid in self.aborts]
        self.waiting = [s for s in self.waiting if s.rid not in self.aborts]
        self.aborts.clear()
        return waiting, active

    def admit(self) -> list[SequenceState]:
        """Start prefilling as many waiting sequences as there are free KV slots."""
        room = self.max_batch_size - len(self.running())
        new, self.waiting = self.waiting[: max(0, room)], self.waiting[max(0, room):]
        self.prefilling.extend(new)
        return new

    def prefill_chunks(self) -> list[PrefillChunk]:
        """This step's prompt chunks (`actors.prefill.plan_chunks`): within `prefill_chunk_tokens` while
        streams decode, whole when none does (chunking protects running streams; with none there is nothing
        to protect, and a burst of new requests would otherwise wait chunk by chunk for its first tokens)."""
        return plan_chunks(self.prefilling, self.prefill_chunk_tokens if self.active else None)

    def prefilled(self, chunks: list[PrefillChunk]) -> list[SequenceState]:
        """Record fed chunks; sequences whose prompt is now cached join the active batch (returned)."""
        for chunk in chunks:
            chunk.seq.prefilled = chunk.end
        done = [c.seq for c in chunks if c.last]
        ids = {s.rid for s in done}
        self.prefilling = [s for s in self.prefilling if s.rid not in ids]
        self.active.extend(done)
        return done

    def resume(self, seq: SequenceState) -> None:
        """A running sequence whose KV was lost prefills again: its prompt and every token but the pending one."""
        if seq in self.active:
            self.active.remove(seq)
            self.prefilling.append(seq)
        seq.prefilled, seq.crop = 0, NO_CROP

    def remove(self, seq: SequenceState) -> None:
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        if seq in self.active:
            self.active.remove(seq)
        self.plan.pop(seq.rid, None)

    # --- the γ plan --------------------------------------------------------------------------------------
    def set_plan(self, keys: list[RowKey], plan: list[int]) -> None:
        live = {s.rid for s in self.running()}
        self.plan.update((k.request_id, g) for k, g in zip(keys, plan) if k.request_id in live)

    def gammas(self, rows: list[SequenceState], *, can_draft: bool, free_drafts: bool) -> list[int]:
        """γ per row: the policy's plan, within what the row may still emit.

        A batched forward is as wide as its widest row, so positions up to that width cost the target nothing
        extra. With a drafter whose drafts are free (prompt lookup), every speculating row drafts up to the
        round's width: the padding is spent on tokens that may be accepted instead of on nothing.
        """
        limits = [s.draft_limit(self.max_seq_len) if can_draft else 0 for s in rows]
        gammas = [min(self.plan.get(s.rid, 0), cap) for s, cap in zip(rows, limits)]
        if free_drafts:
            width = max(gammas, default=0)
            gammas = [min(width, cap) for cap in limits]
        return gammas


def penalties_for(params: SamplingParams, eos: Collection[int]) -> Penalties | None:
    """A request's rules (`policies.penalties`): its stop ids are stop_token_ids and, unless it ignores EOS,
    the EOS ids; None when no rule changes a logit."""
    if not params.penalised:
        return None
    stops = (*params.stop_token_ids, *(() if params.ignore_eos else eos))
    rules = Penalties.of(frequency=params.frequency_penalty, presence=params.presence_penalty,
                         repetition=params.repetition_penalty, logit_bias=params.logit_bias,
                         min_tokens=params.min_tokens, stop_ids=stops)
    return rules if rules.active else None


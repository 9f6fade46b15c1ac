"""The speculative loop of one unit, batched over all its active sequences.

A round, for every active sequence at once: γ per row from the plan (`Scheduler.gammas`); the drafter
proposes; the target crops last round's rejected KV, feeds each row's pending token and drafts, and returns
compact scores or exact samples; verification (`actors.verification`: exact rows here, ASD rows against the
unit's ledger leases in its `UnitPolicy`); commit; the round's observations go to the policy, which reports
them to the app's authority in the background. The same loop runs in-process and on Ray; only the backends
differ, and outputs are identical.

Failures: a drafter that fails makes its rows decode target-only (requests marked degraded) until it recovers.
A target whose shard dies is rebuilt and the running requests resume on it, prefilled again from their prompt
and the tokens already emitted (greedy output as if undisturbed); any other failure ends them with "error".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from actors.contracts import (DraftBatch, DraftRequest, DrafterBackend, Engine, RoundReport, TargetBackend,
                              TargetResult, TargetUnavailable, split_result)
from actors.grammar import Grammars
from actors.prefill import PrefillChunk, prefill_batch
from actors.policy import UnitPolicy
from actors.requests import (EXACT, ArmSpec, GenerationChunk, GenerationRequest, GenerationResult, SamplingParams,
                             collect)
from actors.rules import decode_batch
from actors.scheduler import RowOutcome, Scheduler, SequenceState
from actors.stats import LoopObserver, NullObserver, RoundRecord, RowRecord
from actors.timing import END_DEFERRED
from actors.verification import asd_batches, asd_outcomes, attach_logprobs, exact_outcomes, first_token

log = logging.getLogger(__name__)

MAX_RESUMES = 2  # times a request is resumed on a rebuilt target before it ends with an error

__all__ = ["Coordinator", "ArmSpec", "EXACT", "GenerationChunk", "GenerationRequest", "GenerationResult",
           "SamplingParams"]


class Coordinator:
    """Runs rounds over every active sequence of one unit."""

    def __init__(self, *, target: TargetBackend, drafter: DrafterBackend | None, policy: UnitPolicy,
                 eos_token_ids: Sequence[int] = (), max_seq_len: int = 2048, max_batch_size: int = 64,
                 unit: str = "local", observer: LoopObserver | None = None, clock=time.time,
                 vocab_size: int | None = None, prefill_chunk_tokens: int | None = None,
                 tokenizer_source: str | None = None):
        self.target, self.drafter, self.policy = target, drafter, policy
        self.eos = frozenset(eos_token_ids)
        self.max_seq_len = max_seq_len
        self.unit = unit
        self.observer = observer or NullObserver()
        self.clock = clock
        grammars = Grammars(tokenizer_source, vocab_size, self.eos) if tokenizer_source and vocab_size else None
        self.scheduler = Scheduler(max_batch_size=max_batch_size, max_seq_len=max_seq_len, vocab_size=vocab_size,
                                   clock=clock, prefill_chunk_tokens=prefill_chunk_tokens, eos=self.eos,
                                   grammars=grammars)
        self._drafter_recovery: asyncio.Future | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle_sync: asyncio.Future | None = None
        self._ending: set[asyncio.Event] = set()  # requests answered whose caches are still being freed

    @classmethod
    def local(cls, engine: Engine, drafter, policy, **kwargs) -> Coordinator:
        """An in-process unit from an `Engine`, a `Drafter` (or None) and a `PolicyCore` (its authority)."""
        from actors.drafting import LocalDrafter
        from actors.policy import LocalPolicy
        from actors.target import LocalTarget

        kwargs.setdefault("max_seq_len", engine.max_seq_len)
        kwargs.setdefault("vocab_size", engine.vocab_size)
        return cls(target=LocalTarget(engine), drafter=None if drafter is None else LocalDrafter(drafter),
                   policy=LocalPolicy(policy, unit=kwargs.get("unit", "local")), **kwargs)

    # --- public API --------------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        seq = self.scheduler.enqueue(request)
        seq.book.enqueued_t = time.perf_counter()
        self._ensure_loop()
        finished = False
        try:
            while True:
                chunk = await seq.queue.get()
                finished = chunk.finish_reason is not None
                yield chunk
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away (disconnect, cancel): free everything
                self.scheduler.aborts.add(request.request_id)
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV caches and ledger; returns once that is done."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return
        self.scheduler.aborts.add(request_id)
        self._wake.set()
        await seq.done.wait()

    def active_requests(self) -> list[str]:
        return self.scheduler.request_ids()

    @property
    def degraded(self) -> bool:
        """True while the drafter is down and rounds decode target-only."""
        return self._drafter_recovery is not None

    def generate_sync(self, request: GenerationRequest) -> GenerationResult:
        return self.generate_many_sync([request])[0]

    def generate_many_sync(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Run requests concurrently (batched into shared rounds) on a private event loop."""

        async def all_of():
            try:
                return await asyncio.gather(*(collect(self.generate(r)) for r in requests))
            finally:
                await self.stop()

        return asyncio.run(all_of())

    async def close(self) -> None:
        """Abort what is running, stop the loop and free the unit's actors (target shards, drafter actor)."""
        for rid in self.active_requests():
            await self.abort(rid)
        await self.stop()
        await self.target.close()
        if self.drafter is not None:
            await self.drafter.close()

    def healthy(self) -> bool:
        """The native unit rebuilds a failed target itself: it stays healthy."""
        return True

    async def stats(self) -> dict:
        """What the unit holds: active requests, sequences cached by its target and drafter, open ledgers."""
        drafter = getattr(self.drafter, "handle", None)  # a model drafter's actor
        for ending in list(self._ending):  # answered requests: their caches are freed after the answer
            await ending.wait()
        return {
            "unit": self.unit,
            "active_requests": self.active_requests(),
            "target_sequences": list(await self.target.active_ids()),
            "drafter_sequences": list(await drafter.active_ids.remote()) if drafter is not None else [],
            "open_ledgers": self.policy.open_ledgers(),
        }

    async def stop(self) -> None:
        if self._idle_sync is not None and not self._idle_sync.done():  # the loop ends: let the last report out
            await asyncio.wait([self._idle_sync], timeout=1.0)
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._task = None

    # --- the loop ----------------------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop, self._wake = loop, asyncio.Event()
            self._task = loop.create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        while True:
            if not self.scheduler.busy():
                self._wake.clear()
                self._sync_when_idle()
                await self._wake.wait()
            try:
                await self._apply_aborts()
                started = len(self.scheduler.active)
                chunks = await self._admit()
                if len(self.scheduler.active) > started:  # first tokens out before the next forward, which a
                    await asyncio.sleep(0)  # local target runs without suspending (issue 23: it held them a round)
                if self.scheduler.active:
                    await self._round(chunks)
                await asyncio.sleep(0)  # local backends never suspend: let consumers and aborts run
            except asyncio.CancelledError as exc:
                cancelling = getattr(asyncio.current_task(), "cancelling", None)  # Python >= 3.11
                if cancelling is None or cancelling():
                    raise
                log.exception("unit %s: a part of the round was cancelled", self.unit)  # not the loop: fail, not hang
                await self._fail_all(exc)
            except TargetUnavailable as exc:  # a shard died: rebuild the target, resume what was running
                log.warning("unit %s: target lost (%s); rebuilding and resuming its requests", self.unit, exc)
                await self._resume_all(exc)
            except Exception as exc:  # a failed part of the unit fails its in-flight requests, never hangs them
                log.exception("unit %s: round failed", self.unit)
                await self._fail_all(exc)

    def _sync_when_idle(self) -> None:
        """Going idle: what the last rounds observed and closed reaches the authority, also when a report is still
        in flight (then it goes once that one is answered), without holding up the next request."""
        if self._idle_sync is None or self._idle_sync.done():
            self._idle_sync = asyncio.ensure_future(self.policy.synced())

    async def _apply_aborts(self) -> None:
        waiting, active = self.scheduler.take_aborted()
        for seq in waiting:
            await self._finish(seq, "abort", release=False)
        for seq in active:
            await self._finish(seq, "abort")

    async def _admit(self) -> list[PrefillChunk]:
        """Admit, and plan this step's prompt chunks (`actors.prefill`). While streams decode, the chunks are
        returned to ride in the round's forward; otherwise they are fed here."""
        for seq in self.scheduler.admit():
            seq.book.admitted_t = time.perf_counter()
            seq.book.ledger = self.policy.open_request(seq.rid, seq.request.arm.name, seq.book.budget)
        chunks = self.scheduler.prefill_chunks()
        if not chunks or self.scheduler.active:
            return chunks
        await self._prefilled(chunks, await self.target.step(prefill_batch(chunks)))
        return []

    async def _prefilled(self, chunks: list[PrefillChunk], result: TargetResult) -> None:
        """Record fed chunks; a prompt now cached gets its γ plan and emits its first token (row b of `result`
        is chunk b)."""
        new = self.scheduler.prefilled(chunks)
        if not new:
            return
        keys = [s.key() for s in new]
        self.scheduler.set_plan(keys, self.policy.plan(keys, len(self.scheduler.active)))
        now, now_t = self.clock(), time.perf_counter()
        for b, seq in ((b, c.seq) for b, c in enumerate(chunks) if c.last and not c.seq.output):
            seq.book.first_token_s, seq.book.prefilled_t = now, now_t
            await self._commit(seq, first_token(seq, result, b), drafted=0, is_round=False)

    async def _round(self, chunks: list[PrefillChunk]) -> None:
        started, t0 = self.clock(), time.perf_counter()
        rows = list(self.scheduler.active)
        free = self.drafter is not None and self.drafter.free_drafts
        gammas = self.scheduler.gammas(rows, can_draft=self.drafter is not None, free_drafts=free)
        t_draft = time.perf_counter()
        draft, draft_s = await self._draft(rows, gammas)  # 2. draft
        t_batch = time.perf_counter()
        batch, draft = decode_batch(rows, draft)  # drafts cut where a row's rules or grammar refuse them
        lens = draft.draft_lens.tolist()
        if chunks:  # prompt chunks ride in the same forward, after the decode rows
            batch = prefill_batch(chunks, batch)
        t_score = time.perf_counter()
        result = await self.target.step(batch)  # 3. score
        score_s = time.perf_counter() - t_score
        if chunks:
            result, prompts = split_result(result, len(rows))
        t_verify = time.perf_counter()
        outcomes = exact_outcomes(rows, batch, result)  # 4. verify: exact rows here
        report = RoundReport(
            rows=tuple((s.key(), lens[b], o.accepted) for b, (s, o) in enumerate(zip(rows, outcomes)) if o),
            batch_size=len(rows), draft_step_s=draft_s / max(1, max(lens)), score_s=result.forward_s or score_s,
            score_tokens=max(lens) + 1, drafts=tuple(draft.row_confidence(b) for b, o in enumerate(outcomes) if o),
            prompt_tokens=sum(c.end - c.start for c in chunks),
        )
        self.policy.observe_round(report)  # 6. stats (the ASD rows' acceptance is observed where they verify)
        for members, asd in asd_batches(rows, batch, result):  # 4. ASD rows, against the unit's ledger leases
            for b, outcome in zip(members, asd_outcomes(self.policy.verify_asd(asd))):
                outcomes[b] = outcome
        attach_logprobs(rows, outcomes, result)
        t_plan = time.perf_counter()
        keys = [s.key() for s in rows]
        self.scheduler.set_plan(keys, self.policy.plan(keys, len(rows)))
        t_flush = time.perf_counter()
        self.policy.flush()
        t_end = time.perf_counter()
        verify_s = t_end - t_verify
        # each row waited for the whole round: its parts count for every row (the batch's build is score's)
        parts = ((t_draft - t0) + (t_flush - t_plan), t_batch - t_draft, t_verify - t_batch,
                 (t_plan - t_verify) + (t_end - t_flush))
        for seq in rows:
            seq.book.add_round(*parts)
        records = tuple(RowRecord(s.rid, s.request.arm.name, lens[b], o.accepted, o.relaxed, o.regret)
                        for b, (s, o) in enumerate(zip(rows, outcomes)))
        # the round is reported before its requests finish, so a request's last round precedes its record
        self.observer.on_round(RoundRecord(self.unit, len(rows), started, draft_s, score_s, verify_s,
                                           time.perf_counter() - t0, records, result.forward_s))
        for seq, outcome, drafted in zip(rows, outcomes, lens):  # 5. commit
            await self._commit(seq, outcome, drafted=drafted)
        if chunks:
            await self._prefilled(chunks, prompts)

    # --- draft -------------------------------------------------------------------------------------------
    async def _draft(self, rows: list[SequenceState], gammas: list[int]) -> tuple[DraftBatch, float]:
        asks = [(i, DraftRequest(s.rid, s.tokens, g, s.request.params.spec(), s.penalties,
                                     len(s.request.prompt_ids)))
                for i, (s, g) in enumerate(zip(rows, gammas)) if g > 0]
        if asks and not self._drafter_ready():
            for i, _ in asks:
                rows[i].book.degraded = True
            asks = []
        if not asks:
            return DraftBatch.empty(len(rows)), 0.0
        start = time.perf_counter()
        try:
            sub = await self.drafter.propose([r for _, r in asks])
        except Exception as exc:  # drafter died: decode target-only (same greedy output), mark degraded
            log.warning("unit %s: drafter failed (%s); target-only until it is back", self.unit, exc)
            self._drafter_recovery = asyncio.ensure_future(self.drafter.recover())
            for i, _ in asks:
                rows[i].book.degraded = True
            return DraftBatch.empty(len(rows)), time.perf_counter() - start
        return sub.scatter([i for i, _ in asks], len(rows)), time.perf_counter() - start

    def _drafter_ready(self) -> bool:
        """False while a failed drafter is being restarted; rounds meanwhile decode target-only."""
        recovery = self._drafter_recovery
        if recovery is None:
            return True
        if not recovery.done():
            return False
        self._drafter_recovery = None
        # still down, or its loop ended before it did (a private loop of `generate_sync`): try again next round
        if recovery.cancelled() or recovery.exception() is not None:
            log.warning("unit %s: drafter recovery failed: %s", self.unit,
                        "cancelled" if recovery.cancelled() else recovery.exception())
            self._drafter_recovery = asyncio.ensure_future(self.drafter.recover())
            return False
        log.info("unit %s: drafter is back", self.unit)
        return True

    # --- commit and finish -------------------------------------------------------------------------------
    async def _commit(self, seq: SequenceState, outcome: RowOutcome, *, drafted: int, is_round: bool = True) -> None:
        """Append a round's emitted tokens (up to EOS / stop ids / max_tokens / context) and stream them."""
        out, reason = seq.commit(outcome, drafted=drafted, eos=self.eos, max_seq_len=self.max_seq_len,
                                 is_round=is_round)
        if out:
            seq.book.last_token_t = time.perf_counter()
            seq.queue.put_nowait(GenerationChunk(out, logprobs=outcome.logprobs[: len(out)] if outcome.logprobs else None))
        if reason is not None:
            await self._finish(seq, reason)

    async def _finish(self, seq: SequenceState, reason: str, *, release: bool = True, error: str | None = None) -> None:
        """End a request: its final message first, then (off the critical path) free its caches and report its
        record; `seq.done` is set once all of it is done (`abort` and `stats` wait for that)."""
        self.scheduler.remove(seq)
        self.policy.close_request(seq.rid)
        record = seq.record(self.unit, reason, self.clock())
        seq.queue.put_nowait(GenerationChunk([], finish_reason=reason, record=record, error=error))
        self._ending.add(seq.done)
        deferred = time.perf_counter()
        try:
            if release:
                await self._release(seq.rid)
            self.observer.on_request(
                replace(record, timing_s={**record.timing_s, END_DEFERRED: time.perf_counter() - deferred}))
        finally:
            seq.done.set()
            self._ending.discard(seq.done)

    async def _release(self, seq_id: str) -> None:
        try:
            await self.target.release([seq_id])
        except Exception:
            log.exception("unit %s: target release failed", self.unit)
        if self.drafter is not None:
            try:
                await self.drafter.release(seq_id)
            except Exception:
                log.warning("unit %s: drafter release of %s failed", self.unit, seq_id)

    async def _resume_all(self, exc: Exception) -> None:
        """Rebuild the target and prefill every running sequence again from its prompt and the tokens it has
        emitted (its book and ledger lease are the unit's, so they carry on); a sequence resumed more than
        `MAX_RESUMES` times, or a target that cannot be rebuilt, ends its requests with an error instead."""
        try:
            await self.target.rebuild()
        except Exception:
            log.exception("unit %s: target rebuild failed", self.unit)
            await self._fail_all(exc, rebuild=False)
            return
        for seq in self.scheduler.running():
            seq.book.resumes += 1
            if seq.book.resumes > MAX_RESUMES:
                await self._finish(seq, "error", error=f"unit {self.unit}: target lost {seq.book.resumes} times")
            else:
                self.scheduler.resume(seq)

    async def _fail_all(self, exc: Exception, *, rebuild: bool = True) -> None:
        message = f"unit {self.unit} failed: {type(exc).__name__}: {exc}"
        for seq in self.scheduler.running():
            await self._finish(seq, "error", error=message)
        if not rebuild:
            return
        try:
            await self.target.rebuild()
        except Exception:
            log.exception("unit %s: target rebuild failed", self.unit)

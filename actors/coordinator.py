"""The speculative loop of one unit, batched over all its active sequences.

A round, for every active sequence at once (DESIGN.md, request path):
1. γ per row from the plan the policy returned last round (refreshed without blocking);
2. the drafter proposes up to γ tokens per row (rows it has nothing for decode plainly);
3. the target crops last round's rejected KV, feeds each row's pending token + drafts, and returns compact
   scores (greedy, ASD) or samples exactly in place (sampling);
4. verify: `verify_greedy_scores` here; ASD rows are verified and charged by the policy actor (`settle`);
5. commit: emitted tokens go to each request's queue; the next round's crop rolls the caches back;
6. stats: the round's acceptance and timings go to the policy (in the same `settle` call) and the observer.

State of a sequence: `tokens` = prompt + emitted output; the target's KV holds `tokens[:-1]`, the last emitted
token is *pending* and is fed first next round. The same loop runs in-process (`Coordinator.local`) and on Ray
(`actors.unit.build_unit`); only the backends differ, and outputs are identical.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

import torch

from actors.drafters import DraftBatch, DraftRequest
from actors.policy_actor import ASDBatch, RoundReport, RowKey
from actors.requests import EXACT, ArmSpec, GenerationChunk, GenerationRequest, GenerationResult, SamplingParams
from actors.stats import LoopObserver, NullObserver, RequestRecord, RoundRecord, RowRecord
from actors.target import NO_CROP, TargetBatch
from policies import PAD_TOKEN_ID, Verdict
from policies.exact import verify_greedy_scores
from policies.scores import TargetScores

log = logging.getLogger(__name__)

__all__ = ["Coordinator", "ArmSpec", "EXACT", "GenerationChunk", "GenerationRequest", "GenerationResult",
           "SamplingParams"]


@dataclass
class _Sequence:
    request: GenerationRequest
    queue: asyncio.Queue
    tokens: list[int]
    started_s: float
    crop: int = NO_CROP  # target KV length to keep before the next feed
    output: list[int] = field(default_factory=list)
    first_token_s: float | None = None
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    gammas: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    relaxed: int = 0
    degraded: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def asd(self) -> bool:
        return self.request.arm.verification == "asd" and self.request.params.temperature == 0.0

    def key(self) -> RowKey:
        return RowKey(self.rid, self.request.arm.name, self.request.params.seed is not None
                      and self.request.params.temperature > 0)


async def _resolve(value):
    return await value if inspect.isawaitable(value) else value


class Coordinator:
    """Runs rounds over every active sequence of one unit. Backends may be local objects or Ray adapters."""

    def __init__(self, *, target, drafter, policy, eos_token_ids: Sequence[int] = (), max_seq_len: int = 2048,
                 max_batch_size: int = 64, unit: str = "local", observer: LoopObserver | None = None,
                 clock=time.time, vocab_size: int | None = None):
        self.target = target
        self.drafter = drafter
        self.policy = policy
        self.eos = frozenset(eos_token_ids)
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.vocab_size = vocab_size
        self.unit = unit
        self.observer = observer or NullObserver()
        self.clock = clock
        self._drafter_recovery: asyncio.Future | None = None
        self._waiting: list[_Sequence] = []
        self._active: list[_Sequence] = []
        self._aborts: set[str] = set()
        self._plan: dict[str, int] = {}
        self._pending_settle = None  # awaitable plan of an exact-only round
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def local(cls, engine, drafter, policy, **kwargs) -> "Coordinator":
        """An in-process unit: an `Engine`, a drafter object (or None) and a `PolicyCore`."""
        from actors.target import LocalTarget

        kwargs.setdefault("max_seq_len", getattr(engine, "max_seq_len", 2048))
        kwargs.setdefault("vocab_size", getattr(engine, "vocab_size", None))
        return cls(target=LocalTarget(engine), drafter=drafter, policy=policy, **kwargs)

    # --- public API --------------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        seq = self._enqueue(request)
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
                self._aborts.add(request.request_id)
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV caches and ledger; returns once that is done."""
        seq = next((s for s in self._waiting + self._active if s.rid == request_id), None)
        if seq is None:
            return
        self._aborts.add(request_id)
        self._wake.set()
        await seq.done.wait()

    def active_requests(self) -> list[str]:
        return [s.rid for s in self._waiting + self._active]

    def generate_sync(self, request: GenerationRequest) -> GenerationResult:
        return self.generate_many_sync([request])[0]

    def generate_many_sync(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Run requests concurrently (batched into shared rounds) on a private event loop."""

        async def one(req):
            tokens, last = [], None
            async for chunk in self.generate(req):
                tokens.extend(chunk.token_ids)
                last = chunk
            return GenerationResult(tokens, last.finish_reason, last.record)

        async def all_of():
            try:
                return await asyncio.gather(*(one(r) for r in requests))
            finally:
                await self.stop()

        return asyncio.run(all_of())

    async def close(self) -> None:
        """Abort what is running, stop the loop and free the unit's actors (target shards, drafter actor)."""
        for rid in self.active_requests():
            await self.abort(rid)
        await self.stop()
        for part in (self.target, self.drafter):
            for name in ("close", "kill"):
                fn = getattr(part, name, None)
                if fn is not None:
                    await _resolve(fn())
                    break

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._task = None

    # --- the loop ----------------------------------------------------------------------------------------
    def _enqueue(self, request: GenerationRequest) -> _Sequence:
        if not request.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self.vocab_size is not None and (min(request.prompt_ids) < 0 or max(request.prompt_ids) >= self.vocab_size):
            raise ValueError(f"prompt_ids must lie in [0, {self.vocab_size})")
        if len(request.prompt_ids) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(request.prompt_ids)} tokens leaves no room in max_seq_len {self.max_seq_len}")
        if any(s.rid == request.request_id for s in self._waiting + self._active):
            raise ValueError(f"request_id {request.request_id!r} is already running")
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop, self._wake = loop, asyncio.Event()
            self._task = loop.create_task(self._run())
        seq = _Sequence(request, asyncio.Queue(), list(request.prompt_ids), self.clock())
        self._waiting.append(seq)
        self._wake.set()
        return seq

    async def _run(self) -> None:
        while True:
            if not (self._waiting or self._active or self._aborts):
                self._wake.clear()
                await self._wake.wait()
            try:
                await self._apply_aborts()
                await self._admit()
                if self._active:
                    await self._round()
                await asyncio.sleep(0)  # local backends never suspend: let consumers and aborts run
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a failed part of the unit fails its in-flight requests, never hangs them
                log.exception("unit %s: round failed", self.unit)
                await self._fail_all(exc)

    async def _apply_aborts(self) -> None:
        if not self._aborts:
            return
        for seq in [s for s in self._waiting if s.rid in self._aborts]:
            self._waiting.remove(seq)
            await self._finish(seq, "abort", release=False)
        for seq in [s for s in self._active if s.rid in self._aborts]:
            await self._finish(seq, "abort")
        self._aborts.clear()

    async def _admit(self) -> None:
        room = self.max_batch_size - len(self._active)
        if room <= 0 or not self._waiting:
            return
        new, self._waiting = self._waiting[:room], self._waiting[room:]
        for seq in new:
            budget = seq.request.arm.asd.budget if seq.asd else None
            await _resolve(self.policy.open_request(seq.rid, budget))
        batch = TargetBatch(
            seq_ids=[s.rid for s in new], crops=[NO_CROP] * len(new), tokens=[s.tokens[:] for s in new],
            draft_ids=torch.full((len(new), 1), PAD_TOKEN_ID, dtype=torch.long),
            draft_lens=torch.zeros(len(new), dtype=torch.long),
            sampling=[s.request.params.spec() for s in new], prefill=True,
        )
        self._active.extend(new)
        result = await _resolve(self.target.step(batch))
        plan = await _resolve(self.policy.plan([s.key() for s in new], len(self._active)))
        now = self.clock()
        for b, seq in enumerate(new):
            token = result.sampled_tokens[b][0] if b in result.sampled_tokens else int(result.scores.argmax_ids[b, 0])
            seq.first_token_s = now
            self._plan[seq.rid] = plan[b]
            await self._commit(seq, [token], accepted=0, drafted=0, is_round=False)

    def _gammas(self, rows: list[_Sequence]) -> list[int]:
        """γ per row: the policy's plan, within what the row may still emit.

        A batched forward is as wide as its widest row, so positions up to that width cost the target nothing
        extra. With a drafter whose drafts are free (prompt lookup), every speculating row drafts up to the
        round's width: the padding is spent on tokens that may be accepted instead of on nothing.
        """
        def limit(seq: _Sequence) -> int:
            if not seq.request.speculate or self.drafter is None:
                return 0
            left = seq.request.params.max_tokens - len(seq.output)
            room = self.max_seq_len - len(seq.tokens)
            return max(0, min(left - 1, room - 1))

        limits = [limit(s) for s in rows]
        gammas = [min(self._plan.get(s.rid, 0), cap) for s, cap in zip(rows, limits)]
        if getattr(self.drafter, "free_drafts", False):
            width = max(gammas, default=0)
            gammas = [min(width, cap) for cap in limits]
        return gammas

    async def _draft(self, rows: list[_Sequence], gammas: list[int]) -> tuple[DraftBatch, float]:
        asks = [(i, DraftRequest(s.rid, s.tokens, g, s.request.params.spec()))
                for i, (s, g) in enumerate(zip(rows, gammas)) if g > 0]
        if asks and not self._drafter_ready():
            for i, _ in asks:
                rows[i].degraded = True
            asks = []
        if not asks:
            return DraftBatch.empty(len(rows)), 0.0
        start = time.perf_counter()
        try:
            sub = await _resolve(self.drafter.propose([r for _, r in asks]))
        except Exception as exc:  # drafter died: decode target-only (same greedy output), mark degraded
            log.warning("unit %s: drafter failed (%s); target-only until it is back", self.unit, exc)
            recover = getattr(self.drafter, "recover", None)
            self._drafter_recovery = asyncio.ensure_future(recover()) if recover else None
            for i, _ in asks:
                rows[i].degraded = True
            return DraftBatch.empty(len(rows)), time.perf_counter() - start
        elapsed = time.perf_counter() - start
        width = max(1, sub.draft_ids.shape[1])
        ids = torch.full((len(rows), width), PAD_TOKEN_ID, dtype=torch.long)  # [B, Kmax]
        lens = torch.zeros(len(rows), dtype=torch.long)  # [B]
        probs = None
        if sub.draft_probs is not None:
            probs = torch.zeros(len(rows), width, sub.draft_probs.shape[-1])  # [B, Kmax, V]
        for j, (i, _) in enumerate(asks):
            ids[i, : sub.draft_ids.shape[1]] = sub.draft_ids[j]
            lens[i] = sub.draft_lens[j]
            if probs is not None:
                probs[i, : sub.draft_ids.shape[1]] = sub.draft_probs[j]
        return DraftBatch(ids, lens, probs), elapsed

    @property
    def degraded(self) -> bool:
        """True while the drafter is down and rounds decode target-only."""
        return self._drafter_recovery is not None

    def _drafter_ready(self) -> bool:
        """False while a failed drafter is being restarted; rounds meanwhile decode target-only."""
        recovery = self._drafter_recovery
        if recovery is None:
            return True
        if not recovery.done():
            return False
        self._drafter_recovery = None
        if recovery.exception() is not None:  # still down: try again next round
            log.warning("unit %s: drafter recovery failed: %s", self.unit, recovery.exception())
            self._drafter_recovery = asyncio.ensure_future(self.drafter.recover())
            return False
        log.info("unit %s: drafter is back", self.unit)
        return True

    async def _round(self) -> None:
        started, t0 = self.clock(), time.perf_counter()
        if self._pending_settle is not None:  # last exact-only round's plan, computed while we went on
            (keys, pending), self._pending_settle = self._pending_settle, None
            _, plan = await _resolve(pending)
            self._update_plan(keys, plan)
        rows = list(self._active)
        gammas = self._gammas(rows)
        draft, draft_s = await self._draft(rows, gammas)
        lens = draft.draft_lens.tolist()
        batch = TargetBatch(
            seq_ids=[s.rid for s in rows], crops=[s.crop for s in rows],
            tokens=[[s.tokens[-1]] + draft.draft_ids[b, : lens[b]].tolist() for b, s in enumerate(rows)],
            draft_ids=draft.draft_ids, draft_lens=draft.draft_lens,
            sampling=[s.request.params.spec() for s in rows], draft_probs=draft.draft_probs,
        )
        t_score = time.perf_counter()
        result = await _resolve(self.target.step(batch))
        score_s = time.perf_counter() - t_score
        t_verify = time.perf_counter()
        emitted, accepted = self._verify_local(rows, batch, result)
        relaxed: dict[int, int] = {}
        regret: dict[int, float] = {}
        asd_rows = [b for b, s in enumerate(rows) if s.asd]
        report = RoundReport(
            rows=tuple((s.key(), lens[b], accepted[b]) for b, s in enumerate(rows) if not s.asd),
            batch_size=len(rows), draft_step_s=draft_s / max(1, max(lens)), score_s=result.forward_s or score_s,
            score_tokens=max(lens) + 1,
        )
        survivors = [s.key() for s in rows]
        if asd_rows:
            verdict = await self._settle_asd(rows, asd_rows, batch, result, report, survivors)
            for j, b in enumerate(asd_rows):
                n = int(verdict.num_accepted[j])
                emitted[b] = verdict.tokens[j, : n + 1].tolist()
                accepted[b], relaxed[b] = n, int(verdict.num_relaxed[j])
                regret[b] = float(verdict.regret[j])
        else:
            self._pending_settle = (survivors, self.policy.settle(None, report, survivors, len(rows)))
        verify_s = time.perf_counter() - t_verify
        records = tuple(RowRecord(s.rid, s.request.arm.name, lens[b], accepted[b], relaxed.get(b, 0),
                                  regret.get(b, 0.0)) for b, s in enumerate(rows))
        # the round is reported before its requests finish, so a request's last round precedes its record
        self.observer.on_round(RoundRecord(self.unit, len(rows), started, draft_s, score_s, verify_s,
                                           time.perf_counter() - t0, records))
        for b, seq in enumerate(rows):
            seq.relaxed += relaxed.get(b, 0)
            await self._commit(seq, emitted[b], accepted=accepted[b], drafted=lens[b])

    async def _settle_asd(self, rows, asd_rows, batch, result, report, survivors):
        """ASD rows are charged in the policy actor; one call per arm present (usually one)."""
        by_arm: dict[str, list[int]] = {}
        for b in asd_rows:
            by_arm.setdefault(rows[b].request.arm.name, []).append(b)
        tokens, accepted, relaxed, regret = [], [], [], []
        order = []
        first = True
        for arm_rows in by_arm.values():
            idx = torch.tensor(arm_rows)
            asd = ASDBatch(tuple(rows[b].rid for b in arm_rows), batch.draft_ids[idx], batch.draft_lens[idx],
                           _take(result.scores, idx), rows[arm_rows[0]].request.arm.asd,
                           rows[arm_rows[0]].request.arm.name)
            verdict, plan = await _resolve(self.policy.settle(asd, report if first else None, survivors, len(rows)))
            if first:
                self._update_plan(survivors, plan)
                first = False
            order.extend(arm_rows)
            width = batch.draft_ids.shape[1] + 1
            tokens.append(torch.nn.functional.pad(verdict.tokens, (0, width - verdict.tokens.shape[1]),
                                                  value=PAD_TOKEN_ID))
            accepted.append(verdict.num_accepted)
            relaxed.append(verdict.num_relaxed)
            regret.append(verdict.regret)
        pos = {b: j for j, b in enumerate(order)}
        perm = torch.tensor([pos[b] for b in asd_rows])  # back to asd_rows order
        return Verdict(torch.cat(tokens)[perm], torch.cat(accepted)[perm], torch.cat(relaxed)[perm],
                       torch.cat(regret)[perm])

    def _update_plan(self, keys: list[RowKey], plan: list[int]) -> None:
        live = {s.rid for s in self._active}
        self._plan.update((k.request_id, g) for k, g in zip(keys, plan) if k.request_id in live)

    def _verify_local(self, rows, batch, result):
        """Exact verification of greedy rows (vectorised) and pick-up of rows sampled in the target."""
        emitted: dict[int, list[int]] = {}
        accepted: dict[int, int] = {}
        greedy = [b for b, s in enumerate(rows) if not s.asd and b not in result.sampled_tokens]
        if greedy:
            idx = torch.tensor(greedy)
            verdict = verify_greedy_scores(batch.draft_ids[idx], _take(result.scores, idx),
                                           draft_lens=batch.draft_lens[idx])
            for j, (b, toks) in enumerate(zip(greedy, verdict.emitted())):
                emitted[b], accepted[b] = toks, int(verdict.num_accepted[j])
        for b, toks in result.sampled_tokens.items():
            emitted[b], accepted[b] = toks, result.sampled_accepted[b]
        return emitted, accepted

    async def _commit(self, seq: _Sequence, tokens: list[int], *, accepted: int, drafted: int,
                      is_round: bool = True) -> None:
        """Append a round's emitted tokens, stop at EOS / stop ids / max_tokens / context, stream them."""
        params = seq.request.params
        base = len(seq.tokens)
        out, reason = [], None
        for tok in tokens:
            if tok in params.stop_token_ids or (tok in self.eos and not params.ignore_eos):
                reason = "stop"
                break
            out.append(tok)
            if len(seq.output) + len(out) >= params.max_tokens or base + len(out) >= self.max_seq_len:
                reason = "length"
                break
        seq.tokens.extend(out)
        seq.output.extend(out)
        seq.crop = base + accepted  # KV keeps the old pending token and the accepted drafts
        if is_round:
            seq.rounds += 1
            seq.gammas.append(drafted)
            seq.draft_tokens += drafted
            seq.accepted_tokens += accepted
            seq.accepted_per_position.extend([0] * (accepted - len(seq.accepted_per_position)))
            for k in range(accepted):
                seq.accepted_per_position[k] += 1
        if out:
            seq.queue.put_nowait(GenerationChunk(out))
        if reason is not None:
            await self._finish(seq, reason)

    async def _finish(self, seq: _Sequence, reason: str, *, release: bool = True, error: str | None = None) -> None:
        if seq in self._active:
            self._active.remove(seq)
        self._plan.pop(seq.rid, None)
        summary = None
        try:
            summary = await _resolve(self.policy.close_request(seq.rid))
        except Exception:  # the policy actor restarted: its ledger is gone already
            log.exception("unit %s: closing ledger of %s failed", self.unit, seq.rid)
        if release:
            await self._release([seq.rid])
        record = self._record(seq, reason, summary)
        self.observer.on_request(record)
        seq.queue.put_nowait(GenerationChunk([], finish_reason=reason, record=record, error=error))
        seq.done.set()

    async def _release(self, seq_ids: list[str]) -> None:
        try:
            await _resolve(self.target.release(seq_ids))
        except Exception:
            log.exception("unit %s: target release failed", self.unit)
        if self.drafter is not None:
            for seq_id in seq_ids:
                try:
                    await _resolve(self.drafter.release(seq_id))
                except Exception:
                    log.warning("unit %s: drafter release of %s failed", self.unit, seq_id)

    async def _fail_all(self, exc: Exception) -> None:
        message = f"unit {self.unit} failed: {type(exc).__name__}: {exc}"
        self._pending_settle = None
        for seq in list(self._active):
            await self._finish(seq, "error", error=message)
        rebuild = getattr(self.target, "rebuild", None)
        if rebuild is not None:
            try:
                await _resolve(rebuild())
            except Exception:
                log.exception("unit %s: target rebuild failed", self.unit)

    def _record(self, seq: _Sequence, reason: str, summary: dict | None) -> RequestRecord:
        req = seq.request
        return RequestRecord(
            request_id=seq.rid, arm=req.arm.name, unit=self.unit, prompt_tokens=len(req.prompt_ids),
            output_tokens=len(seq.output), rounds=seq.rounds, draft_tokens=seq.draft_tokens,
            accepted_tokens=seq.accepted_tokens, gammas=tuple(seq.gammas), started_s=seq.started_s,
            first_token_s=seq.first_token_s, finished_s=self.clock(), finish_reason=reason, degraded=seq.degraded,
            verification=req.arm.verification,
            regret_spent=summary["spent"] if summary else None,
            regret_budget=summary["budget"] if summary else (req.arm.asd.budget if req.arm.asd else None),
            relaxed_tokens=seq.relaxed if req.arm.verification == "asd" else None,
            ledger_exhausted=bool(summary and summary.get("exhausted")),
            accepted_per_position=tuple(seq.accepted_per_position),
        )


def _take(scores: TargetScores, idx: torch.Tensor) -> TargetScores:
    return TargetScores(scores.argmax_ids[idx], scores.argmax_logits[idx], scores.draft_logits[idx])

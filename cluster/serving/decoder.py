"""The decoder deployment: one Serve replica is one **unit** (`actors.unit.Unit`, on either engine).

The ingress sends a `DecodeJob` through a streaming Serve handle; the replica runs it on its unit and streams
back `UnitStarted` (accepted), `TextDelta`s (committed tokens and the text safe to send; streaming jobs only)
and one `Finished` (finish reason, output ids, `usage.speculative`). Stop strings end a request here, next to
the unit, which aborts the sequence and still reports usage; a cancelled stream frees the same way. With
`serving.stream_interval_ms` a stream's deltas after its first are merged (`coalesced`: docs/architecture.md,
"Stream batching").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from actors.requests import ArmSpec, GenerationRequest, SamplingParams, TokenLogprob
from cluster.config import SpecServeConfig, parse_config
from cluster.serving.text import TextAssembler

logger = logging.getLogger(__name__)

FINAL_CHUNK_TIMEOUT_S = 30.0  # after an abort, how long to wait for the coordinator's final chunk (the record)


@dataclass(frozen=True)
class DecodeJob:
    """One request for a unit. `prompt_ids` are validated by the ingress (non-empty, within the context)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    arm: ArmSpec
    stop: tuple[str, ...] = ()  # text-level stop strings
    speculate: bool = True  # False: target-only decoding
    stream: bool = True  # False: no TextDelta events; `Finished.text` carries the whole text (one message)


@dataclass(frozen=True)
class UnitStarted:
    unit: str
    started_s: float = 0.0  # the unit's wall clock when it took the request (the ingress's `ingress_to_unit`)


@dataclass(frozen=True)
class TextDelta:
    text: str  # may be empty while text is held back (split characters, a possible stop string)
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when the job's params ask for them


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    token_ids: tuple[int, ...]  # every output token (for usage and the quality audit)
    text: str  # the final text delta (held-back text released at the end)
    speculative: dict[str, Any] | None  # RequestRecord.speculative_usage(), its `timing_s` the unit's hops
    regret_spent: float | None
    unit: str
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # a non-streaming job's, one per output token, when asked
    refused: bool = False  # the unit refused the job before it ran (a ValueError naming the field): a 4xx


def policy_actor_name(app_name: str) -> str:
    return f"{app_name}-policy"


def policy_kwargs(config: SpecServeConfig) -> dict[str, Any]:
    """Arguments of `actors.policy.PolicyCore` (and so of the policy actor) from the config's γ settings."""
    gamma = config.gamma
    return dict(
        gamma_max=gamma.gamma_max,
        gamma_min=gamma.gamma_min,
        prior_alpha=gamma.prior_alpha,
        draft_cost=gamma.draft_cost,
        fixed_gamma=gamma.fixed if gamma.mode == "fixed" else None,
        batch_plan=gamma.batch_plan,
    )


def unit_setup(config: SpecServeConfig) -> dict[str, Any]:
    """The unit's setups from the config: the target's, the drafter's and the threads per actor."""
    from actors.drafting import DrafterSetup
    from actors.setup import TargetSetup

    target, drafter = config.target, config.drafter
    return dict(
        target=TargetSetup(
            source=target.source, engine=target.engine, engine_kwargs=dict(target.engine_kwargs),
            dtype=target.dtype, device=target.device, tp_size=target.tensor_parallel_size,
            max_slots=target.max_batch_size, max_seq_len=target.max_seq_len,
            prefill_chunk_tokens=target.prefill_chunk_tokens,
            resources=target.resources.model_dump(), placement_strategy=target.placement_strategy,
            in_replica=target.in_replica,
        ),
        drafter=DrafterSetup(
            kind=drafter.kind, source=drafter.source, dtype=drafter.dtype, device=drafter.device,
            prompt_lookup_min=drafter.prompt_lookup_min, prompt_lookup_max=drafter.prompt_lookup_max,
            suffix_max_depth=drafter.suffix_max_depth, suffix_min_confidence=drafter.suffix_min_confidence,
            suffix_cache_tokens=drafter.suffix_cache_tokens, resources=drafter.resources.model_dump(),
            engine=drafter.engine, engine_kwargs=dict(drafter.engine_kwargs), method=drafter.method,
        ),
        torch_threads=config.unit.torch_threads,
    )


def config_unit(config: SpecServeConfig, unit: str, observer=None, *, app_name: str | None = None):
    """The config's unit on its engine, started (blocking). With `app_name` it runs on Ray and reports to the
    app's policy actor; without, it is built in this process with its own authority (CLI `generate`, `eval`)."""
    from actors.unit import make_unit

    return make_unit(unit=unit, policy=policy_kwargs(config), observer=observer, on_ray=app_name is not None,
                     policy_actor=policy_actor_name(app_name) if app_name is not None else None,
                     **unit_setup(config))


def local_unit(config: SpecServeConfig, unit: str = "local", observer=None):
    """The config's unit in this process (no Ray)."""
    return config_unit(config, unit, observer)


async def decode_events(coordinator, job: DecodeJob, decode, unit: str) -> AsyncIterator[TextDelta | Finished]:
    """Run `job` on `coordinator`, turning token chunks into text deltas; ends with one `Finished`.

    `decode(ids) -> str` is the tokenizer's decode. On a stop string the sequence is aborted (KV caches and
    ledger freed) and reported as finish reason "stop". If the consumer goes away (cancellation), closing the
    coordinator's stream frees the sequence. `usage.speculative.timing_s` gets the unit's hops (`actors.timing`):
    the engine's, `first_token`, and in `detokenize_sse` the detokenization after the last token (an earlier
    chunk's runs while the next round does, or inside the loop's `decode` when the engine shares this process).
    """
    started = time.perf_counter()
    detokenize_s, first_t = 0.0, None
    assembler = TextAssembler(decode, list(job.prompt_ids), job.stop)
    held: list[str] = []  # a non-streaming job's text, sent once with `Finished`
    request = GenerationRequest(job.request_id, list(job.prompt_ids), job.params, job.arm, speculate=job.speculate)
    stream = coordinator.generate(request)
    tokens: list[int] = []
    logprobs: list[TokenLogprob] | None = [] if job.params.logprobs is not None else None
    last, refused = None, None
    try:
        async for chunk in stream:
            if chunk.token_ids and not assembler.stopped:
                t = time.perf_counter()
                first_t = first_t or t
                tokens.extend(chunk.token_ids)
                entries = _entries(chunk, logprobs is not None)
                text = assembler.push(list(chunk.token_ids))
                detokenize_s = time.perf_counter() - t  # the last chunk's is kept
                if job.stream:
                    yield TextDelta(text, tuple(chunk.token_ids), entries)
                else:
                    held.append(text)
                    if entries is not None:
                        logprobs.extend(entries)
            if chunk.finish_reason is not None:
                last = chunk
                break
            if assembler.stopped:
                await coordinator.abort(job.request_id)
                last = await _final_chunk(stream)
                break
    except ValueError as err:  # the unit refused the job before it ran (its message names the field)
        if tokens:
            raise
        refused = str(err)
    finally:
        await stream.aclose()  # a no-op after the final chunk; otherwise the coordinator aborts the sequence
    if refused is not None:
        yield Finished("error", (), "", None, None, unit, error=refused, refused=True)
        return
    reason = "stop" if assembler.stopped else (last.finish_reason if last is not None else "abort")
    record = last.record if last is not None else None
    t = time.perf_counter()
    text = "".join(held) + ("" if assembler.stopped else assembler.flush())
    speculative = None
    if record is not None:
        speculative = record.speculative_usage()
        timing = speculative["timing_s"]
        timing["detokenize_sse"] = detokenize_s + time.perf_counter() - t
        if first_t is not None:
            timing["first_token"] = first_t - started - (timing.get("queue") or 0.0) - (timing.get("prefill") or 0.0)
    yield Finished(
        finish_reason=reason,
        token_ids=tuple(tokens),
        text=text,
        speculative=speculative,
        regret_spent=record.regret_spent if record is not None else None,
        unit=unit,
        error=last.error if last is not None else None,
        logprobs=None if logprobs is None or job.stream else tuple(logprobs),
    )


def merge(a: TextDelta, b: TextDelta) -> TextDelta:
    """One delta holding `a` then `b`: their text, tokens and logprobs in order."""
    if (a.logprobs is None) != (b.logprobs is None):
        raise ValueError("cannot merge a delta with logprobs and one without")
    logprobs = None if a.logprobs is None else a.logprobs + b.logprobs
    return TextDelta(a.text + b.text, a.token_ids + b.token_ids, logprobs)


async def coalesced(events: AsyncIterator[TextDelta | Finished], interval_s: float
                    ) -> AsyncIterator[TextDelta | Finished]:
    """`events` with the deltas merged so that at most one is sent per `interval_s`, none held longer than that.

    The order, text, tokens and logprobs are those of `events`; `interval_s` ≤ 0 passes every event through.
    Closing the result closes `events` (the unit then aborts the sequence).
    """
    if interval_s <= 0:
        async for event in events:
            yield event
        return
    source = aiter(events)
    pending: asyncio.Task | None = None
    held: TextDelta | None = None
    sent_at = float("-inf")
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            wait = None if held is None else max(0.0, sent_at + interval_s - time.monotonic())
            done, _ = await asyncio.wait((pending,), timeout=wait)
            if not done:  # the interval is over and no event came: send what is held
                yield held
                held, sent_at = None, time.monotonic()
                continue
            task, pending = pending, None
            try:
                event = task.result()
            except StopAsyncIteration:
                break
            if isinstance(event, TextDelta):
                held = event if held is None else merge(held, event)
                if time.monotonic() - sent_at >= interval_s:
                    yield held
                    held, sent_at = None, time.monotonic()
                continue
            if held is not None:
                yield held
                held = None
            yield event
        if held is not None:
            yield held
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, StopAsyncIteration):
                pass
        await source.aclose()


def _entries(chunk, wanted: bool) -> tuple[TokenLogprob, ...] | None:
    """A chunk's logprobs when the job asked for them: one per token, else the engine broke its contract."""
    if not wanted:
        return None
    if chunk.logprobs is None or len(chunk.logprobs) != len(chunk.token_ids):
        raise RuntimeError(f"the unit sent {len(chunk.token_ids)} tokens with "
                           f"{'no' if chunk.logprobs is None else len(chunk.logprobs)} logprobs")
    return tuple(chunk.logprobs)


async def _final_chunk(stream):
    """The coordinator's last chunk (the one with the record) after an abort; None if it does not come."""

    async def drain():
        async for chunk in stream:
            if chunk.finish_reason is not None:
                return chunk
        return None

    try:
        return await asyncio.wait_for(drain(), FINAL_CHUNK_TIMEOUT_S)
    except asyncio.TimeoutError:
        logger.warning("no final chunk after abort")
        return None


class DecoderUnit:
    """Serve deployment body (wrapped by `cluster.serving.app.build_app`): one replica owns one unit.

    `config` is the dumped `SpecServeConfig`. The policy actor and telemetry hub are named per Serve app and
    shared by every unit; the first replica creates them.
    """

    def __init__(self, config: dict[str, Any]):
        from ray import serve

        from actors.sources import load_tokenizer
        from cluster.observability.observer import UnitObserver, remote_sender
        from cluster.observability.telemetry import get_or_create_hub

        self.config = parse_config(config)
        context = serve.get_replica_context()
        self.app_name = context.app_name
        self.unit = f"{context.deployment}-{context.replica_id.unique_id}"
        hub = get_or_create_hub(self.app_name, self.config.telemetry)  # the ingress tells it the arms
        self.observer = UnitObserver(remote_sender(hub), self.unit, self.config.telemetry)
        self.coordinator = config_unit(self.config, self.unit, self.observer, app_name=self.app_name)
        self.tokenizer = load_tokenizer(self.config.target.source)
        self._closed = False
        logger.info("unit %s ready (target %s)", self.unit, self.config.target.source)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def generate(self, job: DecodeJob) -> AsyncIterator[UnitStarted | TextDelta | Finished]:
        """Serve streaming method: `UnitStarted`, then `TextDelta`s, then one `Finished`."""
        yield UnitStarted(self.unit, time.time())
        events = decode_events(self.coordinator, job, self._decode, self.unit)
        async for event in coalesced(events, self.config.serving.stream_interval_ms / 1000):
            yield event

    def check_health(self) -> None:
        """Serve's health check: a unit that cannot serve again makes Serve replace the replica."""
        if not self.coordinator.healthy():
            raise RuntimeError(f"unit {self.unit}: its engine is gone and could not be started again")

    async def stats(self) -> dict[str, Any]:
        """Debug state for leak checks: the unit's `stats()`, with `open_ledgers` also holding every ledger the
        app's policy actor still mirrors (every unit's)."""
        from actors.remote.policy import get_or_create_policy_actor

        stats = await self.coordinator.stats()
        actor = get_or_create_policy_actor(policy_actor_name(self.app_name), **policy_kwargs(self.config))
        stats["open_ledgers"] = sorted(set(stats["open_ledgers"]) | set(await actor.open_ledgers.remote()))
        return stats

    async def __del__(self):
        """Serve calls this when the replica stops (after draining): free the unit's actors."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            await self.coordinator.close()
        except Exception:
            logger.exception("unit %s: close failed", self.unit)
        self.observer.close()

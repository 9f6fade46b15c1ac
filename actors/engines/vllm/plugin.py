"""The `vllm.general_plugins` entry point (pyproject.toml): vLLM loads it in every one of its processes.

`register()` hooks vLLM's model runner (`GPUModelRunner`; vLLM's CPU runner inherits it) in the worker:

- `propose_draft_token_ids`: hands the runner to specserve's proposer (`worker.WORKER`), which reads the batch's
  request ids and sampling parameters from it;
- `_sample`: after vLLM's rejection sampler, rows of greedy ASD requests are re-verified on the raw target
  logits (`worker.WorkerState.verify_asd`); with vLLM's own proposer (drafter kind 'vllm') the step is then
  accounted and each row's γ chosen (`plan`);
- with vLLM's own proposer, `propose_draft_token_ids` drafts the step's largest γ (`draft_len`, in place of
  vLLM's fixed k) and `take_draft_token_ids` cuts each row's drafts to its γ (`cut`) before the scheduler
  schedules them;

makes vLLM's processes end with the unit's (`_die_with_parent`), passes vLLM's start errors to the unit
(`_report_errors`), and adds an `EngineCore` utility, `specserve_kv_stats` (free and total KV blocks, running
and waiting requests), that the unit reads with `call_utility_async`. Every hook is a no-op unless a specserve proposer
was built in the process, so vLLM engines started without specserve are unaffected. The hooks read vLLM 0.32
internals; `actors.engines.vllm.VLLM_RANGE` pins the versions they were written for.
"""

from __future__ import annotations

import copy
import ctypes
import logging
import os
import signal
import sys
import time

from actors.engines.vllm import PARENT_DEATH_ENV  # set by VllmUnit.start for the processes vLLM spawns

log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """vLLM's engine-core process (and its workers) end when the process that started them ends, even when
    that one is killed (a Serve replica stopped with SIGKILL): Linux's parent-death signal. vLLM handles
    SIGTERM by shutting down, and its workers follow their engine core."""
    if os.environ.get(PARENT_DEATH_ENV) != "1" or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        log.warning("specserve: cannot set the parent-death signal; vLLM processes may outlive their unit")
        return
    if os.getppid() == 1:  # the parent is already gone
        os.kill(os.getpid(), signal.SIGTERM)


ERRORS_ENV = "SPECSERVE_VLLM_ERRORS"  # a file the unit reads when its engine fails to start


def _report_errors() -> None:
    """vLLM's engine core logs why it failed to start in its own process, and the unit only gets "Engine core
    initialization failed": copy vLLM's error records to the file the unit names, so its error carries them."""
    path = os.environ.get(ERRORS_ENV)
    if path:
        handler = logging.FileHandler(path)
        handler.setLevel(logging.ERROR)
        logging.getLogger("vllm").addHandler(handler)


def register() -> None:
    _die_with_parent()
    _report_errors()
    try:
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:  # a vLLM without the v1 engine: nothing of ours can run on it
        log.warning("specserve: vLLM's v1 engine is not importable; specserve's hooks are not installed")
        return
    if getattr(GPUModelRunner, "_specserve_hooks", False):
        return
    GPUModelRunner._specserve_hooks = True
    propose, sample = GPUModelRunner.propose_draft_token_ids, GPUModelRunner._sample
    take = GPUModelRunner.take_draft_token_ids

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        from actors.engines.vllm import worker

        state = worker.state_for(self)  # hands the runner to this process's state on the first step
        if state is None or not state.in_vllm:
            return propose(self, scheduler_output, *args, **kwargs)
        step = copy.copy(scheduler_output)  # the scheduler's own object stays as it was
        step.num_spec_tokens_to_schedule = state.draft_len
        start = time.perf_counter()
        out = propose(self, step, *args, **kwargs)
        state.drafted(time.perf_counter() - start)
        return out

    def _sample(self, logits, spec_decode_metadata):
        out = sample(self, logits, spec_decode_metadata)
        from actors.engines.vllm import worker

        state = worker.state_for(self)
        if state is None:
            return out
        if spec_decode_metadata is not None:
            try:  # an exception here would kill vLLM's engine; vLLM's exact verdict stands instead
                state.verify_asd(logits, spec_decode_metadata, out)
            except Exception:
                log.exception("specserve ASD verification failed; this step keeps the exact verdict")
        if state.in_vllm:
            try:  # as above: a failure drafts nothing this step instead of killing the engine
                state.plan(out.sampled_token_ids, self.discard_request_mask.np[: self.input_batch.num_reqs])
            except Exception:
                log.exception("specserve planning failed; no drafts this step")
                state.draft_len, state._gammas = 0, {}
        return out

    def take_draft_token_ids(self):
        drafts = take(self)
        from actors.engines.vllm import worker

        state = worker.WORKER
        if drafts is None or state is None or state.runner is not self or not state.in_vllm:
            return drafts
        return type(drafts)(drafts.req_ids, state.cut(drafts.req_ids, drafts.draft_token_ids))

    def specserve_kv_stats(self) -> dict:
        manager = self.scheduler.kv_cache_manager
        pool = manager.block_pool
        return {"free_blocks": pool.get_num_free_blocks(), "total_blocks": pool.num_gpu_blocks,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting)}

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner._sample = _sample
    GPUModelRunner.take_draft_token_ids = take_draft_token_ids
    EngineCore.specserve_kv_stats = specserve_kv_stats

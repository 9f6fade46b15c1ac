"""specserve inside vLLM's worker process: drafts and γ per request per step, ASD verification, records.

vLLM builds `SpecserveProposer(vllm_config)` in each worker (`speculative_config.method = "custom_class"`) and
calls `propose` once per engine step, after sampling, for every request of the batch (row i is request
`runner.input_batch.req_ids[i]`). `plugin.register` hands the proposer its runner and calls `verify_asd` after
vLLM's rejection sampler. The unit reads and releases a finished request's record with vLLM's
`collective_rpc("specserve_take", ...)` on `SpecserveWorkerExtension` (`worker_extension_cls`).

State per worker process (`WORKER`): a `PolicyCore` (γ policy and ASD ledgers, the same object the policy
actor hosts for the native engine), the unit's drafter, and one `RequestState` per live request. Settings come
from `vllm_config.additional_config["specserve"]` (the unit's γ and drafter settings) and each request's
`SamplingParams.extra_args["specserve"]` (arm, ASD config and budget, speculate).

With tensor parallelism every rank runs the same code on the same scheduled tokens and logits, so every rank
reaches the same verdicts and ledgers; vLLM takes drafts from its output rank only, and the unit reads records
from rank 0.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from actors.contracts import DraftBatch, DraftRequest
from actors.drafting import DrafterSetup, make_drafter
from actors.policy import PolicyCore
from policies import PAD_TOKEN_ID
from policies.asd import ASDConfig, verify_asd_scores
from policies.scores import TargetScores, compact_scores

log = logging.getLogger(__name__)

KEY = "specserve"  # additional_config[KEY] (unit settings) and SamplingParams.extra_args[KEY] (per request)
_PRUNE_AT = 4096  # records of requests vLLM no longer holds are dropped past this many (a unit that never took them)


@dataclass
class RequestState:
    """What specserve tracks for one request in the worker (its `usage.speculative`, minus the unit's part)."""

    arm: str
    speculate: bool
    seeded: bool
    asd: ASDConfig | None  # greedy requests on an ASD arm; None: exact verification
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    gammas: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    last_gamma: int = 0  # drafts proposed for the step now running
    last_draft: tuple = ()  # (confidence, match_len) of that draft, for the policy
    internal_id: str = ""  # vLLM's id of the request
    degraded: bool = False  # a draft was wanted while the model drafter was unavailable

    def record(self, ledger) -> dict[str, Any]:
        out = {"arm": self.arm, "rounds": self.rounds, "draft_tokens": self.draft_tokens,
               "accepted_tokens": self.accepted_tokens, "gammas": list(self.gammas),
               "accepted_per_position": list(self.accepted_per_position), "degraded": self.degraded}
        if ledger is not None:
            summary = ledger.summary()
            out.update(regret_spent=summary["spent"], regret_budget=summary["budget"],
                       relaxed_tokens=summary["relaxed_tokens"], ledger_exhausted=summary["exhausted"])
        return out


def request_settings(rid: str, arm: str, *, speculate: bool, seeded: bool, asd: ASDConfig | None) -> dict[str, Any]:
    """A request's `SamplingParams.extra_args[KEY]` (built by the unit)."""
    out: dict[str, Any] = {"rid": rid, "arm": arm, "speculate": speculate, "seeded": seeded}
    if asd is not None:
        out["asd"] = {"g": asd.g, "M": asd.max_relaxed_per_block, "B": asd.budget}
    return out


class WorkerState:
    """The policy, the drafter and the live requests of one vLLM worker."""

    def __init__(self, settings: dict[str, Any], gamma_max: int, max_model_len: int):
        self.policy = PolicyCore(**settings["policy"])
        if settings["drafter"]["kind"] == "model":
            from actors.remote.drafter import NamedDrafterClient

            self.drafter = NamedDrafterClient(**settings["drafter_actor"], rank0=_tensor_parallel_rank() == 0)
        else:
            self.drafter = make_drafter(DrafterSetup(**settings["drafter"]), max_slots=1, max_seq_len=max_model_len)
        self.gamma_max, self.max_model_len = gamma_max, max_model_len
        self.requests: dict[str, RequestState] = {}  # by the unit's request id
        self._rid_of: dict[str, str] = {}  # vLLM's internal id -> the unit's id
        self.runner = None  # vLLM's model runner, set by plugin.register's hook before the first propose
        self._last_step_t: float | None = None
        self._last_score_tokens = 1
        # Tests read every ASD verification back (`settings["record_asd"]`): inputs, ledger state and verdict.
        self.asd_log: list[dict[str, Any]] | None = [] if settings.get("record_asd") else None

    # --- requests ----------------------------------------------------------------------------------------
    def _state(self, internal_id: str) -> tuple[str, RequestState] | None:
        """The request behind a batch row (vLLM's internal id is the unit's id plus a random suffix; the
        unit's id travels in extra_args). None for a request that is not specserve's."""
        rid = self._rid_of.get(internal_id)
        if rid is not None:
            return rid, self.requests[rid]
        held = self.runner.requests.get(internal_id)
        params = getattr(held, "sampling_params", None)
        cfg = ((params.extra_args or {}).get(KEY) if params is not None else None)
        if cfg is None:
            return None  # not a specserve request: no drafts, no records
        rid, asd = cfg["rid"], cfg.get("asd")
        greedy = params.temperature < 1e-5
        config = ASDConfig(g=asd["g"], max_relaxed_per_block=asd["M"], budget=asd["B"]) if asd and greedy else None
        state = RequestState(cfg["arm"], bool(cfg.get("speculate", True)), bool(cfg.get("seeded")), config)
        self.take([rid])  # a reused id: start over
        self.requests[rid], self._rid_of[internal_id], state.internal_id = state, rid, internal_id
        self.policy.open_request(rid, config.budget if config is not None else None)
        return rid, state

    def take(self, request_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Records of finished requests, releasing everything kept for them (drafter state, γ statistics,
        ledgers). Unknown ids are skipped (a request that never reached a decode step)."""
        out = {}
        for rid in request_ids:
            state = self.requests.pop(rid, None)
            if state is None:
                continue
            self._rid_of.pop(state.internal_id, None)
            ledger = self.policy.ledgers.get(rid)
            out[rid] = state.record(ledger)
            self.policy.close_request(rid)
            if self.drafter is not None:
                self.drafter.release(rid)
        return out

    def live(self) -> dict[str, list[str]]:
        return {"requests": sorted(self.requests), "ledgers": sorted(self.policy.open_ledgers()),
                "drafter": sorted(getattr(self.drafter, "active_ids", lambda: [])())}

    # --- one engine step ---------------------------------------------------------------------------------
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray) -> list[list[int]]:
        """Account for the tokens this step emitted, learn, and draft for the next step."""
        now = time.perf_counter()
        req_ids = self.runner.input_batch.req_ids
        batch = len(sampled_token_ids)
        step_s = None if self._last_step_t is None else now - self._last_step_t
        self._last_step_t = now
        rows: list[tuple[int, str, RequestState, int]] = []
        prefill = False  # the step fed a prompt (chunk): its time is not a decode step's
        for i in range(batch):
            known = req_ids[i] in self._rid_of
            found = self._state(req_ids[i])
            prefill = prefill or not known or not sampled_token_ids[i]
            if found is None or not sampled_token_ids[i]:
                continue  # not ours, or a prompt chunk that emitted nothing
            rid, state = found
            self._account(rid, state, len(sampled_token_ids[i]))
            rows.append((i, rid, state, self._gamma(rid, state, batch, int(num_tokens_no_spec[i]))))
        if step_s is not None and batch and not prefill:
            # One decode step: schedule, forward over 1 + γ tokens per row, sample, propose (between calls).
            self.policy.gamma.observe_costs(batch, None, {self._last_score_tokens: step_s})
        drafts: list[list[int]] = [[] for _ in range(batch)]
        wanted = [(i, rid, state, g) for i, rid, state, g in rows if g > 0]
        if wanted and self.drafter is not None:
            batch_drafts = self.drafter.propose([
                DraftRequest(rid, token_ids_cpu[i, : int(num_tokens_no_spec[i])].tolist(), g)
                for i, rid, _, g in wanted])
            if batch_drafts is None:  # the model drafter is unavailable: these rows decode plainly this step
                for _, _, state, _ in wanted:
                    state.degraded = True
                batch_drafts = DraftBatch.empty(len(wanted))
            lens = batch_drafts.draft_lens.tolist()
            ids = batch_drafts.draft_ids.tolist()
            for j, (i, rid, state, _) in enumerate(wanted):
                drafts[i] = ids[j][: lens[j]]
                if batch_drafts.confidence is not None:
                    state.last_draft = (tuple(batch_drafts.confidence[j, : lens[j]].tolist()),
                                        int(batch_drafts.match_lens[j]))
        for i, _, state, _ in rows:
            state.last_gamma = len(drafts[i])
        self._last_score_tokens = 1 + round(sum(len(d) for d in drafts) / max(batch, 1))
        if len(self.requests) > _PRUNE_AT:
            self._prune()
        return drafts

    def _account(self, rid: str, state: RequestState, emitted: int) -> None:
        """The step that just ran emitted `emitted` tokens for the request, after drafting `last_gamma`."""
        k = state.last_gamma
        state.rounds += 1
        state.gammas.append(k)
        accepted = min(emitted - 1, k)
        if k:
            state.draft_tokens += k
            state.accepted_tokens += accepted
            if len(state.accepted_per_position) < k:
                state.accepted_per_position.extend([0] * (k - len(state.accepted_per_position)))
            for pos in range(accepted):
                state.accepted_per_position[pos] += 1
        if state.speculate:  # a plain round counts too: after `probe_interval` of them the policy probes γ = 1
            confidence, match_len = state.last_draft or ((), 0)
            self.policy.gamma.observe(rid, state.arm, k, accepted, confidence, match_len)
        state.last_gamma, state.last_draft = 0, ()

    def _gamma(self, rid: str, state: RequestState, batch: int, num_tokens: int) -> int:
        if not state.speculate:
            return 0
        gamma = self.policy.seeded_gamma if state.seeded else self.policy.gamma.choose(rid, state.arm, batch)
        room = self.max_model_len - num_tokens - 1  # drafts and the bonus token must fit the context
        return max(0, min(gamma, self.gamma_max, room))

    def _prune(self) -> None:
        held = set(self.runner.requests)
        gone = [rid for rid, state in self.requests.items() if state.internal_id not in held]
        log.warning("dropping %d specserve records the unit never took", len(gone))
        self.take(gone)

    # --- ASD after vLLM's rejection sampler ----------------------------------------------------------------
    def verify_asd(self, logits: torch.Tensor, metadata, sampler_output) -> None:
        """Re-verify the rows of greedy ASD requests on vLLM's raw target logits, charging their ledgers.

        `metadata` (vLLM's SpecDecodeMetadata) gives per row b its draft count, the flattened draft ids, the
        logits rows that score them (teacher-forced on the draft) and the bonus row. The verdict replaces row b
        of `sampler_output.sampled_token_ids` ([B, max_spec_len + 1], -1 = rejected, the same sentinel as
        PAD_TOKEN_ID). vLLM's scheduler then rolls KV back past the kept tokens; a relaxed token's KV was
        computed with the draft token as input, so it is already right.
        """
        req_ids = self.runner.input_batch.req_ids
        counts = list(metadata.num_draft_tokens)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int) if counts else []
        groups: dict[ASDConfig, list[tuple[int, str, int]]] = {}
        for b, k in enumerate(counts):
            rid = self._rid_of.get(req_ids[b]) if k else None
            state = self.requests[rid] if rid is not None else None
            if state is not None and state.asd is not None:
                groups.setdefault(state.asd, []).append((b, rid, k))
        if not groups:
            return
        sampled = sampler_output.sampled_token_ids  # [B, max_spec_len + 1]
        # one host copy of each metadata tensor per step, not one per row (each is a sync on a GPU)
        all_drafts = metadata.draft_token_ids.long().cpu()  # [sum K_b]
        all_targets = metadata.target_logits_indices.long().cpu()  # [sum K_b]
        bonus = metadata.bonus_logits_indices.long().cpu()  # [B]
        for config, rows in groups.items():
            kmax = max(k for _, _, k in rows)
            draft_ids = torch.full((len(rows), kmax), PAD_TOKEN_ID, dtype=torch.long)  # [N, Kmax]
            index = torch.empty((len(rows), kmax + 1), dtype=torch.long)  # [N, Kmax + 1] rows of `logits`
            for j, (b, _, k) in enumerate(rows):
                s = int(starts[b])
                draft_ids[j, :k] = all_drafts[s : s + k]
                index[j, :k] = all_targets[s : s + k]
                index[j, k:] = bonus[b]  # the bonus row, repeated as padding
            # reduced over the vocabulary where the logits are; only [N, Kmax + 1] scores come to the host
            target_logits = logits[index.to(logits.device)].float()  # [N, Kmax + 1, V]
            scores = compact_scores(draft_ids.to(logits.device), target_logits, validate=False)
            scores = TargetScores(scores.argmax_ids.cpu(), scores.argmax_logits.cpu(), scores.draft_logits.cpu())
            ledgers = [self.policy.ledgers[rid] for _, rid, _ in rows]
            spent_before = [ledger.spent for ledger in ledgers]
            lens = torch.tensor([k for _, _, k in rows])  # [N]
            verdict = verify_asd_scores(draft_ids, scores, ledgers, config, draft_lens=lens)
            if self.asd_log is not None and len(self.asd_log) < 10_000:
                self.asd_log.append({
                    "rids": [rid for _, rid, _ in rows],
                    "config": (config.g, config.max_relaxed_per_block, config.budget),
                    "positions": [int(self.runner.input_batch.num_tokens_no_spec[b]) for b, _, _ in rows],
                    "draft_ids": draft_ids.tolist(), "draft_lens": lens.tolist(), "spent_before": spent_before,
                    "argmax_ids": scores.argmax_ids.tolist(), "argmax_logits": scores.argmax_logits.tolist(),
                    "draft_logits": scores.draft_logits.tolist(), "logits_dtype": str(scores.argmax_logits.dtype),
                    "tokens": verdict.tokens.tolist(), "num_accepted": verdict.num_accepted.tolist()})
            for j, (b, _, k) in enumerate(rows):
                sampled[b, : k + 1] = verdict.tokens[j, : k + 1].to(sampled.device, sampled.dtype)
                sampled[b, k + 1 :] = PAD_TOKEN_ID


WORKER: WorkerState | None = None  # this process's state (one vLLM worker per process)


def _tensor_parallel_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - not initialized: a single worker
        return 0


class SpecserveProposer:
    """vLLM `custom_class` proposer: `propose` returns each row's drafts (any length, none included)."""

    def __init__(self, vllm_config):
        global WORKER
        settings = (vllm_config.additional_config or {}).get(KEY)
        if settings is None:
            raise ValueError(f"additional_config[{KEY!r}] is missing: start this engine through "
                             "actors.engines.vllm.unit.VllmUnit")
        WORKER = WorkerState(settings, vllm_config.speculative_config.num_speculative_tokens,
                             vllm_config.model_config.max_model_len)
        self.state = WORKER

    def load_model(self, *args, **kwargs) -> None:
        pass  # the drafters run in this process; a model drafter is not supported on this engine yet

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        try:
            return self.state.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception:  # an exception here kills vLLM's engine: decode this step without drafts instead
            log.exception("specserve proposer failed; no drafts this step")
            for state in self.state.requests.values():
                state.last_gamma = 0
            return [[] for _ in sampled_token_ids]


class SpecserveWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); called with `collective_rpc` by the unit."""

    def specserve_take(self, request_ids: list[str]) -> dict[str, dict[str, Any]]:
        return {} if WORKER is None else WORKER.take(request_ids)

    def specserve_asd_log(self) -> list[dict[str, Any]]:
        """Every ASD verification so far, when the unit was started with `record_asd` (tests)."""
        return [] if WORKER is None or WORKER.asd_log is None else WORKER.asd_log

    def specserve_live(self) -> dict[str, list[str]]:
        return {"requests": [], "ledgers": [], "drafter": []} if WORKER is None else WORKER.live()

"""specserve inside vLLM's worker process: γ per request per step, drafts, ASD verification, bookkeeping.

vLLM builds `SpecserveProposer(vllm_config)` in each worker (`speculative_config.method = "custom_class"`) and
calls `propose` once per engine step for every request of the batch (row i is `runner.input_batch.req_ids[i]`);
`plugin.register` hands it the runner and calls `verify_asd` inside vLLM's rejection sampler (after its verdict,
before its logprobs). With drafter kind 'vllm' vLLM's own proposer drafts, and the plugin's hooks call `plan`
(account the step, choose each row's γ), read `draft_len` (the step's draft length) and call `cut` (each row's
drafts to its γ). Per request the worker keeps the shared `RequestBook` (`actors.bookkeeping`) and its ledger
lease in a `UnitPolicy` that reports to the app's policy actor (tensor-parallel rank 0 only; every rank verifies
alike). The unit takes a finished request's book with `collective_rpc("specserve_take", ...)`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from actors.bookkeeping import RequestBook
from actors.contracts import DraftBatch
from actors.drafting import DrafterSetup, make_drafter
from actors.engines.vllm import SharedMemoryReport
from actors.policy import InProcessLink, PolicyCore, UnitPolicy
from actors.engines.vllm.sampling import KEY, allowed, draft_request, worker_request
from policies import PAD_TOKEN_ID
from policies.asd import ASDConfig, verify_asd_scores
from policies.batch_plan import scored_tokens
from policies.scores import TargetScores, compact_scores

log = logging.getLogger(__name__)

_PRUNE_AT = 4096  # books of requests vLLM no longer holds are dropped past this many (a unit that never took them)


def _policy(settings: dict[str, Any], rank0: bool) -> UnitPolicy:
    """Rank 0 reports to the app's policy actor on Ray, else to one in-process; vLLM's own proposer runs every
    step, so its policy prices that floor (`draft_floor`)."""
    where = settings.get("policy_actor")
    policy = {**settings["policy"], "draft_floor": True} if settings.get("vllm_proposer") else settings["policy"]
    if where and rank0:
        from actors.remote.policy import policy_from_outside

        return policy_from_outside(where, unit=settings.get("unit", "vllm"), **policy)
    return UnitPolicy(InProcessLink(PolicyCore(**policy)), unit=settings.get("unit", "vllm"), **policy)


class WorkerState:
    """The policy, the drafter and the live requests' books of one vLLM worker."""

    def __init__(self, settings: dict[str, Any], gamma_max: int, max_model_len: int):
        rank0 = _tensor_parallel_rank() == 0
        self.policy = _policy(settings, rank0)
        self.in_vllm = bool(settings.get("vllm_proposer"))  # vLLM's own proposer drafts (plan / cut)
        # an in-process drafter reads a row's context as a view, only the tokens it has not indexed; an actor gets ints
        self.remote_drafter = not self.in_vllm and settings["drafter"]["kind"] == "model"
        if self.in_vllm:
            self.drafter = None
        elif settings["drafter"]["kind"] == "model":
            from actors.remote.drafter import NamedDrafterClient

            self.drafter = NamedDrafterClient(**settings["drafter_actor"], rank0=rank0)
        else:
            self.drafter = make_drafter(DrafterSetup(**settings["drafter"]), max_slots=1, max_seq_len=max_model_len)
        self.gamma_max, self.max_model_len = gamma_max, max_model_len
        self.books: dict[str, RequestBook] = {}  # by the unit's request id
        self._internal: dict[str, str] = {}  # the unit's id -> vLLM's internal id
        self._rid_of: dict[str, str] = {}  # vLLM's internal id -> the unit's id
        self._drafted: dict[str, tuple[int, tuple]] = {}  # rid -> (γ, (confidence, match_len)) of the running step
        self.runner = None  # vLLM's model runner, set by plugin.register's hook before the first propose
        self._last_step_t: float | None = None
        self._last_draft_s, self._last_draft_steps, self._last_score_tokens = 0.0, 0, 1  # proposer s, steps; n scored
        self._gammas: dict[str, int] = {}  # kind vllm: vLLM's internal id -> γ of the step being drafted
        self.draft_len = 0  # kind vllm: the step's draft length (the largest γ)
        self.verified: dict[int, int] = {}  # with record_asd: draft tokens verified in one row -> rows
        # Tests read every ASD verification back (`settings["record_asd"]`): inputs, ledger state and verdict.
        self.asd_log: list[dict[str, Any]] | None = [] if settings.get("record_asd") else None

    # --- requests ----------------------------------------------------------------------------------------
    def _book(self, internal_id: str) -> RequestBook | None:
        """The book of the request behind a batch row (vLLM's internal id is the unit's id plus a random
        suffix; the unit's id travels in extra_args). None for a request that is not specserve's."""
        rid = self._rid_of.get(internal_id)
        if rid is not None:
            return self.books[rid]
        held = self.runner.requests.get(internal_id)
        params = getattr(held, "sampling_params", None)
        cfg = ((params.extra_args or {}).get(KEY) if params is not None else None)
        if cfg is None:
            return None  # not a specserve request: no drafts, no books
        book = RequestBook(worker_request(cfg, params, getattr(held, "prompt_token_ids", ())), time.time())
        self.take([book.rid])  # a reused id: start over
        self.books[book.rid], self._rid_of[internal_id], self._internal[book.rid] = book, book.rid, internal_id
        book.ledger = self.policy.open_request(book.rid, book.request.arm.name, book.budget)
        return book

    def take(self, request_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The books of finished requests (`RequestBook.export`), releasing everything kept for them (drafter
        state, γ statistics, ledgers). Unknown ids are skipped (a request that never reached a decode step)."""
        out = {}
        for rid in request_ids:
            book = self.books.pop(rid, None)
            if book is None:
                continue
            self._rid_of.pop(self._internal.pop(rid, ""), None)
            self._drafted.pop(rid, None)
            out[rid] = book.export()
            self.policy.close_request(rid)
            if self.drafter is not None:
                self.drafter.release(rid)
        if out:
            self.policy.flush()
        return out

    def live(self) -> dict[str, list[str]]:
        return {"requests": sorted(self.books), "ledgers": self.policy.open_ledgers(),
                "drafter": sorted(getattr(self.drafter, "active_ids", lambda: [])())}

    # --- one engine step ---------------------------------------------------------------------------------
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray) -> list[list[int]]:
        """Account for the tokens this step emitted, learn, and draft for the next step (specserve's drafter)."""
        rows = self._round([len(t) for t in sampled_token_ids], num_tokens_no_spec[: len(sampled_token_ids)].tolist())
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        wanted = [(i, book, g) for i, book, g in rows if g > 0]
        self._last_draft_s = 0.0
        if wanted and self.drafter is not None:
            start = time.perf_counter()
            contexts = [token_ids_cpu[i, : int(num_tokens_no_spec[i])] for i, _, _ in wanted]  # views of the buffer
            contexts = [c.tolist() for c in contexts] if self.remote_drafter else contexts
            batch_drafts = self.drafter.propose([draft_request(b.request, c, g) for (_, b, g), c in zip(wanted, contexts)])
            self._last_draft_s = time.perf_counter() - start
            if batch_drafts is None:  # the model drafter is unavailable: these rows decode plainly this step
                for _, book, _ in wanted:
                    book.degraded = True
                batch_drafts = DraftBatch.empty(len(wanted))
            lens = batch_drafts.draft_lens.tolist()
            ids = batch_drafts.draft_ids.tolist()
            for j, (i, book, _) in enumerate(wanted):
                drafts[i] = allowed(book.request, ids[j][: lens[j]], int(num_tokens_no_spec[i]))
                if batch_drafts.confidence is not None:
                    self._drafted[book.rid] = (lens[j], (tuple(batch_drafts.confidence[j, : lens[j]].tolist()),
                                                         int(batch_drafts.match_lens[j])))
            keep = self.policy.plan_step([(b.rid, b.request.arm.name, len(drafts[i]), b.seeded) for i, b, _ in wanted],
                                         len(sampled_token_ids), drafted=True)  # the step's drafts, priced whole
            for (i, _, _), k in zip(wanted, keep):
                drafts[i] = drafts[i][:k]
        self._end_round(rows, [len(d) for d in drafts])
        self._last_draft_steps = self._last_score_tokens - 1
        return drafts

    def plan(self, sampled: torch.Tensor, discard: np.ndarray) -> None:
        """Kind 'vllm', after each step's sampling: account the step and choose each row's γ for the next one.

        `sampled` [B, 1 + K]: each row's kept tokens, -1 past them; a row of `discard` (a prompt chunk) emitted
        nothing. Sets `draft_len` and the γs `cut` applies."""
        vocab, tokens = self.runner.input_batch.vocab_size, sampled.tolist()
        emitted = [0 if discard[i] else sum(1 for t in row if 0 <= t < vocab) for i, row in enumerate(tokens)]
        before = self.runner.input_batch.num_tokens_no_spec  # this step's tokens are not in it yet
        rows = self._round(emitted, [int(before[i]) + e for i, e in enumerate(emitted)])
        req_ids = self.runner.input_batch.req_ids
        keep = self.policy.plan_step([(b.rid, b.request.arm.name, g, b.seeded) for _, b, g in rows], len(tokens))
        self._gammas = {req_ids[i]: k for (i, _, _), k in zip(rows, keep)}
        self.draft_len = max(self._gammas.values(), default=0)
        self._end_round(rows, [self._gammas.get(r, 0) for r in req_ids[: len(tokens)]])

    def drafted(self, seconds: float) -> None:
        """Kind 'vllm': vLLM's proposer took `seconds` for `draft_len` steps; with none, its one pass over the step's
        tokens (keeping its KV cache in step) is one drafter step (`draft_floor`), so v(0) is the target's alone."""
        self._last_draft_s, self._last_draft_steps = seconds, max(1, self.draft_len)

    def cut(self, req_ids: list[str], drafts: list[list[int]]) -> list[list[int]]:
        """Kind 'vllm': each row's drafts cut to its γ and before the first token its rules ban (rows specserve
        did not plan keep vLLM's)."""
        gammas, self._gammas = self._gammas, {}
        out = [d[: gammas[r]] if r in gammas else d for r, d in zip(req_ids, drafts)]
        batch = self.runner.input_batch  # this step's tokens are in it by now
        try:  # an optimization only (the target rejects a banned draft): a failure must not kill vLLM's engine
            for j, r in enumerate(req_ids):
                book = self.books.get(self._rid_of.get(r, ""))
                if book is not None and len(out[j]) and r in batch.req_id_to_index:
                    out[j] = allowed(book.request, out[j], int(batch.num_tokens_no_spec[batch.req_id_to_index[r]]))
        except Exception:
            log.exception("specserve: cutting drafts at banned tokens failed; this step keeps them")
        return out

    def _round(self, emitted: list[int], num_tokens: list[int]) -> list[tuple[int, RequestBook, int]]:
        """Account the `emitted` tokens of each row (0: a prompt chunk), feed the last step's costs to the
        policy, and choose each specserve row's γ for the next step: (row, book, γ). `num_tokens`: each row's
        context after this step."""
        now = time.perf_counter()
        req_ids = self.runner.input_batch.req_ids
        batch = len(emitted)
        step_s = None if self._last_step_t is None else now - self._last_step_t
        self._last_step_t = now
        rows: list[tuple[int, RequestBook, int]] = []
        prefill = False  # the step fed a prompt (chunk): its time is not a decode step's
        for i in range(batch):
            known = req_ids[i] in self._rid_of
            book = self._book(req_ids[i])
            prefill = prefill or not known or not emitted[i]
            if book is None or not emitted[i]:
                continue  # not ours, or a prompt chunk that emitted nothing
            self._account(book, emitted[i])
            rows.append((i, book, self._gamma(book, batch, num_tokens[i])))
        if step_s is not None and batch and not prefill:
            # One decode step: forward over 1 + γ tokens per row and sampling; the last draft's time is c's, not
            # the forward's (it ran inside the step too)
            score_s = max(step_s - self._last_draft_s, 1e-6)
            draft_step_s = self._last_draft_s / max(1, self._last_draft_steps) if self._last_draft_s else None
            self.policy.observe_costs(batch, draft_step_s, {self._last_score_tokens: score_s})
        return rows

    def _end_round(self, rows: list[tuple[int, RequestBook, int]], lens: list[int]) -> None:
        """The rows' drafts for the next step are `lens[i]` long (what `_account` reads back after it)."""
        for i, book, _ in rows:  # drafts cut short keep their tokens' confidences
            k, (confidence, match_len) = self._drafted.get(book.rid, (0, ((), 0)))
            self._drafted[book.rid] = (lens[i], (confidence[: lens[i]], match_len) if confidence and k >= lens[i]
                                       else ((), 0))
        self._last_score_tokens = scored_tokens(lens)
        self.policy.flush()
        if len(self.books) > _PRUNE_AT:
            self._prune()

    def _account(self, book: RequestBook, emitted: int) -> None:
        """The step that just ran emitted `emitted` tokens for the request, after drafting what `_drafted` says."""
        k, (confidence, match_len) = self._drafted.pop(book.rid, (0, ((), 0)))
        accepted = min(emitted - 1, k)
        book.account(k, accepted)
        if book.request.speculate:  # a plain round counts too: after `probe_interval` of them the policy probes
            self.policy.observe(book.rid, book.request.arm.name, k, accepted, confidence, match_len)

    def _gamma(self, book: RequestBook, batch: int, num_tokens: int) -> int:
        limit = book.draft_limit(output_len=num_tokens - len(book.request.prompt_ids), context_len=num_tokens,
                                 max_seq_len=self.max_model_len)
        if limit == 0:
            return 0
        gamma = self.policy.choose(book.rid, book.request.arm.name, batch, seeded=book.seeded)
        return max(0, min(gamma, self.gamma_max, limit))

    def _prune(self) -> None:
        held = set(self.runner.requests)
        gone = [rid for rid in self.books if self._internal.get(rid) not in held]
        log.warning("dropping %d specserve books the unit never took", len(gone))
        self.take(gone)

    # --- ASD inside vLLM's rejection sampler --------------------------------------------------------------
    def verify_asd(self, draft_token_ids: torch.Tensor, counts: list[int], target_logits: torch.Tensor,
                   bonus_token_ids: torch.Tensor, sampled: torch.Tensor) -> None:
        """Re-verify the rows of greedy ASD requests on the target logits vLLM verified, charging their ledgers.

        Called by `plugin.register`'s hook right after vLLM's `rejection_sample`, with its arguments:
        `draft_token_ids` [sum K_b] and `target_logits` [sum K_b, V], row b's K_b = `counts[b]` positions
        consecutive, after vLLM's penalties, the logit bias, min_tokens and the grammar's mask (so a relaxed token is
        one the grammar allows: the drafts were cut at the grammar's first refusal; a token a rule bans has infinite
        regret), and `bonus_token_ids` [B, 1], sampled under the same rules. The verdict replaces row b of
        `sampled` ([B, max_spec_len + 1], -1 = rejected, the same sentinel as PAD_TOKEN_ID) before vLLM
        computes the logprobs of the kept tokens and its scheduler rolls KV back past them (a relaxed token's KV
        was computed with the draft token as input, so it is already right).
        """
        req_ids = self.runner.input_batch.req_ids
        if self.asd_log is not None:  # tests read them back (`record_asd`); a serving step does not count
            for k in counts:
                self.verified[k] = self.verified.get(k, 0) + 1
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int) if counts else []
        groups: dict[ASDConfig, list[tuple[int, str, int]]] = {}
        for b, k in enumerate(counts):
            rid = self._rid_of.get(req_ids[b]) if k else None
            book = self.books[rid] if rid is not None else None
            if book is not None and book.asd and book.greedy:
                groups.setdefault(book.request.arm.asd, []).append((b, rid, k))
        if not groups:
            return
        # one host copy of the drafts and bonus ids per step, not one per row (each is a sync on a GPU)
        all_drafts = draft_token_ids.long().cpu()  # [sum K_b]
        bonus = bonus_token_ids.long().view(-1).cpu()  # [B]
        for config, rows in groups.items():
            kmax = max(k for _, _, k in rows)
            draft_ids = torch.full((len(rows), kmax), PAD_TOKEN_ID, dtype=torch.long)  # [N, Kmax]
            index = torch.empty((len(rows), kmax + 1), dtype=torch.long)  # [N, Kmax + 1] rows of `target_logits`
            for j, (b, _, k) in enumerate(rows):
                s = int(starts[b])
                draft_ids[j, :k] = all_drafts[s : s + k]
                index[j, :k] = torch.arange(s, s + k)
                index[j, k:] = s  # a stand-in row: the bonus position's argmax is vLLM's bonus token (below)
            # reduced over the vocabulary where the logits are; only [N, Kmax + 1] scores come to the host
            scores = compact_scores(draft_ids.to(target_logits.device), target_logits[index.to(target_logits.device)],
                                    validate=False)
            argmax_ids = scores.argmax_ids.cpu()  # [N, Kmax + 1]
            for j, (b, _, k) in enumerate(rows):
                argmax_ids[j, k:] = bonus[b]
            scores = TargetScores(argmax_ids, scores.argmax_logits.cpu(), scores.draft_logits.cpu())
            ledgers = [self.books[rid].ledger for _, rid, _ in rows]
            spent_before = [ledger.spent for ledger in ledgers]
            mirrored = self._mirrored([rid for _, rid, _ in rows]) if self.asd_log is not None else None
            lens = torch.tensor([k for _, _, k in rows])  # [N]
            verdict = verify_asd_scores(draft_ids, scores, ledgers, config, draft_lens=lens)
            self.policy.charged([rid for _, rid, _ in rows])
            if self.asd_log is not None and len(self.asd_log) < 10_000:
                self.asd_log.append({
                    "rids": [rid for _, rid, _ in rows],
                    "config": (config.g, config.max_relaxed_per_block, config.budget, config.gate),
                    "positions": [int(self.runner.input_batch.num_tokens_no_spec[b]) for b, _, _ in rows],
                    "draft_ids": draft_ids.tolist(), "draft_lens": lens.tolist(), "spent_before": spent_before,
                    "mirrored_before": mirrored,
                    "argmax_ids": scores.argmax_ids.tolist(), "argmax_logits": scores.argmax_logits.tolist(),
                    "draft_logits": scores.draft_logits.tolist(), "logits_dtype": str(scores.argmax_logits.dtype),
                    "tokens": verdict.tokens.tolist(), "num_accepted": verdict.num_accepted.tolist()})
            for j, (b, _, k) in enumerate(rows):
                sampled[b, : k + 1] = verdict.tokens[j, : k + 1].to(sampled.device, sampled.dtype)
                sampled[b, k + 1 :] = PAD_TOKEN_ID

    def _mirrored(self, request_ids: list[str]) -> list[float | None] | None:
        """The in-process authority's spend of these ledgers (tests); None when the authority is an actor."""
        core = getattr(self.policy.link, "core", None)
        return None if core is None else [None if core.ledger(r) is None else core.ledger(r).spent for r in request_ids]


WORKER: WorkerState | None = None  # this process's state (one vLLM worker per process)


def state_for(runner) -> WorkerState | None:
    """This process's state when it serves `runner`: built here on first use for vLLM's own proposers (drafter
    kind 'vllm'; `SpecserveProposer` builds it otherwise). None for an engine started without specserve."""
    global WORKER
    if WORKER is None:
        settings = (runner.vllm_config.additional_config or {}).get(KEY)
        if settings is None or not settings.get("vllm_proposer") or runner.speculative_config is None:
            return None
        WORKER = WorkerState(settings, runner.speculative_config.num_speculative_tokens,
                             runner.model_config.max_model_len)
    if WORKER.runner is None:
        WORKER.runner = runner
    return WORKER if WORKER.runner is runner else None


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
            self.state._drafted.clear()
            return [[] for _ in sampled_token_ids]


class SpecserveWorkerExtension(SharedMemoryReport):
    """Mixed into vLLM's worker (`worker_extension_cls`); called with `collective_rpc` by the unit."""

    def specserve_take(self, request_ids: list[str]) -> dict[str, dict[str, Any]]:
        return {} if WORKER is None else WORKER.take(request_ids)

    def specserve_asd_log(self) -> list[dict[str, Any]]:
        """Every ASD verification so far, when the unit was started with `record_asd` (tests)."""
        return [] if WORKER is None or WORKER.asd_log is None else WORKER.asd_log

    def specserve_flush(self) -> None:
        """Report what the worker observed to the authority now, and wait for it (the unit went idle)."""
        if WORKER is not None:
            WORKER.policy.flush(wait=True)

    def specserve_verified(self) -> dict[int, int]:
        """Rows of vLLM's verification steps by the number of draft tokens they verified (0 included); counted
        only when the unit was started with `record_asd` (tests)."""
        return {} if WORKER is None else dict(WORKER.verified)

    def specserve_policy(self) -> dict[str, Any]:
        """The γ policy as this worker prices steps (`GammaPolicy.summary`); {} before the first step."""
        return {} if WORKER is None else WORKER.policy.gamma.summary()

    def specserve_live(self) -> dict[str, list[str]]:
        return {"requests": [], "ledgers": [], "drafter": []} if WORKER is None else WORKER.live()

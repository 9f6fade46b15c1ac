"""Approximate speculative decoding for sampled requests: speculative sampling with a per-position allowance.

A funded position i accepts x_i with probability min(1, e^{ε_i} p/q), ε_i = min(g · (K_b − i) / K_b, B) nats
(the "fraction" form whatever the arm's `gate`: docs/asd-sampled.md says why), and charges its cost c_i to the
request's `RegretLedger`; every other position runs the exact test. Then no output sequence
is more than e^B times as likely as under the target, and B = 0, g = 0 or M = 0 give `verify_sampled` token for
token for the same draws. Terms, proofs and wiring: docs/asd-sampled.md.

`sampled_scores` runs next to the target's probabilities and draws all the randomness (the K_b + 1 uniforms of
`verify_sampled`); `verify_asd_sampled_scores` runs where the ledgers are and decides.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from policies.asd import ASDConfig, _check_ledgers
from policies.exact import Generators, _check_probs, _sample_inverse_cdf
from policies.ledger import LedgerEvent, RegretLedger
from policies.verdict import PAD_TOKEN_ID, Verdict, accepted_prefix, check_draft, check_vocab_range

__all__ = [
    "SampledScores",
    "emitted_distribution",
    "relaxation_allowance",
    "sampled_scores",
    "verify_asd_sampled",
    "verify_asd_sampled_scores",
]

_CHARGE_LOCK = threading.Lock()
"""Held from reading the ledgers' remaining budgets to charging them: no interleaving of calls, even two calls
sharing a ledger, can fund a position against budget another call has already spent."""


@dataclass(frozen=True)
class SampledScores:
    """Everything the sampled ASD decision needs about one block per row; a few bytes per position.

    Positions ≥ K_b are padding: False, 0 or PAD_TOKEN_ID.
    """

    accept_exact: torch.Tensor  # [B, K] bool, u_i · q_i(x_i) < p_i(x_i)
    accept_relaxed: torch.Tensor  # [B, K] bool, u_i · q_i(x_i) < e^{ε_i} · p_i(x_i), or accept_exact
    cost: torch.Tensor  # [B, K] float64, c_i = min(ε_i, log(q_i(x_i) / p_i(x_i))) if q_i(x_i) > p_i(x_i), else 0
    allowance: torch.Tensor  # [B, K] float64, ε_i = min(g · (K_b − i) / K_b, B)
    recovered: torch.Tensor  # [B, K] long, sample of norm(max(0, p_i − q_i)) where a block can stop, else PAD
    bonus: torch.Tensor  # [B] long, sample of p_{K_b}

    def check(self, draft_ids: torch.Tensor, config: ASDConfig, lens: torch.Tensor) -> None:
        """Raise ValueError unless the fields fit `draft_ids` [B, K] and were computed with `config`."""
        batch, k = draft_ids.shape
        for name, shape, dtype in (
            ("accept_exact", (batch, k), torch.bool),
            ("accept_relaxed", (batch, k), torch.bool),
            ("cost", (batch, k), torch.float64),
            ("allowance", (batch, k), torch.float64),
            ("recovered", (batch, k), torch.long),
            ("bonus", (batch,), torch.long),
        ):
            tensor = getattr(self, name)
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(f"scores.{name} must be a {dtype} tensor of shape {shape} to match draft_ids")
            if tensor.device != lens.device:
                raise ValueError(f"scores.{name} is on {tensor.device}, other fields on {lens.device}")
        if not torch.equal(self.allowance, relaxation_allowance(config, lens, k)):
            raise ValueError("scores.allowance differs from the config's: scores were drawn for another arm")
        # NaN fails both comparisons.
        if not bool(((self.cost >= 0) & (self.cost <= self.allowance)).all()):
            raise ValueError("scores.cost must lie in [0, scores.allowance]")
        if bool((self.accept_exact & ~self.accept_relaxed).any()):
            raise ValueError("scores.accept_relaxed must hold wherever scores.accept_exact does")
        if bool((self.bonus < 0).any()):
            raise ValueError("scores.bonus holds negative token ids")

    def to(self, device: torch.device | str) -> SampledScores:
        """The same scores on another device (e.g. from the target's GPU to the policy actor's CPU)."""
        return SampledScores(**{name: getattr(self, name).to(device) for name in self.__dataclass_fields__})


def relaxation_allowance(
    config: ASDConfig,
    draft_lens: torch.Tensor,  # [B] long
    k: int,
) -> torch.Tensor:  # [B, K] float64
    """ε_i = min(g · (K_b − i) / K_b, B) for i < K_b, 0 beyond: never more than the request's whole budget."""
    lens = draft_lens.to(torch.float64)[:, None]  # [B, 1]
    pos = torch.arange(k, dtype=torch.float64, device=draft_lens.device)  # [K]
    allowance = (config.g * (lens - pos) / lens).clamp(max=config.budget)  # [B, K], NaN where K_b = 0
    return torch.where(pos < lens, allowance, 0.0)  # [B, K]


def emitted_distribution(
    p: torch.Tensor,  # [..., V] float, target probabilities at one position
    q: torch.Tensor,  # [..., V] float, draft probabilities there
    allowance: float | torch.Tensor,  # ε, scalar or [...]
) -> torch.Tensor:  # [..., V] float64
    """Law of the token one position emits under the relaxed rule: q·a' + P(reject) · norm(max(0, p − q)).

    ε = 0 gives p (speculative sampling). TV(e, p) = Σ_v max(0, min(q, e^ε p) − p)(v) ≤ min(1 − e^{−ε}, TV(p, q)).
    """
    p, q = p.double(), q.double()
    stretch = torch.as_tensor(allowance, dtype=torch.float64, device=p.device).exp()[..., None]  # [..., 1]
    accepted = torch.minimum(q, stretch * p)  # [..., V], q · a'
    residual = (p - q).clamp(min=0)  # [..., V]
    rejected = 1 - accepted.sum(dim=-1, keepdim=True)  # [..., 1]
    mass = residual.sum(dim=-1, keepdim=True)  # [..., 1]
    return accepted + torch.where(mass > 0, rejected * residual / mass, 0.0)  # [..., V]


def sampled_scores(
    draft_ids: torch.Tensor,  # [B, K] long, padded with PAD_TOKEN_ID beyond draft_lens
    draft_probs: torch.Tensor | None,  # [B, K, V] float q, or None for one-hot q at the draft token
    target_probs: torch.Tensor,  # [B, K+1, V] float p
    config: ASDConfig,
    generator: Generators = None,
    draft_lens: torch.Tensor | None = None,  # [B] long
) -> SampledScores:
    """Draw the block's randomness next to p and reduce it to `SampledScores` (runs at the target).

    `generator`: one torch.Generator (or None: the global one) for the batch, or a list of B: then row b draws
    its K_b + 1 uniforms from its own generator only, so a seeded request reproduces in any batch.
    Recovered tokens are sampled only at positions where some funding of the block can stop: at or after the
    exact rule's first rejection, at or before the relaxed rule's, where the exact rule rejects.
    """
    _check_config(config)
    if not isinstance(target_probs, torch.Tensor):
        raise ValueError(f"target_probs must be a tensor [B, K+1, V], got {type(target_probs).__name__}")
    device = target_probs.device
    lens = _check_lens(draft_ids, draft_lens).to(device)  # [B]
    draft_ids = draft_ids.to(device)  # [B, K]
    batch, k = draft_ids.shape
    pos = torch.arange(k, device=device)  # [K]
    valid = pos < lens[:, None]  # [B, K]
    scored = torch.arange(k + 1, device=device) <= lens[:, None]  # [B, K+1]
    p = _check_probs("target_probs", target_probs, (batch, k + 1), scored)  # [B, K+1, V]
    vocab = p.shape[2]
    check_vocab_range(draft_ids, vocab)
    q = None
    if draft_probs is not None:
        q = _check_probs("draft_probs", draft_probs, (batch, k, vocab), valid)  # [B, K, V]
        if q.device != device:
            raise ValueError(f"draft_probs is on {q.device}, target_probs on {device}")
    uniforms = _uniforms(generator, lens, k, device)  # [B, K+1]; column K_b of row b samples the last token

    x = draft_ids.clamp(min=0)  # [B, K]
    p_x = p[:, :k].gather(-1, x[..., None]).squeeze(-1)  # [B, K]
    q_x = torch.ones_like(p_x) if q is None else q.gather(-1, x[..., None]).squeeze(-1)  # [B, K]
    accept_exact = (uniforms[:, :k] * q_x < p_x) & valid  # [B, K], bit for bit verify_sampled's test
    allowance = relaxation_allowance(config, lens, k)  # [B, K] float64
    p64, q64 = p_x.double(), q_x.double()  # [B, K]
    stretched = uniforms[:, :k].double() * q64 < allowance.exp() * p64  # [B, K]
    accept_relaxed = accept_exact | (stretched & valid)  # [B, K]; ⊇ accept_exact whatever the rounding
    over = (q64 > p64) & valid  # [B, K]
    log_ratio = torch.where(over, q64.log() - p64.log(), 0.0)  # [B, K], +inf where p_i(x_i) = 0
    cost = torch.minimum(log_ratio, allowance)  # [B, K]

    # Any funding decides each position between the exact and the relaxed bit, so the block stops in
    # [first exact rejection, first relaxed rejection], at a position the exact rule rejects.
    first_exact = accepted_prefix(accept_exact)  # [B]
    first_relaxed = accepted_prefix(accept_relaxed)  # [B]
    can_stop = valid & ~accept_exact & (pos >= first_exact[:, None]) & (pos <= first_relaxed[:, None])  # [B, K]
    rows, cols = can_stop.nonzero(as_tuple=True)  # [N], [N]
    p_stop = p[rows, cols]  # [N, V]
    if q is None:
        q_stop = torch.zeros_like(p_stop).scatter_(1, x[rows, cols][:, None], 1.0)  # [N, V]
    else:
        q_stop = q[rows, cols]  # [N, V]
    residual = (p_stop - q_stop).clamp(min=0)  # [N, V]
    dist = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_stop)  # [N, V]; p if rounding left none
    u_last = uniforms.gather(1, lens[:, None]).squeeze(1)  # [B], independent of the acceptance draws
    recovered = torch.full((batch, k), PAD_TOKEN_ID, dtype=torch.long, device=device)  # [B, K]
    recovered[rows, cols] = _sample_inverse_cdf(dist, u_last[rows])
    bonus = _sample_inverse_cdf(p[torch.arange(batch, device=device), lens], u_last)  # [B]
    return SampledScores(accept_exact, accept_relaxed, cost, allowance, recovered, bonus)


def verify_asd_sampled_scores(
    draft_ids: torch.Tensor,  # [B, K] long
    scores: SampledScores,
    ledgers: Sequence[RegretLedger],  # one per row, distinct
    config: ASDConfig,
    draft_lens: torch.Tensor | None = None,  # [B] long
) -> Verdict:
    """Decide each row's block from its scores and ledger, and charge the ledgers (runs in the policy actor).

    Every ledger of the call is charged (one block, one event per relaxed token) or, when the call raises, none.
    """
    _check_config(config)
    if not isinstance(scores, SampledScores):
        raise ValueError(f"scores must be SampledScores, got {type(scores).__name__}")
    device = scores.cost.device
    lens = _check_lens(draft_ids, draft_lens).to(device)  # [B]
    draft_ids = draft_ids.to(device)  # [B, K]
    scores.check(draft_ids, config, lens)
    batch, k = draft_ids.shape
    ledgers = _check_ledgers(ledgers, batch)

    pos = torch.arange(k, device=device)  # [K]
    valid = pos < lens[:, None]  # [B, K]
    over = scores.cost > 0  # [B, K]
    # Along the funded prefix every kept position is charged its cost, so these are exact there.
    spent_incl = scores.cost.cumsum(dim=1)  # [B, K]
    spent_before = torch.cat([spent_incl.new_zeros(batch, 1), spent_incl[:, :-1]], dim=1)  # [B, K]
    relaxed_before = over.long().cumsum(dim=1) - over.long()  # [B, K]
    with _CHARGE_LOCK:
        remaining = torch.tensor([ledger.remaining for ledger in ledgers], dtype=torch.float64, device=device)
        fits = (
            valid
            & (scores.allowance > 0)
            & (relaxed_before < config.max_relaxed_per_block)
            & (spent_before + scores.allowance <= remaining[:, None])
        )  # [B, K]
        funded = fits.long().cumprod(dim=1).bool()  # [B, K], a prefix of the block
        decided = torch.where(funded, scores.accept_relaxed, scores.accept_exact) & valid  # [B, K]
        num_accepted = accepted_prefix(decided)  # [B]
        kept_funded = funded & (pos < num_accepted[:, None])  # [B, K]
        relaxed = kept_funded & over  # [B, K]
        charged_len = kept_funded.sum(dim=1)  # [B]
        block_cost = spent_incl.gather(1, (charged_len - 1).clamp(min=0)[:, None]).squeeze(1)  # [B]
        # spent_before + ε ≤ remaining was checked and c ≤ ε; the minimum only absorbs rounding of the sum.
        block_cost = torch.where(charged_len > 0, torch.minimum(block_cost, remaining), 0.0)  # [B]
        rejected = num_accepted < lens  # [B]
        stop = num_accepted.clamp(max=k - 1)  # [B]
        recovered = scores.recovered.gather(1, stop[:, None]).squeeze(1)  # [B]
        if bool((rejected & (recovered < 0)).any()):
            raise ValueError("scores.recovered has no token at a stop position: scores are not from sampled_scores")
        last = torch.where(rejected, recovered, scores.bonus)  # [B]
        _charge(ledgers, draft_ids, scores, relaxed, block_cost, lens)
    return Verdict(
        tokens=_assemble_tokens(draft_ids, num_accepted, last),
        num_accepted=num_accepted,
        num_relaxed=relaxed.sum(dim=1),
        regret=block_cost.float(),
    )


def verify_asd_sampled(
    draft_ids: torch.Tensor,  # [B, K] long
    draft_probs: torch.Tensor | None,  # [B, K, V] float q, or None for one-hot q
    target_probs: torch.Tensor,  # [B, K+1, V] float p
    ledgers: Sequence[RegretLedger],  # one per row, distinct
    config: ASDConfig,
    generator: Generators = None,
    draft_lens: torch.Tensor | None = None,  # [B] long
) -> Verdict:
    """`sampled_scores` then `verify_asd_sampled_scores`, in one process (tests, in-process units)."""
    ledgers = _check_ledgers(ledgers, _check_lens(draft_ids, draft_lens).shape[0])  # before any draw
    scores = sampled_scores(draft_ids, draft_probs, target_probs, config, generator, draft_lens)
    return verify_asd_sampled_scores(draft_ids, scores, ledgers, config, draft_lens)


def _charge(
    ledgers: list[RegretLedger],
    draft_ids: torch.Tensor,  # [B, K]
    scores: SampledScores,
    relaxed: torch.Tensor,  # [B, K] bool
    block_cost: torch.Tensor,  # [B] float64
    lens: torch.Tensor,  # [B]
) -> None:
    """Write one block to every ledger whose row had a block, with an event per relaxed token."""
    events: dict[int, list[LedgerEvent]] = {}
    lens_list = lens.tolist()
    rows, cols = relaxed.nonzero(as_tuple=True)  # [R], [R], row-major: positions in order
    exact_token = torch.where(scores.accept_exact, draft_ids, scores.recovered)[rows, cols]  # [R]
    for b, i, x, y, cost in zip(rows.tolist(), cols.tolist(), draft_ids[rows, cols].tolist(), exact_token.tolist(),
                                scores.cost[rows, cols].tolist()):
        k_b = lens_list[b]
        events.setdefault(b, []).append(LedgerEvent(ledgers[b].blocks, i, x, y, cost, k_b - i, k_b, "fraction"))
    for b, (ledger, k_b, spent) in enumerate(zip(ledgers, lens_list, block_cost.tolist())):
        if k_b > 0:
            ledger.charge_block(events.get(b, ()), spent)


def _assemble_tokens(
    draft_ids: torch.Tensor,  # [B, K]
    num_accepted: torch.Tensor,  # [B]
    last: torch.Tensor,  # [B]
) -> torch.Tensor:  # [B, K+1]
    """`policies.verdict.assemble_tokens` on the inputs' device."""
    batch, k = draft_ids.shape
    pad = torch.full((batch, 1), PAD_TOKEN_ID, dtype=torch.long, device=draft_ids.device)  # [B, 1]
    tokens = torch.cat([draft_ids, pad], dim=1)  # [B, K+1]
    kept = torch.arange(k + 1, device=draft_ids.device) < num_accepted[:, None]  # [B, K+1]
    tokens = torch.where(kept, tokens, PAD_TOKEN_ID)  # [B, K+1]
    return tokens.scatter_(1, num_accepted[:, None], last[:, None])  # [B, K+1]


def _uniforms(generator: Generators, lens: torch.Tensor, k: int, device: torch.device) -> torch.Tensor:
    """U[0, 1) draws [B, K+1] on `device`, as `verify_sampled` draws them; per-row generators draw K_b + 1."""
    batch = lens.shape[0]
    if generator is None:
        return torch.rand(batch, k + 1, device=device)
    if isinstance(generator, torch.Generator):
        return torch.rand(batch, k + 1, generator=generator, device=generator.device).to(device)
    generators = list(generator)
    if len(generators) != batch or not all(isinstance(g, torch.Generator) for g in generators):
        raise ValueError(f"generator must be a torch.Generator or a list of B={batch} of them")
    uniforms = torch.zeros(batch, k + 1)  # [B, K+1], filled on the CPU, moved once
    for row, (g, n) in enumerate(zip(generators, lens.tolist())):
        uniforms[row, : n + 1] = torch.rand(n + 1, generator=g, device=g.device).cpu()
    return uniforms.to(device)


def _check_lens(draft_ids: torch.Tensor, draft_lens: torch.Tensor | None) -> torch.Tensor:
    """`check_draft` on CPU copies (it builds CPU tensors); returns draft_lens [B] long on the CPU."""
    if not isinstance(draft_ids, torch.Tensor):
        raise ValueError(f"draft_ids must be a 2-D tensor [B, K], got {type(draft_ids).__name__}")
    cpu_lens = draft_lens.cpu() if isinstance(draft_lens, torch.Tensor) else draft_lens
    return check_draft(draft_ids.cpu(), cpu_lens)


def _check_config(config: object) -> None:
    if not isinstance(config, ASDConfig):
        raise ValueError(f"config must be an ASDConfig, got {type(config).__name__}")

"""Exact verification: the emitted tokens follow the target's distribution exactly.

Greedy rows keep the longest prefix where x_i equals the target argmax y*_i; sampled rows run speculative
sampling (Leviathan et al. 2022), accepting x_i with probability min(1, p_i(x_i) / q_i(x_i)) (the rules and
their terms: docs/architecture.md, "Terms"). Shapes: B rows, K draft positions, V vocabulary; logits and
probabilities are teacher-forced on the draft. Inputs share one device and results stay there; `validate=False`
skips the checks that read tensor values (on a GPU each is a host sync), for a caller that checked its inputs on
the host or checks the results once; parameters given as Python numbers are always checked, on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from policies.scores import TargetScores, compact_scores
from policies.verdict import (Verdict, accepted_prefix, assemble_tokens, check_devices, check_draft,
                              check_vocab_range, positions)

Generators = torch.Generator | Sequence[torch.Generator | None] | None


def verify_greedy(
    draft_ids: torch.Tensor,  # [B, K] long
    target_logits: torch.Tensor,  # [B, K+1, V] float
    draft_lens: torch.Tensor | None = None,  # [B] long
) -> Verdict:
    """Greedy verification on full logits; equal to `verify_greedy_scores(draft_ids, compact_scores(...))`."""
    return verify_greedy_scores(draft_ids, compact_scores(draft_ids, target_logits), draft_lens)


def verify_greedy_scores(
    draft_ids: torch.Tensor,  # [B, K] long
    scores: TargetScores,
    draft_lens: torch.Tensor | None = None,  # [B] long
) -> Verdict:
    """Greedy verification on compact scores: keep x_i while x_i == y*_i, then emit y* at the stop position."""
    lens = check_draft(draft_ids, draft_lens)  # [B]
    scores.check(draft_ids)
    k = draft_ids.shape[1]
    valid = positions(k, draft_ids.device) < lens[:, None]  # [B, K]
    match = (draft_ids == scores.argmax_ids[:, :k]) & valid  # [B, K]
    num_accepted = accepted_prefix(match)  # [B]
    last = scores.argmax_ids.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return Verdict(tokens=assemble_tokens(draft_ids, num_accepted, last), num_accepted=num_accepted)


def process_logits(
    logits: torch.Tensor,  # [B, ..., V] float
    temperature: float | torch.Tensor,  # scalar or [B]
    top_k: int | torch.Tensor | None = None,  # scalar or [B]; None keeps all
    top_p: float | torch.Tensor | None = None,  # scalar or [B] in (0, 1]; None or 1 keeps all
    validate: bool = True,
) -> torch.Tensor:  # [B, ..., V] float probabilities
    """Turn logits into the sampling distribution; the one place this happens, for drafter and target alike.

    Order (as in Hugging Face's warpers): divide by the temperature, keep the top_k largest logits, keep the
    smallest top-probability set whose mass reaches top_p, softmax. Tokens tied with the last kept one are
    kept too, so the result never depends on how a sort breaks ties.
    Temperature 0 gives the one-hot distribution of the argmax (greedy as a distribution).
    A per-row tensor parameter [B] applies to dim 0 of `logits`; top_p = 1 keeps every token exactly.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor [..., V]")
    if validate:
        row_max = logits.amax(dim=-1)  # NaN propagates through max
        if bool(torch.isnan(row_max).any()) or bool((row_max == float("inf")).any()):
            raise ValueError("logits holds NaN or +inf values")
    vocab = logits.shape[-1]
    any_greedy = _any_zero(temperature) if validate or _on_host(temperature) else True
    temperature = _per_row("temperature", temperature, logits, torch.float32, validate,
                           lambda t: bool((t >= 0).all()) and bool(torch.isfinite(t).all()), "finite and ≥ 0")
    greedy = temperature == 0  # broadcastable to logits
    scaled = logits / torch.where(greedy, 1.0, temperature)  # [B, ..., V]
    if top_k is not None or top_p is not None:
        ranked = _sorted_descending(scaled)  # [B, ..., V], values only
        if top_k is not None:
            k = _per_row("top_k", top_k, logits, torch.long, validate, lambda t: bool((t >= 1).all()),
                         "≥ 1 (None keeps every token)")
            kth = ranked.gather(-1, (k.clamp(max=vocab) - 1).expand(*ranked.shape[:-1], 1))  # [B, ..., 1]
            ranked = ranked.masked_fill(ranked < kth, float("-inf"))
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))  # [B, ..., V]
        if top_p is not None:
            p = _per_row("top_p", top_p, logits, scaled.dtype, validate, lambda t: bool(((t > 0) & (t <= 1)).all()),
                         "in (0, 1]")
            ranked_probs = ranked.softmax(dim=-1)  # [B, ..., V]
            mass_before = ranked_probs.cumsum(dim=-1) - ranked_probs  # [B, ..., V]
            keep = (mass_before < p).sum(dim=-1, keepdim=True)  # [B, ..., 1], ≥ 1: the top token has 0 before it
            keep = torch.where(p >= 1, vocab, keep)  # rounding may leave mass_before ≥ 1 in the tail
            smallest_kept = ranked.gather(-1, keep - 1)  # [B, ..., 1]
            scaled = scaled.masked_fill(scaled < smallest_kept, float("-inf"))  # ties with it stay
    if validate and not bool(torch.isfinite(scaled.amax(dim=-1)).all()):
        raise ValueError("logits has a row where every value is -inf")
    probs = scaled.softmax(dim=-1)  # [B, ..., V]
    if any_greedy:  # unknown on the device without a sync, which costs more than the where it would skip
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)  # [B, ..., V]
        probs = torch.where(greedy, one_hot, probs)
    return probs


def verify_sampled(
    draft_ids: torch.Tensor,  # [B, K] long
    draft_probs: torch.Tensor | None,  # [B, K, V] float q, or None for one-hot q at the draft token
    target_probs: torch.Tensor,  # [B, K+1, V] float p
    generator: Generators = None,
    draft_lens: torch.Tensor | None = None,  # [B] long
    uniforms: torch.Tensor | None = None,  # [B, K+1] float, drawn already (`draw_uniforms`); then no generator
    validate: bool = True,
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2022). The emitted tokens follow p exactly.

    Accept x_i iff u_i · q_i(x_i) < p_i(x_i) with u_i ~ U[0, 1): probability min(1, p/q), no NaN when p == q,
    and a token with p(x) = 0 is never kept, even when q(x) = 0. At the first rejection emit a sample of
    norm(max(0, p_i − q_i)) (falling back to p_i when rounding leaves no mass); after a fully accepted block
    emit a sample of p_{K_b}. `draft_probs=None` is a drafter without a distribution (n-gram): q is one-hot at
    x_i, so x_i is kept with probability p_i(x_i) and the residual is p_i with x_i removed.

    `generator` is one torch.Generator (or None: the global one) for the whole batch, or a list of B of them:
    then row b draws its K_b + 1 uniforms from its own generator only, so a seeded request reproduces whatever
    else is in its batch; an entry None draws from the device's global generator.
    """
    device = check_devices(draft_ids=draft_ids, target_probs=target_probs, draft_probs=draft_probs,
                           draft_lens=draft_lens, uniforms=uniforms)
    batch, k = draft_ids.shape
    if validate:
        lens = check_draft(draft_ids, draft_lens)  # [B]
    else:
        lens = torch.full((batch,), k, device=device) if draft_lens is None else draft_lens.long()  # [B]
    valid = positions(k, device) < lens[:, None]  # [B, K]
    scored = positions(k + 1, device) <= lens[:, None]  # [B, K+1]
    p = _check_probs("target_probs", target_probs, (batch, k + 1), scored, validate)  # [B, K+1, V]
    vocab = p.shape[2]
    if validate:
        check_vocab_range(draft_ids, vocab)
    if draft_probs is not None:
        q = _check_probs("draft_probs", draft_probs, (batch, k, vocab), valid, validate)  # [B, K, V]
    x = draft_ids.clamp(min=0)  # [B, K]
    if uniforms is None:
        uniforms = _uniforms(generator, lens, k, device)  # [B, K+1]; column K_b of row b samples the last token
    elif generator is not None or tuple(uniforms.shape) != (batch, k + 1):
        raise ValueError(f"uniforms must have shape [{batch}, {k + 1}] and come without a generator")
    p_x = p[:, :k].gather(-1, x[..., None]).squeeze(-1)  # [B, K]
    q_x = torch.ones_like(p_x) if draft_probs is None else q.gather(-1, x[..., None]).squeeze(-1)  # [B, K]
    accept = (uniforms[:, :k] * q_x < p_x) & valid  # [B, K]
    num_accepted = accepted_prefix(accept)  # [B]
    rows = torch.arange(batch, device=device)
    p_last = p[rows, num_accepted]  # [B, V]
    rejected = num_accepted < lens  # [B]
    stop = num_accepted.clamp(max=k - 1)  # [B], row index of the rejected position
    if draft_probs is None:
        q_last = torch.zeros_like(p_last).scatter_(1, x[rows, stop][:, None], 1.0)  # [B, V]
    else:
        q_last = q[rows, stop]  # [B, V]
    residual = (p_last - q_last).clamp(min=0)  # [B, V]
    use_residual = rejected & (residual.sum(dim=1) > 0)  # [B]
    dist = torch.where(use_residual[:, None], residual, p_last)  # [B, V]
    u_last = uniforms.gather(1, lens[:, None]).squeeze(1)  # [B], independent of the acceptance draws
    last = _sample_inverse_cdf(dist, u_last)  # [B]
    return Verdict(tokens=assemble_tokens(draft_ids, num_accepted, last), num_accepted=num_accepted)


def _sorted_descending(values: torch.Tensor) -> torch.Tensor:
    """Values sorted descending along the last dim; numpy on CPU, where it is much faster than torch's sort."""
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(-np.sort(-values.detach().numpy(), axis=-1))
    return values.sort(dim=-1, descending=True).values


def _sample_inverse_cdf(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of an unnormalised distribution dist [B, V] from uniforms u [B] in [0, 1)."""
    cdf = dist.double().cumsum(dim=1)  # [B, V]
    threshold = u.double() * cdf[:, -1]  # [B], strictly below the total mass
    # The first index whose cdf exceeds the threshold; a zero-mass token never is one.
    index = torch.searchsorted(cdf, threshold[:, None], right=True).squeeze(1)  # [B]
    return index.clamp(max=dist.shape[1] - 1)


def _uniforms(generator: Generators, lens: torch.Tensor, k: int, device: torch.device) -> torch.Tensor:
    """U[0, 1) draws [B, K+1] on `device`. Per-row generators draw only the K_b + 1 values their row uses."""
    batch = lens.shape[0]
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(batch, k + 1, generator=generator, device=device)
    generators = list(generator)
    if len(generators) != batch or not all(g is None or isinstance(g, torch.Generator) for g in generators):
        raise ValueError(f"generator must be a torch.Generator or a list of B={batch} of them")
    return draw_uniforms(generators, lens.tolist(), k, device)


def draw_uniforms(generators: Sequence[torch.Generator | None], lens: Sequence[int], k: int,
                  device: torch.device | str) -> torch.Tensor:
    """U[0, 1) draws [B, K+1] for `verify_sampled(uniforms=)`: row b draws its K_b + 1 = lens[b] + 1 values
    from generators[b] (None: the device's global generator), so a seeded row reproduces in any batch.

    Generators must live on `device`. The row lengths come from the host, so drawing never waits for the device.
    """
    uniforms = torch.zeros(len(lens), k + 1, device=device)  # [B, K+1]
    for row, (g, n) in enumerate(zip(generators, lens)):
        uniforms[row, : n + 1] = torch.rand(n + 1, generator=g, device=device)
    return uniforms


def _check_probs(name: str, probs: object, shape: tuple[int, ...], used: torch.Tensor,
                 validate: bool = True) -> torch.Tensor:
    """Validate a probability tensor; `shape` gives its leading dims (and V when known).

    Rows where `used` [B, n] is False (padding of ragged blocks) need not sum to 1. Without `validate` only
    the shape is checked.
    """
    if not isinstance(probs, torch.Tensor) or probs.dim() != 3 or not probs.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor of rank 3")
    if tuple(probs.shape[: len(shape)]) != shape:
        raise ValueError(f"{name} must have leading shape {shape}, got {tuple(probs.shape)}")
    if probs.shape[2] == 0:
        raise ValueError(f"{name} has an empty vocabulary (V = 0)")
    if not validate:
        return probs
    # One min and one sum per row: NaN fails both comparisons, ±inf fails one of them.
    row_ok = (probs.amin(dim=-1) >= 0) & ((probs.sum(dim=-1) - 1).abs() <= 1e-3)  # [B, n]
    if not bool((row_ok | ~used).all()):
        raise ValueError(f"{name} must be finite and non-negative, and each row must sum to 1")
    return probs


def _per_row(name: str, value: float | int | torch.Tensor, logits: torch.Tensor, dtype: torch.dtype,
             validate: bool, ok: Callable[[torch.Tensor], bool], rule: str) -> torch.Tensor:
    """A scalar or a [B] tensor parameter, checked against `ok` (on the host for Python values, else only
    with `validate`), on the logits' device and shaped to broadcast against logits [B, ..., V]."""
    tensor = torch.as_tensor(value, dtype=dtype)
    if (_on_host(value) or validate) and not ok(tensor):
        raise ValueError(f"{name} must be {rule}")
    tensor = tensor.to(logits.device)
    if tensor.dim() == 0:
        return tensor.reshape([1] * logits.dim())
    if tensor.shape != (logits.shape[0],):
        raise ValueError(f"{name} must be a scalar or a tensor of shape [{logits.shape[0]}]")
    return tensor.reshape([-1] + [1] * (logits.dim() - 1))


def _on_host(value: float | int | torch.Tensor) -> bool:
    return not isinstance(value, torch.Tensor) or value.device.type == "cpu"


def _any_zero(value: float | int | torch.Tensor) -> bool:
    return bool((torch.as_tensor(value) == 0).any())

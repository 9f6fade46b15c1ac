"""A request's rules on the target's logits, and the raw logprobs of what it emits.

Rules (vLLM's definitions and order): `logit_bias` is added and, while the output is shorter than
`min_tokens`, the stop ids (EOS unless ignored, and stop_token_ids) get -inf (unless no other token is left,
as where a grammar allows only a stop); then the repetition penalty r
scales z(v) of every token v in the prompt or output (z / r where z > 0, z · r otherwise); then
z(v) -= frequency · count(v) + presence · [count(v) > 0], counts over the output only. Temperature, top-k and
top-p (`policies.exact.process_logits`) come after; greedy is the argmax of the penalised logits.

Under speculation, position i of a block scores the token after draft tokens 0..i-1, so its rules see the
output extended by those drafts (`penalise_block`): exact verification then stays exact under the rules.

Logprobs are the raw distribution: log_softmax of the target's logits before any rule, temperature, top-k or
top-p (vLLM's default `logprobs_mode`, raw_logprobs). Shapes: T scored positions, V vocabulary, n top tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from policies.verdict import PAD_TOKEN_ID

BANNED_BIAS = -100.0  # a bias this low (OpenAI's minimum) bans the token: a drafter never proposes it


@dataclass(frozen=True)
class Penalties:
    """One request's rules on the target's logits; the neutral values change nothing."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0  # > 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()  # masked while the output is shorter than min_tokens

    @staticmethod
    def of(*, frequency: float = 0.0, presence: float = 0.0, repetition: float = 1.0,
           logit_bias: Mapping[int, float] | None = None, min_tokens: int = 0,
           stop_ids: Sequence[int] = ()) -> Penalties:
        return Penalties(float(frequency), float(presence), float(repetition),
                         tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items())),
                         int(min_tokens), frozenset(int(t) for t in stop_ids) if min_tokens else frozenset())

    @property
    def active(self) -> bool:
        """Whether any rule changes a logit (the neutral request costs nothing)."""
        return bool(self.frequency or self.presence or self.repetition != 1.0 or self.logit_bias
                    or (self.min_tokens and self.stop_ids))

    def banned(self, output_len: int) -> frozenset[int]:
        """Tokens the rules give no chance at the position after `output_len` output tokens: bias ≤
        BANNED_BIAS, and the stop ids before min_tokens."""
        out = {t for t, b in self.logit_bias if b <= BANNED_BIAS}
        if output_len < self.min_tokens:
            out |= self.stop_ids
        return frozenset(out)


def penalise_block(
    logits: torch.Tensor,  # [T, V] float, position i scores the token after draft_ids[:i]
    rules: Penalties,
    prompt_ids: torch.Tensor,  # [P] long
    output_ids: torch.Tensor,  # [O] long, the output before the block
    draft_ids: torch.Tensor,  # [k] long, k < T, no padding
) -> torch.Tensor:  # [T, V] float, a new tensor
    """The logits of one row's block after its rules; position i sees output + draft_ids[:i] (see the module
    docstring). Inputs share one device; positions past k see all k drafts (a caller pads its block)."""
    positions, vocab = logits.shape
    k = draft_ids.numel()
    if k >= positions:
        raise ValueError(f"draft_ids: {k} drafts need at least {k + 1} scored positions, got {positions}")
    device = logits.device
    z = logits.float().clone()  # [T, V]
    if rules.logit_bias:
        ids = torch.tensor([t for t, _ in rules.logit_bias], dtype=torch.long, device=device)  # [L]
        bias = torch.tensor([b for _, b in rules.logit_bias], dtype=z.dtype, device=device)  # [L]
        z[:, ids] += bias
    if rules.min_tokens and rules.stop_ids:
        short = rules.min_tokens - output_ids.numel()  # positions before min_tokens (past k: all k drafts)
        short = short if short <= k else positions
        if short > 0:
            stops = torch.tensor(sorted(rules.stop_ids), dtype=torch.long, device=device)  # [S]
            masked = z[:short].index_fill(-1, stops, float("-inf"))  # [short, V]
            dead = torch.isneginf(masked).all(dim=-1, keepdim=True)  # a grammar allowed only a stop: keep it
            z[:short] = torch.where(dead, z[:short], masked)
    if not (rules.frequency or rules.presence or rules.repetition != 1.0):
        return z
    counts = torch.zeros(positions, vocab, dtype=z.dtype, device=device)  # [T, V], output tokens before i
    counts += torch.bincount(output_ids, minlength=vocab)[:vocab].to(z.dtype)
    if k:
        drafts = torch.zeros(positions, vocab, dtype=z.dtype, device=device)  # [T, V]
        drafts[torch.arange(1, k + 1, device=device), draft_ids] = 1.0  # draft j counts from position j + 1
        counts += drafts.cumsum(dim=0)
    seen = counts > 0  # [T, V]
    if rules.repetition != 1.0:
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)  # [V]
        in_prompt[prompt_ids] = True
        r = torch.where(seen | in_prompt, rules.repetition, 1.0)  # [T, V]
        z = torch.where(z > 0, z / r, z * r)
    if rules.frequency:
        z -= rules.frequency * counts
    if rules.presence:
        z -= rules.presence * seen.to(z.dtype)
    return z


def apply_bitmask(
    logits: torch.Tensor,  # [T, V] float
    bitmask: torch.Tensor,  # [T, ceil(V / 32)] int32, same device
) -> torch.Tensor:  # [T, V], a new tensor
    """`logits` with -inf wherever the bitmask's bit is 0: token j is bit j % 32 of word j // 32 (xgrammar's
    layout), 1 allowing it."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    allowed = ((bitmask[..., None] >> shifts) & 1).flatten(-2)[..., :vocab].bool()  # [T, V]
    return logits.masked_fill(~allowed, float("-inf"))


def allowed_drafts(draft_ids: Sequence[int], rules: Penalties, output_len: int) -> int:
    """How many of a row's drafts to keep: up to the first one its rules ban at its position
    (`Penalties.banned`), since the target would reject it anyway."""
    always = {t for t, b in rules.logit_bias if b <= BANNED_BIAS}
    for i, token in enumerate(draft_ids):
        if token in always or (output_len + i < rules.min_tokens and token in rules.stop_ids):
            return i
    return len(draft_ids)


@dataclass(frozen=True)
class BlockLogprobs:
    """Raw logprobs of one row's block at every scored position: the candidates (the tokens the row may emit
    there), and the `n` most likely tokens, most likely first."""

    candidates: torch.Tensor  # [T, C] long, PAD_TOKEN_ID where a slot has no token
    candidate_logprobs: torch.Tensor  # [T, C] float
    top_ids: torch.Tensor  # [T, n] long
    top_logprobs: torch.Tensor  # [T, n] float

    def lookup(self, position: int, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
        """(logprob of `token` at `position`, its n most likely (id, logprob)); ValueError if the token was
        not a candidate there."""
        row = self.candidates[position].tolist()
        if token not in row:
            raise ValueError(f"token {token} was not a candidate at position {position}: {row}")
        logprob = float(self.candidate_logprobs[position, row.index(token)])
        top = tuple(zip(self.top_ids[position, :n].tolist(), self.top_logprobs[position, :n].tolist()))
        return logprob, top


def raw_logprobs(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax of raw logits [..., V] in float32, and its n most likely (ids, logprobs) [..., n] each."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [..., V]
    top_lp, top_ids = logprobs.topk(n, dim=-1) if n else (logprobs[..., :0], logprobs[..., :0].long())
    return logprobs, top_ids, top_lp


def gather_candidates(logprobs: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The logprobs [..., C] of `candidates` [..., C] (PAD_TOKEN_ID slots read token 0) in `logprobs` [..., V]."""
    return logprobs.gather(-1, candidates.clamp(min=0)).masked_fill(candidates == PAD_TOKEN_ID, float("-inf"))

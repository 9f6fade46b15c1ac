"""The contracts between the coordinator and the parts of a unit: what crosses, and who answers.

A unit is a coordinator with a **target** (`TargetBackend.step(TargetBatch) -> TargetResult` per round, over
its own KV caches), a **drafter** (`DrafterBackend.propose([DraftRequest]) -> DraftBatch`) and its local policy
(`actors.policy.UnitPolicy`). Backends are async because any of them may live behind a Ray actor. Below them
sit synchronous, torch-only parts: an `Engine` (sequences by id over a KV cache) and a `Drafter`. Everything
that crosses is a small frozen dataclass; tensors carry a shape comment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from actors.sampling import GREEDY, SamplingSpec
from policies import PAD_TOKEN_ID, Verdict
from policies.asd import ASDConfig
from policies.asd_sampled import SampledScores
from policies.penalties import BlockLogprobs, Penalties
from policies.scores import TargetScores

NO_CROP = -1  # TargetBatch.crops[b]: keep every cached position


# --- drafter -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftRequest:
    seq_id: str
    context: Sequence[int]  # committed tokens: prompt + output so far
    gamma: int  # tokens wanted (≥ 1)
    sampling: SamplingSpec = GREEDY
    rules: Penalties | None = None  # the request's rules on the target's logits (a model drafter applies them too)
    prompt_len: int = 0  # context[:prompt_len] is the prompt: the rules count the output after it


@dataclass(frozen=True)
class DraftBatch:
    """Draft ids per row; a drafter that knows how likely its drafts are (the suffix drafter) adds, per token,
    its confidence c_j ≈ P(draft tokens 0..j all accepted), and per row the match length L its draft continues
    (`policies.confidence` learns α from both)."""

    draft_ids: torch.Tensor  # [B, Kmax] long, padded with PAD_TOKEN_ID
    draft_lens: torch.Tensor  # [B] long, tokens actually proposed per row
    draft_probs: torch.Tensor | None  # [B, Kmax, V] float q rows when any row samples, else None
    confidence: torch.Tensor | None = None  # [B, Kmax] float, 0 beyond a row's draft; None: not reported
    match_lens: torch.Tensor | None = None  # [B] long; None when confidence is None

    @staticmethod
    def empty(batch_size: int) -> DraftBatch:
        """No drafts: one padded column, since a block always has K ≥ 1 positions (draft_lens 0 = plain)."""
        return DraftBatch.from_rows([[] for _ in range(batch_size)])

    @staticmethod
    def from_rows(rows: Sequence[Sequence[int]], draft_probs: torch.Tensor | None = None,
                  confidence: Sequence[Sequence[float]] | None = None,
                  match_lens: Sequence[int] | None = None) -> DraftBatch:
        """Pack ragged rows of draft ids, padding with PAD_TOKEN_ID to at least one column (and confidence
        rows, one value per draft token, with 0)."""
        width = max(1, max((len(r) for r in rows), default=0))
        # padded on the host and converted once: a tensor write per row cost more than the drafting itself
        ids = torch.tensor([[*row, *[PAD_TOKEN_ID] * (width - len(row))] for row in rows],
                           dtype=torch.long).reshape(len(rows), width)  # [B, Kmax]
        conf = None if confidence is None else torch.tensor(
            [[*c, *[0.0] * (width - len(row))] for row, c in zip(rows, confidence)],
            dtype=torch.float).reshape(len(rows), width)  # [B, Kmax]
        lens = None if confidence is None else torch.as_tensor(list(match_lens or [0] * len(rows)), dtype=torch.long)
        return DraftBatch(ids, torch.tensor([len(r) for r in rows], dtype=torch.long), draft_probs, conf, lens)

    def scatter(self, rows: Sequence[int], batch_size: int) -> DraftBatch:
        """This batch's row j as row `rows[j]` of a batch of `batch_size`; the other rows draft nothing."""
        width = self.draft_ids.shape[1]
        index = torch.as_tensor(list(rows), dtype=torch.long)  # [b]
        ids = torch.full((batch_size, width), PAD_TOKEN_ID, dtype=torch.long)  # [B, Kmax]
        ids[index] = self.draft_ids
        lens = torch.zeros(batch_size, dtype=torch.long)  # [B]
        lens[index] = self.draft_lens
        parts = []
        for part in (self.draft_probs, self.confidence, self.match_lens):  # [b, Kmax, V], [b, Kmax], [b]
            full = None
            if part is not None:
                full = torch.zeros((batch_size, *part.shape[1:]), dtype=part.dtype)  # [B, ...]
                full[index] = part
            parts.append(full)
        return DraftBatch(ids, lens, *parts)

    def row_confidence(self, b: int) -> tuple[tuple[float, ...], int] | None:
        """(confidence of each drafted token, match length) of row b, None when the drafter reports none."""
        if self.confidence is None:
            return None
        k = int(self.draft_lens[b])
        return tuple(self.confidence[b, :k].tolist()), int(self.match_lens[b])



class Drafter(Protocol):
    """A synchronous, torch-only drafter. `free_drafts`: proposing costs ~nothing (prompt lookup), so the
    coordinator may fill a round's padded width with drafts."""

    free_drafts: bool

    def propose(self, requests: list[DraftRequest]) -> DraftBatch: ...

    def release(self, seq_id: str) -> None: ...


@runtime_checkable
class DrafterBackend(Protocol):
    free_drafts: bool

    async def propose(self, requests: list[DraftRequest]) -> DraftBatch: ...

    async def release(self, seq_id: str) -> None: ...

    async def recover(self) -> None:
        """Bring a failed drafter back (returns once it answers again); raises while it cannot."""

    async def close(self) -> None: ...


# --- target --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowRules:
    """A row's rules on the target's logits (`policies.penalties`) and the context they read: the request's
    prompt and its output before this round's block; and its grammar's allowed tokens at each position."""

    penalties: Penalties | None
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    grammar_mask: torch.Tensor | None = None  # [k+1, ceil(V / 32)] int32 bitmask (`actors.grammar`), None: any


@dataclass(frozen=True)
class TargetBatch:
    """Every active row of one round. Row b first crops its KV cache to `crops[b]` (rolling back last round's
    rejected drafts), then feeds `tokens[b]`: the pending token plus the row's drafts, or the prompt."""

    seq_ids: list[str]
    crops: list[int]  # per row: KV length to keep before feeding, NO_CROP to keep all
    tokens: list[list[int]]  # per row: pending token + drafts (or the prompt at prefill)
    draft_ids: torch.Tensor  # [B, Kmax] long, PAD_TOKEN_ID beyond a row's drafts
    draft_lens: torch.Tensor  # [B] long
    sampling: list[SamplingSpec]  # per row
    draft_probs: torch.Tensor | None = None  # [B, Kmax, V] q rows of a model drafter, None = one-hot q
    prompt_rows: int = 0  # the last this many rows are prompt chunks: only their last position is scored
    # row -> its arm's ASDConfig, for sampled rows an ASD arm verifies with the relaxed rule
    # (`policies.asd_sampled`): the target returns their SampledScores instead of sampling them in place
    relaxed_sampled: dict[int, ASDConfig] = field(default_factory=dict)
    rules: dict[int, RowRules] = field(default_factory=dict)  # row -> its rules, for rows that have any
    logprobs: dict[int, int] = field(default_factory=dict)  # row -> top n, for rows that ask for logprobs

    def num_logits(self) -> list[int]:
        """Logit rows each row needs: pending + drafts, and the last position of a prompt chunk."""
        decode = len(self.tokens) - self.prompt_rows
        return [len(t) for t in self.tokens[:decode]] + [1] * self.prompt_rows


@dataclass(frozen=True)
class TargetResult:
    scores: TargetScores  # compact scores, all rows (sampled rows' entries unused)
    sampled_tokens: dict[int, list[int]] = field(default_factory=dict)  # row -> emitted tokens (sampled rows)
    sampled_accepted: dict[int, int] = field(default_factory=dict)  # row -> draft tokens accepted
    forward_s: float = 0.0  # model forward time inside the target
    sampled_scores: dict[int, SampledScores] = field(default_factory=dict)  # row -> [1, Kmax] on the CPU
    # (the rows of `TargetBatch.relaxed_sampled`; their decision and charge happen in the policy)
    logprobs: dict[int, BlockLogprobs] = field(default_factory=dict)  # row -> raw logprobs (`TargetBatch.logprobs`)


def split_result(result: TargetResult, rows: int) -> tuple[TargetResult, TargetResult]:
    """Rows [0, rows) and the rest of a result as two, each indexed from 0 (a round's decode rows and the
    prompt chunks fed in the same forward). Both keep the forward's time."""
    def part(lo: int, hi: int | None) -> TargetResult:
        def pick(by_row: dict) -> dict:
            return {b - lo: v for b, v in by_row.items() if b >= lo and (hi is None or b < hi)}

        s = result.scores
        scores = TargetScores(s.argmax_ids[lo:hi], s.argmax_logits[lo:hi], s.draft_logits[lo:hi])
        return TargetResult(scores, pick(result.sampled_tokens), pick(result.sampled_accepted), result.forward_s,
                            pick(result.sampled_scores), pick(result.logprobs))

    return part(0, rows), part(rows, None)


class Engine(Protocol):
    """Sequences by id over a KV cache; prefill, decode and teacher-forced scoring are all `forward`."""

    vocab_size: int
    max_seq_len: int

    def forward(self, seq_ids: Sequence[str], tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int] | None = None) -> torch.Tensor: ...  # [B, T, V]

    def crop(self, seq_id: str, length: int) -> None: ...

    def release(self, seq_id: str) -> bool: ...

    def length(self, seq_id: str) -> int: ...

    def active_ids(self) -> list[str]: ...


class TargetUnavailable(RuntimeError):
    """The target failed (a shard died, the engine crashed); its cached sequences are lost until `rebuild()`."""


@runtime_checkable
class TargetBackend(Protocol):
    async def step(self, batch: TargetBatch) -> TargetResult: ...

    async def release(self, seq_ids: Sequence[str]) -> None: ...

    async def active_ids(self) -> list[str]: ...

    async def rebuild(self) -> None:
        """Replace a failed target; every cached sequence is lost."""

    async def close(self) -> None: ...


# --- policy --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowKey:
    request_id: str
    arm: str
    seeded: bool = False  # seeded sampled requests plan from their own history only, to reproduce


@dataclass(frozen=True)
class RoundReport:
    """What a unit measured in one round, for the α and cost estimates."""

    rows: tuple[tuple[RowKey, int, int], ...]  # (row, gamma drafted, accepted)
    batch_size: int
    draft_step_s: float  # drafter time per drafted position (0 when nothing was drafted)
    score_s: float  # target forward time for the round
    score_tokens: int  # tokens fed per row (max over rows: the padded width of the forward)
    drafts: tuple[tuple[tuple[float, ...], int] | None, ...] = ()  # per entry of rows: (confidence, match length)
    prompt_tokens: int = 0  # prompt-chunk tokens fed in the same forward: score_s is then not a v(γ) sample


@dataclass(frozen=True)
class ASDBatch:
    """The ASD rows of one arm and one rule in one round, in compact form: greedy rows carry `TargetScores`
    (verified by `policies.asd.verify_asd_scores`), sampled rows of a relaxed arm `SampledScores`
    (`policies.asd_sampled.verify_asd_sampled_scores`)."""

    request_ids: tuple[str, ...]
    draft_ids: torch.Tensor  # [A, K] long, PAD beyond draft_lens
    draft_lens: torch.Tensor  # [A] long
    scores: TargetScores | SampledScores  # [A, ...] compact target scores
    config: ASDConfig
    arm: str

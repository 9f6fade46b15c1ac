"""A small causal LM drafting autoregressively, batched over rows, with its own `Engine` (KV cache per sequence).

Its vocabulary must equal the target's; `check_vocab` says so at load, naming both models. When any row samples,
the q rows of every drafted position come back (`draft_probs`), one-hot for greedy rows.

A request's rules (`DraftRequest.rules`: penalties, logit_bias, min_tokens) apply to the drafter's logits as to
the target's, each drafted position seeing the output extended by the drafts before it, so the drafter proposes
what the penalised target would keep, and no banned token. Drafting runs on the engine's device: each step's
tokens are chosen there (argmax, or `RowSampler`: every row's distribution in one batched call, each sampled row
drawing from its own generator) and fed back as a device tensor, so the host waits once per `propose`, when the
drafts are brought back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from actors.contracts import DraftBatch, DraftRequest, Engine
from actors.devices import to_device, to_host
from actors.sampling import SamplingSpec, SeededGenerators
from policies.exact import process_logits
from policies.penalties import penalise_block


def check_vocab(target_name: str, target_vocab: int, drafter_name: str, drafter_vocab: int) -> None:
    if target_vocab != drafter_vocab:
        raise ValueError(
            f"drafter {drafter_name!r} has vocabulary size {drafter_vocab} but target {target_name!r} has "
            f"{target_vocab}; speculative decoding needs the same tokenizer and vocabulary"
        )


class ModelDrafter:
    """A small causal LM drafting autoregressively, batched over rows, with a KV cache per sequence.

    The cache holds the committed context plus the previous round's drafts; each round crops it back to the
    longest common prefix with the new context and feeds only the tokens it has not seen.
    """

    free_drafts = False  # every drafted position costs a drafter forward

    def __init__(self, engine: Engine, name: str = "drafter"):
        self.engine = engine
        self.name = name
        self._cached: dict[str, list[int]] = {}  # tokens whose KV sits in the engine, per sequence
        self._generators = SeededGenerators(salt=0x5EED, device=engine.device)

    def _sync(self, seq_id: str, context: Sequence[int]) -> list[int]:
        """Crop the cache to the common prefix with context; return the tokens to feed (never empty)."""
        cached = self._cached.get(seq_id, [])
        common = 0
        limit = min(len(cached), len(context))
        if limit:
            a = np.asarray(cached[:limit])
            b = np.asarray(context[:limit])
            diff = np.flatnonzero(a != b)
            common = int(diff[0]) if diff.size else limit
        common = min(common, len(context) - 1)  # always feed ≥ 1 token to get next-token logits
        if seq_id in self._cached:
            self.engine.crop(seq_id, common)
        self._cached[seq_id] = list(context)
        return list(context[common:])

    def propose(self, requests: list[DraftRequest]) -> DraftBatch:
        # rows by γ, longest first: the rows still drafting at step s are a prefix, so no step gathers rows
        active = sorted((i for i, r in enumerate(requests) if r.gamma > 0), key=lambda i: -requests[i].gamma)
        rows: list[list[int]] = [[] for _ in requests]
        if not active:
            return DraftBatch.from_rows(rows)
        seq_ids = [requests[i].seq_id for i in active]
        gammas = [requests[i].gamma for i in active]
        specs = [requests[i].sampling for i in active]
        feeds = [self._sync(requests[i].seq_id, requests[i].context) for i in active]
        try:
            return self._draft(requests, active, seq_ids, gammas, specs, feeds)
        except Exception:  # the engine's caches no longer match `_cached`: start these sequences over
            for sid in seq_ids:
                self.release(sid)
            raise

    def _draft(self, requests, active, seq_ids, gammas, specs, feeds) -> DraftBatch:
        rows: list[list[int]] = [[] for _ in requests]
        device, width = self.engine.device, gammas[0]
        sampler = None
        if any(not s.greedy for s in specs):
            generators = [self._generators.get(sid, spec) for sid, spec in zip(seq_ids, specs)]
            sampler = RowSampler(specs, generators, self.engine.vocab_size, device)
        rules = _Rules(requests, active, device)
        drafted = torch.zeros(len(active), width, dtype=torch.long, device=device)  # [A, Kmax]
        q_rows = None if sampler is None else torch.zeros(len(active), width, self.engine.vocab_size, device=device)
        for step in range(width):
            live = sum(g > step for g in gammas)
            fed = feeds if step == 0 else drafted[:live, step - 1 : step]  # host lists, then [L, 1] on the device
            z = self.engine.forward(seq_ids[:live], fed, [1] * live)[:, 0]  # [L, V]
            z = rules.apply(z, drafted, step)
            if sampler is None:
                drafted[:live, step] = z.argmax(dim=-1)
            else:
                drafted[:live, step], q_rows[:live, step] = sampler.sample(z)
        drafted_host = to_host([drafted])[0].tolist()  # the one wait for the device
        for j, i in enumerate(active):
            rows[i] = drafted_host[j][: gammas[j]]
            # every draft token but the last was fed: its KV sits in the engine
            self._cached[seq_ids[j]].extend(rows[i][:-1])
        probs = None
        if q_rows is not None:
            probs = torch.zeros(len(requests), width, self.engine.vocab_size)  # [B, Kmax, V], zero past a row's γ
            probs[torch.tensor(active)] = q_rows.cpu()
        return DraftBatch.from_rows(rows, probs)

    def release(self, seq_id: str) -> None:
        if self._cached.pop(seq_id, None) is not None:
            self.engine.release(seq_id)
        self._generators.release(seq_id)

    def active_ids(self) -> list[str]:
        return list(self._cached)


class _Rules:
    """The drafting rows' rules (`policies.penalties.penalise_block`), applied to each step's logits with the
    output extended by the row's drafts so far, as the target's block applies them at the same positions."""

    def __init__(self, requests: list[DraftRequest], active: list[int], device):
        self.rows = []  # (row among the drafting rows, rules, prompt ids [P], output ids [O]) on the device
        for j, i in enumerate(active):
            request = requests[i]
            if request.rules is not None:
                context = torch.as_tensor(np.asarray(request.context, dtype=np.int64))
                prompt, output = to_device([context[: request.prompt_len], context[request.prompt_len :]], device)
                self.rows.append((j, request.rules, prompt, output))

    def apply(self, z: torch.Tensor, drafted: torch.Tensor, step: int) -> torch.Tensor:
        """z [L, V] of the first L drafting rows at `step`, its ruled rows penalised (a new tensor when any is);
        drafted [A, Kmax] holds the steps before."""
        live = [row for row in self.rows if row[0] < z.shape[0]]
        if not live:
            return z
        z = z.clone()
        for j, rules, prompt, output in live:
            seen = torch.cat([output, drafted[j, :step]])
            z[j] = penalise_block(z[j : j + 1], rules, prompt, seen, seen[:0])[0]
        return z


class RowSampler:
    """Per-row sampling of a batch of drafting rows on the device: `process_logits` once for all rows (with
    per-row temperature, top_k, top_p; greedy rows get their one-hot q), then one draw per sampled row from
    its own generator. Rows are a prefix of the rows it was built for (the rows still drafting)."""

    def __init__(self, specs: list[SamplingSpec], generators: list, vocab: int, device: torch.device):
        host = [torch.tensor([s.temperature for s in specs], dtype=torch.float32),
                torch.tensor([s.top_k or vocab for s in specs]),  # V keeps every token
                torch.tensor([s.top_p or 1.0 for s in specs], dtype=torch.float32)]  # 1 keeps every token
        self.temperature, self.top_k, self.top_p = to_device(host, device)  # [A] each
        self.use_top_k = any(s.top_k for s in specs)
        self.use_top_p = any(s.top_p for s in specs)
        self.sampled = [(j, g) for j, (s, g) in enumerate(zip(specs, generators)) if not s.greedy]

    def sample(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [L] and their distributions q [L, V] for the logits z [L, V] of the first L rows."""
        live = z.shape[0]
        q = process_logits(z, self.temperature[:live], self.top_k[:live] if self.use_top_k else None,
                           self.top_p[:live] if self.use_top_p else None, validate=False)  # [L, V]
        tokens = z.argmax(dim=-1)  # [L]
        for j, generator in self.sampled:
            if j < live:
                tokens[j : j + 1] = torch.multinomial(q[j], 1, generator=generator)
        return tokens, q

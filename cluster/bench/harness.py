"""In-process measurement: one `Engine`, one coordinator per mode, requests run one by one or in waves.

A **mode** is what varies between measured runs on the same prompts: target-only, a fixed γ, adaptive γ, or an
ASD arm. Each mode gets a fresh `PolicyCore` that lives for the whole run (warm-up included), as a serving
unit's policy actor lives across requests; so adaptive γ is measured in its steady state, not at its prior.

Timing. A request's **e2e** time is from submission to its last token (prefill included, what a user waits);
its **decode** time is from the first token to the last. tokens/s of a run is Σ output tokens / Σ e2e seconds
at concurrency 1, and Σ output tokens / Σ wave wall time at concurrency N (N requests submitted together).
Every round's `RoundRecord` is kept (single stream) for the α, c and v(γ) fit in `cluster.bench.speedup`.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

from actors.coordinator import EXACT, ArmSpec, Coordinator, GenerationRequest, SamplingParams
from actors.policy_actor import PolicyCore
from actors.stats import RequestRecord, RoundRecord
from cluster.bench.workloads import Prompt, cycle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mode:
    """How a run decodes. `fixed_gamma` None with `speculate` True is adaptive γ."""

    name: str
    speculate: bool = True
    fixed_gamma: int | None = None
    arm: ArmSpec = EXACT


TARGET_ONLY = Mode("target_only", speculate=False)
ADAPTIVE = Mode("adaptive")


def fixed(gamma: int) -> Mode:
    return Mode(f"fixed_{gamma}", fixed_gamma=gamma)


@dataclass(frozen=True)
class RequestMeasure:
    prompt: str
    token_ids: tuple[int, ...]
    e2e_s: float
    decode_s: float  # first token to last token
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    regret_spent: float | None = None
    relaxed_tokens: int | None = None

    @property
    def output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class RunMeasure:
    """One mode on one workload at one concurrency: the median repeat's requests and every repeat's rate."""

    workload: str
    mode: str
    concurrency: int
    tokens_per_s: float  # median over repeats
    decode_tokens_per_s: float  # median over repeats; (tokens - 1) / decode time (concurrency 1 only)
    repeat_tokens_per_s: tuple[float, ...]
    requests: tuple[RequestMeasure, ...]  # from the median repeat
    rounds: tuple[RoundRecord, ...] = field(default=(), repr=False)  # median repeat, concurrency 1 only

    def latencies(self) -> list[float]:
        return [r.e2e_s for r in self.requests]

    def summary(self) -> dict:
        """The JSON form (rounds are summarized by cluster.bench.speedup, not dumped)."""
        drafted = sum(r.draft_tokens for r in self.requests)
        accepted = sum(r.accepted_tokens for r in self.requests)
        rounds = sum(r.rounds for r in self.requests)
        lat = sorted(self.latencies())
        out = {
            "workload": self.workload, "mode": self.mode, "concurrency": self.concurrency,
            "tokens_per_s": self.tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s,
            "repeat_tokens_per_s": list(self.repeat_tokens_per_s),
            "output_tokens": sum(r.output_tokens for r in self.requests),
            "rounds": rounds, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": accepted / rounds if rounds else None,
            "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
        }
        regret = [r.regret_spent for r in self.requests if r.regret_spent is not None]
        if regret:
            out["regret_spent_mean"] = statistics.fmean(regret)
            out["relaxed_tokens"] = sum(r.relaxed_tokens or 0 for r in self.requests)
        return out


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile of already sorted values (None when empty)."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class RoundCollector:
    """A `LoopObserver` that keeps every round and request record of a run."""

    def __init__(self):
        self.rounds: list[RoundRecord] = []
        self.requests: list[RequestRecord] = []

    def on_round(self, record: RoundRecord) -> None:
        self.rounds.append(record)

    def on_request(self, record: RequestRecord) -> None:
        self.requests.append(record)


class InProcessBench:
    """Runs modes on prompts over one engine. `drafter` is shared by all modes (the n-gram one is stateless).

    policy: `PolicyCore` keyword arguments (γ bounds, priors); `fixed_gamma` is set per mode.
    """

    def __init__(self, engine, drafter, *, eos_token_ids, policy: dict, max_tokens: int, repeats: int = 1,
                 warmup: int = 1):
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        if repeats < 1:
            raise ValueError(f"repeats: must be >= 1, got {repeats}")
        self.engine = engine
        self.drafter = drafter
        self.eos = tuple(eos_token_ids)
        self.policy = dict(policy)
        self.max_tokens = max_tokens
        self.repeats = repeats
        self.warmup = warmup
        self._ids = 0

    def _coordinator(self, mode: Mode, observer: RoundCollector) -> Coordinator:
        policy = PolicyCore(**{**self.policy, "fixed_gamma": mode.fixed_gamma})
        return Coordinator.local(self.engine, self.drafter, policy, eos_token_ids=self.eos, unit="bench",
                                 observer=observer, max_batch_size=self.engine.max_slots)

    def _request(self, prompt: Prompt, mode: Mode) -> GenerationRequest:
        self._ids += 1
        return GenerationRequest(f"{prompt.name}#{self._ids}", list(prompt.ids), SamplingParams(self.max_tokens),
                                 mode.arm, speculate=mode.speculate)

    def warm_up(self, prompt: Prompt) -> None:
        """One untimed request, so the first measured run does not pay for torch's first calls."""
        self.run([prompt], TARGET_ONLY, warmup=0)

    def run(self, prompts: list[Prompt], mode: Mode, concurrency: int = 1, warmup: int | None = None) -> RunMeasure:
        """Warm up on the first `warmup` prompts (default: the bench's), then run all prompts `repeats` times;
        at concurrency N, in waves of N prompts (cycled). The warm-up also teaches an adaptive policy."""
        if concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
        observer = RoundCollector()
        coordinator = self._coordinator(mode, observer)
        for prompt in prompts[: self.warmup if warmup is None else warmup]:
            coordinator.generate_sync(self._request(prompt, mode))
        batch = prompts if concurrency == 1 else cycle(prompts, max(concurrency, len(prompts)))
        repeats = []
        for _ in range(self.repeats):
            observer.rounds.clear()
            repeats.append(self._repeat(coordinator, observer, batch, mode, concurrency))
        rates = [r[0] for r in repeats]
        median = sorted(range(len(repeats)), key=lambda i: rates[i])[(len(repeats) - 1) // 2]
        rate, decode_rate, requests, rounds = repeats[median]
        return RunMeasure(prompts[0].workload, mode.name, concurrency, rate, decode_rate, tuple(rates),
                          tuple(requests), tuple(rounds) if concurrency == 1 else ())

    def _repeat(self, coordinator, observer, batch, mode, concurrency):
        requests: list[RequestMeasure] = []
        wall = 0.0
        for start in range(0, len(batch), concurrency):
            wave = batch[start : start + concurrency]
            t0 = time.perf_counter()
            results = coordinator.generate_many_sync([self._request(p, mode) for p in wave])
            wall += time.perf_counter() - t0
            for prompt, result in zip(wave, results):
                if result.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"{prompt.name}: finished with {result.finish_reason!r}")
                requests.append(_measure(prompt, result))
        tokens = sum(r.output_tokens for r in requests)
        decode_s = sum(r.decode_s for r in requests)
        decode_rate = sum(max(0, r.output_tokens - 1) for r in requests) / decode_s if decode_s > 0 else 0.0
        return tokens / wall, decode_rate, requests, list(observer.rounds)


def _measure(prompt: Prompt, result) -> RequestMeasure:
    rec = result.record
    first = rec.first_token_s if rec.first_token_s is not None else rec.started_s
    return RequestMeasure(
        prompt=prompt.name, token_ids=tuple(result.token_ids), e2e_s=rec.finished_s - rec.started_s,
        decode_s=rec.finished_s - first, rounds=rec.rounds, draft_tokens=rec.draft_tokens,
        accepted_tokens=rec.accepted_tokens, regret_spent=rec.regret_spent, relaxed_tokens=rec.relaxed_tokens,
    )

"""In-process measurement: one `Engine`, one coordinator per mode, requests run one by one or in waves.

A **mode** is what varies between runs on the same prompts: target-only, a fixed γ, adaptive γ, or an ASD arm;
each has its own `PolicyCore` for the whole sweep (warm-up included). The modes of a sweep are interleaved wave
by wave. A request's **e2e** time runs from submission to its last token, its **decode** time from the first
token to the last; a run's tokens/s is Σ output tokens / Σ wave time, each wave's time its fastest repeat
(`best_of`). Every single-stream `RoundRecord` is kept for `bench.speedup`. Why: docs/benchmarks.md, "Method".
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

from actors.coordinator import Coordinator
from actors.policy import PolicyCore
from actors.requests import EXACT, ArmSpec, GenerationRequest, SamplingParams
from actors.stats import RequestRecord, RoundRecord
from bench.workloads import Prompt, cycle

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
    """One mode on one workload at one concurrency: rates from each wave's fastest repeat (`best_of`), every
    repeat's own rate, and the median repeat's requests."""

    workload: str
    mode: str
    concurrency: int
    tokens_per_s: float  # Σ tokens / Σ per-wave least wall time over repeats
    decode_tokens_per_s: float  # Σ (tokens - 1) / Σ per-request least decode time (concurrency 1 only)
    repeat_tokens_per_s: tuple[float, ...]
    requests: tuple[RequestMeasure, ...]  # from the median repeat
    rounds: tuple[RoundRecord, ...] = field(default=(), repr=False)  # median repeat, concurrency 1 only

    def latencies(self) -> list[float]:
        return [r.e2e_s for r in self.requests]

    def summary(self) -> dict:
        """The JSON form (rounds are summarized by bench.speedup, not dumped)."""
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


def best_of(tokens: list[int], seconds_by_repeat: list[list[float]]) -> float:
    """Σ tokens / Σ_i min over repeats of seconds[i]: each item's least disturbed time (0 when no time)."""
    total = sum(min(times) for times in zip(*seconds_by_repeat))
    return sum(tokens) / total if total > 0 else 0.0


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


class ModeRunner:
    """One mode's coordinator (and policy) on the bench's engine, kept across a whole sweep."""

    def __init__(self, bench: "InProcessBench", mode: Mode):
        self.bench = bench
        self.mode = mode
        self.collector = RoundCollector()
        policy = PolicyCore(**{**bench.policy, "fixed_gamma": mode.fixed_gamma})
        self.coordinator = Coordinator.local(bench.engine, bench.drafter, policy, eos_token_ids=bench.eos,
                                             unit="bench", observer=self.collector,
                                             max_batch_size=bench.engine.max_slots)

    @property
    def learns(self) -> bool:
        """Adaptive γ learns α and costs: it is warmed up before it is measured."""
        return self.mode.speculate and self.mode.fixed_gamma is None

    def wave(self, prompts: list[Prompt]) -> tuple[list[RequestMeasure], float]:
        """Run prompts together (one batched wave); (measures, wall seconds)."""
        t0 = time.perf_counter()
        results = self.coordinator.generate_many_sync([self.bench.request(p, self.mode) for p in prompts])
        wall = time.perf_counter() - t0
        for prompt, result in zip(prompts, results):
            if result.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"{prompt.name} ({self.mode.name}): finished with {result.finish_reason!r}")
        return [_measure(p, r) for p, r in zip(prompts, results)], wall


class InProcessBench:
    """Runs modes on prompts over one engine. `drafter` is shared by all modes (the n-gram one is stateless).

    policy: `PolicyCore` keyword arguments (γ bounds, priors); `fixed_gamma` is set per mode.
    Modes of one sweep are **interleaved**: every wave of prompts runs under each mode in turn (order
    alternating), so a machine whose load drifts during the run biases no mode against another.
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

    def request(self, prompt: Prompt, mode: Mode) -> GenerationRequest:
        self._ids += 1
        return GenerationRequest(f"{prompt.name}#{self._ids}", list(prompt.ids), SamplingParams(self.max_tokens),
                                 mode.arm, speculate=mode.speculate)

    def runner(self, mode: Mode) -> ModeRunner:
        return ModeRunner(self, mode)

    def warm_up(self, prompt: Prompt) -> None:
        """One untimed request, so the first measured run does not pay for torch's first calls."""
        self.runner(TARGET_ONLY).wave([prompt])

    def run(self, prompts: list[Prompt], mode: Mode, concurrency: int = 1) -> RunMeasure:
        return self.sweep(prompts, [mode], concurrency)[mode.name]

    def sweep(self, prompts: list[Prompt], modes: list[Mode], concurrency: int = 1) -> dict[str, RunMeasure]:
        """Warm up the learning modes on the first `warmup` prompts, then run all prompts `repeats` times under
        every mode, interleaved; at concurrency N, in waves of N prompts (cycled)."""
        if concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
        if len({m.name for m in modes}) != len(modes):
            raise ValueError("modes: names must be distinct")
        runners = [self.runner(m) for m in modes]
        for runner in runners:
            if runner.learns:
                for prompt in prompts[: self.warmup]:
                    runner.wave([prompt])
        batch = prompts if concurrency == 1 else cycle(prompts, max(concurrency, len(prompts)))
        waves = [batch[i : i + concurrency] for i in range(0, len(batch), concurrency)]
        repeats: dict[str, list] = {m.name: [] for m in modes}
        wave_walls: dict[str, list[list[float]]] = {m.name: [] for m in modes}  # [repeat][wave]
        for r in range(self.repeats):
            measures = {m.name: [] for m in modes}
            walls = {m.name: [] for m in modes}
            for runner in runners:
                runner.collector.rounds.clear()
            for i, wave in enumerate(waves):
                for runner in runners if (i + r) % 2 == 0 else runners[::-1]:
                    got, wall = runner.wave(wave)
                    measures[runner.mode.name].extend(got)
                    walls[runner.mode.name].append(wall)
            for runner in runners:
                name = runner.mode.name
                wave_walls[name].append(walls[name])
                repeats[name].append(_rates(measures[name], sum(walls[name])) + (list(runner.collector.rounds),))
        out = {}
        for mode in modes:
            reps = repeats[mode.name]
            rates = [r[0] for r in reps]
            _, _, requests, rounds = reps[sorted(range(len(reps)), key=lambda i: rates[i])[(len(reps) - 1) // 2]]
            tokens = [r.output_tokens for r in requests]
            decode_s = [[m.decode_s for m in rep[2]] for rep in reps]  # [repeat][request]
            decode_rate = best_of([max(0, t - 1) for t in tokens], decode_s)
            rate = best_of(tokens, wave_walls[mode.name])
            out[mode.name] = RunMeasure(prompts[0].workload, mode.name, concurrency, rate, decode_rate,
                                        tuple(rates), tuple(requests), tuple(rounds) if concurrency == 1 else ())
        return out


def _rates(requests: list[RequestMeasure], wall: float) -> tuple[float, float, list[RequestMeasure]]:
    """(tokens/s over wall time, decode tokens/s, requests)."""
    tokens = sum(r.output_tokens for r in requests)
    decode_s = sum(r.decode_s for r in requests)
    decode_rate = sum(max(0, r.output_tokens - 1) for r in requests) / decode_s if decode_s > 0 else 0.0
    return tokens / wall if wall > 0 else 0.0, decode_rate, requests


def _measure(prompt: Prompt, result) -> RequestMeasure:
    rec = result.record
    first = rec.first_token_s if rec.first_token_s is not None else rec.started_s
    return RequestMeasure(
        prompt=prompt.name, token_ids=tuple(result.token_ids), e2e_s=rec.finished_s - rec.started_s,
        decode_s=rec.finished_s - first, rounds=rec.rounds, draft_tokens=rec.draft_tokens,
        accepted_tokens=rec.accepted_tokens, regret_spent=rec.regret_spent, relaxed_tokens=rec.relaxed_tokens,
    )

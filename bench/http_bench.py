"""The HTTP path: the real Serve app on a local Ray cluster, driven over `/v1/completions` with token-id prompts.

One deployment per γ setting (adaptive, or `gamma.mode: fixed`), each under its own app name so its policy
actor starts fresh; target-only is the same deployment with the request extension `speculate: false`.
Autoscaling is off: one unit. At concurrency N, prompts go out in waves of N requests sent together; aggregate
tokens/s is Σ completion tokens / Σ wave wall time, latency each request's response time. `measure_levels`
interleaves the levels' waves and keeps each wave's fastest repeat (`bench.harness.best_of`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from bench.harness import best_of, percentile
from bench.workloads import Prompt, cycle

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class HttpMeasure:
    workload: str
    mode: str  # "adaptive" | "fixed_<g>" | "target_only"
    concurrency: int
    tokens_per_s: float
    latencies_s: tuple[float, ...]
    output_tokens: int
    token_ids: tuple[tuple[int, ...], ...] = ()

    def summary(self) -> dict:
        lat = sorted(self.latencies_s)
        return {"workload": self.workload, "mode": self.mode, "concurrency": self.concurrency,
                "tokens_per_s": self.tokens_per_s, "output_tokens": self.output_tokens,
                "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95)}


def bench_config(config, *, name: str, fixed_gamma: int | None, port: int):
    """A copy of `config` for one benchmark deployment: its own app name, one unit, the γ mode asked for."""
    gamma = config.gamma.model_copy(update={"mode": "fixed", "fixed": fixed_gamma} if fixed_gamma is not None
                                    else {"mode": "adaptive"})
    if fixed_gamma is not None and fixed_gamma > gamma.gamma_max:
        gamma = gamma.model_copy(update={"gamma_max": fixed_gamma})
    from bench.drafter import bench_drafter_spec

    return config.model_copy(update={
        "name": name, "gamma": gamma, "drafter": bench_drafter_spec(config),
        "autoscaling": config.autoscaling.model_copy(update={"enabled": False, "min_replicas": 1,
                                                             "initial_replicas": 1, "max_replicas": 1}),
        "serving": config.serving.model_copy(update={"port": port, "host": "127.0.0.1"}),
        "audit": config.audit.model_copy(update={"fraction": 0.0}),
    })


def exact_arm(config) -> str:
    """The name of `config`'s first exact arm, which benchmarks force with `x-specserve-arm`; ValueError if none."""
    for arm in config.arms:
        if arm.verification == "exact":
            return arm.name
    raise ValueError("arms: the benchmark measures exact speculation and the config has no exact arm")


class ServedApp:
    """Serve's HTTP proxy on 127.0.0.1:`port`, on a local Ray cluster started here unless one is already
    initialized in this process; `deploy` replaces the running benchmark app."""

    def __init__(self, port: int = 8765, num_cpus: int | None = None):
        self.port = port
        self.num_cpus = num_cpus
        self.app_name: str | None = None
        self.served_name: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServedApp":
        import os

        import ray
        from ray import serve

        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:  # the served app at the priority of the in-process runs it is compared with
            from cluster.serving.app import serve_at_normal_priority

            serve_at_normal_priority()
            ray.init(address="local", num_cpus=self.num_cpus or os.cpu_count() or 2, include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        return self

    def deploy(self, config) -> None:
        """Serve `config` (see `bench_config`), deleting the previous benchmark app first."""
        from ray import serve

        from cluster.serving.app import build_app
        from cluster.config import dump_config

        if self.app_name is not None:
            serve.delete(self.app_name)
        serve.run(build_app({"config": dump_config(config)}), name=config.name, route_prefix="/")
        self.app_name, self.served_name = config.name, config.target.served_name
        self._wait_ready()

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the benchmark app did not become healthy at {self.url}")
            time.sleep(1.0)

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            if self._owns_ray:
                ray.shutdown()


async def _complete(client, url: str, model: str, prompt: Prompt, max_tokens: int, speculate: bool):
    body = {"model": model, "prompt": list(prompt.ids), "max_tokens": max_tokens, "temperature": 0.0,
            "speculate": speculate}
    start = time.perf_counter()
    response = await client.post(f"{url}/v1/completions", json=body)
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{prompt.name}: HTTP {response.status_code}: {response.text[:300]}")
    usage = response.json()["usage"]
    return usage["completion_tokens"], seconds


def complete_sync(app: ServedApp, prompt: Prompt, max_tokens: int, speculate: bool = True) -> tuple[int, float]:
    """One request, blocking: (completion tokens, seconds)."""
    import httpx

    async def one():
        async with httpx.AsyncClient(timeout=600) as client:
            return await _complete(client, app.url, app.served_name, prompt, max_tokens, speculate)

    return asyncio.run(one())


def measure(app: ServedApp, prompts: list[Prompt], *, mode: str, concurrency: int, max_tokens: int,
            speculate: bool = True, warmup: int = 1) -> HttpMeasure:
    """Waves of `concurrency` requests against the deployed app (after `warmup` single requests)."""
    import httpx

    if concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
    batch = prompts if concurrency == 1 else cycle(prompts, max(concurrency, len(prompts)))

    async def run():
        limits = httpx.Limits(max_connections=concurrency + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            for prompt in prompts[:warmup]:
                await _complete(client, app.url, app.served_name, prompt, max_tokens, speculate)
            tokens, latencies, wall = 0, [], 0.0
            for start in range(0, len(batch), concurrency):
                wave = batch[start : start + concurrency]
                t0 = time.perf_counter()
                results = await asyncio.gather(*(
                    _complete(client, app.url, app.served_name, p, max_tokens, speculate) for p in wave))
                wall += time.perf_counter() - t0
                tokens += sum(n for n, _ in results)
                latencies.extend(s for _, s in results)
            return tokens, latencies, wall

    tokens, latencies, wall = asyncio.run(run())
    return HttpMeasure(prompts[0].workload, mode, concurrency, tokens / wall, tuple(latencies), tokens)


def measure_levels(app: ServedApp, prompts: list[Prompt], *, mode: str, levels: tuple[int, ...], max_tokens: int,
                   repeats: int = 1, speculate: bool = True, warmup: int = 1) -> dict[int, HttpMeasure]:
    """Waves at every concurrency level, interleaved (wave k of each level in turn, the order alternating) and
    repeated; a level's tokens/s is Σ tokens / Σ each wave's least wall time over the repeats."""
    import httpx

    if not levels or min(levels) < 1:
        raise ValueError(f"levels: must be concurrency levels >= 1, got {levels}")
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    waves = {}
    for c in levels:
        batch = prompts if c == 1 else cycle(prompts, max(c, len(prompts)))
        waves[c] = [batch[i : i + c] for i in range(0, len(batch), c)]

    async def run():
        limits = httpx.Limits(max_connections=max(levels) + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            for prompt in prompts[:warmup]:
                await _complete(client, app.url, app.served_name, prompt, max_tokens, speculate)
            walls = {c: [[] for _ in range(repeats)] for c in levels}  # [repeat][wave]
            tokens = {c: [] for c in levels}  # per wave (greedy: the same every repeat)
            latencies = {c: [] for c in levels}
            for r in range(repeats):
                for k in range(max(len(w) for w in waves.values())):
                    for c in levels if (k + r) % 2 == 0 else levels[::-1]:
                        if k >= len(waves[c]):
                            continue
                        t0 = time.perf_counter()
                        results = await asyncio.gather(*(
                            _complete(client, app.url, app.served_name, p, max_tokens, speculate) for p in waves[c][k]))
                        walls[c][r].append(time.perf_counter() - t0)
                        if r == 0:
                            tokens[c].append(sum(n for n, _ in results))
                        latencies[c].extend(s for _, s in results)
            return walls, tokens, latencies

    walls, tokens, latencies = asyncio.run(run())
    return {c: HttpMeasure(prompts[0].workload, mode, c, best_of(tokens[c], walls[c]), tuple(latencies[c]),
                           sum(tokens[c])) for c in levels}

"""Stream batching (`serving.stream_interval_ms`) on against off, side by side on one Ray cluster.

`python -m bench.stream_batching [--config C] [--intervals 0,50] [--loads 8,32] [--repeats 3] [--out DIR]`
serves C once per interval, each app under its own route prefix (one unit each, exact arm forced), and sends
waves of N greedy streamed chat requests, the apps' waves interleaved in alternating order. Per app and load:
output tokens/s (Σ tokens / Σ wave wall time), the messages a token crosses (content chunks per output token),
time to first token and the gap between a stream's chunks (p50, p95). Writes DIR/results.json and prints a
table; docs/benchmarks.md, "Stream batching", has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from bench.harness import percentile


async def _stream(client, url: str, model: str, arm: str, text: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start, stamps, tokens = time.perf_counter(), [], None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers={"x-specserve-arm": arm}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", ())):
                stamps.append(time.perf_counter() - start)
    return {"tokens": tokens, "chunks": len(stamps), "ttft_s": stamps[0] if stamps else None,
            "gaps_s": [b - a for a, b in zip(stamps, stamps[1:])]}


def measure(apps: dict[str, str], model: str, arm: str, texts: list[str], loads, max_tokens: int,
            repeats: int) -> dict:
    """Per app (label → URL) and load: the waves' rows, the apps' waves interleaved, their order alternating."""
    import httpx

    async def run():
        out = {label: {str(n): {"wall_s": 0.0, "rows": []} for n in loads} for label in apps}
        limits = httpx.Limits(max_connections=max(loads) + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            for url in apps.values():  # warm-up
                await _stream(client, url, model, arm, texts[0], max_tokens)
            for r in range(repeats):
                for n in loads:
                    batch = [texts[(r * n + i) % len(texts)] for i in range(n)]
                    order = list(apps) if r % 2 == 0 else list(reversed(apps))
                    for label in order:
                        t0 = time.perf_counter()
                        rows = await asyncio.gather(*(_stream(client, apps[label], model, arm, t, max_tokens)
                                                      for t in batch))
                        cell = out[label][str(n)]
                        cell["wall_s"] += time.perf_counter() - t0
                        cell["rows"] += rows
        return out

    return asyncio.run(run())


def summarize(cell: dict) -> dict:
    rows = cell["rows"]
    tokens = sum(r["tokens"] for r in rows)
    gaps = sorted(g for r in rows for g in r["gaps_s"])
    ttft = sorted(r["ttft_s"] for r in rows if r["ttft_s"] is not None)
    return {"tokens_per_s": tokens / cell["wall_s"], "chunks_per_token": sum(r["chunks"] for r in rows) / tokens,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "gap_p50_s": percentile(gaps, 50) if gaps else None, "gap_p95_s": percentile(gaps, 95) if gaps else None,
            "requests": len(rows), "tokens": tokens}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--intervals", default="0,50", help="stream_interval_ms values, comma-separated")
    parser.add_argument("--loads", default="8,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8, help="chat prompts per workload (chat and edit)")
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    intervals = [float(v) for v in args.intervals.split(",")]
    loads = tuple(int(v) for v in args.loads.split(","))

    from ray import serve

    from bench.http_bench import ServedApp, bench_config, exact_arm
    from bench.workloads import _texts
    from cluster.config import dump_config, load_config
    from cluster.serving.app import build_app

    config = load_config(args.config)
    texts = [text for w in ("chat", "edit") for _, text, chat in _texts(w)[: args.prompts] if chat]
    apps = {}
    with ServedApp(args.port, num_cpus=2 * len(intervals) + 2) as app:  # logical CPUs: one app computes at a time
        for i, ms in enumerate(intervals):
            cfg = bench_config(config, name=f"stream-batching-{i}", fixed_gamma=None, port=args.port)
            cfg = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"stream_interval_ms": ms})})
            serve.run(build_app({"config": dump_config(cfg)}), name=cfg.name, route_prefix=f"/s{i}")
            apps[f"{ms:g} ms"] = f"{app.url}/s{i}"
        served = measure(apps, config.target.served_name, exact_arm(config), texts, loads, args.max_tokens,
                         args.repeats)
    results = {"config": args.config, "loads": list(loads), "repeats": args.repeats, "max_tokens": args.max_tokens,
               "apps": {label: {n: {**summarize(cell), "rows": cell["rows"]} for n, cell in cells.items()}
                        for label, cells in served.items()}}
    print("| interval | load | tok/s | chunks per token | TTFT p50 / p95 s | chunk gap p50 / p95 s |")
    print("|---|---|---|---|---|---|")
    for label, cells in results["apps"].items():
        for n, s in cells.items():
            print(f"| {label} | {n} | {s['tokens_per_s']:.1f} | {s['chunks_per_token']:.2f} | "
                  f"{s['ttft_p50_s']:.3f} / {s['ttft_p95_s']:.3f} | {s['gap_p50_s']:.3f} / {s['gap_p95_s']:.3f} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

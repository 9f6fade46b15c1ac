"""`specserve bench --section features [--quick] [--out DIR] [CONFIG]`: what issue 24's request fields cost.

For the CONFIG's engine and the other local engine (as `bench.breakdown` picks them), one served app each (one
unit, adaptive γ, `bench.http_bench.bench_config`), driven over HTTP with greedy chat requests. Each **variant**
is the same request with one field group added: `logprobs` (top 5), `penalties` (frequency, presence and
repetition), `json_schema` (`response_format`); `plain` has none. Every variant runs speculative and target-only
(`speculate: false`), at 1 and 8 concurrent streams, the variants' waves interleaved (the order alternating per
repeat) so drift hits all alike. Per cell: tokens/s, its **cost** against `plain` (1 − tokens/s ÷ plain's), and
the **speedup** of speculation over target-only under the variant. Goals: cost ≤ 5%, and the speedup holds
(≥ 95% of plain's). Writes DIR/results.json and DIR/report.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

log = logging.getLogger("specserve.bench")

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
          "required": ["answer", "confidence"], "additionalProperties": False}
VARIANTS = {
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 5},
    "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}},
}
PRESETS = {
    "quick": {"workloads": ("chat",), "prompts": 3, "max_tokens": 32, "loads": (1, 8), "repeats": 1},
    "full": {"workloads": ("chat", "edit"), "prompts": 8, "max_tokens": 96, "loads": (1, 8), "repeats": 2},
}
COST_GOAL = 0.05
SPEEDUP_KEPT = 0.95


async def _chat(client, url: str, model: str, text: str, max_tokens: int, extra: dict, speculate: bool) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.0, "speculate": speculate, **extra}
    response = await client.post(f"{url}/v1/chat/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    return response.json()["usage"]["completion_tokens"]


def measure(url: str, model: str, texts: list[str], preset: dict) -> dict:
    """tokens/s per load, variant and mode ("speculative" | "target_only"): Σ tokens ÷ Σ wave wall time."""
    import httpx

    cells = [(v, mode) for v in VARIANTS for mode in ("speculative", "target_only")]

    async def run():
        limits = httpx.Limits(max_connections=max(preset["loads"]) + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            for variant, extra in VARIANTS.items():  # warm-up: compiles each grammar once
                await _chat(client, url, model, texts[0], 8, extra, True)
            out = {}
            for n in preset["loads"]:
                tokens = {cell: 0 for cell in cells}
                walls = {cell: 0.0 for cell in cells}
                for r in range(preset["repeats"]):
                    for variant, mode in cells if r % 2 == 0 else cells[::-1]:
                        extra = VARIANTS[variant]
                        batch = texts if n == 1 else [texts[i % len(texts)] for i in range(n)]
                        t0 = time.perf_counter()
                        if n == 1:
                            counts = [await _chat(client, url, model, t, preset["max_tokens"], extra,
                                                  mode == "speculative") for t in batch]
                        else:
                            counts = await asyncio.gather(*(_chat(client, url, model, t, preset["max_tokens"], extra,
                                                                  mode == "speculative") for t in batch))
                        walls[variant, mode] += time.perf_counter() - t0
                        tokens[variant, mode] += sum(counts)
                out[str(n)] = {f"{v}/{m}": {"tokens": tokens[v, m], "wall_s": walls[v, m],
                                            "tokens_per_s": tokens[v, m] / walls[v, m]} for v, m in cells}
                log.info("  load %d: %s", n, ", ".join(f"{k} {c['tokens_per_s']:.1f}" for k, c in out[str(n)].items()))
            return out

    return asyncio.run(run())


def summarize(loads: dict) -> dict:
    """Per load and variant: cost against plain, speculation's speedup, and whether both goals hold."""
    out = {}
    for n, cells in loads.items():
        plain = cells["plain/speculative"]["tokens_per_s"]
        plain_speedup = plain / cells["plain/target_only"]["tokens_per_s"]
        out[n] = {}
        for variant in VARIANTS:
            tps = cells[f"{variant}/speculative"]["tokens_per_s"]
            speedup = tps / cells[f"{variant}/target_only"]["tokens_per_s"]
            cost = 1.0 - tps / plain
            out[n][variant] = {"tokens_per_s": tps, "cost": cost, "speedup": speedup,
                               "cost_met": cost <= COST_GOAL, "speedup_held": speedup >= SPEEDUP_KEPT * plain_speedup}
    return out


def report_markdown(results: dict) -> str:
    meta = results["meta"]
    lines = ["# What issue 24's request fields cost", "",
             f"`{meta['command']}`, started {meta['started']}, {meta['elapsed_s']:.0f} s. Greedy chat over HTTP; "
             f"cost = 1 − tokens/s ÷ plain's (goal ≤ {COST_GOAL:.0%}); speedup = speculative ÷ target-only under "
             f"the same variant (goal: ≥ {SPEEDUP_KEPT:.0%} of plain's).", ""]
    for engine in results["engines"]:
        lines += [f"## {engine['engine']} engine ({engine['config']})", "",
                  "| load | variant | tokens/s | cost | speedup | goals |", "|---|---|---|---|---|---|"]
        for n, variants in engine["summary"].items():
            for variant, s in variants.items():
                goals = "met" if s["cost_met"] and s["speedup_held"] else (
                    "missed: " + ", ".join(k for k, ok in (("cost", s["cost_met"]), ("speedup", s["speedup_held"]))
                                           if not ok))
                lines.append(f"| {n} | {variant} | {s['tokens_per_s']:.1f} | {s['cost']:+.1%} | "
                             f"{s['speedup']:.2f} | {goals if variant != 'plain' else '-'} |")
        lines.append("")
    for note in results.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def main_section(args, command: str) -> int:
    """Measure every engine; write DIR/results.json and DIR/report.md."""
    from bench.breakdown import measure_engines
    from bench.http_bench import ServedApp, bench_config
    from bench.workloads import _texts
    from cluster.config import load_config

    preset_name = "quick" if args.quick else "full"
    preset = PRESETS[preset_name]
    out = Path(args.out or f"bench-out/features-{preset_name}")
    out.mkdir(parents=True, exist_ok=True)

    def one(path: str) -> dict:
        config = load_config(path)
        texts = [text for w in preset["workloads"] for _, text, chat in _texts(w)[: preset["prompts"]] if chat]
        with ServedApp(args.port) as app:
            app.deploy(bench_config(config, name=f"features-{config.target.engine}", fixed_gamma=None, port=args.port))
            loads = measure(app.url, app.served_name, texts, preset)
        return {"config": path, "engine": config.target.engine, "loads": loads, "summary": summarize(loads)}

    results = measure_engines(args.config, "features", preset_name, command, one)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report_markdown(results))
    log.info("wrote %s and %s", out / "results.json", out / "report.md")
    return 0

"""`specserve bench --section features [--quick] [--out DIR] [CONFIG]`: what issue 24's request fields cost.

For the CONFIG's engine and the other local engine (as `bench.breakdown` picks them), one served app each (one
unit, adaptive γ, `bench.http_bench.bench_config`), driven over HTTP with greedy chat requests on the config's
exact arm (forced by header: an A/B split would mix in the ASD arm's other outputs). Each **variant** is the
same request with one field group added: `logprobs` (top 5), `penalties` (frequency, presence and repetition),
`json_schema` (`response_format`); `plain` has none. Every variant runs speculative and target-only (`speculate:
false`), at 1 and 8 concurrent streams, interleaved so that drift hits every cell alike: at one stream each
prompt runs in every cell back to back, at N each cell's wave follows the last, the order alternating. Per
cell: tokens/s, the acceptance of its drafts, its **cost** against `plain` (1 − tokens/s ÷ plain's) with a
bootstrap 95% CI over those interleaved blocks, and the **speedup** of speculation over target-only under the
variant. Goals: cost ≤ 5% (shown when the CI's upper end is ≤ 5%), and the speedup holds (≥ 95% of plain's).
Writes DIR/results.json and DIR/report.md after each engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from pathlib import Path

from cluster.serving.ab import ARM_HEADER

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


async def _chat(client, url: str, model: str, arm: str, text: str, max_tokens: int, extra: dict,
                speculate: bool) -> list[int]:
    """One greedy request on `arm`: [completion tokens, draft tokens, accepted draft tokens]."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.0, "speculate": speculate, **extra}
    response = await client.post(f"{url}/v1/chat/completions", json=body, headers={ARM_HEADER: arm})
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    usage = response.json()["usage"]
    speculative = usage.get("speculative") or {}
    return [usage["completion_tokens"], speculative.get("draft_tokens", 0), speculative.get("accepted_tokens", 0)]


def measure(url: str, model: str, arm: str, texts: list[str], preset: dict) -> dict:
    """Per load, every request on `arm`: tokens/s and acceptance per "variant/mode" cell (Σ tokens ÷ Σ wall time)
    and the `blocks` they came from (one per prompt and repeat at one stream, one per wave at N: {cell: [tokens,
    wall_s, draft tokens, accepted]}), for the CI."""
    import httpx

    cells = [(v, mode) for v in VARIANTS for mode in ("speculative", "target_only")]

    async def run():
        limits = httpx.Limits(max_connections=max(preset["loads"]) + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            for variant, extra in VARIANTS.items():  # warm-up: compiles each grammar once
                await _chat(client, url, model, arm, texts[0], 8, extra, True)

            async def timed(variant: str, mode: str, batch: list[str]) -> list[float]:
                t0 = time.perf_counter()
                counts = await asyncio.gather(*(_chat(client, url, model, arm, t, preset["max_tokens"],
                                                      VARIANTS[variant], mode == "speculative") for t in batch))
                tokens, draft, accepted = (sum(c[i] for c in counts) for i in range(3))
                return [tokens, time.perf_counter() - t0, draft, accepted]

            out = {}
            for n in preset["loads"]:
                blocks = []
                for r in range(preset["repeats"]):
                    batches = [[t] for t in texts] if n == 1 else [[texts[i % len(texts)] for i in range(n)]]
                    for b, batch in enumerate(batches):
                        order = cells if (r + b) % 2 == 0 else cells[::-1]
                        blocks.append({f"{v}/{m}": await timed(v, m, batch) for v, m in order})
                out[str(n)] = {**_totals(blocks), "blocks": blocks}
                log.info("  load %d: %s", n, ", ".join(f"{k} {c['tokens_per_s']:.1f}"
                                                        for k, c in _totals(blocks).items()))
            return out

    return asyncio.run(run())


def _totals(blocks: list[dict]) -> dict:
    """{cell: {"tokens", "wall_s", "tokens_per_s", "acceptance"}} summed over `blocks`."""
    out = {}
    for cell in blocks[0]:
        tokens, wall, draft, accepted = (sum(b[cell][i] for b in blocks) for i in range(4))
        out[cell] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                     "acceptance": accepted / draft if draft else None}
    return out


def _cost_ci(blocks: list[dict], variant: str, mode: str = "speculative", draws: int = 2000,
             seed: int = 0) -> list[float] | None:
    """Bootstrap 95% CI of `variant`'s cost against plain in `mode`, resampling whole blocks (each holds every
    cell, measured side by side); None with fewer than 3 blocks."""
    if len(blocks) < 3:
        return None
    rng = random.Random(seed)
    costs = []
    for _ in range(draws):
        sample = _totals([rng.choice(blocks) for _ in blocks])
        plain = sample[f"plain/{mode}"]["tokens_per_s"]
        costs.append(1.0 - sample[f"{variant}/{mode}"]["tokens_per_s"] / plain)
    costs.sort()
    return [costs[int(0.025 * draws)], costs[int(0.975 * draws) - 1]]


def summarize(loads: dict) -> dict:
    """Per load and variant: cost against plain, speculation's speedup, and whether both goals hold; beside
    them `work_cost`, the cost target-only (the field's own work, without its effect on what is accepted)."""
    out = {}
    for n, cells in loads.items():
        blocks = cells.get("blocks")
        plain = cells["plain/speculative"]["tokens_per_s"]
        plain_speedup = plain / cells["plain/target_only"]["tokens_per_s"]
        out[n] = {}
        for variant in VARIANTS:
            tps = cells[f"{variant}/speculative"]["tokens_per_s"]
            speedup = tps / cells[f"{variant}/target_only"]["tokens_per_s"]
            cost = 1.0 - tps / plain
            compared = bool(blocks) and variant != "plain"
            ci = _cost_ci(blocks, variant) if compared else None
            work_ci = _cost_ci(blocks, variant, "target_only") if compared else None
            alone = cells[f"{variant}/target_only"]["tokens_per_s"] / cells["plain/target_only"]["tokens_per_s"]
            out[n][variant] = {"tokens_per_s": tps, "acceptance": cells[f"{variant}/speculative"].get("acceptance"),
                               "cost": cost, "cost_ci": ci, "work_cost": 1.0 - alone, "work_cost_ci": work_ci,
                               "speedup": speedup,
                               "cost_met": cost <= COST_GOAL, "cost_shown": ci is not None and ci[1] <= COST_GOAL,
                               "speedup_held": speedup >= SPEEDUP_KEPT * plain_speedup}
    return out


def report_markdown(results: dict) -> str:
    meta = results["meta"]
    lines = ["# What issue 24's request fields cost", "",
             f"`{meta['command']}`, started {meta['started']}, {meta['elapsed_s']:.0f} s. Greedy chat over HTTP; "
             f"cost = 1 − tokens/s ÷ plain's (goal ≤ {COST_GOAL:.0%}); speedup = speculative ÷ target-only under "
             f"the same variant (goal: ≥ {SPEEDUP_KEPT:.0%} of plain's).", ""]
    for engine in results["engines"]:
        lines += [f"## {engine['engine']} engine ({engine['config']})", "",
                  "| load | variant | tokens/s | acceptance | cost (95% CI) | target-only cost (95% CI) | speedup "
                  "| goals |",
                  "|---|---|---|---|---|---|---|---|"]
        for n, variants in engine["summary"].items():
            for variant, s in variants.items():
                goals = "met" if s["cost_met"] and s["speedup_held"] else (
                    "missed: " + ", ".join(k for k, ok in (("cost", s["cost_met"]), ("speedup", s["speedup_held"]))
                                           if not ok))
                ci = s.get("cost_ci")
                cost = _with_ci(s["cost"], ci)
                work = "-" if "work_cost" not in s else _with_ci(s["work_cost"], s["work_cost_ci"])
                if ci is not None and goals == "met" and not s["cost_shown"]:
                    goals = f"met; the CI reaches {ci[1]:+.1%}"
                acceptance = "-" if s.get("acceptance") is None else f"{s['acceptance']:.0%}"
                lines.append(f"| {n} | {variant} | {s['tokens_per_s']:.1f} | {acceptance} | {cost} | {work} | "
                             f"{s['speedup']:.2f} | {goals if variant != 'plain' else '-'} |")
        lines.append("")
    for note in results.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def _with_ci(value: float, ci: list[float] | None) -> str:
    return f"{value:+.1%}" + ("" if ci is None else f" ({ci[0]:+.1%} to {ci[1]:+.1%})")


def main_section(args, command: str) -> int:
    """Measure every engine; write DIR/results.json and DIR/report.md."""
    from bench.breakdown import measure_engines
    from bench.http_bench import ServedApp, bench_config, exact_arm
    from bench.workloads import _texts
    from cluster.config import load_config

    preset_name = "quick" if args.quick else "full"
    preset = PRESETS[preset_name]
    out = Path(args.out or f"bench-out/features-{preset_name}")
    out.mkdir(parents=True, exist_ok=True)

    def one(path: str) -> dict:
        config = load_config(path)
        texts = [text for w in preset["workloads"] for _, text, chat in _texts(w)[: preset["prompts"]] if chat]
        arm = exact_arm(config)
        with ServedApp(args.port) as app:
            app.deploy(bench_config(config, name=f"features-{config.target.engine}", fixed_gamma=None, port=args.port))
            loads = measure(app.url, app.served_name, arm, texts, preset)
        return {"config": path, "engine": config.target.engine, "arm": arm, "loads": loads,
                "summary": summarize(loads)}

    def write(results: dict) -> None:
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "report.md").write_text(report_markdown(results))
        log.info("wrote %s and %s", out / "results.json", out / "report.md")

    write(measure_engines(args.config, "features", preset_name, command, one, after_each=write))
    return 0

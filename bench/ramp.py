"""`specserve bench --section ramp [--quick] [--out DIR] [CONFIG]`: autoscaling under a traffic ramp.

The CONFIG's served app with its own `autoscaling` settings (default `configs/local.yaml`), and the other engine's
local config where it runs here (`bench.breakdown.engine_configs`; a config that does not autoscale is ramped with
autoscaling on and at most 2 units, and the report says so), each driven by closed-loop streaming clients
whose number follows the preset's profile: a steady stretch at 1 stream, a ramp to the peak, a hold, a ramp
back to 1, and a hold long enough for the downscale delay. Every second it samples the streams wanted, the
requests in flight and the decoder's replicas (Serve's status: running, and wanted); per request, the time to
its first streamed token (TTFT), its end and its status. Figures: p95 TTFT while the load rises (the up-ramp and
the hold's first half) against the steady state (the hold's second half, the units settled), their ratio against
`TTFT_BOUND`, and the seconds from the first stream over `target_ongoing_requests` to the second unit running.
Writes DIR/results.json, DIR/report.md and DIR/ramp.png (load, units and TTFT over time, one column per
engine, when matplotlib imports).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path

log = logging.getLogger("specserve.bench")

# (seconds, streams at the start, streams at the end) per stage; a last hold at 1 stream lasts the downscale delay
# and `tail_s` more
PRESETS = {
    "quick": {"stages": ((15, 1, 1), (40, 1, 16), (40, 16, 16), (30, 16, 1)), "tail_s": 30.0, "max_tokens": 32},
    "full": {"stages": ((30, 1, 1), (90, 1, 16), (90, 16, 16), (60, 16, 1)), "tail_s": 30.0, "max_tokens": 64},
}
RISE, STEADY = "rise", "steady"
TTFT_BOUND = 3.0  # p95 TTFT while the load rises, at most this many times the settled peak's
SAMPLE_S = 1.0
REQUEST_TIMEOUT_S = 300.0


def stages(preset: dict, downscale_delay_s: float) -> list[tuple[float, int, int]]:
    """The preset's stages and a final hold at 1 stream that outlasts the downscale delay by `tail_s`."""
    return [*preset["stages"], (downscale_delay_s + preset["tail_s"], 1, 1)]


def wanted(profile: list[tuple[float, int, int]], t: float) -> int:
    """Streams wanted `t` seconds into the profile (linear within a stage, rounded); 0 after its end."""
    for seconds, start, end in profile:
        if t < seconds:
            return round(start + (end - start) * t / seconds)
        t -= seconds
    return 0


def phase_of(profile: list[tuple[float, int, int]], t: float) -> str | None:
    """RISE in the up-ramp and the first half of the peak's hold, STEADY in its second half, else None."""
    start, up, hold = (seconds for seconds, _, _ in profile[:3])
    if start <= t < start + up + hold / 2:
        return RISE
    if start + up + hold / 2 <= t < start + up + hold:
        return STEADY
    return None


class Sampler(threading.Thread):
    """Serve's view of the decoder, every `SAMPLE_S`: running replicas, and the replicas it wants."""

    def __init__(self, app_name: str, t0: float, load: dict):
        super().__init__(daemon=True, name="ramp-sampler")
        self.app_name, self.t0, self.load = app_name, t0, load
        self.samples: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        from ray import serve

        from cluster.serving.app import DECODER_DEPLOYMENT

        while not self.stop.wait(SAMPLE_S):
            try:
                status = serve.status().applications[self.app_name].deployments[DECODER_DEPLOYMENT]
            except (KeyError, AttributeError):
                continue
            states = status.replica_states
            self.samples.append({"t": time.monotonic() - self.t0, "streams": self.load["wanted"],
                                 "in_flight": self.load["in_flight"], "running": states.get("RUNNING", 0),
                                 "replicas": sum(states.values())})


async def drive(url: str, model: str, texts: list[str], profile, max_tokens: int, t0: float, load: dict) -> list:
    """Closed-loop clients following `profile` from `t0`; every request's row (its end as `bench.load.send`
    classifies it)."""
    import httpx

    from bench.load import LoadRequest, send

    total = sum(seconds for seconds, _, _ in profile)
    peak = max(max(start, end) for _, start, end in profile)
    rows: list[dict] = []

    async def client_loop(i: int, http) -> None:
        n = 0
        while (t := time.monotonic() - t0) < total:
            if i >= wanted(profile, t):
                await asyncio.sleep(0.1)
                continue
            load["in_flight"] += 1
            request = LoadRequest(n, texts[(i + n) % len(texts)], max_tokens, stream=True, arm=None)
            try:
                out = await send(http, url, model, request, timeout_s=REQUEST_TIMEOUT_S)
            finally:
                load["in_flight"] -= 1
            rows.append({"t": t, "end_t": time.monotonic() - t0, "client": i, "status": out.status,
                         "ttft_s": out.ttft_s, "end": out.end, "phase": phase_of(profile, t)})
            n += 1

    async def follow() -> None:
        while (t := time.monotonic() - t0) < total:
            load["wanted"] = wanted(profile, t)
            await asyncio.sleep(0.2)

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=peak + 4)) as http:
        await asyncio.gather(follow(), *(client_loop(i, http) for i in range(peak)))
    return rows


def p95(values: list[float]) -> float | None:
    from bench.harness import percentile

    return percentile(sorted(values), 95) if values else None


def summarize(rows: list[dict], samples: list[dict], target_ongoing: int) -> dict:
    """The run's figures (module docstring)."""
    ttft = {phase: [r["ttft_s"] for r in rows if r["phase"] == phase and r["ttft_s"] is not None]
            for phase in (RISE, STEADY)}
    rise, steady = p95(ttft[RISE]), p95(ttft[STEADY])
    over = next((s["t"] for s in samples if s["streams"] > target_ongoing), None)
    second = next((s["t"] for s in samples if over is not None and s["t"] >= over and s["running"] >= 2), None)
    peak_units = max((s["running"] for s in samples), default=0)
    last = samples[-1]["running"] if samples else None
    ends: dict[str, int] = {}
    for r in rows:
        ends[r["end"]] = ends.get(r["end"], 0) + 1
    return {"requests": len(rows), "ends": ends, "ttft_p95_rise_s": rise, "ttft_p95_steady_s": steady,
            "rise_vs_steady": rise / steady if rise and steady else None, "bound": TTFT_BOUND,
            "within_bound": bool(rise and steady and rise / steady <= TTFT_BOUND),
            "units_peak": peak_units, "units_at_end": last,
            "second_unit_after_s": second - over if second is not None else None}


def ramp_config(config_path: str, port: int):
    """CONFIG as the ramp serves it: its own app name and port, no audit, and its autoscaling; a config that does
    not autoscale (or allows one unit) is ramped with `enabled`, `max_replicas` ≥ 2 and its other settings, and
    the second value says so."""
    from cluster.config import load_config

    config = load_config(config_path)
    scaling, overridden = config.autoscaling, False
    if not scaling.enabled or scaling.max_replicas < 2:
        scaling = scaling.model_copy(update={"enabled": True, "max_replicas": max(2, scaling.max_replicas)})
        overridden = True
    config = config.model_copy(update={
        "name": f"ramp-{config.target.engine}", "autoscaling": scaling,
        "serving": config.serving.model_copy(update={"port": port, "host": "127.0.0.1"}),
        "audit": config.audit.model_copy(update={"fraction": 0.0})})
    return config, overridden


def measure_engine(config_path: str, preset: dict, port: int) -> dict:
    """One engine's served app, with its autoscaling, under the ramp."""
    from bench.http_bench import ServedApp
    from bench.workloads import _texts

    config, overridden = ramp_config(config_path, port)
    scaling, name = config.autoscaling, config.name
    texts = [text for w in ("chat", "code") for _, text, _ in _texts(w)]
    profile = stages(preset, scaling.downscale_delay_s)
    load = {"wanted": 0, "in_flight": 0}
    with ServedApp(port) as app:
        app.deploy(config)
        t0 = time.monotonic()
        sampler = Sampler(name, t0, load)
        sampler.start()
        try:
            rows = asyncio.run(drive(app.url, app.served_name, texts, profile, preset["max_tokens"], t0, load))
        finally:
            sampler.stop.set()
            sampler.join()
    return {"config": config_path, "engine": config.target.engine, "profile": profile,
            "autoscaling": scaling.model_dump(), "autoscaling_overridden": overridden,
            "summary": summarize(rows, sampler.samples, scaling.target_ongoing_requests),
            "samples": sampler.samples, "requests": rows}


def report_markdown(results: dict, plot: str | None) -> str:
    meta = results["meta"]
    lines = ["# Autoscaling under a traffic ramp (issue 26)", "",
             f"`{meta['command']}`, started {meta['started']}, {meta['elapsed_s']:.0f} s. Closed-loop streaming "
             "clients (greedy completions of the chat and code prompts) following the profile (seconds, streams "
             "from, streams to); TTFT is the time to the first streamed token; `rise` is the up-ramp and the first "
             "half of the peak's hold, `steady` its second half.",
             ""]
    for engine in results["engines"]:
        s, scaling = engine["summary"], engine["autoscaling"]
        ratio = "-" if s["rise_vs_steady"] is None else f"{s['rise_vs_steady']:.2f}"
        enabled = " (on for the ramp: the config does not autoscale)" if engine.get("autoscaling_overridden") else ""
        lines += [f"## {engine['engine']} engine ({engine['config']})", "",
                  f"Profile {engine['profile']}; autoscaling{enabled} min {scaling['min_replicas']}, max "
                  f"{scaling['max_replicas']}, target_ongoing_requests {scaling['target_ongoing_requests']}, "
                  f"upscale_delay_s {scaling['upscale_delay_s']}, downscale_delay_s {scaling['downscale_delay_s']}.",
                  "", "| requests | ends | p95 TTFT rise | p95 TTFT steady | rise / steady (bound) | units at peak | "
                  "units at the end | second unit running after |", "|---|---|---|---|---|---|---|---|",
                  f"| {s['requests']} | {s['ends']} | {_s(s['ttft_p95_rise_s'])} | {_s(s['ttft_p95_steady_s'])} | "
                  f"{ratio} (≤ {s['bound']:g}) | {s['units_peak']} | {s['units_at_end']} | "
                  f"{_s(s['second_unit_after_s'])} |", ""]
    for note in results.get("notes", []):
        lines.append(f"- {note}")
    if plot:
        lines += ["", f"![ramp]({plot})"]
    return "\n".join(lines) + "\n"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def plot_ramp(results: dict, out: Path) -> str | None:
    """Load, units and TTFT over time, one column per engine; the file name, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    engines = results["engines"]
    fig, axes = plt.subplots(3, len(engines), figsize=(6 * len(engines), 8), sharex="col", squeeze=False)
    for col, engine in enumerate(engines):
        t = [s["t"] for s in engine["samples"]]
        load, units, ttft = axes[0][col], axes[1][col], axes[2][col]
        load.plot(t, [s["streams"] for s in engine["samples"]], label="streams wanted")
        load.plot(t, [s["in_flight"] for s in engine["samples"]], label="requests in flight", alpha=0.7)
        load.set_ylabel("streams")
        load.set_title(f"{engine['engine']} engine")
        load.legend(loc="upper right", fontsize=8)
        units.step(t, [s["running"] for s in engine["samples"]], where="post", label="running")
        units.step(t, [s["replicas"] for s in engine["samples"]], where="post", label="replicas (any state)",
                   alpha=0.7)
        units.set_ylabel("units")
        units.legend(loc="upper right", fontsize=8)
        done = [r for r in engine["requests"] if r["ttft_s"] is not None]
        colors = {RISE: "tab:orange", STEADY: "tab:green", None: "tab:gray"}
        ttft.scatter([r["t"] for r in done], [r["ttft_s"] for r in done], s=6,
                     c=[colors[r["phase"]] for r in done])
        ttft.set_ylabel("TTFT (s)")
        ttft.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(out / "ramp.png", dpi=110)
    plt.close(fig)
    return "ramp.png"


def main_section(args, command: str) -> int:
    """Ramp every engine, write DIR/results.json, DIR/report.md and the plot (after each engine too)."""
    from bench.breakdown import engine_configs, measure_engines

    preset_name = "quick" if args.quick else "full"
    out = Path(args.out or f"bench-out/ramp-{preset_name}")
    out.mkdir(parents=True, exist_ok=True)
    for path in engine_configs(args.config):
        ramp_config(path, args.port)  # every config is valid before the first is measured
    results = measure_engines(args.config, "ramp", preset_name, command,
                              lambda path: measure_engine(path, PRESETS[preset_name], args.port),
                              after_each=lambda partial: write(out, partial))
    write(out, results)
    return 0


def write(out: Path, results: dict) -> None:
    """DIR/results.json, DIR/report.md and the plot, of the engines measured so far."""
    plot = plot_ramp(results, out)
    notes = results["notes"] + ([] if plot else ["no plot: matplotlib does not import."])
    (out / "results.json").write_text(json.dumps({**results, "notes": notes}, indent=1))
    (out / "report.md").write_text(report_markdown({**results, "notes": notes}, plot))
    log.info("wrote %s and %s", out / "results.json", out / "report.md")
